"""Zeppelin's rings inside PCIe-only nodes run as "heads" documents (DeepSpeed-Ulysses,
`plan.Ring` comm "heads") instead, simulated and estimated (issue 48).

    OMP_NUM_THREADS=1 python bench/investigations/heads_split.py [--steps 8] [--workloads wlbllm prolong] [--out FILE]

On `bench/hetero.py`'s a800+l40s configurations (16K tokens per GPU, 64K context,
LLaMA-7B, seed 0), for each batch whose zeppelin plan runs a ring inside a PCIe-only node
(`zeppelin.pcie_level.inside_pcie_node`): the plan with every such ring whose members
divide the model's K/V heads (`cost.flops.heads_divide`) run as a "ring" and as a
"heads" document (the search's choice between them: `pcie_level.by_heads`; the attention
layout, and so memory and recomputation, unchanged), each simulated and estimated
(`CandidateMaker.price` of the chosen plan's recomputation mode), against the batch's
lower bound. Writes a Markdown table (default
bench/results/heads_split.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, BENCH)  # after this folder: bench/ (hetero)

from _common import RESULTS, command, machine, write_text
from hetero import MAX_LENGTH, MODEL, TOKENS_PER_GPU

from ballonet import specs, workloads
from ballonet.cost.flops import heads_divide
from ballonet.plan import Plan
from ballonet.planning.zeppelin.pcie_level import inside_pcie_node
from ballonet.planning.zeppelin.search import CandidateSearch, ZeppelinOptions
from ballonet.simulation.simulator import simulate

CLUSTER = "a800+l40s"


def as_comm(plan: Plan, rings, comm: str) -> Plan:
    """`plan` with `rings` run as `comm` ("ring" or "heads") documents."""
    docs = {r.doc for r in rings}
    return dataclasses.replace(plan, rings=tuple(dataclasses.replace(r, comm=comm) if r.doc in docs else r
                                                 for r in plan.rings)).validate()


def batch_rows(workload: str, steps: int) -> list[str]:
    cluster, model = specs.cluster(CLUSTER), specs.model(MODEL)
    rows = []
    for i, lengths in enumerate(workloads.get(workload).batches(TOKENS_PER_GPU * cluster.num_ranks, 0, steps,
                                                                  MAX_LENGTH)):
        search = CandidateSearch(lengths=list(lengths), cluster=cluster, model=model, options=ZeppelinOptions())
        plan = search.run()
        maker = next(m for _, m, *_ in search.made if m.model == search.best.model)  # the chosen plan's mode
        inside = [r for r in plan.rings if inside_pcie_node(r, search.best.dev) and heads_divide(model, len(r.ranks))]
        if not inside:
            continue
        figures = []
        for p in (as_comm(plan, inside, "ring"), as_comm(plan, inside, "heads")):
            res = simulate(p, cluster, model)
            figures.append((res.step_time_s, maker.price(p).seconds, res.lower_bound_s))
        (ring_s, ring_e, bound), (heads_s, heads_e, _) = figures
        shape = ", ".join(f"{plan.lengths[r.doc] // 1024}K over {len(r.ranks)}" for r in inside)
        chosen = "heads" if all(r.comm == "heads" for r in inside) else "ring"
        rows.append(f"| {workload} | {i} | {shape} | {chosen} | {ring_s:.2f} | {ring_e:.2f} | {heads_s:.2f} | {heads_e:.2f} "
                    f"| {heads_e / heads_s:.3f} | {bound:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workloads", nargs="+", default=["wlbllm", "prolong"])
    ap.add_argument("--out", default=os.path.join(RESULTS, "heads_split.md"))
    args = ap.parse_args(argv)
    began = time.time()
    lines = [f"| workload ({CLUSTER}) | batch | rings inside PCIe nodes | zeppelin chose | ring: simulated s "
             "| estimated s | heads: simulated s | estimated s | heads estimate / simulated | bound s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workload in args.workloads:
        lines += batch_rows(workload, args.steps)
    text = "\n".join(["# Rings inside PCIe-only nodes as \"heads\" documents", "",
                      f"Command: `{command('investigations/heads_split.py', argv)}` "
                      f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}, "
                      f"{time.time() - began:.0f} s).", "", *lines, ""])
    write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
