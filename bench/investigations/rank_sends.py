"""One rank's sends in zeppelin's plan of a held-out configuration, per pass: for each
send label and link kind (NVLink port or NIC), its seconds at the links' own speed, its
seconds on the timeline (shared links stretch it) and how many.

    OMP_NUM_THREADS=1 python bench/investigations/rank_sends.py INDEX RANK
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimate import held_configs
from first_batch import first_batch

from ballonet import plan_batch
from ballonet.simulation.simulator import simulate


def main(argv) -> int:
    i, rank = int(argv[0]), int(argv[1])
    _, cl, nodes, mdl, tp, wl, ctx, seed = held_configs()[i]
    c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
    res = simulate(plan_batch(batch, c, m, "zeppelin"), c, m)
    R = len(res.compute_s)
    for name, tl, start, finish, _ in res.timelines:
        out: dict = {}
        for t in range(tl.num_tasks):
            kind, r, label = tl.label[t]
            if kind == "send" and r == rank:
                nic = any(link >= 2 * R for link in tl.links[t])
                key = (label, "nic" if nic else "nvlink")
                d = out.setdefault(key, [0.0, 0.0, 0])
                d[0] += tl.duration[t]
                d[1] += finish[t] - start[t]
                d[2] += 1
        print(name, {k: (round(v[0] * 1e3, 2), round(v[1] * 1e3, 2), v[2]) for k, v in out.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
