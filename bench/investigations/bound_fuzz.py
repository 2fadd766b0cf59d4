"""Random batches on one node group (`planning.fuzz.random_case`), every planner planned
and simulated: the least step over the batch lower bound, and every plan under it.

    OMP_NUM_THREADS=1 python bench/investigations/bound_fuzz.py SEED SECONDS
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ballonet import plan_batch, simulate
from ballonet.errors import InputError
from ballonet.planning.fuzz import PLANNERS, random_case


def main(seed: int, seconds: float) -> None:
    rng = np.random.default_rng(seed)
    t0, worst, n, errors = time.time(), (float("inf"), None), 0, 0
    while time.time() - t0 < seconds:
        lengths, c, m = random_case(rng)
        if len(c.groups) > 1:  # mixed clusters: the per-group bound, bench/hetero.py
            continue
        for p in PLANNERS:
            try:
                r = simulate(plan_batch(lengths, c, m, p), c, m)
            except InputError:  # infeasible batches: the planner fuzz's business
                errors += 1
                continue
            n += 1
            q = r.step_time_s / r.lower_bound_s
            if q < worst[0]:
                worst = (q, (p, c.groups[0].gpu, c.num_ranks, m.name, m.tp, len(lengths), sum(lengths)))
            if q < 1:
                print("UNDER", q, p, c, m.name, m.tp, lengths, flush=True)
    print("simulated", n, "failed", errors, "least step/bound", worst)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
