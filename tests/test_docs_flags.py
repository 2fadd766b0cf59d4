"""Every `ballonet COMMAND --flag` the README, docs/guide.md and docs/design.md show exists in
that command's parser, so the docs cannot drift from the command line: command lines in
fenced code blocks (continuation lines joined, `torchrun ... -m ballonet train ...`
included) and in inline code spans (`ballonet plan --check-schedule`, or `plan
--lengths`), and each bare flag span (`--eval-every N`) in some command or, for another
tool's flag, in `OTHER_TOOLS`; and the `ballonet` lines of the shell scripts a user runs."""

import re
from pathlib import Path

import pytest

from tests.parsers import subcommand_flags

from ballonet.cli.foreign_flags import FOREIGN_FLAGS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md", "docs/design.md")
SCRIPTS = ("scripts/gpu_check.sh", "scripts/gpu_train_check.sh", "examples/lease_multinode.sh",
           "examples/slurm_multinode.sh")
"""Shell scripts a user runs or copies: their `ballonet` lines are checked as a code block's."""

OTHER_TOOLS = {
    "--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--local-addr",
    # (torchrun)
    "--recompute-num-layers",  # Megatron-LM, named for comparison
}
"""Flags of other tools (torchrun, Megatron-LM) the docs name in bare spans; and those
`ballonet.cli.foreign_flags` translates."""

_ENDS = {"&&", "||", "|", ";", "&", ">", ">>", "2>", "<"}
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`]+)`")


def _is_ballonet(token: str) -> bool:
    return token == "ballonet" or token.endswith("/ballonet")


def _commands(tokens: list[str], commands: set[str], anywhere: bool) -> list[tuple[str, list[str]]]:
    """(subcommand, flags) of each `ballonet CMD ...` in `tokens` where `ballonet` stands in
    a command's place (first, after env assignments, `-m`, `&&`, ...), or, with `anywhere`
    (a span of prose), also `CMD --flag...` at the start."""
    found = []
    for i, tok in enumerate(tokens):
        before = tokens[:i]
        at_start = all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", t) for t in before)
        placed = at_start or before[-1] in _ENDS | {"-m"}
        if _is_ballonet(tok) and placed and i + 1 < len(tokens):
            name, rest = tokens[i + 1], tokens[i + 2:]
        elif anywhere and i == 0 and tok in commands and len(tokens) > 1 and tokens[1].startswith("--"):
            name, rest = tok, tokens[1:]
        else:
            continue
        if name.isupper() or name.startswith("-"):  # `ballonet COMMAND --help`, `ballonet --help`
            continue
        flags = []
        for t in rest:
            if t in _ENDS or _is_ballonet(t):
                break
            if t.startswith("--") and not t.endswith("-"):
                flags.append(t.split("=", 1)[0])
        found.append((name, flags))
    return found


def code_commands(code: str, first: int, commands: set[str]) -> list[tuple[int, str, list[str]]]:
    """(line, subcommand, flags) of every `ballonet` command line of shell `code` whose first
    line is line `first` (continuation lines joined, comments dropped)."""
    found = []
    joined, start = "", None
    for n, line in enumerate(code.split("\n"), first):
        start = n if start is None else start
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        tokens = (joined + line).split(" #", 1)[0].split()
        found += [(start, name, flags) for name, flags in _commands(tokens, commands, anywhere=False)]
        joined, start = "", None
    return found


def doc_commands(text: str, commands: set[str]) -> list[tuple[int, str, list[str]]]:
    """(line, subcommand, flags) of every `ballonet` command line of a Markdown `text`."""
    found = []
    for block in _FENCE.finditer(text):
        found += code_commands(block.group(1), text.count("\n", 0, block.start(1)) + 1, commands)
    unfenced = re.sub(r"^```.*$", "", text, flags=re.M)  # spans in prose, and in a block's comments or listings
    for span in _SPAN.finditer(unfenced):
        line = unfenced.count("\n", 0, span.start()) + 1
        found += [(line, name, flags) for name, flags in _commands(span.group(1).split(), commands, anywhere=True)]
    return found


def bare_flags(text: str) -> list[tuple[int, str]]:
    """(line, flag) of every inline span of prose that starts with a flag (`--eval-every N`)."""
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found = []
    for span in _SPAN.finditer(prose):
        tokens = span.group(1).split()
        if tokens[0].startswith("--") and not tokens[0].endswith("-"):
            line = prose.count("\n", 0, span.start()) + 1
            found += [(line, t.split("=", 1)[0]) for t in tokens if t.startswith("--") and not t.endswith("-")]
    return found


def misnamed(text: str, where: str, parsers: dict[str, set[str]], script: bool = False) -> list[str]:
    """What `text` (Markdown, or with `script` a shell script) names that no parser has, as
    `where:line: ...` lines."""
    every = set().union(*parsers.values())
    wrong = []
    found = code_commands(text, 1, set(parsers)) if script else doc_commands(text, set(parsers))
    for line, name, flags in found:
        if name not in parsers:
            wrong.append(f"{where}:{line}: `ballonet {name}` is no command (commands: {', '.join(sorted(parsers))})")
            continue
        wrong += [f"{where}:{line}: `ballonet {name}` has no flag {flag}" for flag in flags if flag not in parsers[name]]
    if not script:
        wrong += [f"{where}:{line}: no command has the flag {flag}" for line, flag in bare_flags(text)
                  if flag not in every | OTHER_TOOLS and flag.replace("_", "-") not in FOREIGN_FLAGS]
    return wrong


@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_the_docs_name_exists(doc):
    parsers = subcommand_flags()
    text = (ROOT / doc).read_text()
    assert len(doc_commands(text, set(parsers))) >= 3, f"{doc}: its command lines were not found"
    assert misnamed(text, doc, parsers) == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_the_scripts_give_exists(script):
    parsers = subcommand_flags()
    text = (ROOT / script).read_text()
    assert code_commands(text, 1, set(parsers)), f"{script}: no ballonet command line found"
    assert misnamed(text, script, parsers, script=True) == []


def test_the_check_finds_a_flag_or_command_that_does_not_exist():
    parsers = subcommand_flags()
    text = ("Run:\n\n```bash\nballonet plan --cluster cpu \\\n    --bogus-flag 3   # a comment --not-a-flag\n```\n\n"
            "then `ballonet simulate --json --tokens-per-gpux 8`, `plan --lenghts`, `--eval-evry N`,\n"
            "`torchrun --nnodes 2 -m ballonet train --nprocs 2`, `ballonet stepplot` and `ballonet COMMAND --help`.\n")
    script = "set -e\nX=1 torchrun --nnodes 2 \\\n  -m ballonet train --steps 2 \\\n  --resum\n"
    assert misnamed(text, "doc.md", parsers) == [
        "doc.md:4: `ballonet plan` has no flag --bogus-flag",
        "doc.md:8: `ballonet simulate` has no flag --tokens-per-gpux",
        "doc.md:8: `ballonet plan` has no flag --lenghts",
        "doc.md:9: `ballonet train` has no flag --nprocs",
        "doc.md:9: `ballonet stepplot` is no command (commands: calibrate, cost, demo, export, plan, prepare, "
        "simulate, train)",
        "doc.md:8: no command has the flag --eval-evry",
    ]
    assert misnamed(script, "run.sh", parsers, script=True) == ["run.sh:2: `ballonet train` has no flag --resum"]


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_toml_examples_load(doc, tmp_path):
    """A cluster file (`[[node_groups]]`) loads as `--cluster`, any other as `train --config`."""
    from ballonet import specs
    from ballonet.training.config import TrainConfig
    from ballonet.training.config_file import read_config_file

    for n, block in enumerate(re.findall(r"^```toml\n(.*?)^```", (ROOT / doc).read_text(), re.S | re.M)):
        path = tmp_path / f"{n}.toml"
        path.write_text(block)
        if "[[node_groups]]" in block:
            assert specs.cluster(str(path)).num_ranks > 0
        else:
            TrainConfig(**read_config_file(str(path), TrainConfig))
