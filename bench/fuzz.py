"""Fuzz: random planner calls, and a sweep of bad command lines through the real CLI.

    OMP_NUM_THREADS=1 python bench/fuzz.py [--cases 10000] [--seed 0] [--no-sweep] [--no-planners]
        [--issue-47-only]

Planner fuzz (issue 16): `--cases` random cases of `ballonet.planning.fuzz` (its
docstring says what they are and what counts as a failure); every planner plans every
batch, and zeppelin once more with single rings only (`VARIANTS`).

Bad-input sweep (issues 16 and 33): each case of `sweep_cases.SWEEP` runs `python -m
ballonet ...` in a fresh folder (`sweep.py`) and records the exit code, the stderr lines,
and any file left behind. Every case should exit 2 (a dead peer: 1) with one stderr line
naming what is wrong and leave nothing; a few valid look-alikes (a folder named like a
preset) should exit 0. Hostile checkpoints and corpora are edited copies of clean ones
made by the real CLI; read-only and full disks are tmpfs mounts. The report counts
payloads that ran, tracebacks, hangs (over --sweep-timeout) and silent wrong answers
(exit 0 where a refusal was due). `--source DIR` sweeps another tree's ballonet (an
older commit, to see the cases fail there). Writes bench/results/fuzz.md and fuzz.json.

Issue 47's cases (`sweep_cases_47.ISSUE_47`, by class: code run from a folder, files
outside read or replaced, hangs and memory blow-ups, tracebacks, silent wrong answers, a
full disk) are held to two more bounds: each ends within 20 s and under 1.5 GB of peak
resident memory over its whole process tree (`peak_rss.py`), else it is a hang; a file
it guards must be unchanged (else "file replaced").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections import Counter

import sweep as sweep_module
from _common import HERE, command, record, write_text
from sweep import outcome, sweep
from sweep_cases import ISSUE_33, SWEEP
from sweep_cases_47 import CLASSES, ISSUE_47

from ballonet.planning.fuzz import fuzz_planners

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


ISSUE_33_CLASSES = {1: "code in a checkpoint", 2: "a corpus reading outside its folder or vocabulary",
                    3: "size budgets (hangs, memory)", 4: "late failures (outputs checked first)", 5: "tracebacks",
                    6: "silent wrong answers", 7: "a dead peer"}


def _sweep_section(result: dict) -> list[str]:
    rows = result["rows"]
    kinds = Counter(outcome(r) for r in rows)
    out = [f"## Bad-input sweep: {len(rows)} command lines, {kinds['ok']} as expected", "",
           result["stamp"], "",
           "Each runs `python -m ballonet ARGS` in a fresh folder (`bench/sweep.py`; cases in "
           "`bench/sweep_cases.py`). Expected: exit 2 (1 for a dead peer), one line on stderr holding the "
           "expected words, no file left behind (a payload that ran would leave PWNED); valid look-alikes exit 0. "
           "Read-only and full disks are tmpfs mounts (64 KiB, filled) at disk/ in a private mount namespace.", "",
           (f"Swept with the ballonet of `{result['source']}`, not this tree." if result.get("source") else
            "`fuzz_issue33_main.md`: issue 33's cases swept with the code before its fixes (`--source`)."), "",
           f"Outcomes: {kinds['ok']} ok, {kinds['payload ran']} payloads run, {kinds['traceback']} tracebacks, "
           f"{kinds['hang']} hangs, {kinds['silent wrong answer']} silent wrong answers, {kinds['failed']} other "
           f"failures, {kinds['not run']} not run.", "",
           "### Issue 33, by class", "",
           "| class | cases | ok | payloads run | tracebacks | hangs | silent wrong answers | other |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for number, title in ISSUE_33_CLASSES.items():
        mine = Counter(outcome(r) for r in rows if r.get("issue") == number)
        out.append(f"| {number}. {title} | {sum(mine.values())} | {mine['ok']} | {mine['payload ran']} | "
                   f"{mine['traceback']} | {mine['hang']} | {mine['silent wrong answer']} | {mine['failed']} |")
    out += ["| 8. calibrate's threading | see `calibration_threads.md` | | | | | | |", ""]
    out += _issue_47_table(rows)
    out += ["",
            "| issue (class) | case | command | exit | expected | stderr lines | left behind | s | CPU s | peak MB | "
            "outcome | message |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r.get("issue") or 99, r.get("klass") or "")):
        env = f"{r['env']} " if r.get("env") else ""
        disk = f" (disk/ {r['disk']})" if r.get("disk") else ""
        out.append(f"| {r.get('issue') or ('47 ' + r['klass'] if r.get('klass') else '-')} | {_md_cell(r['name'])} | `{env}ballonet {_md_cell(r['argv'])}`{disk} | "
                   f"{r['exit_code']} | {r['expected']} | {r['stderr_lines']} | "
                   f"{_md_cell(', '.join(r['left_behind']) or '-')} | {r.get('seconds', '-')} | {r.get('cpu_s', '-')} | {r.get('peak_mb', '-')} | {outcome(r)} | "
                   f"{_md_cell(r['message'][:240])} |")
    return out + [""]


def _issue_47_table(rows: list[dict]) -> list[str]:
    mine = [r for r in rows if r.get("klass")]
    if not mine:
        return []
    kinds = ("ok", "payload ran", "file replaced", "hang", "traceback", "silent wrong answer", "failed")
    out = ["### Issue 47, by class", "",
           f"Each case within {sweep_module.MAX_SECONDS:.0f} CPU seconds and {sweep_module.MAX_RSS_MB} MB of peak "
           "RSS (its whole process tree), and killed (a hang) at the sweep's timeout; `(issue)` in a case's name "
           "marks the issue's own reproductions, the rest are this sweep's own. The last columns: the most CPU "
           "seconds, wall seconds and peak MB of any case of the class (wall seconds are mostly waiting for one "
           "of the 2 shared cores).", "",
           "| class | cases | " + " | ".join(kinds) + " | CPU s | wall s | peak MB |",
           "|" + " --- |" * (len(kinds) + 5)]
    for key, title in CLASSES.items():
        rs = [r for r in mine if r["klass"] == key]
        n = Counter(outcome(r) for r in rs)
        cpu = max((r.get("cpu_s") or 0 for r in rs), default=0)
        wall = max((r.get("seconds") or 0 for r in rs), default=0)
        peak = max((r.get("peak_mb") or 0 for r in rs), default=0)
        out.append(f"| {title} | {len(rs)} | " + " | ".join(str(n[k]) for k in kinds) + f" | {cpu} | {wall} | {peak} |")
    n = Counter(outcome(r) for r in mine)
    out.append(f"| all | {len(mine)} | " + " | ".join(str(n[k]) for k in kinds) + " | | | |")
    return out


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
    p.add_argument("--sweep-timeout", type=float, default=120.0, help="seconds per command line before it is a hang")
    p.add_argument("--source", default=None,
                   help="sweep the ballonet of this source tree (e.g. an older commit's, to see the cases fail there)")
    p.add_argument("--issue-33-only", action="store_true", help="sweep issue 33's classes only")
    p.add_argument("--issue-47-only", action="store_true", help="sweep issue 47's classes only")
    p.add_argument("--only", action="append", default=None,
                   help="rerun only the cases whose name holds this text (repeatable); their rows replace those "
                        "of the last run, the rest are kept, and the stamp says so")
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
        cases = ISSUE_33 if args.issue_33_only else ISSUE_47 if args.issue_47_only else SWEEP + ISSUE_47
        cases = [c for c in cases if args.only is None or any(text in c.name for text in args.only)]
        rows = sweep(cases, args.sweep_timeout, os.path.abspath(args.source) if args.source else sweep_module.ROOT)
        stamp = _stamp(cmd, time.perf_counter() - start)
        if args.only and "sweep" in results:
            rerun = {r["name"]: r for r in rows}
            rows = [rerun.pop(r["name"], r) for r in results["sweep"]["rows"]] + list(rerun.values())
            stamp = f"{results['sweep']['stamp']} Then {len(cases)} cases rerun: {stamp}"
        results["sweep"] = {"rows": rows, "stamp": stamp, "source": args.source}
    report = write_report(results)
    record(cmd, results, args.out + ".json")
    write_text(args.out + ".md", report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
