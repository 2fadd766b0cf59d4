"""How much of zeppelin's distance to the lower bound its placement heuristic leaves.

    OMP_NUM_THREADS=1 python bench/hill_climb.py [--cluster B] [--model llama-3b] [--tp 1]
        [--workload shortmix] [--steps 2] [--moves 4000] [--seed 0] [--out bench/results]

Starts from zeppelin's plan of each batch of one main-grid configuration of
`bench/paper.py` (4 nodes, 16K tokens a GPU, 64K context; default its worst on the
bound) and climbs under the simulator: a random move is kept when the simulated step gets
shorter. Moves: a whole document to another rank, two whole documents swapped, or 16 to
1024 tokens of a document split inside a node from one of its members to another. The
rings stay those the partitioner chose (rings across nodes keep their tokens), as do its
recomputation mode (each rank recomputes as little as its tokens need, as simulated) and,
where it remaps, the remap's rule (each node's tokens spread over its ranks). The climbed
step bounds from above what better placement of the same rings could gain: what it leaves
to the lower bound is structure (the rings' transfers, recomputation, kernel efficiency),
not the greedy steps. Writes hill_climb.json and hill_climb.md to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time

from ballonet import InfeasiblePlan, plan_batch, specs, workloads
from ballonet.plan import Plan
from ballonet.planning.assembly import Placement
from ballonet.planning.devices import devices
from ballonet.planning.routing import plan_routes
from ballonet.planning.zeppelin import finish
from ballonet.simulation.simulator import simulate
from ballonet.specs import ClusterSpec, ModelSpec

CLUSTERS = {"A": "a800-4nic", "B": "h800-8nic", "C": "h200-8nic"}
SHIFTS = (16, 64, 256, 1024)
"""Tokens a ring-share move takes from one member to another."""


def placement_of(plan: Plan) -> Placement:
    """The placement `plan` was assembled from: its whole documents per rank and, per
    ring, each member's tokens (its chunks i and 2g-1-i)."""
    out = Placement(num_ranks=plan.num_ranks, local=[plan.local_docs(r) for r in range(plan.num_ranks)])
    for ring in plan.rings:
        g, b = len(ring.ranks), ring.bounds
        out.split[ring.doc] = {r: (b[i + 1] - b[i]) + (b[2 * g - i] - b[2 * g - 1 - i])
                               for i, r in enumerate(ring.ranks)}
    return out


def rebuild(plan: Plan, placement: Placement, cluster: ClusterSpec, model: ModelSpec) -> Plan:
    """`placement` as a plan made like `plan` (`zeppelin.finish`): the same recomputation's
    memory caps (raises `InfeasiblePlan` over them), double rings where it had them, its
    remap rule where it remapped, routes where it had them."""
    spec = dataclasses.replace(model, recompute=plan.meta.get("recompute", model.recompute))
    dev = devices(cluster, spec)
    copy = dataclasses.replace(placement, local=[list(ds) for ds in placement.local],
                               split={d: dict(s) for d, s in placement.split.items()})  # `assemble` edits it
    out = finish(list(plan.lengths), dev, copy, plan.meta, remap=bool(plan.remap),
                 node_remap=plan.meta["options"]["price_linear"], double=any(r.comm == "double" for r in plan.rings))
    if plan.routes:
        out = dataclasses.replace(out, routes=plan_routes(out, cluster, spec, dev.local_index))
    return out


def _move(placement: Placement, plan: Plan, rng: random.Random) -> Placement | None:
    """One random move on a copy of `placement` (None when the draw has nothing to move)."""
    local = [list(ds) for ds in placement.local]
    split = {d: dict(s) for d, s in placement.split.items()}
    R, draw = len(local), rng.random()
    if draw < 0.6:
        a, b = rng.randrange(R), rng.randrange(R)
        if a == b or not local[a]:
            return None
        d = rng.choice(local[a])
        local[a].remove(d)
        local[b].append(d)
    elif draw < 0.8:
        a, b = rng.randrange(R), rng.randrange(R)
        if a == b or not local[a] or not local[b]:
            return None
        d, e = rng.choice(local[a]), rng.choice(local[b])
        local[a][local[a].index(d)], local[b][local[b].index(e)] = e, d
    else:
        inside = [r.doc for r in plan.rings if r.kind == "intra"]
        if not inside:
            return None
        d = rng.choice(inside)
        a, b = rng.sample(sorted(split[d]), 2)
        n = min(rng.choice(SHIFTS), split[d][a] - 1)
        if n <= 0:
            return None
        split[d][a] -= n
        split[d][b] += n
    return dataclasses.replace(placement, local=local, split=split)


def hill_climb(plan: Plan, cluster: ClusterSpec, model: ModelSpec, moves: int, seed: int = 0) -> tuple[Plan, int]:
    """(the shortest plan found from `plan` in `moves` random moves, moves kept)."""
    rng = random.Random(seed)
    placement, best = placement_of(plan), simulate(plan, cluster, model).step_time_s
    kept = 0
    for _ in range(moves):
        trial = _move(placement, plan, rng)
        if trial is None:
            continue
        try:
            candidate = rebuild(plan, trial, cluster, model)
        except InfeasiblePlan:
            continue
        step = simulate(candidate, cluster, model).step_time_s
        if step < best:
            placement, best, plan, kept = trial, step, candidate, kept + 1
    return plan.validate(), kept


def worst_configuration(results: str) -> tuple[str, str, int, str]:
    """(cluster, model, tp, workload) of the main grid's configuration furthest from the
    lower bound in `results` (bench/paper.py's paper.json)."""
    with open(results) as f:
        grid = json.load(f)["grid"]
    cfg = max(grid, key=lambda c: c["results"]["zeppelin"]["ratio_to_lower_bound"])
    return cfg["cluster"], cfg["model"], cfg["tp"], cfg["workload"]


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", choices=sorted(CLUSTERS), help="default: the worst of results/paper.json")
    ap.add_argument("--model", help="e.g. llama-3b (default: the worst configuration's)")
    ap.add_argument("--tp", type=int, default=None, help="tensor parallelism (default: the configuration's, else 1)")
    ap.add_argument("--workload", choices=["wlbllm", "prolong", "shortmix"])
    ap.add_argument("--steps", type=int, default=2, help="batches (bench/paper.py's --steps)")
    ap.add_argument("--moves", type=int, default=4000, help="random moves tried per batch")
    ap.add_argument("--seed", type=int, default=0, help="of the moves; the batches are bench/paper.py's (seed 0)")
    ap.add_argument("--out", default=os.path.join(here, "results"))
    args = ap.parse_args(argv)
    if args.steps < 1 or args.moves < 0 or (args.tp is not None and args.tp < 1):
        ap.error("--steps and --tp must be at least 1, --moves at least 0")
    given = (args.cluster, args.model, args.workload)
    if all(given):
        cluster, model, tp, workload = args.cluster, args.model, args.tp if args.tp is not None else 1, args.workload
    elif not any(given):
        try:
            cluster, model, tp, workload = worst_configuration(os.path.join(here, "results", "paper.json"))
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"no configuration given and results/paper.json unreadable ({e}); give --cluster, --model "
                     "and --workload")
        tp = args.tp if args.tp is not None else tp
    else:
        ap.error("give all of --cluster, --model and --workload, or none (the worst of results/paper.json)")
    try:
        m = specs.model(model, tp=tp)
    except ValueError as e:
        ap.error(f"--model/--tp: {e}")
    c = specs.cluster(CLUSTERS[cluster], num_nodes=4)
    t = time.perf_counter()
    rows = []
    for i, batch in enumerate(workloads.get(workload).batches(16384 * c.num_ranks, 0, args.steps, 65536)):
        plan = plan_batch(batch, c, m, "zeppelin")
        start = simulate(plan, c, m)
        climbed, kept = hill_climb(plan, c, m, args.moves, args.seed + i)
        end = simulate(climbed, c, m)
        nodes = sorted(set(plan.node_of_rank))
        per_node = [[sum(n for r, n in enumerate(p.linear_token_counts) if p.node_of_rank[r] == k) for k in nodes]
                    for p in (plan, climbed)]
        rows.append({"batch": i, "step_s": start.step_time_s, "climbed_step_s": end.step_time_s,
                     "lower_bound_s": start.lower_bound_s, "moves_kept": kept,
                     "node_tokens": per_node[0], "climbed_node_tokens": per_node[1]})
        print(f"  batch {i}: {start.step_time_s:.4f} -> {end.step_time_s:.4f} s ({kept} moves kept)",
              file=sys.stderr, flush=True)
    bound = statistics.mean(r["lower_bound_s"] for r in rows)
    data = {"command": " ".join(["OMP_NUM_THREADS=1 python bench/hill_climb.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "configuration": {"cluster": cluster, "model": model, "tp": tp, "workload": workload, "gpus": c.num_ranks},
            "moves": args.moves, "seed": args.seed, "batches": rows,
            "ratio_to_lower_bound": statistics.mean(r["step_s"] for r in rows) / bound,
            "climbed_ratio_to_lower_bound": statistics.mean(r["climbed_step_s"] for r in rows) / bound,
            "seconds": time.perf_counter() - t}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hill_climb.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(args.out, "hill_climb.md"), "w") as f:
        f.write(report(data))
    print(report(data))
    return 0


def report(data: dict) -> str:
    cfg = data["configuration"]
    title = (f"# Hill-climb of zeppelin's plans: {cfg['cluster']} {cfg['model']} (tp {cfg['tp']}) "
             f"{cfg['workload']}, {cfg['gpus']} GPUs")
    summary = (f"Zeppelin's step over the lower bound: {data['ratio_to_lower_bound']:.3f}x; after {data['moves']} "
               f"random moves per batch under the simulator (same rings): "
               f"{data['climbed_ratio_to_lower_bound']:.3f}x.")
    lines = [title, "", f"Command: `{data['command']}` ({data['date']}, {data['seconds']:.0f} s).", "", summary, "",
             "| batch | step s | climbed step s | shorter | bound s | moves kept | tokens per node | climbed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["batches"]:
        lines.append(f"| {r['batch']} | {r['step_s']:.4f} | {r['climbed_step_s']:.4f} | "
                     f"{1 - r['climbed_step_s'] / r['step_s']:.1%} | {r['lower_bound_s']:.4f} | {r['moves_kept']} | "
                     f"{', '.join(map(str, r['node_tokens']))} | {', '.join(map(str, r['climbed_node_tokens']))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
