"""How far a cheap bound could prune zeppelin's candidate plans (issue 49, item 1).

    OMP_NUM_THREADS=1 python bench/investigations/candidate_bounds.py [--max-gpus 1024]

Plans every configuration of `bench/estimate.py` (paper grid, scale grid, held-out) and
`bench/planner.py`'s wlbllm batches (32-1024 GPUs), with double rings and without, and
records every candidate the search prices (`CandidateSearch._candidate`): its
recomputation, keep_tokens and double, its level 1's bound as the search's prunes use it
(`NodeLevel.node_seconds` plus `CandidateMaker.every_rank_s`), and its estimated layers
(`Candidate.seconds - tail_s`) and node floor (`Candidate.node_floor_s`). Reports:

- whether level 1's bound is a lower bound on a candidate's estimated layers (a prune by
  it is safe only where it is), and how often it is under by more than
  `Thresholds.node_prune_margin`;
- which kinds of candidate the search chose (a kind never chosen could go unplanned);
- the remap plan against the keep-tokens plan of the same level 1: how much faster it
  can be, and how far behind the best plan so far a keep-tokens plan whose remap plan was
  chosen was (what a prune of the remap plan by the keep-tokens plan would have to allow).

Writes bench/results/candidate_bounds.md and .json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, BENCH)  # after this folder: bench/ (_common, estimate)

from _common import RESULTS, command, record, write_text
from estimate import CLUSTERS, TOKENS_PER_GPU, grid_configs, held_configs, scale_configs

from ballonet import InfeasiblePlan, specs, workloads
from ballonet.planning.zeppelin import search
from ballonet.planning.zeppelin.thresholds import THRESHOLDS


def configurations(max_gpus: int) -> list[tuple]:
    bench = [("planner", "C", g // 8, "llama-7b", 1, "wlbllm", None, 0) for g in (32, 64, 128, 256, 512, 1024)]
    return [c for c in grid_configs() + scale_configs() + held_configs() + bench if c[2] * 8 <= max_gpus]


def searches(max_gpus: int) -> list[dict]:
    """Per configuration and option set, the candidates priced, in the search's order."""
    seen: list[dict] = []
    real = search.CandidateSearch._candidate

    def spy(maker, level, keep, placed):
        c = real(maker, level, keep, placed)
        seen.append({"recompute": maker.model.recompute, "double": level.double, "keep": keep,
                     "bound_s": float(level.node_seconds + maker.every_rank_s),
                     "layers_s": None if c is None else float(c.seconds - c.tail_s),
                     "seconds": None if c is None else float(c.seconds),
                     "floor_s": None if c is None else float(c.node_floor_s)})
        return c

    search.CandidateSearch._candidate = staticmethod(spy)  # type: ignore[method-assign]
    out = []
    try:
        for cfg in configurations(max_gpus):
            part, cl, nodes, model, tp, wl, ctx, seed = cfg
            c = specs.cluster(CLUSTERS[cl], num_nodes=nodes)
            m = specs.model(model, tp=tp)
            if part == "planner":
                lengths = workloads.get(wl).sample_batch(TOKENS_PER_GPU * c.num_ranks, seed)
            else:
                lengths = next(iter(workloads.get(wl).batches(TOKENS_PER_GPU * c.num_ranks, seed, 1, ctx)))
            for double in (True, False):
                seen.clear()
                try:
                    search.zeppelin(lengths, c, m, double=double)
                except InfeasiblePlan:
                    continue
                out.append({"config": [str(x) for x in cfg], "double": double, "candidates": list(seen)})
            print(f"  {cfg}", file=sys.stderr, flush=True)
    finally:
        search.CandidateSearch._candidate = staticmethod(real)  # type: ignore[method-assign]
    return out


def chosen(candidates: list[dict]) -> int:
    """The index the search keeps: the first of the least estimated step."""
    best, at = float("inf"), -1
    for i, c in enumerate(candidates):
        if c["seconds"] is not None and c["seconds"] < best:
            best, at = c["seconds"], i
    return at


def summary(runs: list[dict]) -> dict:
    ratios = {False: [], True: []}
    kinds: dict[str, list[int]] = {}
    remap_keep, remap_floor, behind = [], [], []
    for run in runs:
        cs, win = run["candidates"], chosen(run["candidates"])
        best_s = best_layers = float("inf")
        for i, c in enumerate(cs):
            kind = f"{c['recompute']} {'double' if c['double'] else 'single'} {'keep' if c['keep'] else 'remap'}"
            tally = kinds.setdefault(kind, [0, 0])
            tally[0] += 1
            tally[1] += i == win
            if c["layers_s"] is not None and c["bound_s"] > 0:
                ratios[c["double"]].append(c["layers_s"] / c["bound_s"])
            prev = cs[i - 1] if i else None
            pair = (prev is not None and prev["keep"] and not c["keep"] and prev["double"] == c["double"]
                    and prev["recompute"] == c["recompute"] and prev["layers_s"] is not None
                    and c["layers_s"] is not None)
            if pair:
                remap_keep.append(c["layers_s"] / prev["layers_s"])
                remap_floor.append(c["layers_s"] / prev["floor_s"])
                if i == win:
                    behind.append(prev["layers_s"] / best_layers)  # best so far, the keep plan included
            if c["seconds"] is not None and c["seconds"] < best_s:
                best_s, best_layers = c["seconds"], c["layers_s"]
    every = ratios[False] + ratios[True]
    margin = 1 / (1 + THRESHOLDS.node_prune_margin)

    def dist(xs):
        s = sorted(xs)
        return {"n": len(s), "min": s[0], "p5": s[len(s) // 20], "median": statistics.median(s), "max": s[-1]}

    return {"searches": len(runs), "candidates": sum(len(r["candidates"]) for r in runs),
            "layers_over_bound": {"all": dist(every), "single": dist(ratios[False]), "double": dist(ratios[True]),
                                  "under_1": sum(x < 1 for x in every), "under_margin": sum(x < margin for x in every)},
            "kinds": kinds, "remap_over_keep": dist(remap_keep), "remap_over_keep_floor": dist(remap_floor),
            "keep_behind_best_where_remap_chosen": max(behind, default=None)}


def report(data: dict) -> str:
    s = data["summary"]
    lb = s["layers_over_bound"]
    lines = ["# How far a cheap bound could prune zeppelin's candidates", "",
             f"Command: `{data['command']}` ({data['date']}; {data['seconds']:.0f} s).", "",
             f"{s['searches']} searches (bench/estimate.py's configurations and bench/planner.py's wlbllm batches, "
             f"with and without double rings), {s['candidates']} candidates priced.", "",
             "## Level 1's bound against a candidate's estimated layers", "",
             "| candidates | n | min | p5 | median | max |", "| --- | --- | --- | --- | --- | --- |"]
    for k in ("all", "single", "double"):
        d = lb[k]
        lines.append(f"| {k} | {d['n']} | {d['min']:.3f} | {d['p5']:.3f} | {d['median']:.3f} | {d['max']:.3f} |")
    lines += ["", f"Under 1 (the bound over the estimate): {lb['under_1']}; under 1 / (1 + node_prune_margin): "
              f"{lb['under_margin']}. So the bound is no lower bound (a prune by it could drop the plan that "
              f"wins), and it is {lb['all']['median'] - 1:.1%} under a candidate's estimate at the median: "
              "candidates whose estimates are a few percent apart (most of them) cannot be told apart by it.", "",
              "## Kinds of candidate and how often the search chose each", "",
              "| kind | priced | chosen |", "| --- | --- | --- |"]
    for kind, (n, won) in sorted(s["kinds"].items()):
        lines.append(f"| {kind} | {n} | {won} |")
    never = [k for k, (_, won) in sorted(s["kinds"].items()) if not won]
    lines += ["", f"Never chosen: {', '.join(never) if never else 'none'}."]
    rk, rf = s["remap_over_keep"], s["remap_over_keep_floor"]
    lines += ["", "## The remap plan against the keep-tokens plan of the same level 1", "",
              f"Remap / keep-tokens estimated layers over {rk['n']} pairs: min {rk['min']:.3f}, median "
              f"{rk['median']:.3f}, max {rk['max']:.3f}. Remap layers / keep-tokens node floor: min {rf['min']:.3f}. "
              f"Where the remap plan was chosen, its keep-tokens plan was at most "
              f"{s['keep_behind_best_where_remap_chosen']:.4f}x the best plan's layers so far.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gpus", type=int, default=1024, help="leave out configurations over this many GPUs")
    ap.add_argument("--out", default=os.path.join(RESULTS, "candidate_bounds.json"))
    args = ap.parse_args(argv)
    t = time.perf_counter()
    runs = searches(args.max_gpus)
    data = record(command("investigations/candidate_bounds.py", argv),
                  {"summary": summary(runs), "seconds": time.perf_counter() - t}, args.out)
    text = report(data)
    if args.out.endswith(".json"):
        write_text(args.out[:-5] + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
