"""Fuzz: random planner calls, and a sweep of bad command lines through the real CLI.

    OMP_NUM_THREADS=1 python bench/fuzz.py [--cases 10000] [--seed 0] [--no-sweep] [--no-planners]

Planner fuzz (issue 16): `--cases` random cases of `ballonet.planning.fuzz` (its
docstring says what they are and what counts as a failure); every planner plans every
batch, and zeppelin once more with single rings only (`VARIANTS`).

Bad-input sweep: each case of `SWEEP` runs `python -m ballonet ...` in a fresh folder
and records the exit code, the stderr lines, and any file left behind. Every case
should exit 2 with one stderr line and leave nothing; a few valid look-alikes (a folder
named like a preset) should exit 0. Writes bench/results/fuzz.md and fuzz.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import HERE, ROOT, command, record, write_text

from ballonet.planning.fuzz import fuzz_planners

# ---- bad-input sweep ---------------------------------------------------------------------

TOML_OK = '[[node_groups]]\ngpu = "h200"\nnum_nodes = 2\n'
_TRAIN = ["train", "--steps", "1", "--global-tokens", "512"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    """What is wrong, in a few words (the row of the results table)."""
    argv: tuple[str, ...]
    files: tuple[tuple[str, str | bytes], ...] = ()
    """Files made in the case's folder before the run; a name ending in / is a folder."""
    exit_code: int = 2
    """The expected exit code (0 for valid look-alikes)."""
    owner: str = "C"
    """Who fixes the class ("D": training-loop validation, not on this branch alone)."""
    slow: bool = False
    """Starts training ranks (skipped in the CI slice)."""


def _npy(array) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.asarray(array))
    return buf.getvalue()


def _case(name, *argv, files=(), **kw) -> Case:
    return Case(name=name, argv=tuple(argv), files=tuple(files), **kw)


def _toml_case(name: str, text) -> Case:
    """`cost` with the cluster file c.toml holding `text`."""
    return _case(name, "cost", "--length", "10", "--cluster", "c.toml", files=[("c.toml", text)])


SWEEP: list[Case] = [
    # argparse
    _case("no subcommand"),
    _case("unknown subcommand", "fly"),
    _case("unknown flag", "cost", "--length", "10", "--colour"),
    _case("missing required flag", "cost"),
    _case("negative integer flag", "cost", "--length", "-3"),
    _case("non-integer flag", "cost", "--length", "2.5"),
    _case("zero --steps", "simulate", "--steps", "0"),
    _case("zero --nodes", "plan", "--nodes", "0"),
    _case("zero --tp", "cost", "--length", "10", "--tp", "0"),
    _case("--workload with --lengths", "plan", "--workload", "wlbllm", "--lengths", "x.txt"),
    # presets and specs
    _case("unknown model", "cost", "--length", "10", "--model", "gpt-9"),
    _case("unknown cluster", "cost", "--length", "10", "--cluster", "dgx"),
    _case("tp above the heads", "cost", "--length", "10", "--tp", "64"),
    _case("tp not dividing the heads", "cost", "--length", "10", "--tp", "3"),
    _case("tp above the GPUs of a node", "plan", "--cluster", "cpu", "--tp", "4"),
    _case("cost: tp above the GPUs of a node", "cost", "--length", "10", "--tp", "16"),
    _case("unknown planner", "plan", "--planner", "magic"),
    _case("unknown planner in a list", "simulate", "--planners", "zeppelin,magic"),
    _case("empty planner list", "simulate", "--planners", ","),
    _case("unknown workload", "plan", "--workload", "nosuch"),
    # cluster TOML
    _case("cluster file missing", "cost", "--length", "10", "--cluster", "missing.toml"),
    _case("cluster file is a folder", "cost", "--length", "10", "--cluster", "c.toml", files=[("c.toml/", "")]),
    _toml_case("cluster TOML malformed", "[[node_groups]\n"),
    _toml_case("cluster TOML binary", bytes(range(256)) * 4),
    _toml_case("cluster TOML gpu = 5", "[[node_groups]]\ngpu = 5\n"),
    _toml_case("cluster TOML node_groups = [1, 2]", "node_groups = [1, 2]\n"),
    _toml_case('cluster TOML nic_gbps = "fast"', TOML_OK + 'nic_gbps = "fast"\n'),
    _toml_case("cluster TOML num_nodes = 2.5", '[[node_groups]]\ngpu = "h200"\nnum_nodes = 2.5\n'),
    _toml_case("cluster TOML unknown GPU", '[[node_groups]]\ngpu = "z80"\n'),
    _toml_case("cluster TOML unknown field", TOML_OK + "colour = 1\n"),
    _toml_case("cluster TOML name = [1]", "name = [1]\n" + TOML_OK),
    _toml_case("cluster TOML intra_link_bw = true", TOML_OK + "intra_link_bw = true\n"),
    # length files
    _case("lengths file missing", "plan", "--lengths", "missing.txt"),
    _case("lengths file empty", "plan", "--lengths", "l.txt", files=[("l.txt", "")]),
    _case("lengths file with a word", "plan", "--lengths", "l.txt", files=[("l.txt", "10\nabc\n")]),
    _case("lengths file with 0", "plan", "--lengths", "l.txt", files=[("l.txt", "10\n0\n")]),
    _case("lengths file not UTF-8", "plan", "--lengths", "l.txt", files=[("l.txt", b"\xff\xfe\x00\x01")]),
    _case("lengths .json not a list", "plan", "--lengths", "l.json", files=[("l.json", '{"a": 1}')]),
    _case("lengths .json malformed", "plan", "--lengths", "l.json", files=[("l.json", "[1, 2")]),
    _case("lengths .jsonl bad row", "plan", "--lengths", "l.jsonl", files=[("l.jsonl", '{"length": 3}\n[1]\n')]),
    _case("lengths .npy uint64 above 2^63", "plan", "--lengths", "l.npy",
          files=[("l.npy", _npy(np.array([5, 2**63 + 5], dtype=np.uint64)))]),
    _case("lengths .npy 2-D", "plan", "--lengths", "l.npy", files=[("l.npy", _npy(np.ones((2, 2), dtype=np.int64)))]),
    _case("lengths .npy 2.5", "plan", "--lengths", "l.npy", files=[("l.npy", _npy(np.array([2.5])))]),
    _case("lengths .npy not numpy", "plan", "--lengths", "l.npy", files=[("l.npy", "not numpy")]),
    _case("lengths file is a folder", "plan", "--lengths", "l.txt", files=[("l.txt/", "")]),
    _case("workload file with a word", "simulate", "--workload", "w.txt", files=[("w.txt", "abc\n")]),
    _case("document larger than any GPU", "plan", "--lengths", "l.txt", files=[("l.txt", "1000000000\n")]),
    # output paths
    _case("plan --out a folder", "plan", "--out", "d", files=[("d/", "")]),
    _case("plan --out in a missing folder", "plan", "--out", "nodir/p.json"),
    _case("simulate --trace in a missing folder", "simulate", "--planners", "zeppelin", "--trace", "nodir/t.json"),
    _case("simulate --trace a folder", "simulate", "--planners", "zeppelin", "--trace", "d", files=[("d/", "")]),
    _case("simulate --plot in a missing folder", "simulate", "--planners", "zeppelin", "--plot", "nodir/x.png"),
    _case("simulate --plot a folder", "simulate", "--planners", "zeppelin", "--plot", "d", files=[("d/", "")]),
    _case("simulate --plot unknown format", "simulate", "--planners", "zeppelin", "--plot", "x.zzz"),
    # valid look-alikes: a local folder or file named like a preset
    _case("folder named like a cluster preset", "cost", "--length", "10", "--cluster", "h200-8nic",
          files=[("h200-8nic/", "")], exit_code=0),
    _case("folder named like a workload preset", "plan", "--workload", "wlbllm", "--nodes", "1", "--json",
          files=[("wlbllm/", "")], exit_code=0),
    # train: launch flags and inputs
    _case("train --nproc 0", *_TRAIN, "--nproc", "0"),
    _case("train --nproc -1", *_TRAIN, "--nproc", "-1"),
    _case("train --max-restarts -1", *_TRAIN, "--nproc", "2", "--max-restarts", "-1"),
    _case("train unknown model", *_TRAIN, "--model", "gpt-9"),
    _case("train unknown planner", *_TRAIN, "--planner", "magic"),
    _case("train corpus missing", *_TRAIN, "--corpus", "missing.jsonl"),
    _case("train corpus empty folder", *_TRAIN, "--corpus", "d", files=[("d/", "")]),
    _case("train corpus bad JSONL line", *_TRAIN, "--corpus", "c.jsonl",
          files=[("c.jsonl", '{"text": "fine"}\nnot json\n')]),
    _case("train --global-tokens below the ranks", *_TRAIN, "--nproc", "4", "--global-tokens", "3"),
    _case("train --global-tokens 0", *_TRAIN, "--global-tokens", "0"),
    _case("train --steps 0", *_TRAIN, "--steps", "0"),
    _case("train --lr 0", *_TRAIN, "--lr", "0"),
    _case("train cluster TOML gpu = 5", *_TRAIN, "--cluster", "c.toml",
          files=[("c.toml", "[[node_groups]]\ngpu = 5\n")]),
    _case("train --max-doc-tokens 0", *_TRAIN, "--max-doc-tokens", "0", owner="D"),
    _case("train --weight-decay -1", *_TRAIN, "--weight-decay", "-1", owner="D"),
    _case("train --seed -1", *_TRAIN, "--seed", "-1", owner="D"),
    _case("train --json-log a folder", *_TRAIN, "--json-log", "d", files=[("d/", "")]),
    _case("train --json-log in a missing folder", *_TRAIN, "--json-log", "nodir/log.jsonl"),
    _case("train --checkpoint-dir a file", *_TRAIN, "--checkpoint-dir", "f", "--checkpoint-every", "1",
          files=[("f", "x")]),
    _case("train --resume corrupt checkpoint", *_TRAIN, "--checkpoint-dir", "ck", "--resume",
          files=[("ck/", ""), ("ck/checkpoint.pt", b"\x00garbage")], owner="D", slow=True),
    _case("train --global-tokens 8M (budget)", *_TRAIN, "--global-tokens", "8000000", owner="D", slow=True),
    _case("train --nproc 2, a rank's own error (corrupt checkpoint)", *_TRAIN, "--nproc", "2",
          "--checkpoint-dir", "ck", "--resume", files=[("ck/", ""), ("ck/checkpoint.pt", b"\x00garbage")],
          owner="D", slow=True),
]


def _make_files(folder: str, files) -> None:
    for name, content in files:
        path = os.path.join(folder, name)
        if name.endswith("/"):
            os.makedirs(path, exist_ok=True)
            continue
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)


def _listing(folder: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), folder) for d, subdirs, files in os.walk(folder)
            for f in files + [s + "/" for s in subdirs]}


def run_case(case: Case, timeout_s: float = 120.0) -> dict:
    """Run `case` through `python -m ballonet` in a fresh folder: exit code, stderr lines,
    files left behind."""
    with tempfile.TemporaryDirectory() as folder:
        _make_files(folder, case.files)
        before = _listing(folder)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", COLUMNS="200")
        start = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-m", "ballonet", *case.argv], cwd=folder, env=env,
                               capture_output=True, text=True, timeout=timeout_s, check=False)
            code, stderr = r.returncode, r.stderr
        except subprocess.TimeoutExpired as e:
            code, stderr = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        left = sorted(_listing(folder) - before)
    lines = [line for line in stderr.splitlines() if line.strip()]
    ok = code == case.exit_code and (len(lines) == 1 if case.exit_code == 2 else True) and not (left and code)
    return {"name": case.name, "argv": " ".join(case.argv), "exit_code": code, "expected": case.exit_code,
            "stderr_lines": len(lines), "message": lines[-1] if lines else "", "left_behind": left,
            "traceback": "Traceback" in stderr, "ok": ok, "owner": case.owner,
            "seconds": round(time.perf_counter() - start, 1)}


def sweep(cases=SWEEP, timeout_s: float = 120.0) -> list[dict]:
    return [run_case(c, timeout_s) for c in cases]


# ---- report ------------------------------------------------------------------------------


def _md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _stamp(command: str, seconds: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Command: `{command}` ({now}, {platform.machine()}, {os.cpu_count()} cores shared, "
            f"Python {platform.python_version()}, {seconds:.0f} s).")


def _planner_section(result: dict) -> list[str]:
    kinds = ("ok", "infeasible", "input_error", "invalid", "crash", "hang")
    out = [f"## Planner fuzz: {result['cases']} random cases x {len(result['counts'])} planner configurations (seed {result['seed']})",
           "", result["stamp"], "",
           "Random clusters (1-3 node groups, every GPU type, 1-8 GPUs and NICs per node), every model preset "
           "(`MODEL_WEIGHTS`) with tp 1/2/4, batches of 64 to 32K tokens per GPU in 1-256 documents of 1 to 1M tokens. A call must "
           "give a valid plan (`Plan.validate`) or raise InfeasiblePlan / InputError; `invalid`, `crash` and "
           f"`hang` (over {result['timeout_s']:.0f} s) are failures.", "",
           "| planner | " + " | ".join(kinds) + " |", "|" + " --- |" * (len(kinds) + 1)]
    for name, c in result["counts"].items():
        out.append(f"| {name} | " + " | ".join(str(c.get(k, 0)) for k in kinds) + " |")
    out += ["", f"Failures: {len(result['failures'])}."]
    out += [f"- case {f['case']} {f['planner']}: {_md_cell(f['outcome'])}" for f in result["failures"]]
    return out + [""]


def _sweep_section(result: dict) -> list[str]:
    rows = result["rows"]
    bad = [r for r in rows if not r["ok"]]
    out = [f"## Bad-input sweep: {len(rows)} command lines, {len(rows) - len(bad)} as expected", "",
           result["stamp"], "",
           "Each runs `python -m ballonet ARGS` in a fresh folder. Expected: exit 2, one line on stderr, no file "
           "left behind; valid look-alikes (a folder named like a preset) exit 0. Owner D: classes fixed by the "
           "training-loop validation on helper D's branch; a `NO (D)` row fails on this branch alone.", "",
           "| class | command | exit | expected | stderr lines | left behind | ok | message |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {_md_cell(r['name'])} | `ballonet {_md_cell(r['argv'])}` | {r['exit_code']} | "
                   f"{r['expected']} | {r['stderr_lines']} | {_md_cell(', '.join(r['left_behind']) or '-')} | "
                   f"{'yes' if r['ok'] else 'NO (' + r['owner'] + ')'} | {_md_cell(r['message'][:240])} |")
    return out + [""]


def write_report(results: dict) -> str:
    out = ["# Fuzz: planner calls and bad command lines", "",
           "Both parts come from `bench/fuzz.py` (see its docstring); each names the command that made it.", ""]
    if results.get("planners"):
        out += _planner_section(results["planners"])
    if results.get("sweep"):
        out += _sweep_section(results["sweep"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per planner call before it counts as a hang")
    p.add_argument("--jobs", type=int, default=1, help="processes for the planner fuzz")
    p.add_argument("--no-sweep", action="store_true", help="keep the sweep of the last run (in OUT.json)")
    p.add_argument("--no-planners", action="store_true", help="keep the planner fuzz of the last run (in OUT.json)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "fuzz"), help="OUT.md and OUT.json")
    args = p.parse_args(argv)
    cmd = command("fuzz.py", argv)
    results = {}
    if os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            results = {k: v for k, v in json.load(f).items() if k in ("planners", "sweep")}
    if not args.no_planners:
        start = time.perf_counter()
        results["planners"] = fuzz_planners(args.cases, args.seed, args.timeout, args.jobs)
        results["planners"]["stamp"] = _stamp(cmd, time.perf_counter() - start)
    if not args.no_sweep:
        start = time.perf_counter()
        rows = sweep()
        results["sweep"] = {"rows": rows, "stamp": _stamp(cmd, time.perf_counter() - start)}
    report = write_report(results)
    record(cmd, results, args.out + ".json")
    write_text(args.out + ".md", report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
