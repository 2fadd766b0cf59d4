"""The bad-input sweep's machinery: what a case is, and how one runs through the real CLI.

Each case runs `python -m ballonet ARGS` in a fresh folder holding its files (and, for
hostile-file cases, a copy of a clean checkpoint or prepared corpus, made once per sweep
and then edited by the case), optionally with a read-only or full disk mounted at
`disk/` (a tmpfs in a private mount namespace: `unshare`), its standard output piped
into another command, or extra environment. It records the exit code, the stderr lines,
any file left behind (a payload that runs creates one: `PWNED`) and how long it took;
a case over the timeout is a hang. The cases are in `sweep_cases.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT_STEPS = 2
RESUME = ("train", "--steps", "3", "--global-tokens", "512", "--max-doc-tokens", "256", "--checkpoint-dir", "ck",
          "--resume")
"""Resumes the clean checkpoint (`Bases`), copied into the case's folder as ck/."""
CORPUS_TRAIN = ("train", "--steps", "1", "--global-tokens", "64", "--corpus", "corpus")
"""Trains on the clean prepared corpus (`Bases`), copied into the case's folder as corpus/."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    """What is wrong, in a few words (the row of the results table)."""
    argv: tuple[str, ...]
    files: tuple[tuple[str, str | bytes], ...] = ()
    """Files made in the case's folder before the run; a name ending in / is a folder."""
    exit_code: int = 2
    """The expected exit code (0 for valid look-alikes, 1 for a dead peer)."""
    expect: str = ""
    """A part of the message the case must print (so a refusal for another reason fails)."""
    owner: str = "C"
    """Who fixes the class ("D": training-loop validation, not on this branch alone)."""
    slow: bool = False
    """Starts training ranks or needs a base, a disk, a pipe or an environment (not in the
    in-process CI slice, `tests/test_fuzz.py`)."""
    issue: int | None = None
    """The class of issue 33 (1-8) the case reproduces, if any."""
    base: str | None = None
    """"checkpoint" or "corpus": a clean one copied into the folder (ck/, corpus/) first."""
    edit: Callable[[str], None] | None = None
    """Run on the case's folder after its files and base are in place."""
    disk: str | None = None
    """"readonly" or "full": a tmpfs of that kind mounted at disk/ for the run."""
    pipe: str | None = None
    """A shell command the standard output is piped into (`head -c 300`)."""
    env: tuple[tuple[str, str], ...] = ()
    klass: str | None = None
    """The class of issue 47 (`sweep_cases_47.CLASSES`) the case belongs to, if any."""
    stdin: str = ""
    """What the command reads on its standard input (`y` to a prompt that must never come)."""
    guard: tuple[str, ...] = ()
    """Files (of the case's folder) that must be byte for byte the same after the run."""
    after: Callable[[str], str | None] | None = None
    """Run on the case's folder after the run: what is wrong with what it left (a silent
    wrong answer), or None."""


def case(name, *argv, files=(), **kw) -> Case:
    return Case(name=name, argv=tuple(argv), files=tuple(files), **kw)


def make_files(folder: str, files) -> None:
    for name, content in files:
        path = os.path.join(folder, name)
        if name.endswith("/"):
            os.makedirs(path, exist_ok=True)
            continue
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)


def listing(folder: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), folder) for d, subdirs, files in os.walk(folder)
            for f in files + [s + "/" for s in subdirs]}


def _env(extra=(), source: str = ROOT) -> dict:
    return dict(os.environ, PYTHONPATH=source + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                COLUMNS="200", **dict(extra))


def _ballonet(*argv, cwd: str, source: str) -> None:
    subprocess.run([sys.executable, "-m", "ballonet", *argv], cwd=cwd, env=_env(source=source), check=True,
                   capture_output=True, timeout=600)


class Bases:
    """The clean checkpoint and prepared corpus that hostile-file cases copy and edit,
    each made once (by the real CLI) in `folder` when a case first asks for it."""

    def __init__(self, folder: str, source: str = ROOT):
        self.folder, self.source, self._made = folder, source, {}

    def get(self, kind: str) -> str:
        if kind not in self._made:
            where = os.path.join(self.folder, kind)
            os.makedirs(where)
            if kind == "checkpoint":
                _ballonet("train", "--steps", str(CHECKPOINT_STEPS), "--global-tokens", "512", "--max-doc-tokens",
                          "256", "--checkpoint-dir", "ck", "--checkpoint-every", str(CHECKPOINT_STEPS), cwd=where,
                          source=self.source)
                self._made[kind] = os.path.join(where, "ck")
            elif kind == "corpus":
                with open(os.path.join(where, "docs.jsonl"), "w") as f:
                    for i in range(40):
                        f.write(json.dumps({"text": f"document {i}: " + "the quick brown fox " * (i + 1)}) + "\n")
                _ballonet("prepare", "--data", "docs.jsonl", "--out", "corpus", cwd=where, source=self.source)
                self._made[kind] = os.path.join(where, "corpus")
            else:
                raise ValueError(f"unknown base {kind!r}")
        return self._made[kind]


_MOUNTS = {"readonly": "mount -t tmpfs -o ro tmpfs disk",
           "full": "mount -t tmpfs -o size=64k tmpfs disk && { head -c 65536 /dev/zero > disk/fill 2>/dev/null; true; }"}


def _unshare() -> list[str] | None:
    """The command that runs a shell in a private mount namespace here, or None."""
    if not shutil.which("unshare"):
        return None
    with tempfile.TemporaryDirectory() as where:
        for cmd in (["unshare", "-m"], ["unshare", "-rm"]):
            probe = subprocess.run([*cmd, "sh", "-c", f"mount -t tmpfs tmpfs {where}"], capture_output=True,
                                   check=False)
            if probe.returncode == 0:
                return cmd
    return None


PEAK_RSS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak_rss.py")
MAX_SECONDS, MAX_RSS_MB = 20.0, 1536
"""Issue 47's bounds on every case: it ends within 20 s and under 1.5 GB (else a hang).
The seconds are CPU seconds of the whole tree: on this shared 2-core machine (load 15-20
while the sweep ran) wall-clock time is mostly waiting for a core; a case that blocks (a
FIFO) spends no CPU and is caught by the kill at the sweep's timeout instead."""


def _command(case: Case, unshare: list[str] | None) -> tuple[list[str], bool]:
    """(argv to run, whether it runs under a shell script that reports disk/ in .disk_listing).
    The command runs under `peak_rss.py`, which writes the peak RSS of the whole process
    tree to .peak_rss; `-P` as the `ballonet` script runs (the working folder is not on
    the import path)."""
    ballonet = [sys.executable, PEAK_RSS, ".peak_rss", sys.executable, "-P", "-m", "ballonet", *case.argv]
    if case.pipe:
        return ["bash", "-c", f'"$@" | {case.pipe} > /dev/null; exit ${{PIPESTATUS[0]}}', "bash", *ballonet], False
    if case.disk:
        script = f'{_MOUNTS[case.disk]} && {{ "$@"; rc=$?; ls -A disk > .disk_listing; exit $rc; }}'
        return [*unshare, "sh", "-c", script, "sh", *ballonet], True
    return ballonet, False


def run_case(case: Case, timeout_s: float = 120.0, bases: Bases | None = None, unshare=(), source: str = ROOT) -> dict:
    """Run `case` in a fresh folder with the ballonet of the source tree `source`: exit
    code, stderr lines, files left behind."""
    row = {"name": case.name, "argv": " ".join(case.argv) + (f" | {case.pipe}" if case.pipe else ""),
           "expected": case.exit_code, "owner": case.owner, "issue": case.issue, "disk": case.disk,
           "env": " ".join(f"{k}={v}" for k, v in case.env)}
    if unshare == ():
        unshare = _unshare() if case.disk else None
    if case.disk and unshare is None:
        return {**row, "exit_code": "not run", "stderr_lines": 0, "message": "no mount namespace here (unshare)",
                "left_behind": [], "traceback": False, "ok": None, "seconds": 0.0}
    with tempfile.TemporaryDirectory() as folder:
        make_files(folder, case.files)
        if case.base:
            shutil.copytree((bases or Bases(folder, source)).get(case.base),
                            os.path.join(folder, {"checkpoint": "ck", "corpus": "corpus"}[case.base]))
        if case.edit:
            case.edit(folder)
        if case.disk:
            os.makedirs(os.path.join(folder, "disk"), exist_ok=True)
        guarded = {name: _digest(os.path.join(folder, name)) for name in case.guard}
        before = listing(folder)
        argv, reports_disk = _command(case, unshare)
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=folder, env=_env(case.env, source), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(case.stdin, timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole tree: ranks included
            _, stderr = proc.communicate()
            code = "timeout"
        seconds = time.perf_counter() - start
        peak_mb, cpu_s = _read_and_remove(os.path.join(folder, ".peak_rss"))
        replaced = [name for name, digest in guarded.items() if _digest(os.path.join(folder, name)) != digest]
        wrong = case.after(folder) if case.after and code == 0 else None
        disk_left = []
        if reports_disk and os.path.exists(os.path.join(folder, ".disk_listing")):
            with open(os.path.join(folder, ".disk_listing")) as f:
                disk_left = [f"disk/{n}" for n in f.read().split() if n != "fill"]
            os.remove(os.path.join(folder, ".disk_listing"))
        left = sorted(listing(folder) - before) + disk_left
    lines = [line for line in stderr.splitlines() if line.strip()]
    message = lines[-1] if lines else ""
    ok = (code == case.exit_code and (len(lines) == 1 if case.exit_code else True) and not (left and code)
          and case.expect in message and not replaced and not wrong
          and (case.klass is None or ((cpu_s or 0) <= MAX_SECONDS and (peak_mb or 0) <= MAX_RSS_MB)))
    return {**row, "exit_code": code, "stderr_lines": len(lines), "message": message, "left_behind": left,
            "traceback": "Traceback" in stderr, "ok": ok, "seconds": round(seconds, 1), "peak_mb": peak_mb, "cpu_s": cpu_s,
            "replaced": replaced, "wrong": wrong, "klass": case.klass}


def _digest(path: str) -> str | None:
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path) and not os.path.islink(path):
        return json.dumps(sorted(listing(path)))
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _read_and_remove(path: str) -> tuple[int | None, float | None]:
    """The peak RSS in MB and the CPU seconds that peak_rss.py wrote (None if it was killed first)."""
    try:
        with open(path) as f:
            kib, cpu = f.read().split()
        os.remove(path)
        return int(kib) // 1024, float(cpu)
    except (OSError, ValueError):
        return None, None


def outcome(row: dict) -> str:
    """ok, not run, payload ran (it left PWNED), hang, traceback, silent wrong answer (exit 0
    where a refusal was due), or failed."""
    if row["ok"]:
        return "ok"
    if row["ok"] is None:
        return "not run"
    if "PWNED" in row["left_behind"]:
        return "payload ran"
    if row.get("replaced"):
        return "file replaced"
    if row["exit_code"] == "timeout" or (row.get("klass") and ((row.get("cpu_s") or 0) > MAX_SECONDS
                                                               or (row.get("peak_mb") or 0) > MAX_RSS_MB)):
        return "hang"
    if row["traceback"]:
        return "traceback"
    if (row["exit_code"] == 0 and row["expected"] != 0) or row.get("wrong"):
        return "silent wrong answer"
    return "failed"


def sweep(cases, timeout_s: float = 120.0, source: str = ROOT) -> list[dict]:
    """Every case, with the ballonet of the source tree `source` (default this one)."""
    unshare = _unshare()
    with tempfile.TemporaryDirectory() as folder:
        bases = Bases(folder, source)
        return [run_case(c, timeout_s, bases, unshare, source) for c in cases]
