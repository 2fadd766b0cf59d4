"""Ballonet: balanced variable-length, long-context LLM training (the Zeppelin design).

The public API; everything else is reached through its subpackage. The layers, with
dependencies pointing one way, are listed (and enforced) in `.importlinter`.
"""

from ballonet import workloads
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import InvalidPlan, Plan
from ballonet.planning import PLANNERS, plan_batch
from ballonet.simulation import SimResult, simulate
from ballonet.specs import ClusterSpec, ModelSpec, cluster, model

__all__ = ["Plan", "plan_batch", "PLANNERS", "simulate", "SimResult", "cluster", "model", "workloads",
           "ClusterSpec", "ModelSpec", "InputError", "InfeasiblePlan", "InvalidPlan"]
