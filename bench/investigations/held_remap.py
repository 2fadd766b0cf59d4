"""A held-out configuration's batch planned by zeppelin as it chooses, and with every
rank's linear tokens remapped inside nodes (no candidate that keeps its tokens: the
search's keep-tokens candidates dropped, its remapped ones planned as it plans them):
simulated step, bound, the busiest and mean rank's compute, the recomputation ranks run
and the step's tail (LM head, exposed gradient bucket, optimizer). With --cluster also
"across": the remapped candidates' linear tokens evened over the whole cluster
(`candidates.remapped` with node_remap=False) instead of inside nodes.

    OMP_NUM_THREADS=1 python bench/investigations/held_remap.py [--cluster] INDEX ...
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimate import held_configs
from first_batch import first_batch

from ballonet.planning.zeppelin import candidates, zeppelin
from ballonet.planning.zeppelin.search import CandidateSearch
from ballonet.simulation.simulator import simulate


_candidate = CandidateSearch._candidate


def remapped_only(self, maker, level, keep, *args, **kwargs):
    """`CandidateSearch._candidate`, but None for a plan that keeps its tokens."""
    return None if keep else _candidate(maker, level, keep, *args, **kwargs)


_remapped = candidates.remapped


def across_cluster(*args, **kwargs):
    """`candidates.remapped`, its linear tokens evened over the cluster."""
    return _remapped(*args, **{**kwargs, "node_remap": False})


def main(argv) -> int:
    names = ("chosen", "remapped", "across") if "--cluster" in argv else ("chosen", "remapped")
    for i in (a for a in argv if a != "--cluster"):
        _, cl, nodes, mdl, tp, wl, ctx, seed = held_configs()[int(i)]
        c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
        for name in names:
            if name == "chosen":
                plan = zeppelin(batch, c, m)
            else:
                with mock.patch.object(CandidateSearch, "_candidate", remapped_only), \
                        mock.patch.object(candidates, "remapped", across_cluster if name == "across" else _remapped):
                    plan = zeppelin(batch, c, m)
            res = simulate(plan, c, m)
            cs = np.array(res.compute_s)
            recomputing = sum(k > 0 and md != "none" for md, k in res.recompute_per_rank)
            layers = m.num_layers * (res.layer_forward_s + res.layer_backward_s)
            print(f"held:{i} {cl} {c.num_ranks} {mdl} {wl} {name:8s} step {res.step_time_s:.3f} "
                  f"bound {res.lower_bound_s:.3f} ({res.step_time_s / res.lower_bound_s:.3f}) "
                  f"estimate {plan.meta['estimated_step_s']:.3f} compute max {cs.max():.3f} mean {cs.mean():.3f} "
                  f"ranks recomputing {recomputing}/{len(cs)} linear tokens max {max(plan.linear_token_counts)} "
                  f"layers {layers:.3f} head {res.head_s:.3f} grad {res.grad_allreduce_exposed_s:.3f} "
                  f"optimizer {res.optimizer_s:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
