"""Where wlb_llm beats zeppelin (issue 49): how much of its lead is the outlier delay
(it trains other steps than the batch as given) and how much is the plan.

    OMP_NUM_THREADS=1 python bench/investigations/wlb_gap.py [--main I ...] [--scale I ...] [--climb MOVES]
        [--json F] [--md F]

For each configuration (positions in `bench/paper.py`'s main and scale grids, as in
`scale_one.py`; default: the six where `bench/results/paper.md` has zeppelin behind
wlb_llm), wlb_llm at its tuned CP degree (`paper.json`'s) and zeppelin, simulated:

* `wlb delayed`: wlb_llm's row as `comparison.compare` prices it, the weighted steps of
  its outlier delay (`wlb_llm.outlier_steps`), scaled to the batch's tokens;
* `wlb as given`: wlb_llm's plan of the batch itself, no delay;
* `zep as given`: zeppelin's plan of the batch (its paper.md figure);
* `zep delayed`: zeppelin planning each of wlb_llm's delay steps, weighted the same way.

If `zep delayed` <= `wlb delayed`, the lead is the batch reshaping (the delay), not the
plan; with `--climb`, zeppelin's plan of the batch as given is also hill-climbed under
the simulator (the same rings; what better placement of them could gain). Beside each simulated step of the batch as given: busiest rank's compute, mean
exposed communication, mean idle, recomputation and attention imbalance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from paper import TOKENS_PER_GPU
from paper_report import CLUSTERS
from scale_one import grid, main_grid

from ballonet import plan_batch, specs, workloads
from ballonet.cost.bounds import batch_lower_bound
from ballonet.planning.wlb_llm import num_groups, outlier_steps
from ballonet.simulation.comparison import degrees
from ballonet.simulation.hill_climb import hill_climb
from ballonet.simulation.result import SimResult
from ballonet.simulation.simulator import simulate

LOSING_MAIN = [0, 6, 9, 19, 31]
LOSING_SCALE = [16]
HERE = os.path.join(os.path.dirname(__file__), "..", "results")


def _tuned_cp(part: str, index: int) -> int:
    with open(os.path.join(HERE, "paper.json")) as f:
        cfg = json.load(f)[part][index]
    return int(cfg["results"]["wlb_llm"]["options"]["cp_size"])


def _facts(res: SimResult) -> dict:
    n = len(res.compute_s)
    return {"step_s": res.step_time_s, "compute_max_s": max(res.compute_s), "compute_mean_s": sum(res.compute_s) / n,
            "exposed_mean_s": sum(res.exposed_comm_s) / n, "idle_mean_s": sum(res.idle_s) / n,
            "attention_imbalance": res.attention_imbalance, "recompute": res.recompute,
            "recompute_layers": res.recompute_layers}


def one(part: str, index: int, climb: int = 0) -> dict:
    cl, nodes, mdl, tp, wl, ctx = (main_grid() if part == "grid" else grid())[index]
    c, m = specs.cluster(CLUSTERS[cl], num_nodes=nodes), specs.model(mdl, tp=tp)
    work = workloads.get(wl)
    total = TOKENS_PER_GPU * c.num_ranks
    batch = next(iter(work.batches(total, 0, 1, ctx)))
    cp = _tuned_cp(part, index)
    # As `comparison.compare` draws the filler of step 0 (seed 0).
    filler = (L for k in range(1, 5) for L in work.sample_batch(total, (0, 0, k), ctx))
    steps = outlier_steps(batch, num_groups(c, m, cp), filler)
    scale = sum(batch) / sum(w * sum(d) for w, d in steps)
    out = {"part": part, "index": index, "config": f"{cl} {c.num_ranks} {mdl} {os.path.basename(wl)} {ctx // 1024}K",
           "wlb_cp": cp, "delay_steps": [{"weight": w * scale, "docs": len(d), "tokens": sum(d),
                                          "longest": max(d)} for w, d in steps]}
    bound = batch_lower_bound(batch, c, m)
    weights = [w * scale for w, _ in steps]
    out["bound_given_s"] = bound
    out["bound_delayed_s"] = sum(w * batch_lower_bound(d, c, m) for w, (_, d) in zip(weights, steps))
    given_by_cp = {d: simulate(plan_batch(batch, c, m, "wlb_llm", cp_size=d), c, m).step_time_s
                   for d in degrees(c.num_ranks // m.tp)}
    out["wlb_given_best"] = min((s, d) for d, s in given_by_cp.items())
    for name, opts in (("wlb", {"cp_size": cp}), ("zep", {})):
        plan = plan_batch(batch, c, m, "zeppelin" if name == "zep" else "wlb_llm", **opts)
        out[f"{name}_given"] = _facts(simulate(plan, c, m))
        if name == "zep" and climb:
            climbed, kept = hill_climb(plan, c, m, climb)
            out["zep_climbed"] = {"moves": climb, "kept": kept, "step_s": simulate(climbed, c, m).step_time_s}
        res = [simulate(plan_batch(d, c, m, "zeppelin" if name == "zep" else "wlb_llm", **opts), c, m)
               for _, d in steps]
        out[f"{name}_steps_s"] = [r.step_time_s for r in res]
        out[f"{name}_delayed_s"] = SimResult.weighted(res, weights, num_tokens=sum(batch),
                                                     lower_bound_s=bound).step_time_s
    return out


def table(rows: list[dict], argv: list[str]) -> str:
    lines = ["# Where wlb_llm beats zeppelin: the outlier delay or the plan\n",
             f"`OMP_NUM_THREADS=1 python bench/investigations/wlb_gap.py {' '.join(argv)}` (simulated, first batch "
             "of each configuration, seed 0, 16K tokens per GPU; wlb_llm at its tuned CP degree of paper.json)\n",
             "`delayed`: the weighted steps of wlb_llm's outlier delay (as `comparison.compare` prices wlb_llm), "
             "planned by each; `as given`: the batch itself; `hill-climbed`: zeppelin's plan of the batch after "
             "random moves kept where the simulated step got shorter (`simulation.hill_climb`, its rings kept).\n",
             "Zeppelin with `zeppelin/evened.py`; at 415a94c, before it, B llama-13b prolong as given ran 3.973 s "
             "(the other five as here).\n",
             "| configuration | wlb cp | delay steps (weight/docs) | wlb delayed | wlb as given (best cp) | "
             "zep as given | zep as given, hill-climbed | zep delayed | zep given / wlb delayed | zep delayed / wlb delayed | bound given | "
             "bound delayed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        st = ", ".join(f"{s['weight']:.2f}/{s['docs']}" for s in r["delay_steps"])
        best_s, best_cp = r["wlb_given_best"]
        z = r.get("zep_climbed")
        hc = f"{z['step_s']:.3f} ({z['kept']} of {z['moves']} moves kept)" if z else "-"
        lines.append(f"| {r['config']} | {r['wlb_cp']} | {st} | {r['wlb_delayed_s']:.3f} | "
                     f"{r['wlb_given']['step_s']:.3f} ({best_s:.3f} at cp {best_cp}) | {r['zep_given']['step_s']:.3f} | {hc} | "
                     f"{r['zep_delayed_s']:.3f} | {r['zep_given']['step_s'] / r['wlb_delayed_s']:.3f} | "
                     f"{r['zep_delayed_s'] / r['wlb_delayed_s']:.3f} | {r['bound_given_s']:.3f} | "
                     f"{r['bound_delayed_s']:.3f} |")
    lines += ["\nThe batch as given, simulated (s; compute of the busiest rank and the mean, exposed communication "
              "and idle on the mean rank):\n",
              "| configuration | planner | step | compute max | compute mean | exposed | idle | attn imbalance | "
              "recompute |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for name in ("wlb", "zep"):
            g = r[f"{name}_given"]
            lines.append(f"| {r['config']} | {name} | {g['step_s']:.3f} | {g['compute_max_s']:.3f} | "
                         f"{g['compute_mean_s']:.3f} | {g['exposed_mean_s']:.3f} | {g['idle_mean_s']:.3f} | "
                         f"{g['attention_imbalance']:.2f} | {g['recompute']}/{g['recompute_layers']} |")
    lines += ["\nEach step of wlb_llm's delay, simulated (s; the normal step first, then each level's release step):\n",
              "| configuration | step | weight | documents | tokens | longest | wlb_llm | zeppelin | zeppelin / wlb_llm |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for k, (s, w, z) in enumerate(zip(r["delay_steps"], r["wlb_steps_s"], r["zep_steps_s"])):
            lines.append(f"| {r['config']} | {k} | {s['weight']:.3f} | {s['docs']} | {s['tokens']} | {s['longest']} | "
                         f"{w:.3f} | {z:.3f} | {z / w:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--main", type=int, nargs="*", default=None, help="main-grid positions (0-35)")
    ap.add_argument("--scale", type=int, nargs="*", default=None, help="scale-grid positions (0-19)")
    ap.add_argument("--climb", type=int, default=0, help="also hill-climb zeppelin's plan of the batch as given "
                    "under the simulator, this many random moves (`simulation.hill_climb`, as hill_climb.py)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    if args.main is None and args.scale is None:
        args.main, args.scale = LOSING_MAIN, LOSING_SCALE
    todo = [("grid", i) for i in args.main or []] + [("scale", i) for i in args.scale or []]
    for part, i in todo:
        if not 0 <= i < len(main_grid() if part == "grid" else grid()):
            ap.error(f"--{'main' if part == 'grid' else 'scale'} position {i} is not in the grid")
    if args.climb < 0:
        ap.error("--climb must be at least 0")
    rows = []
    for part, i in todo:
        r = one(part, i, args.climb)
        rows.append(r)
        print(f"{r['config']:34s} cp{r['wlb_cp']} wlb delayed {r['wlb_delayed_s']:.3f} given "
              f"{r['wlb_given']['step_s']:.3f} | zep given {r['zep_given']['step_s']:.3f} delayed "
              f"{r['zep_delayed_s']:.3f} | climbed {r.get('zep_climbed')} | wlb given best {r['wlb_given_best']} | bound given {r['bound_given_s']:.3f} "
              f"delayed {r['bound_delayed_s']:.3f} | steps {[(round(s['weight'], 3), s['docs']) for s in r['delay_steps']]} "
              f"wlb {[round(x, 3) for x in r['wlb_steps_s']]} zep {[round(x, 3) for x in r['zep_steps_s']]}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table(rows, argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
