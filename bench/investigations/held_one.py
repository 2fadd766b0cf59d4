"""One held-out configuration's batch planned by zeppelin and simulated: step, bound,
estimate, its rings across nodes, and (--candidates) every candidate compared.

    OMP_NUM_THREADS=1 python bench/investigations/held_one.py [INDEX ...] [--candidates] [--json FILE]

INDEX: positions in `bench/estimate.py`'s `held_configs` (0-11; default: all). The held-out
twin of `scale_one.py` (issue 49: the estimate within 5% of the simulated step there too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimate import held_configs
from _common import write_text
from first_batch import first_batch
from paper import ring_facts

from ballonet import plan_batch
from ballonet.cost.bounds import batch_lower_bound
from ballonet.simulation.simulator import simulate


def one(index: int) -> dict:
    _, cl, nodes, mdl, tp, wl, ctx, seed = held_configs()[index]
    c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
    t = time.process_time()
    plan = plan_batch(batch, c, m, "zeppelin")
    plan_s = time.process_time() - t
    res = simulate(plan, c, m)
    bound = batch_lower_bound(batch, c, m)
    est = plan.meta["estimated_step_s"]
    return {"index": index, "config": f"{cl} {c.num_ranks} {mdl} {os.path.basename(wl)} {ctx // 1024}K s{seed}",
            "step_s": res.step_time_s, "bound_s": bound, "ratio": res.step_time_s / bound, "estimate_s": est,
            "estimate_ratio": est / res.step_time_s, "plan_cpu_s": plan_s, "routes": len(plan.routes),
            "rings": ring_facts(plan), "chosen": {k: plan.meta[k] for k in ("recompute", "recompute_layers", "double")},
            "candidates": sorted(plan.meta["candidates"], key=lambda x: x["estimated_step_s"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("index", type=int, nargs="*", help="held_configs positions (default: all)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--candidates", action="store_true", help="print every candidate")
    args = ap.parse_args(argv)
    rows = []
    for i in args.index or range(len(held_configs())):
        r = one(i)
        rows.append(r)
        print(f"{i:2d} {r['config']:36s} step {r['step_s']:.3f} bound {r['bound_s']:.3f} ratio {r['ratio']:.3f} "
              f"est {r['estimate_s']:.3f} est/sim {r['estimate_ratio']:.3f} plan {r['plan_cpu_s']:.2f}s "
              f"routes {r['routes']} chosen {r['chosen']}", flush=True)
        for ring in r["rings"]:
            print("     ring", ring)
        if args.candidates:
            for cnd in r["candidates"]:
                print("     ", cnd)
    if args.json:
        write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
