"""Where a configuration's layer goes beyond its busiest rank's compute, pass by pass:
zeppelin's plan simulated, then per pass (one layer's forward, its first backward) the
period (the slowest rank's end), the most and the mean rank's compute on the stream, the
rank that ends last (its compute and its waits), the end of the data-parallel
collectives; and the layers' two terms in `simulate`: synchronous (the passes' periods)
and per rank (each rank's own ends plus the slowdown of its compute by its sends, the
profile's `overlap_slowdown` times its send seconds, at most its compute), with the rank
that sets the second and its send seconds a layer.

    OMP_NUM_THREADS=1 python bench/investigations/held_passes.py held:INDEX|scale:INDEX ...
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimate import held_configs, scale_configs
from first_batch import first_batch

from ballonet import plan_batch
from ballonet.cost import hardware
from ballonet.simulation.simulator import simulate


def pass_rows(rec, R: int, arrays: bool = False) -> dict:
    name, tl, start, finish, _ = rec
    compute, last, dp_end, sends = np.zeros(R), np.zeros(R), np.zeros(R), np.zeros(R)
    kinds: dict = {}
    for t in range(tl.num_tasks):
        kind, rank, label = tl.label[t]
        if rank < 0 or rank >= R:
            continue
        if tl.stream[t] >= 0:
            compute[rank] += tl.duration[t]
            last[rank] = max(last[rank], finish[t])
            kinds.setdefault(kind, np.zeros(R))[rank] += tl.duration[t]
        if kind == "send":
            sends[rank] += tl.duration[t]
        if label == "data-parallel collectives":
            dp_end[rank] = max(dp_end[rank], finish[t])
    end = np.maximum(last, dp_end)
    r = int(end.argmax())
    return {"end": end, "sends": sends, "compute": compute} if arrays else {"pass": name, "period": float(end.max()), "compute_max": float(compute.max()),
            "compute_mean": float(compute.mean()), "late_rank": r, "late_compute": float(compute[r]),
            "late_wait": float(last[r] - compute[r]), "dp_end_max": float(dp_end.max()),
            "late_kinds": {k: round(float(v[r]) * 1e3, 2) for k, v in kinds.items()},
            "mean_kinds": {k: round(float(v.mean()) * 1e3, 2) for k, v in kinds.items()}}


def main(argv) -> int:
    parts = {"scale": scale_configs(), "held": held_configs()}
    for w in argv:
        part, _, i = w.partition(":")
        _, cl, nodes, mdl, tp, wl, ctx, seed = parts[part][int(i)]
        c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
        res = simulate(plan_batch(batch, c, m, "zeppelin"), c, m)
        R, L = len(res.compute_s), m.num_layers
        print(f"{w} {cl} {c.num_ranks} {mdl} {wl} step {res.step_time_s:.3f} bound {res.lower_bound_s:.3f} "
              f"layers sync {L * (res.layer_forward_s + res.layer_backward_s):.3f}")
        for rec in res.timelines:
            row = pass_rows(rec, R)
            print("  ", {k: (round(v * 1e3, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        f, b = (pass_rows(rec, R, arrays=True) for rec in res.timelines)
        slow = hardware.profile(c.gpu_of(0)).overlap_slowdown * (np.minimum(f["sends"], f["compute"])
                                                                 + np.minimum(b["sends"], b["compute"]))
        per_rank = L * (f["end"] + b["end"] + slow)
        r = int(per_rank.argmax())
        print(f"   per rank (first backward): {per_rank.max():.3f} s at rank {r} (ends {L * (f['end'][r] + b['end'][r]):.3f}, "
              f"slowdown {L * slow[r]:.3f}, sends a layer {1e3 * (f['sends'][r] + b['sends'][r]):.2f} ms; mean rank "
              f"{1e3 * float(np.mean(f['sends'] + b['sends'])):.2f} ms); head {res.head_s:.3f} gradient bucket "
              f"{res.grad_allreduce_exposed_s:.3f} optimizer {res.optimizer_s:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
