"""Figures of GPUs and links: vendor datasheets, plus efficiencies fitted to measurements.

Peak figures are dense bf16 tensor-core FLOP/s (no sparsity). Link bandwidths are bytes/s
in one direction. Efficiency curves are fitted to `data/calibration/` (H100 runs
from hao-ai-lab/distca, `distca/profiling/data/`) and applied to every GPU type as a
fraction of its own peak: a reasonable first order for Hopper/Ampere/Ada tensor cores.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from ballonet.errors import InputError

GB = 1e9
GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class GPUType:
    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    memory_bytes: float
    intra_link_bw: float
    """Per-GPU, one-direction bandwidth to the other GPUs of its node (bytes/s)."""
    intra_link: str = "nvlink"
    """"nvlink" or "pcie" (a PCIe-only node has no cheap intra-node ring)."""


# Datasheet figures. NVLink: per GPU, one direction (H100/H200/H20: 900 GB/s bidirectional;
# A800/H800: 400 GB/s bidirectional). PCIe Gen4 x16: ~32 GB/s nominal, ~25 GB/s achieved.
GPUS: dict[str, GPUType] = {
    g.name: g
    for g in [
        GPUType(name="h100", peak_flops=989e12, memory_bytes=80 * GB, intra_link_bw=450 * GB),
        GPUType(name="h200", peak_flops=989e12, memory_bytes=141 * GB, intra_link_bw=450 * GB),
        GPUType(name="h800", peak_flops=989e12, memory_bytes=80 * GB, intra_link_bw=200 * GB),
        GPUType(name="a100", peak_flops=312e12, memory_bytes=80 * GB, intra_link_bw=300 * GB),
        GPUType(name="a800", peak_flops=312e12, memory_bytes=80 * GB, intra_link_bw=200 * GB),
        GPUType(name="h20", peak_flops=148e12, memory_bytes=96 * GB, intra_link_bw=450 * GB),
        GPUType(name="l20", peak_flops=119.5e12, memory_bytes=48 * GB, intra_link_bw=25 * GB,
                intra_link="pcie"),
        GPUType(name="l40s", peak_flops=362e12, memory_bytes=48 * GB, intra_link_bw=25 * GB,
                intra_link="pcie"),
        GPUType(name="a10", peak_flops=125e12, memory_bytes=24 * GB, intra_link_bw=25 * GB,
                intra_link="pcie"),
        # An emulated "GPU" for CPU runs: small figures so plans look like real ones.
        GPUType(name="cpu", peak_flops=1e12, memory_bytes=16 * GB, intra_link_bw=10 * GB),
    ]
}


def gpu(name: str) -> GPUType:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise InputError(f"unknown GPU type {name!r}; known: {', '.join(sorted(GPUS))}") from None


# Attention kernel efficiency (achieved / peak) against sequence length, fitted to
# h100_attention_latency.csv (causal forward, 64 query / 4 KV heads, head dim 128):
# efficiency = 2*L*(L+1)*H*D / (latency * 989e12), read at the measured lengths. Below
# the first point a kernel is launch-bound; LAUNCH_S is the measured floor.
# Read as forward latencies, these are ~12% of peak at 32K tokens, well below what
# FlashAttention reaches on H100; if the file holds forward+backward times the curve is
# 3.5x higher. We take the file at its word until a GPU run recalibrates it.
_ATTN_EFF_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_ATTN_EFF = (0.0442, 0.0599, 0.0821, 0.0933, 0.0987, 0.1100, 0.1187, 0.1185)
ATTENTION_LAUNCH_S = 11e-6


def attention_efficiency(length: float) -> float:
    """Fraction of peak a causal attention kernel reaches on a sequence (or chunk) of `length`."""
    if length <= _ATTN_EFF_LENGTHS[0]:
        return _ATTN_EFF[0]  # shorter kernels are launch-bound: see ATTENTION_LAUNCH_S
    if length >= _ATTN_EFF_LENGTHS[-1]:
        return _ATTN_EFF[-1]
    x = math.log2(length)
    i = bisect.bisect_right(_ATTN_EFF_LENGTHS, length) - 1
    x0, x1 = math.log2(_ATTN_EFF_LENGTHS[i]), math.log2(_ATTN_EFF_LENGTHS[i + 1])
    return _ATTN_EFF[i] + (_ATTN_EFF[i + 1] - _ATTN_EFF[i]) * (x - x0) / (x1 - x0)


def attention_efficiency_array(lengths) -> np.ndarray:
    """`attention_efficiency` over an array of lengths (the same clamped log-linear curve)."""
    knots = np.log2(np.asarray(_ATTN_EFF_LENGTHS, dtype=float))
    return np.interp(np.log2(np.maximum(np.asarray(lengths, dtype=float), 1.0)), knots, _ATTN_EFF)


# GEMM efficiency, fitted to h100_megatron_layer_ops.tsv (32K tokens, TP=1, CP=1: the
# output projection of a 4096-hidden layer, 2*T*h*h FLOPs in 1.449 ms = 0.77 of peak).
# Fewer tokens per GEMM lose efficiency: half of it at LINEAR_HALF_TOKENS tokens.
LINEAR_EFFICIENCY = 0.77
LINEAR_HALF_TOKENS = 128


def linear_efficiency(num_tokens: float) -> float:
    return LINEAR_EFFICIENCY * num_tokens / (num_tokens + LINEAR_HALF_TOKENS)


# NCCL on NVLink, fitted to h100_nccl_perf.csv at 64 MB and above: bus bandwidth reached
# as a fraction of the link's one-direction bandwidth, and a per-collective latency.
NCCL_BUS_EFFICIENCY = {"all_gather": 0.78, "reduce_scatter": 0.685, "all_reduce": 0.94, "p2p": 0.80}
NCCL_LATENCY_S = 40e-6
# RDMA NICs reach ~90% of line rate on large messages; a hop costs a few microseconds.
NIC_EFFICIENCY = 0.90
NIC_LATENCY_S = 10e-6
