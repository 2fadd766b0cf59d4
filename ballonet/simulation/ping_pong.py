"""DistCA's ping-pong execution, simulated: a layer as two nano-batches whose compute and
communication take turns (docs/design.md, section 10).

DistCA (arXiv 2510.18121) splits each batch into two nano-batches: while one runs core
attention on the attention servers, the other runs its linear layers and its dispatch
all-to-alls, so each one's communication hides behind the other's compute. Here each
nano-batch is half of the plan (every rank's kernels and bytes halved: DistCA balances the
two alike), each rank's stream runs attention A, attention B, linear A, linear B (the
backward: linear first), and two layers are built in one timeline so that a layer's
period is taken in the steady state (the first layer's K/V gathers and the last layer's
remap back overlap the neighbouring layer there). Our runtime does not run nano-batches:
this prices DistCA as DistCA runs, a courtesy to the baseline (`plan.meta["ping_pong"]`).
"""

from __future__ import annotations

from ballonet.cost import hardware
from ballonet.simulation.layer_graph import LayerGraph

NANO_BATCHES = 2
LAYERS = 2
"""Layers built in one run: the period is the last one's."""


def run(common: dict, backward: bool, grad_bucket: tuple) -> tuple:
    """(period, per-rank compute, per-rank end, per-rank attention, per-rank slowdown,
    timeline record, bytes of one layer) of one layer's pass in the steady state."""
    plan = common["plan"]
    R = plan.num_ranks
    root = None
    graphs: list[list[LayerGraph]] = []
    begin = [[None] * R for _ in range(NANO_BATCHES)]
    layer_end = []
    for layer in range(LAYERS):
        row = []
        for nano in range(NANO_BATCHES):
            g = LayerGraph(backward=backward, grad_bucket=grad_bucket, shared=root, layer=layer, nano=nano,
                           scale=1 / NANO_BATCHES, **common)
            root = root or g
            row.append(g)
        dp = row[0].data_parallel()  # once per layer, full size
        for nano, g in enumerate(row):
            if not g.cp_group:
                g.dp_end = dp
            begin[nano] = g.build_layer(begin[nano])
        layer_end.append([root.tl.join([b[r] for b in begin] + [dp[r]]) for r in range(R)])
        begin = [[root.tl.join([b[r], dp[r]]) for r in range(R)] for b in begin]
        graphs.append(row)
    root.fix_order()
    start, finish = root.tl.run()
    ends = [[finish[e] if e is not None else 0.0 for e in ends] for ends in layer_end]
    period = max(ends[-1], default=0.0) - max(ends[-2], default=0.0)
    compute, attention, comm = [0.0] * R, [0.0] * R, [0.0] * R
    tl = root.tl
    for task in range(tl.num_tasks):
        kind, rank, _ = tl.label[task]
        if tl.stream[task] >= 0 and kind != "tp":
            compute[rank] += tl.duration[task] / LAYERS
            if kind != "linear":
                attention[rank] += tl.duration[task] / LAYERS
        elif kind == "send" and rank >= 0:
            comm[rank] += tl.duration[task] / LAYERS
    gpu = common["fabric"].gpu
    slow = [hardware.profile(gpu[r]).overlap_slowdown * min(comm[r], compute[r]) for r in range(R)]
    sent = sum((g.sent for g in graphs[0]), start=type(graphs[0][0].sent)())
    name = "backward" if backward else "forward"
    return period, compute, [period] * R, attention, slow, (name, tl, start, finish, common["fabric"]), sent
