"""One scale-grid configuration's batch planned by zeppelin and simulated: step, bound,
estimate, every candidate compared, and where the step goes over the bound (compute of
the busiest and mean rank, exposed communication, idle, recomputation).

    OMP_NUM_THREADS=1 python bench/investigations/scale_one.py [INDEX ...] [--json FILE]

INDEX: positions in `bench/paper.py`'s scale grid (0-19; default: all), or with --main in
its main grid (0-35). A quick harness for
iterating on the planner's quality at 64-1024 GPUs (issue 49) without the baselines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import write_text
from first_batch import first_batch
from paper import MODELS, SCALE_CONTEXTS, SCALE_GPUS, SCALE_MODELS, SCALE_WORKLOADS
from paper_report import CLUSTERS, WORKLOADS

from ballonet import plan_batch
from ballonet.cost.bounds import batch_lower_bound, batch_recomputation
from ballonet.simulation.simulator import simulate


def grid() -> list[tuple]:
    """(cluster, nodes, model, tp, workload, context) of each scale-grid configuration, in order."""
    combos = [(cl, mdl) for mdl in SCALE_MODELS for cl in CLUSTERS]
    out, i = [], 0
    for n in SCALE_GPUS:
        for ctx in SCALE_CONTEXTS:
            cl, (mdl, tp) = combos[i % len(combos)]
            out.append((cl, n // 8, mdl, tp, SCALE_WORKLOADS[i % len(SCALE_WORKLOADS)], ctx))
            i += 1
    return out


def main_grid() -> list[tuple]:
    """(cluster, nodes, model, tp, workload, context) of each main-grid configuration, in order."""
    return [(cl, 4, mdl, tp, wl, 65536) for cl in CLUSTERS for mdl, tp in MODELS for wl in WORKLOADS]


def one(index: int, configs=None) -> dict:
    cl, nodes, mdl, tp, wl, ctx = (configs or grid())[index]
    c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed=0)
    t = time.process_time()
    plan = plan_batch(batch, c, m, "zeppelin")
    plan_s = time.process_time() - t
    res = simulate(plan, c, m)
    bound = batch_lower_bound(batch, c, m)
    n = len(res.compute_s)
    cands = sorted(plan.meta["candidates"], key=lambda x: x["estimated_step_s"])
    est = plan.meta["estimated_step_s"]  # the chosen plan's (not always the least: `search.CandidateSearch._wider`)
    return {"index": index, "config": f"{cl} {c.num_ranks} {mdl} {os.path.basename(wl)} {ctx // 1024}K", "step_s": res.step_time_s,
            "bound_s": bound, "ratio": res.step_time_s / bound, "estimate_s": est,
            "estimate_ratio": est / res.step_time_s, "plan_cpu_s": plan_s,
            "compute_no_comm_bound_s": batch_lower_bound(batch, c, m, communication=False),
            "compute_max_s": max(res.compute_s), "compute_mean_s": sum(res.compute_s) / n,
            "exposed_mean_s": sum(res.exposed_comm_s) / n, "idle_mean_s": sum(res.idle_s) / n,
            "attention_imbalance": res.attention_imbalance, "recompute": res.recompute,
            "recompute_layers": res.recompute_layers, "bound_recompute": batch_recomputation(batch, c, m),
            "chosen": {k: plan.meta[k] for k in ("recompute", "recompute_layers", "keep_tokens", "double")},
            "candidates": cands, "longest": max(batch), "docs": len(batch)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("index", type=int, nargs="*", help="grid positions (default: all)")
    ap.add_argument("--main", action="store_true", help="the main grid (36 configurations at 32 GPUs) instead")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--md", default=None, help="and a table of them here")
    ap.add_argument("--before", default=None, help="a --json file of an earlier run: its steps beside these in --md")
    ap.add_argument("--candidates", action="store_true", help="print every candidate")
    args = ap.parse_args(argv)
    rows, configs = [], main_grid() if args.main else grid()
    for i in args.index or range(len(configs)):
        r = one(i, configs)
        rows.append(r)
        print(f"{i:2d} {r['config']:30s} step {r['step_s']:.3f} bound {r['bound_s']:.3f} ratio {r['ratio']:.3f} "
              f"est/sim {r['estimate_ratio']:.3f} plan {r['plan_cpu_s']:.2f}s | cmax {r['compute_max_s']:.2f} "
              f"cmean {r['compute_mean_s']:.2f} exp {r['exposed_mean_s']:.2f} idle {r['idle_mean_s']:.2f} "
              f"rc {r['recompute']}/{r['recompute_layers']} bound-rc {r['bound_recompute'][0]}/"
              f"{r['bound_recompute'][1]:.1f} chosen {r['chosen']}", flush=True)
        if args.candidates:
            for cnd in r["candidates"]:
                print("     ", cnd)
    if args.json:
        write_text(args.json, json.dumps(rows, indent=1))
    if args.md:
        with open(args.md, "w") as f:
            f.write(table(rows, args.before, argv if argv is not None else sys.argv[1:]))
    return 0


def table(rows: list[dict], before: str | None, argv: list[str]) -> str:
    """A markdown table of `rows` (and the steps and bounds of `before`'s rows beside them)."""
    old = {}
    if before:
        with open(before) as f:
            old = {r["index"]: r for r in json.load(f)}
    lines = ["# One configuration at a time: zeppelin's step, bound and estimate\n",
             f"`OMP_NUM_THREADS=1 python bench/investigations/scale_one.py {' '.join(argv)}` (simulated, first "
             "batch of each configuration, seed 0, 16K tokens per GPU)\n",
             "| # | configuration | " + ("step before | bound before | step/bound before | " if old else "")
             + "step | bound | step/bound | estimate/step | recompute (bound's) | plan CPU s |",
             "| --- | --- | " + ("--- | --- | --- | " if old else "") + "--- | --- | --- | --- | --- | --- |"]
    for r in rows:
        o = old.get(r["index"])
        was = f"{o['step_s']:.3f} | {o['bound_s']:.3f} | {o['ratio']:.3f} | " if o else ("| | | " if old else "")
        lines.append(f"| {r['index']} | {r['config']} | {was}{r['step_s']:.3f} | {r['bound_s']:.3f} | {r['ratio']:.3f} | "
                     f"{r['estimate_ratio']:.3f} | {r['recompute']}/{r['recompute_layers']} "
                     f"({r['bound_recompute'][0]}/{r['bound_recompute'][1]:.1f}) | {r['plan_cpu_s']:.3f} |")
    within = sum(r["ratio"] <= 1.15 for r in rows)
    lines.append(f"\n{within} of {len(rows)} within 1.15x of the bound"
                 + (f" (before: {sum(o['ratio'] <= 1.15 for o in old.values())})" if old else "") + ".\n")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
