"""Tensor parallelism from PyTorch's own engine (`torch.distributed.tensor.parallel`), as
torchtitan applies it to Llama: Megatron-LM's column/row split of the projections with
sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022) for the norms and the residual stream.

A plan rank is a TP group of `tp` processes of one node that hold the same tokens. The
plan's exchanges (remaps, rings, relays) run over the plan-rank dimension of the device
mesh, each TP rank with its peers of the same TP index: it carries only its own heads. In
a block, with T the plan rank's tokens on the linear layout:

    x [T, C] Shard(0) -> norm on the shard -> all-gather [T, C] -> wq, wk, wv (column):
    this TP rank's heads q [T, H/tp, D], k, v [T, K/tp, D] -> remap, attention, remap
    back (its heads) -> wo (row) -> reduce-scatter [T, C] Shard(0) -> + x
    -> norm -> all-gather -> w1, w3 (column) -> SwiGLU -> w2 (row) -> reduce-scatter -> + x

so a layer's forward runs two all-gathers and two reduce-scatters of [T, C], its backward
the same two of each (a gather's gradient is scattered and a scatter's gathered), and
DTensor pads T up to a multiple of tp for both. The embedding is split over the
vocabulary (a reduce-scatter to the sequence shard), the head over the vocabulary too
(an all-gather before it) with the loss computed on the vocabulary shards
(`loss_parallel`: three all-reduces of [T] fp32 forward); FSDP2 all-reduces the norms'
weight gradients over the TP group. The simulator prices these collectives
(`cost.tensor_parallel`); `count_collectives` counts what DTensor really sends.

Heads are split, never replicated: tp must divide the query heads and the KV heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from ballonet.errors import InputError
from ballonet.runtime import ByteCounter

__all__ = ["check_heads", "count_collectives", "loss_context", "parallelize_hf", "parallelize_transformer",
           "tp_mesh_of"]

_TP_MESH = "_ballonet_tp_mesh"
"""The attribute a tensor-parallel model carries its TP mesh in."""


def check_heads(name: str, num_heads: int, num_kv_heads: int, tp: int) -> None:
    """InputError unless `tp` divides the query and the KV heads (heads are split over the
    TP group, never replicated)."""
    if num_heads % tp or num_kv_heads % tp:
        raise InputError(f"model {name!r}: --tp {tp} must divide its {num_heads} query heads and {num_kv_heads} "
                         "KV heads (each TP rank attends with its own heads; KV heads are not replicated)")


def tp_mesh_of(model: nn.Module) -> DeviceMesh | None:
    """The TP mesh `model` was parallelized over, None without tensor parallelism."""
    return getattr(model, _TP_MESH, None)


def _sharded(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    setattr(model, _TP_MESH, tp_mesh)


# ---- the built-in model ---------------------------------------------------------------


def parallelize_transformer(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split `model` (a `training.parallelism.model.Transformer`) over `tp_mesh` in place, before
    FSDP2 shards it over the plan ranks (torchtitan's order)."""
    tp = tp_mesh.size()
    check_heads(model.spec.name, model.spec.num_heads, model.spec.num_kv_heads, tp)
    # Token dimension 0: the model runs one rank's tokens as [T, C], no batch dimension.
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False),
        "norm": SequenceParallel(sequence_dim=0),
        "head": ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(sequence_dim=0),
            "ffn_norm": SequenceParallel(sequence_dim=0),
            "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
            "w1": ColwiseParallel(), "w3": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
        })
        # Each norm's output is gathered once for the projections after it (torchtitan puts
        # this on its attention and feed-forward modules; our block calls its linears itself).
        gather = PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate(),
                                     use_local_output=False)
        parallelize_module(block, tp_mesh, {"attention_norm": gather, "ffn_norm": gather})
        block.num_heads //= tp  # the heads this TP rank projects, remaps and attends with
        block.num_kv_heads //= tp
    _sharded(model, tp_mesh)
    return model


# ---- Hugging Face Llama-family models ---------------------------------------------------


_STYLES = {"colwise": "column", "rowwise": "row"}


def parallelize_hf(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split a Hugging Face Llama-family causal LM (Llama, Qwen3, ...) over `tp_mesh` in
    place: the projections as its config's `base_model_tp_plan` names them (colwise,
    rowwise), with torchtitan's sequence parallelism around them (norms on the sequence
    shard, the embedding and head split over the vocabulary). Modules the plan marks
    "replicated_with_grad_allreduce" (Qwen3's per-head q_norm and k_norm) see this TP
    rank's heads: their weights are replicated DTensors, whose gradients DTensor sums
    over the TP group."""
    config, tp = model.config, tp_mesh.size()
    name = getattr(config, "name_or_path", "") or type(model).__name__
    check_heads(name, config.num_attention_heads, getattr(config, "num_key_value_heads", None)
                or config.num_attention_heads, tp)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    per_layer = {key.split("layers.*.", 1)[1]: style for key, style in plan.items() if key.startswith("layers.*.")}
    known = {"colwise", "rowwise", "replicated_with_grad_allreduce"}
    if not per_layer or set(per_layer.values()) - known or len(per_layer) != len(plan):
        raise InputError(f"model {name!r}: --tp needs a Llama-family base_model_tp_plan of per-layer colwise/rowwise "
                         f"projections, got {plan or 'none'}")
    base = model.model
    # Sequence dimension 1: transformers runs a batch of one, [1, T, C].
    parallelize_module(base, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
    })
    parallelize_module(model, tp_mesh, {
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in base.layers:
        layer_plan = {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
        for path, style in per_layer.items():
            if style == "colwise":
                layer_plan[path] = ColwiseParallel()
            elif style == "rowwise":
                layer_plan[path] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            else:  # a per-head norm on this rank's heads [1, T, H/tp, D]
                layer_plan[path] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, layer_plan)
    _sharded(model, tp_mesh)
    return model


# ---- the loss and the bytes ---------------------------------------------------------------


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """Where a tensor-parallel model's loss and its backward must run: its logits are
    split over the vocabulary and `loss_parallel` computes the cross-entropy on the
    shards (forward and backward). A no-op without tensor parallelism."""
    return loss_parallel() if tp_mesh_of(model) is not None else contextlib.nullcontext()


_COLLECTIVES = {"all_gather_into_tensor": ("all_gather", 1), "reduce_scatter_tensor": ("reduce_scatter", 2),
                "all_reduce": ("all_reduce", None)}
"""DTensor's functional collectives: (our name, the argument that holds the group size;
None: read it off the group named by the last argument)."""


class _CollectiveBytes(TorchDispatchMode):
    """Records DTensor's collectives (its functional collectives, `_c10d_functional`; FSDP2's
    and the plan's exchanges call c10d directly and are not seen)."""

    def __init__(self, counter: ByteCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run first: the collectives it runs inside its own dispatch (the
            # loss's all-reduces, implicit redistributions) then come back here.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet.__module__.endswith("_c10d_functional") and packet.__name__ in _COLLECTIVES:
            op, size_arg = _COLLECTIVES[packet.__name__]
            n = int(args[size_arg]) if size_arg else dist.get_world_size(_resolve_process_group(args[-1]))
            # A graph task, not an autograd node: FSDP2 reduces the root's gradients in a
            # callback after the last node, still inside the backward.
            phase = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
            self.counter.add_collective(phase, op, sent_bytes(op, args[0], n))
        return out


def sent_bytes(op: str, t: torch.Tensor, n: int) -> int:
    """Bytes one of `n` ranks sends in a ring collective with input `t` (nccl-tests' bus
    bytes): all-gather (n-1) x its input, reduce-scatter (n-1)/n of it, all-reduce twice that."""
    size = t.numel() * t.element_size()
    return {"all_gather": (n - 1) * size, "reduce_scatter": (n - 1) * size // n,
            "all_reduce": 2 * (n - 1) * size // n}[op]


@contextlib.contextmanager
def count_collectives(counter: ByteCounter | None) -> Iterator[None]:
    """Record in `counter` (its `collectives`: (phase, op) -> bytes this rank sends) every
    tensor-parallel collective run inside the block, forward and backward; nothing when
    `counter` is None. It sees every op in Python (a quarter slower on the tiny model on
    CPU): tests and benchmarks count, the training loop does not."""
    if counter is None:
        yield
        return
    with _CollectiveBytes(counter):
        yield
