"""Whether zeppelin's search, pricing its candidates hop by hop and running the ports of
those within `Thresholds.port_margin` of the least (`CandidateSearch._settle`), picks the plan
it picks with every candidate's ports run, and how far a candidate's port-by-port
estimate falls below its hop-by-hop one.

    OMP_NUM_THREADS=1 python bench/investigations/port_margin.py [main|scale|held|planner ...]

Per configuration: both chosen estimates, whether they are equal, and the least ratio of
port-by-port to hop-by-hop estimate over the candidates with routed rings (below 1:
running the ports priced that candidate lower), with that candidate's hop-by-hop gap
above the least port-by-port estimate (`Thresholds.port_margin` must cover the gaps of ratios below 1
that could win)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from estimate import held_configs
from first_batch import first_batch
from scale_one import grid, main_grid

from ballonet import plan_batch, specs, workloads
from ballonet.planning.crossing_rings import EVERY_PORT, HOP_BY_HOP, routed_ring_docs
from ballonet.planning.zeppelin import search

_settle = search.CandidateSearch._settle
rows: list[tuple[float, float]] = []


def _recording(self) -> None:
    for _, c, maker in self.pending:
        links = maker.links
        if routed_ring_docs(c.plan, c.dev, maker.model, links.link, links.nic, links.rails):
            rows.append((c.seconds, maker.price(c.plan).seconds))
        else:
            rows.append((c.seconds, c.seconds))
    _settle(self)


def configs(parts: list[str]):
    for part in parts:
        if part == "planner":
            for gpus in (128, 1024):
                yield (f"planner {gpus}", workloads.get("wlbllm").sample_batch(16384 * gpus, 0),
                       specs.cluster("h200-8nic", num_nodes=gpus // 8), specs.model("llama-7b"))
            continue
        cfgs = {"main": lambda: [(None, *c, 0) for c in main_grid()], "scale": lambda: [(None, *c, 0) for c in grid()],
                "held": held_configs}[part]()
        for i, (_, cl, nodes, mdl, tp, wl, ctx, seed) in enumerate(cfgs):
            c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
            yield (f"{part} {i} {cl} {c.num_ranks} {mdl} {os.path.basename(wl)} {ctx // 1024}K s{seed}", batch, c, m)


def main(argv=None) -> int:
    parts = (argv if argv is not None else sys.argv[1:]) or ["main", "scale", "held", "planner"]
    differ = 0
    for name, lengths, c, m in configs(parts):
        rows.clear()
        search.CandidateSearch._settle = _recording
        try:
            lazy = plan_batch(lengths, c, m).meta["estimated_step_s"]
        finally:
            search.CandidateSearch._settle = _settle
        search.HOP_BY_HOP = EVERY_PORT  # every candidate's ports run in the search
        t = time.process_time()
        try:
            every = plan_batch(lengths, c, m).meta["estimated_step_s"]
        finally:
            search.HOP_BY_HOP = HOP_BY_HOP
        every_s = time.process_time() - t
        least = min(r for _, r in rows)
        below = [(r / h, h / least - 1) for h, r in rows if r < h]
        low = min(below) if below else (1.0, 0.0)
        differ += lazy != every
        print(f"{name:44s} lazy {lazy:.4f} every {every:.4f} {'same' if lazy == every else 'DIFFER'} "
              f"least ratio {low[0]:.3f} at gap {low[1]:+.3f} plan {every_s:.2f}s", flush=True)
    print(f"{differ} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
