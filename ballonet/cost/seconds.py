"""Seconds of the pieces of a training step, calibrated.

Closed forms first, calibration second: FLOP and byte counts (`flops.py`) over a GPU's
peak times an efficiency from its calibration profile (`hardware.profile`: built in, or
measured by `ballonet calibrate`), and an alpha-beta model of each link. Then the
break-even chunk of a ring and what one document costs alone (`ballonet cost`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import (
    ATTENTION_BACKWARD_FACTOR,
    ELEMENTWISE_BACKWARD_FACTOR,
    LINEAR_BACKWARD_FACTOR,
    attention_flops,
    block_flops,
    elementwise_bytes_per_token,
    grad_bytes,
    head_flops_per_token,
    kv_bytes,
    linear_flops_per_token,
    loss_bytes_per_token,
)
from ballonet.cost.memory import activation_bytes_per_token
from ballonet.cost.recompute import (
    cheapest_per_rank,
    recompute_attention,
    recompute_elementwise_bytes_per_token,
    recompute_flops_per_token,
)
from ballonet.plan.recompute import heaviest

if TYPE_CHECKING:
    from ballonet.specs import ClusterSpec, ModelSpec, NodeGroup

def attention_seconds(model: ModelSpec, gpu: hardware.GPUType, flops, length, backward: bool = False, *,
                      launch_floor: bool = False):
    """Seconds of attention kernels doing `flops` (whole-model forward count) on sequences
    or chunks of about `length` tokens each, forward or backward (2.5x the FLOPs at the
    backward's own efficiency): a float for a number, an array for arrays. With
    `launch_floor` each is one kernel call: at least the profile's launch floor, 0 without FLOPs."""
    eff = hardware.attention_efficiency(length, gpu, backward)
    factor = ATTENTION_BACKWARD_FACTOR if backward else 1.0
    seconds = np.asarray(flops, dtype=float) * factor / model.tp / (gpu.peak_flops * eff)
    if launch_floor:
        floor = hardware.profile(gpu).attention_launch_s
        if seconds.ndim == 0:
            return max(floor, float(seconds)) if flops > 0 else 0.0
        return np.where(np.asarray(flops) > 0, np.maximum(seconds, floor), 0.0)
    return float(seconds) if seconds.ndim == 0 else seconds


def heads_kernel_seconds(model: ModelSpec, gpu: hardware.GPUType, lengths, members: int,
                         backward: bool = False) -> float:
    """Seconds of a "heads" member's one kernel call over documents of `lengths` tokens
    split by heads over `members` (`plan.Ring` comm "heads"): 1/members of each one's
    attention FLOPs at the efficiency of its whole length, forward or backward; at least
    a launch."""
    L = np.asarray(lengths, dtype=float)
    total = float(np.sum(attention_seconds(model, gpu, attention_flops(model, L) / members, L, backward)))
    return max(total, hardware.profile(gpu).attention_launch_s) if total > 0 else 0.0


def attention_work(model: ModelSpec, lengths, gpu=None) -> np.ndarray:
    """[D] forward attention cost of each whole document in peak-FLOP units per GPU: its
    FLOPs over the kernel efficiency at its length (of `gpu`'s profile; default the
    reference GPU's), so seconds on a GPU = work / its peak."""
    L = np.asarray(lengths, dtype=float)
    return attention_flops(model, L) / model.tp / hardware.attention_efficiency(L, gpu)


def linear_time(model: ModelSpec, gpu: hardware.GPUType, num_tokens: float, flops_per_token: float | None = None) -> float:
    """Seconds of one layer's forward GEMMs (or `flops_per_token` of them) over
    `num_tokens` tokens on one GPU (an array of token counts gives an array)."""
    per_token = linear_flops_per_token(model) if flops_per_token is None else flops_per_token
    return _per_call(per_token * np.asarray(num_tokens, dtype=float) / model.tp / gpu.peak_flops,
                     hardware.profile(gpu).linear, num_tokens)


def _per_call(ideal: np.ndarray, curve, num_tokens, efficiency=None):
    """`ideal` seconds over `curve`'s efficiency at `num_tokens` (`efficiency`, when known;
    0 for no tokens): a float for a number, an array for an array."""
    n = np.asarray(num_tokens, dtype=float)
    out = np.where(n > 0, ideal / (curve.at(n) if efficiency is None else efficiency), 0.0)
    return float(out) if out.ndim == 0 else out


def elementwise_time(model: ModelSpec, gpu: hardware.GPUType, num_tokens: float,
                     bytes_per_token: float | None = None) -> float:
    """Seconds of one layer's forward elementwise work (or `bytes_per_token` of it) over
    `num_tokens` tokens on one GPU: bytes over the profile's memory bandwidth times its
    elementwise efficiency at that many tokens (an array of token counts gives an array)."""
    per_token = elementwise_bytes_per_token(model) if bytes_per_token is None else bytes_per_token
    p = hardware.profile(gpu)
    return _per_call(per_token * np.asarray(num_tokens, dtype=float) / p.memory_bw, p.elementwise, num_tokens)


def linear_layer_seconds(model: ModelSpec, gpu: hardware.GPUType, tokens: float, mode: str | None,
                         framework: bool = True, layers: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a rank's linear layers in one layer over `tokens`
    tokens: GEMMs, the elementwise work around them and (with `framework`) the framework's
    per-layer work (half in each pass); the backward reruns what recomputation `mode` drops
    (a mean over layers when only `layers` of them recompute). An array of token counts
    gives a pair of arrays."""
    p, n = hardware.profile(gpu), np.asarray(tokens, dtype=float)
    at = (p.linear.at(n), p.elementwise.at(n))  # the efficiencies of every call below

    def gemms(per_token: float):  # `linear_time`
        return _per_call(per_token * n / model.tp / gpu.peak_flops, p.linear, tokens, at[0])

    def elementwise(per_token: float):  # `elementwise_time`
        return _per_call(per_token * n / p.memory_bw, p.elementwise, tokens, at[1])
    gemm, elt = gemms(linear_flops_per_token(model)), elementwise(elementwise_bytes_per_token(model))
    redo = (gemms(recompute_flops_per_token(model, mode, layers))
            + elementwise(recompute_elementwise_bytes_per_token(model, mode, layers)))
    half = p.framework_s_per_layer / 2 if framework else 0.0
    return gemm + elt + half, gemm * LINEAR_BACKWARD_FACTOR + elt * ELEMENTWISE_BACKWARD_FACTOR + redo + half


def framework_time(model: ModelSpec, gpu: hardware.GPUType) -> float:
    """Seconds a step costs one rank's compute thread in the training framework outside
    the model's kernels (FSDP2's gathers, copies and gradient hooks): per layer, calibrated."""
    return model.num_layers * hardware.profile(gpu).framework_s_per_layer


def head_seconds(model: ModelSpec, gpu: hardware.GPUType, tokens: int) -> float:
    """Forward and backward of the LM head's GEMM and the loss's elementwise work over a
    rank's `tokens` (linear layout)."""
    if not tokens:
        return 0.0
    flops = head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR) / model.tp
    gemm = flops * tokens / (gpu.peak_flops * hardware.linear_efficiency(tokens, gpu))
    loss = elementwise_time(model, gpu, tokens, loss_bytes_per_token(model))
    return gemm + loss * (1 + ELEMENTWISE_BACKWARD_FACTOR)


def optimizer_time(model: ModelSpec, gpu: hardware.GPUType, num_dp_ranks: int) -> float:
    """Seconds of one rank's optimizer step: its shard of the parameters (sharded over the
    data-parallel ranks, as `static_bytes` holds them) at the profile's seconds per parameter."""
    return model.num_params / model.tp / max(num_dp_ranks, 1) * hardware.profile(gpu).optimizer_s_per_param


def p2p_time(num_bytes: float, bandwidth: float, nic: bool = False, gpu: hardware.GPUType | None = None) -> float:
    """One point-to-point transfer over a link of `bandwidth` bytes/s (nominal)."""
    if num_bytes <= 0:
        return 0.0
    p = hardware.profile(gpu)
    if nic:
        return p.nic_latency_s + num_bytes / (bandwidth * p.nic_efficiency)
    return p.p2p_latency_s + num_bytes / (bandwidth * p.p2p_efficiency)


def p2p_times(num_bytes: np.ndarray, bandwidth: np.ndarray, nic: bool = False,
              gpu: hardware.GPUType | None = None) -> np.ndarray:
    """`p2p_time` of each transfer of `num_bytes` over its link of `bandwidth` (arrays)."""
    p = hardware.profile(gpu)
    latency, efficiency = (p.nic_latency_s, p.nic_efficiency) if nic else (p.p2p_latency_s, p.p2p_efficiency)
    return np.where(num_bytes > 0, latency + num_bytes / (bandwidth * efficiency), 0.0)


def collective_time(op: str, num_bytes: float, num_ranks: int, bandwidth: float,
                    gpu: hardware.GPUType | None = None) -> float:
    """NCCL ring collective over `num_ranks` GPUs of one node; `num_bytes` is the full
    buffer (nccl-tests' "size"): bus bytes are (n-1)/n of it, twice that for all_reduce."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    p = hardware.profile(gpu)
    return p.collective_latency_s + bus_bytes(op, num_bytes, num_ranks) / (bandwidth * p.collective_efficiency[op])


def bus_bytes(op: str, num_bytes: float, num_ranks: int) -> float:
    """Bytes each of `num_ranks` GPUs sends in a ring collective of a `num_bytes` buffer
    (nccl-tests' bus bytes): (n-1)/n of it, twice that for all_reduce."""
    return (2 if op == "all_reduce" else 1) * (num_ranks - 1) * num_bytes / num_ranks


def grad_allreduce_parts(model: ModelSpec, group: NodeGroup, num_nodes: int) -> tuple[float, float]:
    """A GPU's share of the hierarchical gradient all-reduce: (seconds of the intra-node
    reduce-scatter and all-gather, bytes its NIC sends and receives across nodes). Each
    GPU's 1/n shard is all-reduced over the nodes by a ring: 2(k-1)/k of it each way."""
    total, n, gpu = grad_bytes(model), group.gpus_per_node, group.gpu_type
    intra = sum(collective_time(op, total, n, group.intra_bw, gpu) for op in ("reduce_scatter", "all_gather"))
    k = num_nodes
    return intra, (2 * (k - 1) / k * total / n if k > 1 else 0.0)


DP_FORWARD_SHARE = 0.5
"""A layer's forward runs beside one bf16 parameter all-gather: half an all-reduce's traffic."""
DP_BACKWARD_SHARE = 1.5
"""A layer's backward runs beside a bf16 all-gather and an fp32 reduce-scatter (FSDP2's
`reduce_dtype`): half an all-reduce, plus twice half."""
DP_PIECES = 8
"""The pieces a layer's data-parallel collectives reach the links in (NCCL's chunks): CP
transfers on their own process group queue between them."""


def dp_layer_parts(model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float]:
    """One layer's share of a bf16 gradient all-reduce, for the slowest node group:
    (intra-node seconds, bytes a GPU sends across nodes); a layer's forward runs beside
    `DP_FORWARD_SHARE` of it, its backward beside `DP_BACKWARD_SHARE`."""
    parts = [grad_allreduce_parts(model, g, cluster.num_nodes) for g in cluster.groups]
    return (max(x[0] for x in parts) / model.num_layers, max(x[1] for x in parts) / model.num_layers)


def dp_piece_seconds(model: ModelSpec, group: NodeGroup, num_nodes: int) -> tuple[float, float]:
    """(forward, backward) seconds one piece of a layer's data-parallel collectives holds a
    GPU's NIC share of `group` (its NIC at line rate over the GPUs it serves): a ring hop
    across nodes queued behind it waits that long."""
    nic = grad_allreduce_parts(model, group, num_nodes)[1] / model.num_layers / DP_PIECES
    per_s = group.nic_bw / group.gpus_per_nic
    return DP_FORWARD_SHARE * nic / per_s, DP_BACKWARD_SHARE * nic / per_s


def grad_allreduce_time(model: ModelSpec, cluster: ClusterSpec) -> float:
    """Hierarchical all-reduce of one GPU's gradients alone on the links: reduce-scatter
    inside each node, all-reduce of each shard across nodes over the NICs (a NIC shared
    by m GPUs carries m shards), all-gather inside the node. The slowest group sets it."""
    worst = 0.0
    for g in cluster.groups:
        intra, nic = grad_allreduce_parts(model, g, cluster.num_nodes)
        if nic:
            intra += p2p_time(nic * g.gpus_per_nic, g.nic_bw, nic=True, gpu=g.gpu_type)
        worst = max(worst, intra)
    return worst


def breakeven_chunk_tokens(model: ModelSpec, gpu: hardware.GPUType, bandwidth: float, nic: bool = False) -> int:
    """Chunk length c above which one ring step's compute (c queries against c keys)
    hides the transfer of c rows of K and V over a link of `bandwidth` bytes/s; about
    c* = F * h_kv * bytes / (2 * h * BW) (docs/design.md, section 3) with F the calibrated FLOP/s.
    Tiny chunks are latency-bound on both sides, so the search runs down from long chunks
    to the last length that is not hidden."""
    def hidden(c: int) -> bool:
        compute = attention_seconds(model, gpu, block_flops(model, c, c), c, launch_floor=True)
        return compute >= p2p_time(kv_bytes(model, c), bandwidth, nic, gpu)

    hi = 1 << 24
    if not hidden(hi):
        return hi
    lo = hi
    while lo > 1 and hidden(lo):
        lo //= 2
    if hidden(lo):
        return 1
    while hi - lo > 1:  # hidden(hi), not hidden(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


@dataclass(frozen=True, kw_only=True)
class SequenceCost:
    """What one document costs on one GPU of a node group (per layer unless stated)."""
    length: int
    attention_flops_fwd: float
    linear_flops_fwd: float
    attention_time_s: float
    attention_backward_time_s: float
    linear_time_s: float
    elementwise_time_s: float
    step_time_s: float
    """Forward plus backward of all layers (attention, GEMMs, elementwise), with recomputation, on one GPU."""
    recompute: str
    activation_bytes: float
    breakeven_chunk_tokens: dict
    recompute_layers: int = 0
    """How many layers (the first ones) recompute under `recompute`."""


def sequence_cost(model: ModelSpec, group: NodeGroup, length: int) -> SequenceCost:
    """One document alone on one GPU of `group`, with the cheapest recomputation that holds it."""
    gpu = group.gpu_type
    found = cheapest_per_rank(model, [length], [gpu], group.num_nodes * group.gpus_per_node // model.tp)
    mode, layers = heaviest(found[1]) if found else ("full", model.num_layers)
    att_flops = attention_flops(model, length)
    att = attention_seconds(model, gpu, att_flops, length, launch_floor=True)
    att_bwd = attention_seconds(model, gpu, att_flops, length, backward=True, launch_floor=True)
    lin = linear_time(model, gpu, length)
    elt = elementwise_time(model, gpu, length)
    redo = linear_time(model, gpu, length, recompute_flops_per_token(model, mode, layers))
    redo += elementwise_time(model, gpu, length, recompute_elementwise_bytes_per_token(model, mode, layers))
    redo += att if recompute_attention(mode) else 0.0
    step = model.num_layers * (att + att_bwd + lin * (1 + LINEAR_BACKWARD_FACTOR)
                               + elt * (1 + ELEMENTWISE_BACKWARD_FACTOR) + redo)
    return SequenceCost(
        length=length,
        attention_flops_fwd=att_flops,
        linear_flops_fwd=linear_flops_per_token(model) * length,
        attention_time_s=att,
        attention_backward_time_s=att_bwd,
        linear_time_s=lin,
        elementwise_time_s=elt,
        step_time_s=step,
        recompute=mode,
        recompute_layers=layers,
        activation_bytes=activation_bytes_per_token(model, mode, layers) * length,
        breakeven_chunk_tokens={
            "intra": breakeven_chunk_tokens(model, gpu, group.intra_bw),
            "inter": breakeven_chunk_tokens(model, gpu, group.nic_bw / group.gpus_per_nic, nic=True),
        },
    )


def best_efficiency(curve, upto) -> np.ndarray:
    """The best efficiency of `curve` (a calibrated curve of tokens) at any token count up to
    each of `upto`: what any split or packing of that much work could reach (the batch bound's)."""
    x = np.asarray(upto, dtype=float)
    last = np.searchsorted(np.asarray(curve.tokens), x, side="right") - 1  # the last knot at or below (increasing)
    best_knot = np.where(last >= 0, np.maximum.accumulate(np.asarray(curve.efficiency))[np.maximum(last, 0)], 0.0)
    return np.maximum(best_knot, curve.at(x))
