"""Data parallelism from PyTorch's own engine: FSDP2 (`fully_shard`), one unit per block
plus the root, over a device mesh of all ranks; and the plan's own process groups.

Process groups by role (as torchtitan gives context parallelism a mesh dimension of its
own): FSDP2's all-gathers and reduce-scatters run on the default group (`device_mesh`);
the plan's traffic (rings, relays, remaps, the plan check) on a group of its own, the
"plan" dimension of `plan_mesh`; and "double" rings' transfers across nodes on a third
(`outer_group`). On NCCL each group has its own communicator and stream, so a ring's
transfer never waits behind a parameter all-gather, nor an inner ring's step behind a
transfer across nodes. Groups are made once by the training loop and passed down; no
module keeps one.
With tensor parallelism each plan rank is a TP group (`tensor_parallel.py`, applied
first) and FSDP2 shards the DTensor weights over the plan ranks, torchtitan's FSDP + TP
composition; the plan's groups are then one per TP index.

The plan decides where tokens go (its attention and linear layouts); FSDP2 decides where
weights live. The two compose because every rank runs every block on its own tokens:
FSDP2 all-gathers a block's weights before its forward (and again before its backward
when resharded) and reduce-scatters its gradients as soon as its backward is done, so
gradient traffic overlaps the backward of the blocks below.

`shard="full"`: parameters, gradients and optimizer states sharded over all ranks.
`shard="none"`: the same machinery on a (ranks x 1) mesh (HSDP with shards of one), i.e.
replicated weights whose gradients are all-reduced, as in DDP: for comparison.

Each rank's loss is a sum over its tokens divided by the global count of valid labels,
so the global gradient is the SUM of the ranks' gradients: FSDP2's reduction divides by
nothing (`set_gradient_divide_factor(1.0)`, as a plain SUM).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from ballonet.cost.memory import MEMORY_RESERVE, gathered_bytes
from ballonet.specs import ModelSpec
from ballonet.training.metrics import training_bytes_per_token

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def device_mesh(world_size: int, shard: str, device: torch.device, tp: int = 1) -> DeviceMesh:
    """All ranks as one shard dimension ("full"), or as replicas of one-rank shards ("none");
    with tensor parallelism (`tp` > 1) each of those is a plan rank of `tp` consecutive
    ranks (one node's, as torchtitan lays out TP), the innermost dimension "tp"."""
    if world_size % tp:
        raise ValueError(f"{world_size} ranks are not a multiple of tp={tp}")
    dims = {"full": (("shard",), (world_size // tp,)),
            "none": (("replicate", "shard"), (world_size // tp, 1))}
    if shard not in dims:
        raise ValueError(f"shard must be 'full' or 'none', got {shard!r}")
    names, shape = dims[shard]
    if tp > 1:
        names, shape = names + ("tp",), shape + (tp,)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions of `device_mesh` over the plan ranks (all but "tp"): FSDP2's."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    return mesh[names] if len(names) < mesh.ndim else mesh


def plan_mesh(device: torch.device, world_size: int, tp: int = 1) -> DeviceMesh:
    """The mesh of the plan's traffic: one dimension, "plan", this rank's TP index's plan
    ranks in plan-rank order (every rank when tp is 1), on a new process group warmed up
    here. (A whole-world one-dimensional `init_device_mesh` would reuse the default group,
    FSDP2's.)"""
    group = _column_group(world_size, tp)
    warm_up(group, device)
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("plan",))


def outer_group(world_size: int, tp: int, device: torch.device) -> dist.ProcessGroup:
    """A second group over the same ranks in the same order as `plan_mesh`'s, for double
    rings' transfers across nodes (`runtime.attention`'s `outer_group`), warmed up here."""
    group = _column_group(world_size, tp)
    warm_up(group, device)
    return group


def _column_group(world_size: int, tp: int) -> dist.ProcessGroup:
    """A new group of the ranks of this rank's TP index. Collective: every rank makes
    every TP index's group (`new_group` must be called alike on all ranks)."""
    if tp == 1:
        return dist.new_group(list(range(world_size)))
    return dist.new_subgroups_by_enumeration([list(range(t, world_size, tp)) for t in range(tp)])[0]


def warm_up(group: dist.ProcessGroup, device: torch.device) -> None:
    """One collective of all the group's ranks: NCCL makes a group's communicator at its
    first use, and PyTorch requires a group's first batched point-to-point call to include
    every rank of the group; a double ring's first transfers involve only some."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """Compute in `dtype`; master weights, gradients and their reduction in fp32.

    Forward inputs are not cast: the blocks take the plan, the process group and a byte
    counter besides their tensors, and FSDP2's cast would rebuild those (dataclasses are
    copied field by field); the activations are already in `dtype` after the embedding."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    param_dtype = None if DTYPES[dtype] == torch.float32 else DTYPES[dtype]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: `model.layers` (ballonet) or `model.model.layers` (Hugging Face)."""
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__}: no `layers` ModuleList to shard block by block")


def parallelize(model: nn.Module, mesh: DeviceMesh, dtype: str = "fp32",
                forward_methods: tuple[str, ...] = ("loss",)) -> FSDPModule:
    """Shard `model` in place with FSDP2: each block a unit (resharded after forward), the
    root (embeddings, final norm, head) a unit kept unsharded between forward and backward.
    `forward_methods` are entry points besides `forward` that run FSDP2's hooks."""
    policy, mesh = mixed_precision(dtype), fsdp_mesh(mesh)  # tensor parallelism inside, done before
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for name in forward_methods:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    for unit in model.modules():  # each unit's own setting: the root's does not reach the blocks
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def local_parameter_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of this rank's parameters (its shards) and optimizer states."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    if optimizer is not None:
        for state in optimizer.state.values():
            total += sum(local(t).numel() * t.element_size() for t in state.values()
                         if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


def local_box(p: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's shard of `p` sits in the whole tensor: one slice a dimension (the
    whole of each for a tensor that is not a DTensor). As DCP finds it, so FSDP2's Shard(0),
    tensor parallelism's and their composition (strided shards) all agree with `to_local`."""
    if not isinstance(p, DTensor):
        return tuple(slice(0, n) for n in p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def rank_bytes(model: ModelSpec, num_ranks: int, tokens_per_rank: float) -> float:
    """Bytes a GPU holds training `model` (its dtype, recomputation and `tp`) under
    `parallelize` with shard "full" over `num_ranks` GPUs: fp32 weights, gradients and
    Adam's two moments sharded (16 bytes a parameter over all the GPUs); in the compute
    dtype the root's embedding and head whole from forward to backward (the root is not
    resharded after forward) and two blocks gathered at once (FSDP2 prefetches the next);
    and the activations of `tokens_per_rank` tokens (`metrics.training_bytes_per_token`)."""
    return model.num_params * 16 / num_ranks + gathered_bytes(model) + tokens_per_rank * training_bytes_per_token(model)


def fewest_gpus(model: ModelSpec, gpu_memory_bytes: float, tokens_per_gpu: float) -> int | None:
    """The fewest GPUs of `gpu_memory_bytes` each (the cost model's MEMORY_RESERVE of it
    used) that train `model` at `tokens_per_gpu` tokens a GPU (`rank_bytes`); None when no
    count does (the unsharded part alone is too much: fewer tokens or recomputation)."""
    room = gpu_memory_bytes * MEMORY_RESERVE - (rank_bytes(model, 1, tokens_per_gpu) - model.num_params * 16)
    return math.ceil(model.num_params * 16 / room) if room > 0 else None
