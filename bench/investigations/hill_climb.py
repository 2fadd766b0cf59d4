"""How much of zeppelin's distance to the lower bound its placement heuristic leaves.

    OMP_NUM_THREADS=1 python bench/investigations/hill_climb.py [--cluster B] [--model llama-3b] [--tp 1]
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
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, BENCH)  # after this folder: bench/ (_common)

from _common import RESULTS, command, record, write_text

from ballonet import plan_batch, specs, workloads
from ballonet.simulation.hill_climb import hill_climb
from ballonet.simulation.simulator import simulate

CLUSTERS = {"A": "a800-4nic", "B": "h800-8nic", "C": "h200-8nic"}


def worst_configuration(results: str) -> tuple[str, str, int, str]:
    """(cluster, model, tp, workload) of the main grid's configuration furthest from the
    lower bound in `results` (bench/paper.py's paper.json)."""
    with open(results) as f:
        grid = json.load(f)["grid"]
    cfg = max(grid, key=lambda c: c["results"]["zeppelin"]["ratio_to_lower_bound"])
    return cfg["cluster"], cfg["model"], cfg["tp"], cfg["workload"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", choices=sorted(CLUSTERS), help="default: the worst of results/paper.json")
    ap.add_argument("--model", help="e.g. llama-3b (default: the worst configuration's)")
    ap.add_argument("--tp", type=int, default=None, help="tensor parallelism (default: the configuration's, else 1)")
    ap.add_argument("--workload", choices=["wlbllm", "prolong", "shortmix"])
    ap.add_argument("--steps", type=int, default=2, help="batches (bench/paper.py's --steps)")
    ap.add_argument("--moves", type=int, default=4000, help="random moves tried per batch")
    ap.add_argument("--seed", type=int, default=0, help="of the moves; the batches are bench/paper.py's (seed 0)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.moves < 0 or (args.tp is not None and args.tp < 1):
        ap.error("--steps and --tp must be at least 1, --moves at least 0")
    given = (args.cluster, args.model, args.workload)
    if all(given):
        cluster, model, tp, workload = args.cluster, args.model, args.tp if args.tp is not None else 1, args.workload
    elif not any(given):
        try:
            cluster, model, tp, workload = worst_configuration(os.path.join(RESULTS, "paper.json"))
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
    data = record(command("investigations/hill_climb.py", argv), {
        "configuration": {"cluster": cluster, "model": model, "tp": tp, "workload": workload, "gpus": c.num_ranks},
        "moves": args.moves, "seed": args.seed, "batches": rows,
        "ratio_to_lower_bound": statistics.mean(r["step_s"] for r in rows) / bound,
        "climbed_ratio_to_lower_bound": statistics.mean(r["climbed_step_s"] for r in rows) / bound,
        "seconds": time.perf_counter() - t}, os.path.join(args.out, "hill_climb.json"))
    write_text(os.path.join(args.out, "hill_climb.md"), report(data))
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
