"""Planning: document lengths and a cluster in, a validated `Plan` out.

`zeppelin` is the hierarchical partitioner (`zeppelin/`, with `pricing.py`, `remap.py`,
`routing.py`); `baselines.py` reproduces the systems it is compared with, `wlb_llm.py`
WLB-LLM, `distca.py` the core attention disaggregation of DistCA and `magi.py`
MagiAttention's dispatch. Every planner is a pure function (lengths, cluster, model,
**options) -> Plan, listed in `PLANNERS`.
"""

from __future__ import annotations

import dataclasses
import inspect

from ballonet.cost.recompute import per_rank_recompute
from ballonet.errors import InputError
from ballonet.plan import Plan
from ballonet.planning.baselines import BASELINES
from ballonet.planning.distca import distca
from ballonet.planning.magi import magi
from ballonet.planning.zeppelin import zeppelin
from ballonet.planning.devices import rank_hardware
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["PLANNERS", "plan_batch"]

PLANNERS = {"zeppelin": zeppelin, **BASELINES, "distca": distca, "magi": magi}
"""Every planner by name: a function (lengths, cluster, model, **options) -> Plan."""


def plan_batch(lengths, cluster: ClusterSpec, model: ModelSpec, planner: str = "zeppelin", **options) -> Plan:
    """Plan one global batch of document `lengths` (tokens, input order) on `cluster` for
    `model` with `planner` (a key of `PLANNERS`); `options` go to the planner. The plan
    says what each rank recomputes for `model` (`Plan.recompute`: the cheapest its tokens
    fit under, `cost.recompute.per_rank_recompute`), whichever planner made it."""
    if planner not in PLANNERS:
        raise InputError(f"unknown planner {planner!r}; known: {', '.join(PLANNERS)}")
    fn = PLANNERS[planner]
    known = [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]
    for key in options:
        if key not in known:
            raise InputError(f"planner {planner!r} has no option {key!r}; options: {', '.join(known) or 'none'}")
    plan = fn(lengths, cluster, model, **options)
    gpus = rank_hardware(cluster, model.tp).gpu
    return dataclasses.replace(plan, recompute=per_rank_recompute(model, plan.linear_token_counts, gpus,
                                                                  plan.attention_token_counts))

