"""What the README promises about the repository itself: its test command is the one CI
runs, after the same set-up; its presets are the code's; the version and the license
are where packaging tools look."""

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import ballonet
from ballonet import specs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> list[str]:
    """The commands of the README's Quick start code blocks."""
    section = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines()
            if line.strip()]


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_readme_test_command_is_what_ci_runs_after_the_same_set_up():
    setup, test = _quick_start()
    ci = _ci_commands()
    assert setup.startswith("bash scripts/setup.sh ")
    assert "bash scripts/setup.sh" in ci  # the same set-up, default extras (no BALLONET_EXTRAS)
    assert not any("BALLONET_EXTRAS" in c for c in ci)
    env, command = test.split(" ", 1)
    assert env == "OMP_NUM_THREADS=1" and "export OMP_NUM_THREADS=1" in ci
    assert ci[-1] == command  # pytest, last, exactly as the README gives it
    setup_script = (ROOT / "scripts" / "setup.sh").read_text()
    default_extras = re.search(r"BALLONET_EXTRAS:-([\w,]+)", setup_script).group(1).split(",")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = {dep for extra in default_extras for dep in extras[extra]}
    assert "ballonet[hf]" in installed  # so the transformers and tokenizer tests run, not skip


def test_the_readme_presets_are_the_code_s():
    text = " ".join((ROOT / "README.md").read_text().split())
    line = re.search(r"Presets \(`ballonet\.specs\.CLUSTERS` and `MODELS`\): clusters (.*?); models (.*?) \(or",
                     text)
    assert line, "the README's presets sentence is missing"
    assert re.findall(r"`([^`]+)`", line.group(1)) == list(specs.CLUSTERS)
    assert re.findall(r"`([^`]+)`", line.group(2)) == list(specs.MODELS)


def test_version_and_license():
    assert ballonet.__version__ == metadata.version("ballonet")
    r = subprocess.run([sys.executable, "-m", "ballonet", "--version"], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == f"ballonet {ballonet.__version__}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not the deprecated table


def test_no_test_file_imports_another():
    """Tests share code through modules that hold no tests (tests/conftest.py, tests/closed_forms.py,
    tests/plans_by_hand.py, ...), never by importing a test file: a test file's tests would
    then be collected twice, or its fixtures run where nobody asked for them."""
    tests = ROOT / "tests"
    names = {p.stem for p in tests.glob("test_*.py")}
    offenders = []
    for path in sorted(tests.glob("*.py")):
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(?:from|import)\s+(?:tests\.)?(test_\w+)", line)
            if m and m.group(1) in names:
                offenders.append(f"{path.name}: {line.strip()}")
    assert not offenders, offenders
