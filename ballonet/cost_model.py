"""FLOPs, bytes, memory and seconds of the pieces of a training step.

Closed forms first, calibration second: FLOP and byte counts are exact functions of the
model shape; seconds come from a GPU's peak times an efficiency fitted to measurements
(`hardware.py`), and from an alpha-beta model of each link. All FLOPs are per layer and
forward unless a name says otherwise; with tensor parallelism a GPU does 1/tp of them.

Sources: causal attention FLOPs as in FlashAttention's benchmark (2 matmuls of 2*D FLOPs
per (query, key) pair and head); linear FLOPs as in Megatron-LM's `num_floating_point_
operations` (2 FLOPs per weight per token); activation memory after Korthikanti et al.
2022 ("Reducing Activation Recomputation", table 2) with full layer recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ballonet import hardware
from ballonet.specs import ClusterSpec, ModelSpec, NodeGroup

ATTENTION_BACKWARD_FACTOR = 2.5
"""Backward attention FLOPs / forward (FlashAttention recomputes P; 5 matmuls vs 2)."""
LINEAR_BACKWARD_FACTOR = 2.0
"""Backward GEMM FLOPs / forward (input and weight gradients)."""
MEMORY_RESERVE = 0.90
"""Share of a GPU's memory a plan may use; the rest is allocator and library slack."""
GRAD_BYTES = 2
"""Bytes per gradient element in the data-parallel all-reduce (bf16)."""


# ---- FLOPs ---------------------------------------------------------------------------


def attention_flops(model: ModelSpec, length: int) -> float:
    """Causal self-attention of one document of `length` tokens (all heads)."""
    return 2.0 * model.num_heads * model.head_dim * length * (length + 1)


def attention_work(model: ModelSpec, lengths) -> np.ndarray:
    """[D] forward attention cost of each whole document in peak-FLOP units per GPU: its
    FLOPs (`attention_flops`, array form) over the kernel efficiency at its length, so
    seconds on a GPU = work / its peak."""
    L = np.asarray(lengths, dtype=float)
    flops = 2.0 * model.num_heads * model.head_dim * L * (L + 1)
    return flops / model.tp / hardware.attention_efficiency_array(L)


def block_flops(model: ModelSpec, q_len: int, k_len: int, causal: bool = False) -> float:
    """One (query chunk, key chunk) block: full, or causal on the diagonal (q_len == k_len)."""
    if causal:
        return attention_flops(model, q_len)
    return 4.0 * model.num_heads * model.head_dim * q_len * k_len


def linear_flops_per_token(model: ModelSpec) -> float:
    """QKV (GQA-aware), output projection and SwiGLU MLP of one layer, per token."""
    h = model.hidden
    weights = h * (h + 2 * model.kv_dim) + h * h + 3 * h * model.ffn_hidden
    return 2.0 * weights


def zigzag_rank_flops(model: ModelSpec, bounds: tuple[int, ...], position: int) -> float:
    """Forward attention FLOPs of ring position `position` of a zig-zag split document:
    its two query chunks against every earlier key token of the document."""
    g = (len(bounds) - 1) // 2
    total = 0.0
    for c in (position, 2 * g - 1 - position):
        q = bounds[c + 1] - bounds[c]
        if q:
            total += block_flops(model, q, bounds[c]) + block_flops(model, q, q, causal=True)
    return total


# ---- bytes -----------------------------------------------------------------------------


def kv_bytes(model: ModelSpec, rows: int) -> float:
    """K and V of `rows` tokens held by one GPU (its tp shard of the KV heads)."""
    return 2.0 * rows * model.kv_dim * model.dtype_bytes / model.tp


def hidden_bytes(model: ModelSpec, rows: int) -> float:
    """Hidden states of `rows` tokens: what a remap moves per token."""
    return float(rows * model.hidden * model.dtype_bytes)


def grad_bytes(model: ModelSpec) -> float:
    """Gradients one GPU all-reduces per step."""
    return model.num_params * GRAD_BYTES / model.tp


def activation_bytes_per_token(model: ModelSpec) -> float:
    """Layer inputs checkpointed for every layer plus one recomputed layer's working set
    (34*h bytes per token in bf16 with a fused attention kernel)."""
    return (model.num_layers * model.hidden * model.dtype_bytes + 34 * model.hidden) / model.tp


def static_bytes(model: ModelSpec, num_dp_ranks: int) -> float:
    """bf16 weights and gradients, plus fp32 Adam states sharded over data-parallel ranks
    (Megatron's distributed optimizer / ZeRO-1)."""
    return model.num_params * (2 + 2 + 12 / max(num_dp_ranks, 1)) / model.tp


def memory_cap(model: ModelSpec, gpu: hardware.GPUType, num_dp_ranks: int) -> float:
    """Bytes of activations a GPU can hold."""
    return gpu.memory_bytes * MEMORY_RESERVE - static_bytes(model, num_dp_ranks)


# ---- seconds ---------------------------------------------------------------------------


def attention_time(model: ModelSpec, gpu: hardware.GPUType, flops: float, length: float) -> float:
    """Seconds of an attention kernel doing `flops` (whole-model count) on chunks of about
    `length` tokens; efficiency depends on the chunk length."""
    if flops <= 0:
        return 0.0
    rate = gpu.peak_flops * hardware.attention_efficiency(length)
    return max(hardware.ATTENTION_LAUNCH_S, flops / model.tp / rate)


def linear_time(model: ModelSpec, gpu: hardware.GPUType, num_tokens: float) -> float:
    """Seconds of one layer's forward GEMMs over `num_tokens` tokens on one GPU."""
    if num_tokens <= 0:
        return 0.0
    flops = linear_flops_per_token(model) * num_tokens / model.tp
    return flops / (gpu.peak_flops * hardware.linear_efficiency(num_tokens))


def p2p_time(num_bytes: float, bandwidth: float, nic: bool = False) -> float:
    """One point-to-point transfer over a link of `bandwidth` bytes/s."""
    if num_bytes <= 0:
        return 0.0
    if nic:
        return hardware.NIC_LATENCY_S + num_bytes / (bandwidth * hardware.NIC_EFFICIENCY)
    return hardware.NCCL_LATENCY_S + num_bytes / (bandwidth * hardware.NCCL_BUS_EFFICIENCY["p2p"])


def collective_time(op: str, num_bytes: float, num_ranks: int, bandwidth: float) -> float:
    """NCCL ring collective over `num_ranks` GPUs of one node; `num_bytes` is the full
    buffer (nccl-tests' "size"): bus bytes are (n-1)/n of it, twice that for all_reduce."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    factor = (2 if op == "all_reduce" else 1) * (num_ranks - 1) / num_ranks
    return hardware.NCCL_LATENCY_S + factor * num_bytes / (bandwidth * hardware.NCCL_BUS_EFFICIENCY[op])


def grad_allreduce_time(model: ModelSpec, cluster: ClusterSpec) -> float:
    """Hierarchical all-reduce of one GPU's gradients: reduce-scatter inside each node,
    all-reduce of each shard across nodes over the NICs, all-gather inside the node.
    The slowest node group sets the time."""
    total = grad_bytes(model)
    worst = 0.0
    for g in cluster.groups:
        n = g.gpus_per_node
        t = collective_time("reduce_scatter", total, n, g.intra_bw) + collective_time("all_gather", total, n, g.intra_bw)
        if cluster.num_nodes > 1:
            shard = total / n
            nic_share = g.nic_bw / g.gpus_per_nic
            k = cluster.num_nodes
            t += hardware.NIC_LATENCY_S + 2 * (k - 1) / k * shard / (nic_share * hardware.NIC_EFFICIENCY)
        worst = max(worst, t)
    return worst


# ---- break-even ------------------------------------------------------------------------


def breakeven_chunk_tokens(model: ModelSpec, gpu: hardware.GPUType, bandwidth: float, nic: bool = False) -> int:
    """Chunk length c above which one ring step's compute (c queries against c keys)
    hides the transfer of c rows of K and V over a link of `bandwidth` bytes/s; about
    c* = F * h_kv * bytes / (2 * h * BW) (docs/design.md, section 3) with F the calibrated FLOP/s.
    Tiny chunks are latency-bound on both sides, so the search runs down from long chunks
    to the last length that is not hidden."""
    def hidden(c: int) -> bool:
        compute = attention_time(model, gpu, block_flops(model, c, c), c)
        return compute >= p2p_time(kv_bytes(model, c), bandwidth, nic)

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
    linear_time_s: float
    step_time_s: float
    """Forward plus backward of all layers, attention and linear, on one GPU."""
    activation_bytes: float
    breakeven_chunk_tokens: dict


def sequence_cost(model: ModelSpec, group: NodeGroup, length: int) -> SequenceCost:
    gpu = group.gpu_type
    att_flops = attention_flops(model, length)
    att = attention_time(model, gpu, att_flops, length)
    lin = linear_time(model, gpu, length)
    step = model.num_layers * (att * (1 + ATTENTION_BACKWARD_FACTOR) + lin * (1 + LINEAR_BACKWARD_FACTOR))
    return SequenceCost(
        length=length,
        attention_flops_fwd=att_flops,
        linear_flops_fwd=linear_flops_per_token(model) * length,
        attention_time_s=att,
        linear_time_s=lin,
        step_time_s=step,
        activation_bytes=activation_bytes_per_token(model) * length,
        breakeven_chunk_tokens={
            "intra": breakeven_chunk_tokens(model, gpu, group.intra_bw),
            "inter": breakeven_chunk_tokens(model, gpu, group.nic_bw / group.gpus_per_nic, nic=True),
        },
    )

