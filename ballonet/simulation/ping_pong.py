"""DistCA's ping-pong execution, simulated: a layer as two nano-batches whose compute and
communication take turns (docs/design.md, section 10).

DistCA (arXiv 2510.18121) splits each batch into two nano-batches: while one runs core
attention on the attention servers, the other runs its linear layers and its dispatch
all-to-alls, so each one's communication hides behind the other's compute. Here each
nano-batch is half of the plan (every rank's kernels and bytes halved: DistCA balances the
two alike), each rank's stream runs attention A, attention B, linear A, linear B (the
backward: linear first). The layer starts on every rank at time 0 and its period is its
slowest rank's end, the per-layer rule of every planner (docs/design.md, section 7: FSDP's
per-layer collectives, and DistCA's own dispatch all-to-all over every rank, make each
layer wait for the slowest rank). Our runtime does not run nano-batches: this prices
DistCA as DistCA runs, a courtesy to the baseline (`plan.meta["ping_pong"]`).
"""

from __future__ import annotations

from ballonet.cost import hardware
from ballonet.simulation.layer_graph import LayerGraph

NANO_BATCHES = 2


def run(common: dict, backward: bool, grad_bucket: tuple) -> tuple:
    """(period, per-rank compute, per-rank end, per-rank attention, per-rank slowdown,
    timeline record, bytes) of one layer's pass."""
    plan = common["plan"]
    R = plan.num_ranks
    graphs: list[LayerGraph] = []
    for nano in range(NANO_BATCHES):
        graphs.append(LayerGraph(backward=backward, grad_bucket=grad_bucket, shared=graphs[0] if graphs else None,
                                 nano=nano, scale=1 / NANO_BATCHES, remap_meets=False, **common))
    root = graphs[0]
    dp = root.data_parallel()  # once per layer, full size
    ends = []
    for g in graphs:
        if not g.cp_group:
            g.dp_end = dp
        ends.append(g.build_layer([None] * R))
    root.fix_order()
    tl = root.tl
    layer_end = [tl.join([e[r] for e in ends] + [dp[r]]) for r in range(R)]
    start, finish = tl.run()
    end = [finish[e] if e is not None else 0.0 for e in layer_end]
    compute, attention, comm = [0.0] * R, [0.0] * R, [0.0] * R
    for task in range(tl.num_tasks):
        kind, rank, _ = tl.label[task]
        if tl.stream[task] >= 0 and kind != "tp":
            compute[rank] += tl.duration[task]
            if kind != "linear":
                attention[rank] += tl.duration[task]
        elif kind == "send" and rank >= 0:
            comm[rank] += tl.duration[task]
    gpu = common["fabric"].gpu
    slow = [hardware.profile(gpu[r]).overlap_slowdown * min(comm[r], compute[r]) for r in range(R)]
    sent = sum((g.sent for g in graphs), start=type(root.sent)())
    name = "backward" if backward else "forward"
    return max(end, default=0.0), compute, end, attention, slow, (name, tl, start, finish, common["fabric"]), sent
