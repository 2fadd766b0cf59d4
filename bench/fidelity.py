"""Fidelity of the simulator against the real runtime on this CPU machine, plan for plan.

    OMP_NUM_THREADS=1 python bench/fidelity.py [--ranks 2 4] [--kinds short long] [--steps 6]
        [--rounds 3] [--planners ...] [--profile FILE]

1. Calibrate this machine for each world size (`ballonet calibrate` under torchrun on that
   many gloo ranks, lengths up to the longest document of the batches: 4 ranks on 2 cores
   compute slower than 2), just before that world size's runs, unless --profile names a
   profile already measured.
2. For each batch kind, world size and planner, train the tiny model for --steps real steps
   with that profile (`ballonet train --calibration PROFILE --json-log`, so the run plans
   with it), 2 ranks on one emulated node, 4 ranks on two. Kinds: "short" (the stdlib
   corpus, documents cut at 2048 tokens, 8192 tokens a step) and "long" (a lengths file of
   documents of 4K-12K tokens among short ones, 16384 tokens a step: attention dominates).
3. For every step but the first (warm-up), plan the step's batch again (the log's ledger
   gives its pieces) with the run's own configuration (`training.loop.preflight`) and
   profile, check the plan's digest against the one the run logged (the very plan that
   trained), and simulate it as the runtime runs it (for distca and magi: without the
   courtesies of docs/design.md section 10); compare each rank's predicted compute (forward
   and backward, without the optimizer step) with its measured CPU time, and the step.

4. Repeat 1-3 --rounds times, each round calibrated afresh and its planners in a rotated
   order: on a shared machine a neighbour's burst moves one run's CPU times (and one
   calibration's) by as much as the target, so each rank's error is the median over the
   rounds of that round's error (its own profile against its own run), and the report says
   how many single rounds met the target and each round's worst error.

Targets: per-rank compute within 15%, step within 25%, planners in the same order.
Writes bench/results/fidelity.md and fidelity.json, with the machine's load; the profiles
in bench/results/fidelity_profiles/. bench/investigations/fidelity_paired.py measures the simulator's
error without the machine's drift between a calibration and a run (both in the same
processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _common import command, record, write_text
from ballonet import calibration
from ballonet.simulation import simulate
from ballonet.training.config import TrainConfig
from ballonet.training.loop import _plan, preflight
from ballonet.training.metrics import plan_profile

PLANNERS = ["zeppelin", "te_cp", "llama_cp", "hybrid_dp", "wlb_llm", "megatron_hcp", "distca", "magi", "packed_dp",
            "flops_dp"]
TARGETS = {"compute": 0.15, "step": 0.25}
KINDS = {"short": {"corpus": "stdlib", "global_tokens": 8192, "max_doc_tokens": 2048},
         "long": {"corpus": "LONG", "global_tokens": 16384, "max_doc_tokens": 12288}}
"""Batch kinds: the corpus ("LONG": `long_lengths` written to the run's folder), tokens a step, the cut."""


def long_lengths(path: str, seed: int = 0) -> None:
    """A lengths file: documents of 4K-12K tokens (uniform) holding about half the tokens,
    among short ones (lognormal around 300, 16 to 2000), in random order."""
    rng = np.random.default_rng(seed)
    longs = rng.integers(4096, 12289, 120).tolist()
    shorts = np.clip(rng.lognormal(np.log(300), 0.8, 3200), 16, 2000).astype(int).tolist()
    docs = longs + shorts
    rng.shuffle(docs)
    with open(path, "w") as f:
        f.write("\n".join(str(int(n)) for n in docs) + "\n")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def calibrate(path: str, max_length: int, nproc: int) -> None:
    """`ballonet calibrate` on `nproc` gloo ranks: the machine as a run of that many ranks
    finds it (where ranks outnumber the cores, each computes slower)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "ballonet", "calibrate", "--max-length", str(max_length),
           "--out", path]
    subprocess.run(cmd, env=_env(), check=True, stdout=subprocess.DEVNULL)


def run_config(nproc: int, planner: str, kind: dict, args, profile_path: str) -> TrainConfig:
    return TrainConfig(model="tiny", corpus=kind["corpus"], global_tokens=kind["global_tokens"],
                       max_doc_tokens=kind["max_doc_tokens"], steps=args.steps, seed=args.seed, planner=planner,
                       nodes=1 if nproc <= 2 else 2, calibration=profile_path)


def train(nproc: int, config: TrainConfig, log: str) -> list[dict]:
    cmd = [sys.executable, "-m", "ballonet", "train", "--nproc", str(nproc), "--nodes", str(config.nodes),
           "--planner", config.planner, "--steps", str(config.steps), "--global-tokens", str(config.global_tokens),
           "--max-doc-tokens", str(config.max_doc_tokens), "--corpus", config.corpus, "--seed", str(config.seed),
           "--calibration", config.calibration, "--json-log", log]
    subprocess.run(cmd, env=_env(), check=True, stdout=subprocess.DEVNULL)
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def predict(record: dict, nproc: int, config: TrainConfig, profile, cluster, spec) -> dict:
    """The simulator on the very plan the step trained on (its digest checked); `cluster`
    and `spec` as the run had them (`training.loop.preflight`)."""
    lengths = [end - start for _, _, start, end in record["ledger"]]
    plan = _plan(plan_profile(cluster, config.calibration), lengths, cluster=cluster, model=spec,
                 planner=config.planner)
    if plan.digest != record["plan_digest"]:
        raise SystemExit(f"{config.planner} on {nproc} ranks, step {record['step']}: the plan made again differs "
                         "from the one that trained")
    with calibration.use(profile):
        res = simulate(as_run(plan), cluster, spec)
    compute = [c - res.optimizer_s for c in res.compute_s]  # the loop's compute: no optimizer step
    return {"compute_s": compute, "cpu_s_max": max(res.compute_s), "step_s": res.step_time_s,
            "rings": len(plan.rings)}


def as_run(plan):
    """`plan` as the runtime runs it here: distca and magi without the courtesies of
    docs/design.md section 10 (K/V sent once per shard, ping-pong)."""
    return dataclasses.replace(plan, meta={**plan.meta, "kv_prefix": False, "ping_pong": False})


def compare(records: list[dict], nproc: int, config: TrainConfig, profile) -> dict:
    """One run against its simulation: per rank, and the step, averaged over the steps."""
    rows = []
    cluster, spec, _ = preflight(config, nproc)
    for rec in records[1:]:  # the first step warms up allocators and kernels
        p = predict(rec, nproc, config, profile, cluster, spec)
        rows.append({"step": rec["step"], "predicted": p,
                     "measured": {"compute_s": rec["compute_s"], "cpu_s_max": rec["cpu_s_max"],
                                  "step_s": rec["tokens"] / rec["tokens_per_s"]}})
    out = {"steps": rows, "rings": statistics.mean(r["predicted"]["rings"] for r in rows)}
    pred = np.mean([r["predicted"]["compute_s"] for r in rows], axis=0)
    meas = np.mean([r["measured"]["compute_s"] for r in rows], axis=0)
    out["per_rank"] = {"predicted": pred.tolist(), "measured": meas.tolist(), "error": (pred / meas - 1).tolist()}
    out["compute_s_max"] = _err(np.mean([max(r["predicted"]["compute_s"]) for r in rows]),
                                np.mean([max(r["measured"]["compute_s"]) for r in rows]))
    for key in ("cpu_s_max", "step_s"):
        out[key] = _err(statistics.mean(r["predicted"][key] for r in rows),
                        statistics.mean(r["measured"][key] for r in rows))
    return out


def _err(pred: float, meas: float) -> dict:
    return {"predicted": float(pred), "measured": float(meas), "error": float(pred / meas - 1)}


def combine(rounds: list[dict]) -> dict:
    """The rounds of one (kind, ranks, planner): each figure, and each error, the median over
    the rounds (an error is a round's own prediction against its own measurement); the
    rounds kept under "rounds"."""
    def med(xs):
        return np.median(np.asarray(xs, dtype=float), axis=0).tolist()
    out = {"rounds": rounds, "rings": statistics.mean(r["rings"] for r in rounds),
           "per_rank": {k: med([r["per_rank"][k] for r in rounds]) for k in ("predicted", "measured", "error")}}
    for key in ("compute_s_max", "cpu_s_max", "step_s"):
        out[key] = {k: med([r[key][k] for r in rounds]) for k in ("predicted", "measured", "error")}
    return out


def rotated(planners: list[str], by: int) -> list[str]:
    """`planners` started at position `by`: round r runs them in another order, so a slow
    spell of the machine falls on other planners each round."""
    by %= len(planners)
    return planners[by:] + planners[:by]


def step_key(nproc: int) -> str:
    """What judges the step: wall time when each rank has a core, else (more ranks than
    cores) the busiest rank's CPU time of the whole step."""
    return "step_s" if nproc <= (os.cpu_count() or 1) else "cpu_s_max"


TIE = 0.02
"""Predictions closer than this (relative) are a tie: the simulator does not order them."""


def _pairs(results: dict, kind: str, nproc: int, key: str) -> tuple[int, int, list[str]]:
    """Pairs of planners predicted more than TIE apart: (how many the measurement orders
    the same way, how many there are, the ones it orders the other way)."""
    mine = {p: r[key] for (k, n, p), r in results.items() if n == nproc and k == kind}
    agree, total, wrong = 0, 0, []
    names = sorted(mine)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = mine[a]["predicted"], mine[b]["predicted"]
            if abs(pa - pb) <= TIE * min(pa, pb):
                continue
            total += 1
            if (pa < pb) == (mine[a]["measured"] < mine[b]["measured"]):
                agree += 1
            else:
                wrong.append(f"{a}/{b}")
    return agree, total, wrong


def _worst(errors: list[float]) -> float:
    return max(errors, key=abs)


def _met(result: dict) -> bool:
    """Every rank's compute error of `result` (a run, or the median of its rounds) within the target."""
    return abs(_worst(result["per_rank"]["error"])) <= TARGETS["compute"]


LIGHT = 0.8
"""A rank predicted to compute under this share of its run's busiest rank is a light rank."""


def _by_load(runs: list[dict]) -> tuple[list[float], list[float]]:
    """The per-rank errors of `runs`, split into light ranks' (`LIGHT`) and the others'."""
    light, busy = [], []
    for r in runs:
        top = max(r["per_rank"]["predicted"])
        for pred, err in zip(r["per_rank"]["predicted"], r["per_rank"]["error"]):
            (light if pred < LIGHT * top else busy).append(err)
    return light, busy


def _median_pct(errors: list[float]) -> str:
    return f"{statistics.median(errors):+.0%} ({len(errors)} rank{'' if len(errors) == 1 else 's'})" if errors else "none"


def _load(loads: list[float]) -> str:
    return f"{min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f})" if loads else "not recorded"


def report(results: dict, args, profile_path: str, seconds: float, command: str) -> str:
    cores = os.cpu_count()
    rounds = max(len(r.get("rounds", [r])) for r in results.values())
    lines = ["# Simulator fidelity on this CPU machine (tiny model, gloo ranks, the plans that trained)", "",
             f"Command: `{command}` ({seconds:.0f} s). Profiles: "
             + ", ".join(f"`{os.path.relpath(p.strip(), ROOT)}`" for p in profile_path.split(","))
             + (" (given with --profile: every run plans with it" if args.profile else
                " (`ballonet calibrate` on as many gloo ranks as the run has, this machine, just before that world "
                "size's runs; every run plans with its round's and world size's")
             + ", `ballonet train --calibration`), and every simulated plan is the one the step trained on (digest "
             "checked). "
             f"{args.steps} steps per run, the first left out. Batch kinds: " + "; ".join(
                 f"{k}: {v['global_tokens']} tokens a step, documents cut at {v['max_doc_tokens']}"
                 + (" (stdlib sources)" if v["corpus"] == "stdlib" else " (4K-12K-token documents among short ones)")
                 for k, v in KINDS.items() if k in args.kinds) + ". "
             "Compute = CPU time of a rank's training thread over forward and backward (predicted: the "
             "simulator's compute of that rank less its optimizer step): each rank's, averaged over the steps. "
             "Step (wall) = wall time of the step; step (CPU) = the busiest rank's CPU time of the whole step. The "
             f"step target is judged on wall time where each rank has a core, on step (CPU) where ranks outnumber "
             f"this machine's {cores} cores. Targets: every rank's compute within {TARGETS['compute']:.0%}, step "
             f"within {TARGETS['step']:.0%}. distca and magi are simulated as the runtime runs them (whole-block "
             "all-gathers, one batch). "
             + (f"{rounds} rounds{'' if args.profile else ', each calibrated afresh'}, planners in a rotated order; "
                "every figure and every error "
                "is the median over the rounds of that round's own (its profile against its run); \"rounds met\" "
                "counts the single rounds whose every rank was within the target, \"round worsts\" gives each "
                "round's worst rank in the order the rounds ran. " if rounds > 1 else "")
             + "Load average (1 min) before the runs (other jobs share this machine): "
             f"{_load(args.load)}.", ""]
    for kind in args.kinds:
        lines += [f"## {kind} batches", "",
                  "| ranks | planner | rings a step | per-rank compute pred / meas (s) | errors | worst | compute met | "
                  + ("rounds met | round worsts | " if rounds > 1 else "")
                  + "compute max err | step (wall) pred / meas (s) | err | step (CPU) pred / meas (s) | err | "
                  "step met |",
                  "| --- | --- | --- | --- | --- | --- | --- | " + ("--- | --- | " if rounds > 1 else "")
                  + "--- | --- | --- | --- | --- | --- |"]
        for (k, n, planner), r in sorted(results.items()):
            if k != kind:
                continue
            pr = r["per_rank"]
            worst = _worst(pr["error"])
            cells = ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(pr["predicted"], pr["measured"]))
            errs = ", ".join(f"{e:+.0%}" for e in pr["error"])
            met = "yes" if _met(r) else "no"
            each = r.get("rounds", [r])
            worsts = ", ".join(f"{_worst(x['per_rank']['error']):+.0%}" for x in each)
            spread = f"{sum(_met(x) for x in each)} of {len(each)} | {worsts} | " if rounds > 1 else ""
            wall, cpu = r["step_s"], r["cpu_s_max"]
            judge = wall if step_key(n) == "step_s" else cpu
            lines.append(f"| {n} | {planner} | {r['rings']:.1f} | {cells} | {errs} | {worst:+.0%} | {met} | {spread}"
                         f"{r['compute_s_max']['error']:+.0%} | {wall['predicted']:.3f} / {wall['measured']:.3f} | "
                         f"{wall['error']:+.0%} | {cpu['predicted']:.3f} / {cpu['measured']:.3f} | {cpu['error']:+.0%} "
                         f"| {'yes' if abs(judge['error']) <= TARGETS['step'] else 'no'} "
                         f"({'wall' if step_key(n) == 'step_s' else 'CPU'}) |")
        mine = [r for (k, _, _), r in results.items() if k == kind]
        within = sum(_met(r) for r in mine)
        line = f"Every rank's compute within {TARGETS['compute']:.0%}: {within} of {len(mine)} runs"
        if rounds > 1:
            single = [sum(_met(r["rounds"][i]) for r in mine) for i in range(rounds)]
            line += " (median of the rounds); in single rounds: " + ", ".join(
                f"round {i + 1} {m} of {len(mine)}" for i, m in enumerate(single))
        lines += ["", line + "."]
        for n in sorted({n for k, n, _ in results if k == kind}):
            light, busy = _by_load([r for (k, m, _), r in results.items() if k == kind and m == n])
            lines.append(f"On {n} ranks, median error of the ranks with under {LIGHT:.0%} of their run's busiest "
                         f"rank's predicted compute: {_median_pct(light)}; of the others: {_median_pct(busy)}.")
        for n in sorted({n for k, n, _ in results if k == kind}):
            key = step_key(n)
            agree, total, wrong = _pairs(results, kind, n, key)
            lines.append(f"Planner pairs predicted more than {TIE:.0%} apart by {key} on {n} ranks, ordered alike by "
                         f"the measurement: {agree} of {total}" + (f" (not: {', '.join(wrong)})" if wrong else "")
                         + ".")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--planners", nargs="+", default=PLANNERS)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every run, each calibrated afresh (errors: the median over the rounds)")
    p.add_argument("--profile", default=None, help="a measured profile for every run (default: calibrate each round)")
    p.add_argument("--profiles", default=None,
                   help="folder for the profiles each round calibrates (default: fidelity_profiles beside --out)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fidelity"))
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json of the last run")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        p.error(f"--rounds must be at least 1 and --steps at least 2 (the first step is left out), got "
                f"{args.rounds} and {args.steps}")
    args.profiles = args.profiles or os.path.join(os.path.dirname(os.path.abspath(args.out)), "fidelity_profiles")
    if args.report_only:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        results = {tuple(int(x) if x.isdigit() else x for x in k.split("/")): r for k, r in saved["results"].items()}
        vars(args).update({k: v for k, v in saved["args"].items() if k != "out"})
        text = report(results, args, saved["profile"], saved["seconds"], saved["command"])
        write_text(args.out + ".md", text)
        print(text)
        return 0
    t0 = time.time()
    logs = tempfile.mkdtemp(prefix="ballonet-fidelity-")
    long_file = os.path.join(logs, "long_lengths.txt")
    long_lengths(long_file, args.seed)
    specs_by_kind = {kind: {**KINDS[kind], "corpus": long_file if KINDS[kind]["corpus"] == "LONG"
                            else KINDS[kind]["corpus"]} for kind in args.kinds}
    max_length = max(KINDS[k]["max_doc_tokens"] for k in args.kinds)
    runs: dict = {}
    paths, args.load = [], []
    for r in range(args.rounds):
        for n in args.ranks:
            path = args.profile or os.path.join(args.profiles, f"round{r + 1}_{n}ranks.json")
            if not args.profile:
                os.makedirs(args.profiles, exist_ok=True)
                calibrate(path, max_length, n)
            paths.append(path)
            profile = calibration.load(path)
            for kind in args.kinds:
                for planner in rotated(args.planners, r * len(args.planners) // args.rounds):
                    args.load.append(os.getloadavg()[0])
                    config = run_config(n, planner, specs_by_kind[kind], args, path)
                    records = train(n, config, os.path.join(logs, f"{kind}_{planner}_{n}_{r}.jsonl"))
                    res = compare(records, n, config, profile)
                    runs.setdefault((kind, n, planner), []).append(res)
                    print(f"round {r + 1} {kind} {n} ranks {planner:12s} per-rank compute "
                          f"{', '.join(f'{e:+.0%}' for e in res['per_rank']['error'])} "
                          f"step {res['step_s']['error']:+.0%}", flush=True)
    results = {key: combine(rs) for key, rs in runs.items()}
    seconds, cmd = time.time() - t0, command("fidelity.py", argv)
    profile_path = ", ".join(dict.fromkeys(paths))
    text = report(results, args, profile_path, seconds, cmd)
    record(cmd, {"profile": profile_path, "seconds": seconds,
                 "args": {k: v for k, v in vars(args).items() if k != "report_only"},
                 "results": {f"{k}/{n}/{p}": r for (k, n, p), r in results.items()}}, args.out + ".json")
    write_text(args.out + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
