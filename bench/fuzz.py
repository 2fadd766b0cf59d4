"""Fuzz: random planner calls, and a sweep of bad command lines through the real CLI.

    OMP_NUM_THREADS=1 python bench/fuzz.py [--cases 10000] [--seed 0] [--no-sweep] [--no-planners]

Planner fuzz (issue 16): `--cases` random clusters (1 to 3 node groups of any GPU type,
1 to 8 GPUs and NICs per node), every model preset with tp 1, 2 or 4, and batches of
64 to 32K tokens per GPU made of 1 to 256 documents of 1 to 1M tokens (log-uniform up to
a longest length, itself log-uniform); every planner plans every batch, and zeppelin
once more with single rings only (`VARIANTS`). A call may end in a valid plan or in
`InfeasiblePlan` / `InputError`; anything else (an invalid plan, another exception, a
call longer than `--timeout` seconds) is a failure.

Bad-input sweep (issues 16 and 33): each case of `sweep_cases.SWEEP` runs `python -m
ballonet ...` in a fresh folder (`sweep.py`) and records the exit code, the stderr lines,
and any file left behind. Every case should exit 2 (a dead peer: 1) with one stderr line
naming what is wrong and leave nothing; a few valid look-alikes (a folder named like a
preset) should exit 0. Hostile checkpoints and corpora are edited copies of clean ones
made by the real CLI; read-only and full disks are tmpfs mounts. The report counts
tracebacks, hangs (over --sweep-timeout) and silent wrong answers (exit 0 where a
refusal was due). Writes bench/results/fuzz.md and fuzz.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import signal
import sys
import time
from collections import Counter

import numpy as np

import sweep as sweep_module
from sweep import outcome, sweep
from sweep_cases import ISSUE_33, SWEEP

from ballonet import PLANNERS, plan_batch, specs
from ballonet.cost import hardware
from ballonet.errors import InputError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MAX_LENGTH = 1 << 20
MAX_DOCS = 256
TP_CHOICES = (1, 2, 4)
MODEL_WEIGHTS = {"tiny": 0.3, "llama-3b": 0.2, "llama-7b": 0.2, "llama3-8b": 0.1, "llama-13b": 0.1, "llama-30b": 0.1}
"""Draw weights of the model presets: big models do not fit most random GPUs (an early
InfeasiblePlan), so smaller ones are drawn more often to exercise the planners."""


# ---- planner fuzz ----------------------------------------------------------------------


def random_cluster(rng: np.random.Generator) -> specs.ClusterSpec:
    """1 to 3 node groups of random GPU types, 1 to 8 GPUs per node, NICs dividing them."""
    groups = []
    for _ in range(int(rng.integers(1, 4))):
        gpus = int(rng.choice([1, 2, 4, 8]))
        nics = int(rng.choice([n for n in (1, 2, 4, 8) if gpus % n == 0 or n % gpus == 0]))
        groups.append(specs.NodeGroup(gpu=str(rng.choice(sorted(hardware.GPUS))), num_nodes=int(rng.integers(1, 5)),
                                      gpus_per_node=gpus, nics_per_node=nics,
                                      nic_gbps=float(rng.choice([100, 200, 400]))))
    return specs.ClusterSpec(name="fuzz", groups=tuple(groups))


def random_case(rng: np.random.Generator):
    """(lengths, cluster, model): tp is 1, 2 or 4 where every node fits it and the heads divide."""
    cluster = random_cluster(rng)
    names = list(MODEL_WEIGHTS)
    model = specs.MODELS[names[int(rng.choice(len(names), p=list(MODEL_WEIGHTS.values())))]]
    fitting = [tp for tp in TP_CHOICES if all(g.gpus_per_node % tp == 0 for g in cluster.groups)
               and model.num_heads % tp == 0 and model.num_kv_heads % tp == 0]
    model = dataclasses.replace(model, tp=int(rng.choice(fitting)))
    longest = np.exp(rng.uniform(0, np.log(MAX_LENGTH)))
    budget = cluster.num_ranks * np.exp(rng.uniform(np.log(64), np.log(32768)))  # tokens per GPU: 64 to 32K
    lengths = np.exp(rng.uniform(0, np.log(longest), MAX_DOCS)).astype(np.int64).clip(1, MAX_LENGTH)
    num_docs = max(1, int(np.searchsorted(np.cumsum(lengths), budget)))
    return lengths[:num_docs].tolist(), cluster, model


VARIANTS = {**{name: (name, {}) for name in PLANNERS}, "zeppelin single": ("zeppelin", {"double": False})}
"""What each call plans with (name: (planner, options)): every planner, and zeppelin
without double rings."""


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def check_call(lengths, cluster, model, planner: str, timeout_s: float, options: dict | None = None) -> str:
    """"ok", "infeasible" or "input_error"; anything else is a failure ("invalid: ...",
    "crash: ...", "hang")."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        plan_batch(lengths, cluster, model, planner=planner, **(options or {})).validate()
        return "ok"
    except _Timeout:
        return "hang"
    except InputError as e:
        return "infeasible" if type(e).__name__ == "InfeasiblePlan" else "input_error"
    except Exception as e:  # noqa: BLE001 - a fuzz records every other exception as a failure
        return f"{'invalid' if type(e).__name__ == 'InvalidPlan' else 'crash'}: {type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _fuzz_case(seed: int, case: int, timeout_s: float) -> tuple[int, dict[str, str], tuple]:
    """Case `case` of the fuzz (its own generator, so cases split over processes)."""
    lengths, cluster, model = random_case(np.random.default_rng([seed, case]))
    outcomes = {name: check_call(lengths, cluster, model, planner, timeout_s, options)
                for name, (planner, options) in VARIANTS.items()}
    return case, outcomes, (lengths, cluster, model)


def fuzz_planners(num_cases: int, seed: int = 0, timeout_s: float = 30.0, jobs: int = 1) -> dict:
    """Outcome counts per planner, and the first failures (with the case that made them)."""
    import functools
    import multiprocessing

    counts = {name: Counter() for name in VARIANTS}
    failures = []
    run = functools.partial(_fuzz_case, seed, timeout_s=timeout_s)
    with multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        results = pool.imap_unordered(run, range(num_cases), chunksize=16) if pool else map(run, range(num_cases))
        for done, (case, outcomes, (lengths, cluster, model)) in enumerate(results, 1):
            for name, outcome in outcomes.items():
                counts[name][outcome.split(":")[0]] += 1
                if outcome not in ("ok", "infeasible", "input_error") and len(failures) < 20:
                    failures.append({"case": case, "planner": name, "outcome": outcome, "lengths": lengths,
                                     "cluster": cluster.to_dict(), "model": model.name, "tp": model.tp})
            if done % 500 == 0:
                print(f"  {done}/{num_cases} cases", file=sys.stderr, flush=True)
    return {"cases": num_cases, "seed": seed, "timeout_s": timeout_s, "counts": {k: dict(v) for k, v in counts.items()},
            "failures": failures}


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
           f"{kinds['hang']} hangs, "
           f"{kinds['silent wrong answer']} silent wrong answers, {kinds['failed']} other failures, "
           f"{kinds['not run']} not run.", "",
           "### Issue 33, by class", "",
           "| class | cases | ok | payloads run | tracebacks | hangs | silent wrong answers | other |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for number, title in ISSUE_33_CLASSES.items():
        mine = Counter(outcome(r) for r in rows if r.get("issue") == number)
        out.append(f"| {number}. {title} | {sum(mine.values())} | {mine['ok']} | {mine['payload ran']} | "
                   f"{mine['traceback']} | {mine['hang']} | {mine['silent wrong answer']} | {mine['failed']} |")
    out += ["| 8. calibrate's threading | see `calibration_threads.md` | | | | | | |", "",
            "| issue 33 | class | command | exit | expected | stderr lines | left behind | s | outcome | message |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r.get("issue") or 99)):
        env = f"{r['env']} " if r.get("env") else ""
        disk = f" (disk/ {r['disk']})" if r.get("disk") else ""
        out.append(f"| {r.get('issue') or '-'} | {_md_cell(r['name'])} | `{env}ballonet {_md_cell(r['argv'])}`{disk} | "
                   f"{r['exit_code']} | {r['expected']} | {r['stderr_lines']} | "
                   f"{_md_cell(', '.join(r['left_behind']) or '-')} | {r.get('seconds', '-')} | {outcome(r)} | "
                   f"{_md_cell(r['message'][:240])} |")
    return out + [""]


def write_report(results: dict) -> str:
    out = ["# Fuzz: planner calls and bad command lines", "",
           "Both parts come from `bench/fuzz.py` (see its docstring); each names the command that made it.", ""]
    if results.get("planners"):
        out += _planner_section(results["planners"])
    if results.get("sweep"):
        out += _sweep_section(results["sweep"])
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per planner call before it counts as a hang")
    p.add_argument("--jobs", type=int, default=1, help="processes for the planner fuzz")
    p.add_argument("--sweep-timeout", type=float, default=120.0, help="seconds per command line before it is a hang")
    p.add_argument("--source", default=None,
                   help="sweep the ballonet of this source tree (e.g. an older commit's, to see the cases fail there)")
    p.add_argument("--issue-33-only", action="store_true", help="sweep issue 33's classes only")
    p.add_argument("--no-sweep", action="store_true", help="keep the sweep of the last run (in OUT.json)")
    p.add_argument("--no-planners", action="store_true", help="keep the planner fuzz of the last run (in OUT.json)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "fuzz"), help="OUT.md and OUT.json")
    args = p.parse_args()
    command = "OMP_NUM_THREADS=1 python " + " ".join(["bench/fuzz.py", *sys.argv[1:]])
    results = {}
    if os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            results = json.load(f)
    if not args.no_planners:
        start = time.perf_counter()
        results["planners"] = fuzz_planners(args.cases, args.seed, args.timeout, args.jobs)
        results["planners"]["stamp"] = _stamp(command, time.perf_counter() - start)
    if not args.no_sweep:
        start = time.perf_counter()
        cases = ISSUE_33 if args.issue_33_only else SWEEP
        rows = sweep(cases, args.sweep_timeout, os.path.abspath(args.source) if args.source else sweep_module.ROOT)
        results["sweep"] = {"rows": rows, "stamp": _stamp(command, time.perf_counter() - start),
                            "source": args.source}
    report = write_report(results)
    with open(args.out + ".md", "w") as f:
        f.write(report)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print(report)


if __name__ == "__main__":
    main()
