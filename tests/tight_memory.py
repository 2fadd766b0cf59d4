"""Clusters whose GPUs hold back memory (`NodeGroup.memory_gb`), for the tests whose scenario
is a batch that nearly fills memory: they were built when the cost model charged every GPU
ZeRO-1's unsharded bf16 weights and gradients (4 bytes a parameter) where the runtime's FSDP2
shards them (`cost.memory.static_bytes`). `tight` holds back the difference, so that each
GPU's room for activations, and so the scenario's caps, stay what the test was built on."""

import dataclasses

from ballonet.cost.hardware import GB
from ballonet.cost.memory import MEMORY_RESERVE, static_bytes


def zero1_static_bytes(model, num_dp_ranks: int) -> float:
    """bf16 weights and gradients whole, fp32 Adam states sharded (Megatron's distributed optimizer)."""
    return model.num_params * (2 + 2 + 12 / max(num_dp_ranks, 1)) / model.tp


def tight(cluster, model):
    """`cluster` with each GPU's memory cut by what ZeRO-1 held beyond FSDP2 for `model`."""
    num_dp = cluster.num_ranks // model.tp
    held = (zero1_static_bytes(model, num_dp) - static_bytes(model, num_dp)) / MEMORY_RESERVE
    groups = tuple(dataclasses.replace(g, memory_gb=(g.gpu_type.memory_bytes - held) / GB) for g in cluster.groups)
    return dataclasses.replace(cluster, groups=groups)
