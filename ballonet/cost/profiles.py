"""The built-in calibration profiles, one per GPU type of `hardware.GPUS`, with sources.

Efficiencies are achieved FLOP/s over the GPU type's dense bf16 peak. Attention FLOPs are
2*H*D*L*(L+1) forward (causal) and 2.5x that backward (`flops.py`), so a backward
efficiency equal to the forward one means 2.5x the forward seconds.

Which H100 file is which (data/README.md): `h100_flash_attention_forward.csv` is forward
only: its profiler (distca `attn-prof.py`) times one `flash_attn_varlen_func` call, and it
reaches 340 TFLOP/s at 32K tokens, what FlashAttention-2 forward reaches on H100.
`h100_attention_latency.csv` has no profiler script; read as forward it would put a fused
kernel at 117 TFLOP/s (12% of peak), below any flash kernel, while read as forward plus
backward it is 410 TFLOP/s over 3.5x the forward FLOPs, and it is 2.7-2.9x the forward
file from 4K tokens up, the ratio a forward plus a 2.5x-FLOP backward at similar
efficiency gives. We read it as forward+backward. A measurement on an H200 (same SMs and
clocks as H100; `bench/gpu_kernels.py`, `bench/results/gpu_kernels.json`), forward and
backward timed separately, settles the split: the Hopper curves below are that run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ballonet.calibration.profile import Curve, Profile

_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# Hopper (H100/H800/H200: 132 SMs at the same clocks), causal varlen flash attention,
# GQA 64/4 x 128, packs of max(1, 64K // L) documents of L tokens (how short documents
# run in a batch), forward and backward timed separately on one H200
# (bench/results/gpu_kernels.json).
HOPPER_FORWARD = Curve(tokens=_LENGTHS, efficiency=(
    0.030, 0.073, 0.096, 0.142, 0.229, 0.297, 0.321, 0.333, 0.339, 0.344, 0.346, 0.335))
HOPPER_BACKWARD = Curve(tokens=_LENGTHS, efficiency=(
    0.023, 0.053, 0.097, 0.151, 0.206, 0.253, 0.285, 0.303, 0.317, 0.322, 0.325, 0.326))
"""Mean of the GQA 64/4 and MHA 32/32 shapes (within 8% of each other from 256 tokens)."""
# GEMMs: llama-7b's QKV, output and MLP GEMMs on the same H200, FLOP-weighted over the
# four (bench/results/gpu_kernels.json "gemm"), by tokens per call; below 128 tokens a
# GEMM is weight-load-bound: efficiency taken proportional to tokens (assumption).
# Megatron's H100 timings (h100_megatron_layer_ops.tsv) agree: 0.77 of peak at 32K tokens.
HOPPER_LINEAR = Curve(tokens=(16, 128, 512, 2048, 8192, 32768),
                      efficiency=(0.034, 0.274, 0.541, 0.707, 0.720, 0.692))

# NCCL on NVLink, h100_nccl_perf.csv at 64 MB and above (8 GPUs): bus bandwidth over the
# link's one-direction bandwidth, and a per-collective latency.
_NVLINK: dict[str, Any] = dict(p2p_latency_s=40e-6, p2p_efficiency=0.80, collective_latency_s=40e-6,
               collective_efficiency={"all_gather": 0.78, "reduce_scatter": 0.685, "all_reduce": 0.94,
                                      "all_to_all": 0.80})
_NIC: dict[str, Any] = dict(nic_latency_s=10e-6, nic_efficiency=0.90)
_COMM_ASSUMPTIONS = (
    "RDMA NICs reach 90% of line rate with 10 us a hop (typical RoCE/InfiniBand figures, not measured here)",
    "all_to_all bus efficiency taken equal to p2p (not in h100_nccl_perf.csv)",
    "compute slows by 0.1 s per second of concurrent communication (NCCL kernels share SMs and "
    "memory bandwidth; a round figure, not measured: `ballonet calibrate` under torchrun measures it)",
)

# Elementwise work (norms, rotary, SwiGLU's product, residual adds, the loss's softmax) is
# bound by memory bandwidth: bytes (`flops.elementwise_bytes_per_token`) over the
# datasheet HBM bandwidth (MEMORY_BW) times a fraction. No measurement of ours on a GPU
# yet: we take 0.70 of nominal for calls of 8K tokens and more (what streaming kernels
# typically reach on HBM), falling to launch-bound calls below 1K tokens (assumption;
# `ballonet calibrate` on a GPU measures it).
GPU_ELEMENTWISE = Curve(tokens=(16, 128, 1024, 8192), efficiency=(0.02, 0.15, 0.55, 0.70))
MEMORY_BW = {"h100": 3.35e12, "h800": 3.35e12, "h200": 4.8e12, "h20": 4.0e12, "a100": 2.039e12,
             "a800": 2.039e12, "l20": 864e9, "l40s": 864e9, "a10": 600e9}
"""Nominal memory bandwidth (bytes/s) from NVIDIA's datasheets (SXM parts; A100/A800 80GB)."""
# AdamW with fp32 master weights and states: per parameter it reads the parameter, its
# gradient and two moments and writes three of them back (28 bytes); a fused multi-tensor
# kernel at the elementwise curve's 0.70 of HBM (assumption).
ADAM_BYTES_PER_PARAM = 28
_STEP_ASSUMPTIONS = (
    "elementwise work reaches 0.70 of nominal HBM bandwidth from 8K tokens a call, less below "
    "(streaming kernels, not measured here)",
    "the framework's per-layer host work (FSDP2 hooks) overlaps the GPU's kernels: 0 s",
    "the optimizer step is AdamW at 28 bytes a parameter and 0.70 of nominal HBM bandwidth",
)


def _gpu_step_terms(gpu: str) -> dict[str, Any]:
    bw = MEMORY_BW[gpu]
    return dict(elementwise=GPU_ELEMENTWISE, memory_bw=bw, framework_s_per_layer=0.0,
                optimizer_s_per_param=ADAM_BYTES_PER_PARAM / (0.70 * bw))


HOPPER = Profile(
    gpu="h100", source="H200 run of bench/gpu_kernels.py (attention forward/backward); "
    "distca H100 files in data/calibration (GEMM, NCCL)",
    attention_forward=HOPPER_FORWARD, attention_backward=HOPPER_BACKWARD, attention_launch_s=11e-6,
    linear=HOPPER_LINEAR, overlap_slowdown=0.1, assumptions=_COMM_ASSUMPTIONS + _STEP_ASSUMPTIONS,
    **_gpu_step_terms("h100"), **_NVLINK, **_NIC)


def _scaled(base: Curve, factor: float) -> Curve:
    return Curve(tokens=base.tokens, efficiency=tuple(min(1.0, e * factor) for e in base.efficiency))


# Ampere (A100/A800): FlashAttention-2 (Dao 2023, section 4.1) reaches up to 73% of A100
# peak forward and 63% backward on long sequences, head dim 128. We take 0.70 / 0.60 for
# causal long documents and give shorter ones the Hopper curve's shape (assumption).
_AMPERE_FWD, _AMPERE_BWD = 0.70, 0.60
AMPERE = dataclasses.replace(
    HOPPER, gpu="a100", source="FlashAttention-2 paper (arXiv 2307.08691, sec. 4.1) A100 figures, "
    "on the Hopper curve's shape; GEMM and NCCL as Hopper",
    attention_forward=_scaled(HOPPER_FORWARD, _AMPERE_FWD / max(HOPPER_FORWARD.efficiency)),
    attention_backward=_scaled(HOPPER_BACKWARD, _AMPERE_BWD / max(HOPPER_BACKWARD.efficiency)),
    assumptions=_COMM_ASSUMPTIONS + _STEP_ASSUMPTIONS + (
        "attention efficiency against length has the Hopper curve's shape, scaled to 0.70 forward / 0.60 "
        "backward at long lengths (FA2's A100 maxima, slightly lowered for causal)",
        "GEMMs reach the same fraction of peak as on Hopper"), **_gpu_step_terms("a100"))

# Inference GPUs. H20: a Hopper die with few SMs enabled (148 TFLOP/s against 4 TB/s),
# so kernels are more compute-bound than on H100: the Hopper fractions are a floor.
# L40S/L20 (Ada) and A10 (Ampere GA102) run FlashAttention-2's sm80 kernels: Ampere
# fractions. PCIe-only nodes: p2p over PCIe reaches 80% of nominal like NVLink does.
_INFERENCE_ASSUMPTION = "no measurement of this GPU: fractions of peak taken from {} (same kernel family)"
_PCIE_ASSUMPTION = "PCIe p2p and collectives reach the NVLink fractions of their own nominal bandwidth"


def _like(base: Profile, gpu: str, family: str, pcie: bool = False) -> Profile:
    notes = base.assumptions + (_INFERENCE_ASSUMPTION.format(family),) + ((_PCIE_ASSUMPTION,) if pcie else ())
    return dataclasses.replace(base, gpu=gpu, source=f"{family} profile ({base.source})", assumptions=notes,
                               **_gpu_step_terms(gpu))


# An emulated "GPU" for CPU runs (gloo ranks, one thread each): measured on the development
# VM (2 vCPUs, torch 2.13 CPU) by `ballonet calibrate` on 2 ranks, lengths up to 2048,
# CPU time per thread, the tiny model's head shape (bench/results/cpu_profile.json: the
# profile of the 2026-12-01 04:00 bench/fidelity.py run). Fractions of the nominal
# 1 TFLOP/s "peak" of hardware.GPUS["cpu"]; another machine: calibrate it. The link
# figures are an earlier calibration's of the same VM (the file holds that run's own).
_CPU_LENGTHS = (64, 128, 256, 512, 1024, 2048)
_CPU_TOKENS = (64, 256, 1024, 4096, 16384)
CPU = dataclasses.replace(
    HOPPER, gpu="cpu", source="ballonet calibrate on the development VM (bench/results/cpu_profile.json)",
    attention_forward=Curve(tokens=_CPU_LENGTHS, efficiency=(0.002822, 0.004827, 0.007536, 0.008613, 0.01635, 0.02169)),
    attention_backward=Curve(tokens=_CPU_LENGTHS, efficiency=(0.002682, 0.005291, 0.008141, 0.01086, 0.01581, 0.02047)),
    attention_launch_s=0.000189,
    linear=Curve(tokens=_CPU_TOKENS, efficiency=(0.01135, 0.02708, 0.03877, 0.03731, 0.03746)),
    elementwise=Curve(tokens=_CPU_TOKENS, efficiency=(0.04827, 0.1773, 0.3618, 0.449, 0.3096)), memory_bw=10e9,
    framework_s_per_layer=0.00816, optimizer_s_per_param=2.42e-07,
    p2p_latency_s=1.2e-3, p2p_efficiency=0.142, nic_latency_s=1.2e-3, nic_efficiency=1.0, collective_latency_s=2.2e-3,
    collective_efficiency={"all_gather": 0.05, "reduce_scatter": 0.05, "all_reduce": 0.05, "all_to_all": 0.034},
    overlap_slowdown=0.0,
    assumptions=("a CPU's speed depends on the machine and its load: calibrate it",
                 "memory bandwidth 10 GB/s nominal (a round figure the elementwise curve is a fraction of)",
                 "all ranks on one host: the NIC figures are the measured point-to-point ones",
                 "all_gather and reduce_scatter taken as all_reduce (not measured)",
                 "overlap slowdown not measured (0)"))

PROFILES: dict[str, Profile] = {
    "h100": HOPPER,
    "h800": dataclasses.replace(HOPPER, gpu="h800", source=f"Hopper ({HOPPER.source}); H800 = H100 compute",
                                **_gpu_step_terms("h800")),
    "h200": dataclasses.replace(HOPPER, gpu="h200", source=f"Hopper, measured on this GPU ({HOPPER.source})",
                                **_gpu_step_terms("h200")),
    "h20": _like(HOPPER, "h20", "Hopper"),
    "a100": AMPERE,
    "a800": dataclasses.replace(AMPERE, gpu="a800", source=f"Ampere ({AMPERE.source}); A800 = A100 compute",
                                **_gpu_step_terms("a800")),
    "l20": _like(AMPERE, "l20", "Ampere", pcie=True),
    "l40s": _like(AMPERE, "l40s", "Ampere", pcie=True),
    "a10": _like(AMPERE, "a10", "Ampere", pcie=True),
    "cpu": CPU,
}
