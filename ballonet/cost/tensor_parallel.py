"""Tensor parallelism's collectives in a step, as the runtime runs them
(`training/parallelism/tensor_parallel.py`: DTensor, sequence parallelism, the loss on vocabulary
shards): which, their bytes (what one GPU of a TP group sends, nccl-tests' bus bytes)
and their seconds on its node's links. The simulator runs them on the compute stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ballonet.cost import hardware
from ballonet.cost.flops import LOSS_DTYPE_BYTES, hidden_bytes
from ballonet.cost.memory import layer_mean
from ballonet.cost.seconds import bus_bytes, collective_time

if TYPE_CHECKING:
    from ballonet.specs import ModelSpec, NodeGroup

TP_RERUN = {"none": (0, 0), "selective": (1, 0), "linear": (2, 1), "full": (2, 1)}
"""(all-gathers, reduce-scatters) of the hidden states a layer's backward runs again under
each recomputation (`training/parallelism/tensor_parallel.py`): the checkpointed pieces rerun their
gathers, and `torch.utils.checkpoint` stops a rerun after the last tensor the backward
needs, before the piece's last reduce-scatter."""


def tp_buffer_bytes(model: ModelSpec, tokens: int) -> float:
    """The [T, C] hidden states of one tensor-parallel all-gather or reduce-scatter: T =
    `tokens` padded up to a multiple of tp (DTensor pads uneven shards)."""
    return hidden_bytes(model, -(-int(tokens) // model.tp) * model.tp)


def tp_layer_seconds(model: ModelSpec, tokens: int, bandwidth: float, gpu: hardware.GPUType,
                     mode: str = "none") -> tuple[float, float]:
    """(forward, backward) seconds of one layer's tensor-parallel collectives on a GPU of a
    TP group whose plan rank holds `tokens` on the linear layout: two all-gathers and two
    reduce-scatters of the hidden states a pass (sequence parallelism; the backward scatters
    what the forward gathered and gathers what it scattered), and the backward's reruns
    under recomputation `mode` (`TP_RERUN`)."""
    if model.tp == 1:
        return 0.0, 0.0
    buf = tp_buffer_bytes(model, tokens)
    ag, rs = (collective_time(op, buf, model.tp, bandwidth, gpu) for op in ("all_gather", "reduce_scatter"))
    rerun_ag, rerun_rs = TP_RERUN[mode]
    return 2 * (ag + rs), (2 + rerun_ag) * ag + (2 + rerun_rs) * rs


def tp_step_collectives(model: ModelSpec, tokens: int) -> list[tuple[str, str, float]]:
    """(phase, op, buffer bytes) of the tensor-parallel collectives a step runs outside its
    layers, on a GPU whose plan rank holds `tokens` on the linear layout: the embedding's
    reduce-scatter to the sequence shard and the head's all-gather (the backward the other
    way round), the loss's three all-reduces of [T] fp32 over the vocabulary shards
    (`loss_parallel`: the max, the sum of exponentials, the target logits) and, backward,
    one all-reduce of each norm weight's gradient (two a layer and the final norm)."""
    if model.tp == 1:
        return []
    buf, T = tp_buffer_bytes(model, tokens), float(tokens)
    out = [(phase, op, buf) for phase in ("forward", "backward") for op in ("all_gather", "reduce_scatter")]
    out += [("forward", "all_reduce", T * LOSS_DTYPE_BYTES)] * 3
    return out + [("backward", "all_reduce", float(model.hidden * model.dtype_bytes))] * (2 * model.num_layers + 1)


def tp_sent_bytes(model: ModelSpec, tokens: int, mode: str = "none",
                  layers: int | None = None) -> dict[str, dict[str, float]]:
    """{phase: {op: bytes}} one GPU of a TP group sends in a step's tensor-parallel
    collectives (`tp_layer_seconds`' and `tp_step_collectives`'), its plan rank holding
    `tokens` on the linear layout and recomputing under `mode` on its first `layers`
    layers (the others one mode below, as `recompute_layer_count`)."""
    out: dict[str, dict[str, float]] = {"forward": {}, "backward": {}}
    if model.tp == 1:
        return out
    n, L, buf = model.tp, model.num_layers, tp_buffer_bytes(model, tokens)
    for i, op in enumerate(("all_gather", "reduce_scatter")):
        rerun = layer_mean(model, {m: float(r[i]) for m, r in TP_RERUN.items()}, mode, layers)
        out["forward"][op] = 2 * L * bus_bytes(op, buf, n)
        out["backward"][op] = (2 + rerun) * L * bus_bytes(op, buf, n)
    for phase, op, nbytes in tp_step_collectives(model, tokens):
        out[phase][op] = out[phase].get(op, 0.0) + bus_bytes(op, nbytes, n)
    return out


def tp_seconds_per_token(model: ModelSpec, group: NodeGroup) -> float:
    """Seconds of tensor-parallel collectives per token on each GPU of a TP group, per
    pass of all layers (two all-gathers and two reduce-scatters of its hidden states a
    layer, sequence parallelism), latency aside: what `collective_time` charges a byte."""
    if model.tp <= 1:
        return 0.0
    p = hardware.profile(group.gpu_type)
    per_token = hidden_bytes(model, 1) * (model.tp - 1) / model.tp / group.intra_bw
    return model.num_layers * 2 * sum(per_token / p.collective_efficiency[op] for op in ("all_gather", "reduce_scatter"))
