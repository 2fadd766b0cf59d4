"""Where zeppelin's simulated step goes over the batch lower bound, one configuration at a
time: the step less the bound split into what the bound leaves out.

    OMP_NUM_THREADS=1 python bench/investigations/bound_gap.py scale:INDEX|held:INDEX ... [--json FILE]

scale:INDEX is a position in `bench/paper.py`'s scale grid (0-19), held:INDEX in
`bench/estimate.py`'s held-out configurations (0-11). Per configuration (its first batch):

- bound: `batch_lower_bound`; compute: its compute alone (`communication=False`), split
  perfectly at best efficiency under the bound's recomputation; communication: the rest.
- extra recompute: the mean rank's recomputation seconds (`linear_layer_seconds` at its
  own token count, under the plan's per-rank modes and layers) less the bound's (its
  compute under the bound's recomputation less under none).
- split: the mean rank's compute without its recomputation less the bound's compute
  without any (attention on blocks shorter than whole documents, GEMMs on a rank's
  tokens, tensor-parallel collectives, head and optimizer as ranks run them).
- imbalance: the busiest rank's compute less the mean.
- exposed + idle: the step less the busiest rank's compute (communication compute does
  not hide, waits on other ranks).
The four sum to step - bound + communication (the bound's communication is counted once,
on its own line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimate import held_configs, scale_configs
from _common import write_text
from first_batch import first_batch

from ballonet import plan_batch
from ballonet.cost import bounds
from ballonet.cost.seconds import linear_layer_seconds
from ballonet.simulation.simulator import simulate


def recompute_seconds(plan, res, c, m) -> np.ndarray:
    """[R] seconds each plan rank's backward reruns (its linear layers; full recomputation
    also its attention forward, left out here: no configuration below runs it)."""
    out = []
    for r, ((mode, k), n) in enumerate(zip(res.recompute_per_rank, plan.linear_token_counts)):
        gpu = c.gpu_of(r * m.tp)
        base = linear_layer_seconds(m, gpu, n, "none")[1]
        redo = linear_layer_seconds(m, gpu, n, mode, layers=k)[1]
        out.append(m.num_layers * (redo - base))
    return np.array(out)


def one(cfg: tuple) -> dict:
    part, cl, nodes, mdl, tp, wl, ctx, seed = cfg
    c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
    plan = plan_batch(batch, c, m, "zeppelin")
    res = simulate(plan, c, m)
    bound = bounds.batch_lower_bound(batch, c, m)
    compute = bounds.batch_lower_bound(batch, c, m, communication=False)
    mode, layers = bounds.batch_recomputation(batch, c, m)
    with mock.patch.object(bounds, "batch_recomputation", lambda *a: ("none", 0)):
        compute_none = bounds.bound_parts(batch, c, m, communication=False)[0]
    rc = recompute_seconds(plan, res, c, m)
    cs = np.array(res.compute_s)
    cmean, cmax = float(cs.mean()), float(cs.max())
    modes = {}
    for md, k in res.recompute_per_rank:
        modes[f"{md}/{k}"] = modes.get(f"{md}/{k}", 0) + 1
    return {"config": f"{part} {cl} {c.num_ranks} {mdl} {wl} {ctx // 1024}K seed {seed}",
            "step_s": res.step_time_s, "bound_s": bound, "ratio": res.step_time_s / bound,
            "bound_compute_s": compute, "bound_comm_s": bound - compute,
            "bound_recompute": [mode, float(layers)], "bound_recompute_s": compute - compute_none,
            "plan_recompute_mean_s": float(rc.mean()), "extra_recompute_s": float(rc.mean()) - (compute - compute_none),
            "split_s": cmean - float(rc.mean()) - compute_none,
            "imbalance_s": cmax - cmean, "exposed_idle_s": res.step_time_s - cmax,
            "exposed_mean_s": float(np.mean(res.exposed_comm_s)), "idle_mean_s": float(np.mean(res.idle_s)),
            "plan_modes": modes, "longest": int(max(batch)), "docs": len(batch),
            "linear_tokens_max": int(max(plan.linear_token_counts)),
            "linear_tokens_mean": float(np.mean(plan.linear_token_counts))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", nargs="+", help="scale:INDEX or held:INDEX")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    parts = {"scale": scale_configs(), "held": held_configs()}
    rows = []
    for w in args.which:
        part, _, i = w.partition(":")
        r = one(parts[part][int(i)])
        rows.append(r)
        print(f"{r['config']:45s} step {r['step_s']:.3f} bound {r['bound_s']:.3f} ({r['ratio']:.3f}) = compute "
              f"{r['bound_compute_s']:.3f} + comm {r['bound_comm_s']:.3f} | extra rc {r['extra_recompute_s']:.3f} "
              f"(plan {r['plan_recompute_mean_s']:.3f}, bound {r['bound_recompute_s']:.3f} "
              f"{r['bound_recompute'][0]}/{r['bound_recompute'][1]:.1f}) split {r['split_s']:.3f} "
              f"imb {r['imbalance_s']:.3f} exp+idle {r['exposed_idle_s']:.3f} modes {r['plan_modes']} "
              f"lin max {r['linear_tokens_max']} mean {r['linear_tokens_mean']:.0f}", flush=True)
        if args.json:
            write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
