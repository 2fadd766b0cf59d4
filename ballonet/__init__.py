"""Ballonet: balanced variable-length, long-context LLM training (the Zeppelin design).

The public API; everything else is reached through its subpackage. Layers, dependencies
pointing one way (enforced by `.importlinter`, see docs/design.md):

    errors, hardware, specs, workloads, plan, cost_model   the contract
    planning/      lengths + cluster -> Plan (zeppelin and the baselines)
    simulation/    Plan + cluster -> SimResult (one training iteration, simulated)
    runtime/       Plan + tensors -> distributed attention and remap (torch.distributed)
    training/      model, corpus, loader, checkpoints, the loop (torchrun)
"""

from ballonet import workloads
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import InvalidPlan, Plan
from ballonet.planning import PLANNERS, plan_batch
from ballonet.simulation import SimResult, simulate
from ballonet.specs import ClusterSpec, ModelSpec, cluster, model

__version__ = "0.1.0"
"""The package's version (pyproject.toml reads it from here, without importing the package)."""

__all__ = ["__version__", "Plan", "plan_batch", "PLANNERS", "simulate", "SimResult", "cluster", "model", "workloads",
           "ClusterSpec", "ModelSpec", "InputError", "InfeasiblePlan", "InvalidPlan"]
