"""What each single ring across nodes with routed crossing hops waits in the simulator
beside what the estimate prices for it (`routed_ring.routed_waits`), one configuration
at a time.

    OMP_NUM_THREADS=1 python bench/investigations/routed_ring_waits.py {main,scale,held} INDEX [--single]

For each such ring of zeppelin's plan (`--single`: planned with single rings only): per
layer, forward and backward, the most a member waits beyond its ring steps and local
documents in the simulator (its last step's end, or in the backward its own block's
summed dK/dV, less its first step's start and its kernels' seconds) and what
`routed_waits` gives (the backward with its last dK/dV hop alone added, which the
estimate prices apart, `step_terms.final_grad_wait_seconds`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from estimate import held_configs
from first_batch import first_batch
from scale_one import grid, main_grid

from ballonet import plan_batch
from ballonet.cost.flops import kv_bytes, kv_grad_bytes
from ballonet.cost.seconds import DP_FORWARD_SHARE, dp_piece_seconds
from ballonet.planning import ring_pricing, routed_ring
from ballonet.simulation.simulator import simulate


def configuration(part: str, index: int) -> tuple:
    if part == "held":
        _, cl, nodes, mdl, tp, wl, ctx, seed = held_configs()[index]
    else:
        (cl, nodes, mdl, tp, wl, ctx), seed = (main_grid() if part == "main" else grid())[index], 0
    return first_batch(cl, nodes, mdl, tp, wl, ctx, seed)


def simulated_waits(res, ring) -> list[float]:
    """[forward, backward] the most a member of `ring` waits in the simulator, per layer."""
    doc, out = f"doc {ring.doc}", []
    for _, tl, start, finish, _ in res.timelines:
        first, last, busy = {}, collections.defaultdict(float), collections.defaultdict(float)
        for t in range(tl.num_tasks):
            _, rank, name = tl.label[t]
            if tl.stream[t] < 0 or rank not in ring.ranks:
                continue
            if isinstance(name, tuple) and name[0] == doc and name[1] in ("step", "dkv wait"):
                first[rank] = min(first.get(rank, float("inf")), start[t])
                last[rank] = max(last[rank], finish[t])
                busy[rank] += tl.duration[t]
            elif name == "local documents":
                busy[rank] += tl.duration[t]
        out.append(max(last[r] - first[r] - busy[r] for r in ring.ranks))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("main", "scale", "held"))
    ap.add_argument("index", type=int)
    ap.add_argument("--single", action="store_true", help="plan with single rings only (double=False)")
    args = ap.parse_args(argv)
    c, m, batch = configuration(args.part, args.index)
    plan = plan_batch(batch, c, m, "zeppelin", **({"double": False} if args.single else {}))
    res = simulate(plan, c, m)
    priced = dataclasses.replace(m, recompute=plan.meta["recompute"])
    print(f"{args.part} {args.index}: step {res.step_time_s:.3f} estimate {plan.meta['estimated_step_s']:.3f} "
          f"({plan.meta['recompute']}, {len(plan.routes)} routes)")
    for ring in plan.rings:
        if ring.kind != "inter" or ring.comm != "ring":
            continue
        r, nodes = ring.ranks[0], len({plan.node_of_rank[x] for x in ring.ranks})
        group = next(g for g in c.groups if c.group_of(r * m.tp) is g)
        per_node = c.num_ranks // c.num_nodes // m.tp
        rails = max(1, min(group.gpus_per_node // group.gpus_per_nic, per_node))
        length, members = plan.lengths[ring.doc], len(ring.ranks)
        nic, intra = group.nic_bw, group.intra_bw
        width = routed_ring.routed_ring_width(priced, length, members, nodes, nic, (intra, rails))
        sim = simulated_waits(res, ring)
        line = (f"  ring of {members} over {nodes} nodes ({length} tokens): simulated {sim[0] * 1e3:.2f} + "
                f"{sim[1] * 1e3:.2f} ms a layer")
        if width:
            dp = DP_FORWARD_SHARE * ring_pricing.dp_intra_seconds(m, group.gpu_type, per_node, intra)
            (fwd, _), (bwd, _) = routed_ring.routed_waits(priced, group.gpu_type, length, members, nodes, nic, intra,
                                                           width, dp_piece_seconds(m, group, c.num_nodes)[0], dp)
            block = max(length // members, 1)
            last = ring_pricing.crossing_seconds(kv_grad_bytes(m, block), nic, intra, rails, group.gpu_type)
            line += (f"; routed_waits {fwd * 1e3:.2f} + {bwd * 1e3:.2f} (+ {last * 1e3:.2f} last dK/dV hop) ms over "
                     f"{width} rails; priced hop by hop (kv {kv_bytes(m, block) / 1e6:.0f} MB a block): "
                     f"{ring_pricing.ring_exposed_seconds(priced, group.gpu_type, length, members, nic, routed=(intra, rails), dp_intra=dp) / m.num_layers * 1e3:.2f} ms")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
