"""The kernel seam: variable-length attention over packed sequences, returning the LSE.

Shapes: T packed rows, H query heads, H_kv key/value heads (H % H_kv == 0, GQA or MHA),
D head size. A `Packing` cuts the query rows and the key rows into the same number of
sequences (flash-attn's `cu_seqlens` convention); sequence i of the queries attends to
sequence i of the keys only. `causal` is only for square sequences (each query sequence
as long as its key sequence, positions aligned), which is all the engine asks for; then
top-left (torch SDPA) and bottom-right (flash-attn) alignment agree.

`lse_TH` is fp32: the natural log of each query row's softmax normaliser. The backward
takes the *final* `out` and `lse` of a row, which may come from merging several calls;
then P = exp(S - lse) is the true attention matrix and the gradients of one call are
exactly its share (the rule ring attention relies on).

Backends, one signature each, picked once per call by `select`:
  cpu         a loop over sequences calling aten's CPU flash-attention kernels
  cuda        aten's flash-attention varlen kernels (bf16/fp16; fp32 falls back to reference)
  flash_attn  the flash-attn package's FlashAttention-2 varlen kernels (`pip install
              'ballonet[gpu]'`; bf16/fp16, head size a multiple of 8)
  fa4         FlashAttention-4, `flash_attn.cute` (CuTe DSL; Hopper and Blackwell)
  reference   plain PyTorch math in fp32, any device; the independent check in tests
On a GPU `select` takes the first installed of fa4 (compute capability 9.0 or more),
flash_attn and cuda, and says once which it fell back from. `kernel_contract.check`
holds a backend to these shapes and this LSE against the reference.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

ENV_VAR = "BALLONET_ATTENTION_KERNEL"


@dataclass(frozen=True)
class Packing:
    """How the rows of one varlen call pack into sequences."""

    offsets_q: tuple[int, ...]
    """[N + 1] query row offsets of the N sequences, from 0 to T_q."""
    offsets_k: tuple[int, ...]
    """[N + 1] key row offsets, from 0 to T_k."""
    causal: bool
    cu_seqlens_q: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """offsets_q as an int32 tensor, made once per step with the step's metadata and
    moved to the device with it (`with_cu_seqlens`); None: made at each call."""
    cu_seqlens_k: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if len(self.offsets_q) != len(self.offsets_k) or self.offsets_q[0] != 0 or self.offsets_k[0] != 0:
            raise ValueError(f"bad packing offsets {self.offsets_q} / {self.offsets_k}")
        if self.causal and self.offsets_q != self.offsets_k:
            raise ValueError("a causal packing needs square sequences (equal query and key offsets)")

    @staticmethod
    def of(lengths_q, lengths_k=None, causal: bool = True) -> Packing:
        return Packing(offsets_q=_cumsum(lengths_q), offsets_k=_cumsum(lengths_q if lengths_k is None else lengths_k),
                       causal=causal)

    def with_cu_seqlens(self) -> Packing:
        """This packing with its offsets as int32 CPU tensors (`cu_seqlens_q`, `_k`)."""
        return Packing(offsets_q=self.offsets_q, offsets_k=self.offsets_k, causal=self.causal,
                       cu_seqlens_q=torch.tensor(self.offsets_q, dtype=torch.int32),
                       cu_seqlens_k=torch.tensor(self.offsets_k, dtype=torch.int32))

    def device_offsets(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens_q, cu_seqlens_k) on `device`: the precomputed ones when they are
        there, else made now (a host-to-device copy each)."""
        q, k = self.cu_seqlens_q, self.cu_seqlens_k
        if q is not None and k is not None and q.device == torch.device(device):
            return q, k
        return _cu(self.offsets_q, device), _cu(self.offsets_k, device)

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in zip(self.offsets_q, self.offsets_q[1:])), default=0)

    @property
    def max_k(self) -> int:
        return max((b - a for a, b in zip(self.offsets_k, self.offsets_k[1:])), default=0)

    def sequences(self):
        """(q_start, q_end, k_start, k_end) of each non-empty sequence."""
        for qa, qb, ka, kb in zip(self.offsets_q, self.offsets_q[1:], self.offsets_k, self.offsets_k[1:]):
            if qb > qa and kb > ka:
                yield qa, qb, ka, kb


def _cumsum(lengths) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return tuple(out)


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Callable
    """(q_THD, k_THD, v_THD, packing, scale) -> (out_THD, lse_TH fp32)"""
    backward: Callable
    """(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing, scale) -> (dq, dk, dv),
    in the inputs' dtype or in fp32 (unrounded partial sums, which the engine prefers)"""


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---- cpu: aten's flash-attention kernels, one sequence at a time -----------------------


def _bhtd(x_THD: torch.Tensor) -> torch.Tensor:
    return x_THD.transpose(0, 1).unsqueeze(0)


def _cpu_forward(q_THD, k_THD, v_THD, packing: Packing, scale: float):
    out_THD = q_THD.new_zeros(q_THD.shape)
    lse_TH = q_THD.new_full(q_THD.shape[:2], float("-inf"), dtype=torch.float32)
    for qa, qb, ka, kb in packing.sequences():
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhtd(q_THD[qa:qb]), _bhtd(k_THD[ka:kb]), _bhtd(v_THD[ka:kb]), 0.0, packing.causal, scale=scale)
        out_THD[qa:qb] = out[0].transpose(0, 1)
        lse_TH[qa:qb] = lse[0].transpose(0, 1)
    return out_THD, lse_TH


def _cpu_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing: Packing, scale: float):
    # In fp32 whatever the inputs: as fast as bf16 on CPU (bench/results/attention.md), and
    # ring steps then add unrounded partial gradients.
    dout_THD, q_THD, k_THD, v_THD, out_THD = (x.float() for x in (dout_THD, q_THD, k_THD, v_THD, out_THD))
    dq, dk, dv = torch.zeros_like(q_THD), torch.zeros_like(k_THD), torch.zeros_like(v_THD)
    for qa, qb, ka, kb in packing.sequences():
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhtd(dout_THD[qa:qb]).contiguous(), _bhtd(q_THD[qa:qb]), _bhtd(k_THD[ka:kb]), _bhtd(v_THD[ka:kb]),
            _bhtd(out_THD[qa:qb]).contiguous(), lse_TH[qa:qb].t().unsqueeze(0).contiguous(),
            0.0, packing.causal, scale=scale)
        dq[qa:qb] = grads[0][0].transpose(0, 1)
        dk[ka:kb] += grads[1][0].transpose(0, 1)
        dv[ka:kb] += grads[2][0].transpose(0, 1)
    return dq, dk, dv


# ---- reference: plain fp32 math --------------------------------------------------------


def _probs(q_HQD, k_HKD, lse_HQ, causal: bool, scale: float):
    """Scores S [H, Q, K] and, when `lse_HQ` is given, P = exp(S - lse)."""
    s_HQK = scale * q_HQD @ k_HKD.transpose(1, 2)
    if causal:
        mask = torch.ones(s_HQK.shape[1:], dtype=torch.bool, device=s_HQK.device).tril()
        s_HQK = s_HQK.masked_fill(~mask, float("-inf"))
    return s_HQK if lse_HQ is None else torch.exp(s_HQK - lse_HQ.unsqueeze(-1))


def _heads(x_THD: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, H_kv, D] -> [H, T, D] in fp32, each K/V head repeated for its query heads."""
    return x_THD.float().transpose(0, 1).repeat_interleave(num_heads // x_THD.shape[1], dim=0)


def _ref_forward(q_THD, k_THD, v_THD, packing: Packing, scale: float):
    H = q_THD.shape[1]
    out_THD = torch.zeros(q_THD.shape, dtype=torch.float32, device=q_THD.device)
    lse_TH = torch.full(q_THD.shape[:2], float("-inf"), dtype=torch.float32, device=q_THD.device)
    for qa, qb, ka, kb in packing.sequences():
        s_HQK = _probs(q_THD[qa:qb].float().transpose(0, 1), _heads(k_THD[ka:kb], H), None, packing.causal, scale)
        lse_HQ = torch.logsumexp(s_HQK, dim=-1)
        out_THD[qa:qb] = (torch.exp(s_HQK - lse_HQ.unsqueeze(-1)) @ _heads(v_THD[ka:kb], H)).transpose(0, 1)
        lse_TH[qa:qb] = lse_HQ.t()
    return out_THD.to(q_THD.dtype), lse_TH


def _ref_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing: Packing, scale: float):
    H, H_kv = q_THD.shape[1], k_THD.shape[1]
    dq = torch.zeros(q_THD.shape, dtype=torch.float32, device=q_THD.device)
    dk = torch.zeros(k_THD.shape, dtype=torch.float32, device=q_THD.device)
    dv = torch.zeros_like(dk)
    for qa, qb, ka, kb in packing.sequences():
        q_HQD, k_HKD, v_HKD = q_THD[qa:qb].float().transpose(0, 1), _heads(k_THD[ka:kb], H), _heads(v_THD[ka:kb], H)
        do_HQD = dout_THD[qa:qb].float().transpose(0, 1)
        p_HQK = _probs(q_HQD, k_HKD, lse_TH[qa:qb].t(), packing.causal, scale)
        delta_HQ = (do_HQD * out_THD[qa:qb].float().transpose(0, 1)).sum(-1)
        ds_HQK = p_HQK * (do_HQD @ v_HKD.transpose(1, 2) - delta_HQ.unsqueeze(-1))
        dq[qa:qb] = (scale * ds_HQK @ k_HKD).transpose(0, 1)
        # Sum the gradients of the query heads that share a K/V head.
        dk[ka:kb] += (scale * ds_HQK.transpose(1, 2) @ q_HQD).unflatten(0, (H_kv, -1)).sum(1).transpose(0, 1)
        dv[ka:kb] += (p_HQK.transpose(1, 2) @ do_HQD).unflatten(0, (H_kv, -1)).sum(1).transpose(0, 1)
    return dq, dk, dv


# ---- cuda: aten's flash-attention varlen kernels (checked only where a GPU is lent) ----


def _cu(offsets, device) -> torch.Tensor:
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _cuda_forward(q_THD, k_THD, v_THD, packing: Packing, scale: float):
    if q_THD.dtype == torch.float32:  # flash attention has no fp32 kernel
        return _ref_forward(q_THD, k_THD, v_THD, packing, scale)
    out_THD, lse_HT, *_ = torch.ops.aten._flash_attention_forward(
        q_THD, k_THD, v_THD, *packing.device_offsets(q_THD.device), packing.max_q, packing.max_k, 0.0,
        packing.causal, False, scale=scale)
    return out_THD, lse_HT.t()


def _cuda_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing: Packing, scale: float):
    if q_THD.dtype == torch.float32:
        return _ref_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing, scale)
    device = q_THD.device
    rng_state = torch.zeros(2, dtype=torch.uint64, device=device)  # unused: no dropout
    return torch.ops.aten._flash_attention_backward(
        dout_THD.contiguous(), q_THD, k_THD, v_THD, out_THD.contiguous(), lse_TH.t().contiguous(),
        *packing.device_offsets(device), packing.max_q, packing.max_k,
        0.0, packing.causal, rng_state, torch.empty(0, device=device), scale=scale)


# ---- flash_attn and fa4: the flash-attn packages, when installed -----------------------
# Both keep the LSE as [H, T] and write +inf for a row without keys (so that exp(S - lse)
# is 0 in their backward); the seam's LSE is [T, H] and -inf there (`merge` adds it as 0).


def _lse_from_flash(lse_HT: torch.Tensor) -> torch.Tensor:
    return lse_HT.t().float().masked_fill(lse_HT.t() == float("inf"), float("-inf"))


def _lse_to_flash(lse_TH: torch.Tensor) -> torch.Tensor:
    return lse_TH.t().masked_fill(lse_TH.t() == float("-inf"), float("inf")).contiguous()


def _fa2_forward(q_THD, k_THD, v_THD, packing: Packing, scale: float):
    if q_THD.dtype == torch.float32:
        return _ref_forward(q_THD, k_THD, v_THD, packing, scale)
    from flash_attn import flash_attn_varlen_func

    out_THD, lse_HT, _ = flash_attn_varlen_func(
        q_THD, k_THD, v_THD, *packing.device_offsets(q_THD.device), packing.max_q, packing.max_k,
        dropout_p=0.0, softmax_scale=scale, causal=packing.causal, return_attn_probs=True)
    return out_THD, _lse_from_flash(lse_HT)


def _fa2_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing: Packing, scale: float):
    if q_THD.dtype == torch.float32:
        return _ref_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing, scale)
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    dq, dk, dv = torch.empty_like(q_THD), torch.empty_like(k_THD), torch.empty_like(v_THD)
    _flash_attn_varlen_backward(
        dout_THD.contiguous(), q_THD, k_THD, v_THD, out_THD.contiguous(), _lse_to_flash(lse_TH), dq, dk, dv,
        *packing.device_offsets(q_THD.device), packing.max_q, packing.max_k, 0.0, scale, packing.causal,
        -1, -1, 0.0, None, False, None)
    return dq, dk, dv


def _fa4_forward(q_THD, k_THD, v_THD, packing: Packing, scale: float):
    if q_THD.dtype == torch.float32:
        return _ref_forward(q_THD, k_THD, v_THD, packing, scale)
    from flash_attn.cute.interface import _flash_attn_fwd

    cu_q, cu_k = packing.device_offsets(q_THD.device)
    out_THD, lse_HT, *_ = _flash_attn_fwd(
        q_THD, k_THD, v_THD, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=packing.max_q,
        max_seqlen_k=packing.max_k, softmax_scale=scale, causal=packing.causal, return_lse=True)
    return out_THD, _lse_from_flash(lse_HT)


def _fa4_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing: Packing, scale: float):
    if q_THD.dtype == torch.float32:
        return _ref_backward(dout_THD, q_THD, k_THD, v_THD, out_THD, lse_TH, packing, scale)
    from flash_attn.cute.interface import _flash_attn_bwd

    cu_q, cu_k = packing.device_offsets(q_THD.device)
    dq, dk, dv = _flash_attn_bwd(
        q_THD, k_THD, v_THD, out_THD.contiguous(), dout_THD.contiguous(), _lse_to_flash(lse_TH),
        softmax_scale=scale, causal=packing.causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=packing.max_q, max_seqlen_k=packing.max_k)[:3]
    return dq, dk, dv


KERNELS = {
    "cpu": Kernel(name="cpu", forward=_cpu_forward, backward=_cpu_backward),
    "cuda": Kernel(name="cuda", forward=_cuda_forward, backward=_cuda_backward),
    "flash_attn": Kernel(name="flash_attn", forward=_fa2_forward, backward=_fa2_backward),
    "fa4": Kernel(name="fa4", forward=_fa4_forward, backward=_fa4_backward),
    "reference": Kernel(name="reference", forward=_ref_forward, backward=_ref_backward),
}
PACKAGES = {"flash_attn": ("flash_attn.flash_attn_interface", "flash-attn"), "fa4": ("flash_attn.cute", "flash-attn-4")}
"""The module a package backend imports, and the package that installs it."""


def installed(name: str) -> bool:
    """Whether backend `name` can run here: always for aten's and the reference, for
    flash_attn and fa4 when their module imports (its CUDA library found)."""
    if name not in PACKAGES:
        return name in KERNELS
    try:
        importlib.import_module(PACKAGES[name][0])
    except (ImportError, OSError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def _gpu_default(capability: tuple[int, int]) -> str:
    """The first installed of fa4 (capability 9.0 or more), flash_attn and cuda; a fallback
    is said once per process and GPU kind (the cache)."""
    wanted = (["fa4"] if capability >= (9, 0) else []) + ["flash_attn", "cuda"]
    name = next(n for n in wanted if installed(n))
    if name != wanted[0]:
        missing = " and ".join(PACKAGES[n][1] for n in wanted[:wanted.index(name)])
        logging.getLogger(__name__).warning(
            "attention kernel: %s not installed, using %r; pip install 'ballonet[gpu]' for the faster kernels",
            missing, name)
    return name


def select(name: str | None = None, device: torch.device | None = None) -> Kernel:
    """The kernel named `name`, else the one named by $BALLONET_ATTENTION_KERNEL, else the
    default for `device` (on a GPU the fastest installed, see the module docstring; "cpu"
    otherwise). A named package backend that is not installed is a ValueError."""
    if not name:
        name = os.environ.get(ENV_VAR)
    if not name:
        on_gpu = device is not None and device.type == "cuda"
        name = _gpu_default(torch.cuda.get_device_capability(device)) if on_gpu else "cpu"
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    if not installed(name):
        raise ValueError(f"attention kernel {name!r} needs the {PACKAGES[name][1]} package "
                         "(pip install 'ballonet[gpu]')")
    return KERNELS[name]
