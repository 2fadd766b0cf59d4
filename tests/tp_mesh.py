"""Tensor parallelism's process groups on gloo ranks, as `ballonet train --tp` builds them."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_groups(world: int, tp: int):
    """As `ballonet train --tp` builds them on `world` gloo ranks: the 2-D mesh (plan ranks
    x tp, a plan rank's TP ranks consecutive, as inside a node), this rank's plan rank,
    the plan-rank group of its TP index, and the second group over the same ranks (double
    rings' transfers across nodes)."""
    from ballonet.training.parallelism import parallel

    cpu = torch.device("cpu")
    mesh = parallel.device_mesh(world, "full", cpu, tp)
    plan = parallel.plan_mesh(cpu, world, tp).get_group("plan")
    return mesh, dist.get_rank() // tp, plan, parallel.outer_group(world, tp, cpu)
