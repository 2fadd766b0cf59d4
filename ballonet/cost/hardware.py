"""Figures of GPUs and links: vendor datasheets, plus one calibration profile per GPU type.

Peak figures are dense bf16 tensor-core FLOP/s (no sparsity). Link bandwidths are bytes/s
in one direction. Speeds below peak come from a `calibration.Profile` per GPU type
(`PROFILES`, built in `cost/profiles.py` from the evidence named there), or from a
profile file measured by `ballonet calibrate` and installed with `calibration.use`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ballonet import calibration
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


REFERENCE_GPU = "h100"
"""Whose profile prices work when no GPU is named (the planners' GPU-free unit of work)."""


def profile(gpu: GPUType | str | None = None) -> calibration.Profile:
    """The profile pricing `gpu`: one installed by `calibration.use`, else the built-in; a
    GPU type without a profile of its own is priced like the reference GPU."""
    name = REFERENCE_GPU if gpu is None else gpu if isinstance(gpu, str) else gpu.name
    builtin = _builtin_profiles()
    return calibration.override(name) or builtin.get(name) or builtin[REFERENCE_GPU]


def calibrated(gpu: GPUType | str | None = None) -> bool:
    """Whether a profile installed by `calibration.use` prices `gpu` (else a built-in one
    does, which never changes: what it prices may be cached)."""
    return calibration.override(REFERENCE_GPU if gpu is None else gpu if isinstance(gpu, str) else gpu.name) is not None


@functools.cache
def _builtin_profiles() -> dict:
    """`cost.profiles.PROFILES`, imported on first use: the built-ins are data about
    GPUS (the partitioner asks for a profile thousands of times per plan)."""
    from ballonet.cost.profiles import PROFILES
    return PROFILES


def attention_efficiency(lengths, gpu: GPUType | str | None = None, backward: bool = False) -> np.ndarray:
    """Fraction of peak a causal attention kernel reaches on sequences (or chunks) of each
    of `lengths` tokens (an array of their shape), forward or backward (FLOPs of the
    backward counted as 2.5x)."""
    p = profile(gpu)
    return (p.attention_backward if backward else p.attention_forward).at(lengths)


def linear_efficiency(num_tokens: float, gpu: GPUType | str | None = None) -> float:
    """Fraction of peak the layer's GEMMs reach on calls of `num_tokens` tokens."""
    return float(profile(gpu).linear.at(num_tokens))
