"""Ballonet: balanced variable-length, long-context LLM training (the Zeppelin design).

Layers, dependencies pointing one way: specs -> plan -> cost_model -> planner/baselines ->
simulator; `ballonet.runtime` depends on the plan only; training and the CLI sit on top.
"""

from ballonet.errors import InfeasiblePlan, InputError
from ballonet.specs import ClusterSpec, ModelSpec, cluster, model

__all__ = ["ClusterSpec", "ModelSpec", "InputError", "InfeasiblePlan", "cluster", "model", "plan_batch"]


def plan_batch(lengths, cluster, model, planner="zeppelin", **options):
    """Plan one global batch of document `lengths` on `cluster` for `model` (see planner.py)."""
    from ballonet.planner import plan_batch as _plan_batch

    return _plan_batch(lengths, cluster, model, planner=planner, **options)
