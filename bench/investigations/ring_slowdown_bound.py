"""What a bound could charge for the slowdown of compute by K/V sends no plan escapes, on
held-out configurations (an estimate, generous to the charge; not in the bound).

    OMP_NUM_THREADS=1 python bench/investigations/ring_slowdown_bound.py INDEX ...

A document whose attention a layer (forward and backward, at efficiencies above the
profiles' best: 0.7 and 0.6) is over the bound's layer must run on at least k of its
ranks, and its members together receive about (k - 1) / 2 times its K/V in the forward
(contiguous parts, each needing the keys before it) and as much again in the backward
(dK/dV left out). At the senders' NVLink bandwidth, slowed by 10% and spread over every
rank (a bound has only the mean rank), it is the figure printed: a share of the bound.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimate import held_configs
from first_batch import first_batch

from ballonet.cost import hardware
from ballonet.cost.bounds import batch_lower_bound
from ballonet.cost.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, kv_bytes


def main(argv) -> int:
    for i in argv:
        _, cl, nodes, mdl, tp, wl, ctx, seed = held_configs()[int(i)]
        c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
        lengths = np.array(batch, dtype=float)
        g = c.groups[0]
        bound = batch_lower_bound(lengths, c, m)
        layer = bound / m.num_layers
        work = attention_flops(m, lengths) * (1 / 0.7 + ATTENTION_BACKWARD_FACTOR / 0.6) / g.gpu_type.peak_flops
        k = np.ceil(work / layer)
        sent = 2 * float(((k - 1) / 2 * lengths * float(kv_bytes(m, 1)))[k > 1].sum())
        slow = hardware.profile(g.gpu_type).overlap_slowdown * sent / g.intra_bw / c.num_ranks * m.num_layers
        print(f"held:{i} {cl} {c.num_ranks} {mdl} {wl}: documents over a layer {int((k > 1).sum())} (most ranks "
              f"{int(k.max())}), K/V sent {sent / 1e9:.1f} GB a layer, slowdown {slow:.4f} s a step = "
              f"{slow / bound:.2%} of the bound", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
