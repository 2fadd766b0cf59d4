"""The kernel seam against dense float64 attention computed here, forward and backward."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from ballonet.runtime import kernel_contract, kernels
from ballonet.runtime.engine import merge
from ballonet.runtime.kernels import Packing

D = 8
GPU_BACKENDS = [n for n in ("cuda", "flash_attn", "fa4") if torch.cuda.is_available() and kernels.installed(n)]
BACKENDS = ["cpu", "reference"] + GPU_BACKENDS


def dense(q, k, v, packing: Packing, scale: float):
    """out [T_q, H, D] and lse [T_q, H] by masked dense softmax over the whole packed
    batch, in float64: a query row sees the keys of its own sequence only."""
    H = q.shape[1]
    seq_q = torch.repeat_interleave(torch.arange(len(packing.offsets_q) - 1), torch.diff(torch.tensor(packing.offsets_q)))
    seq_k = torch.repeat_interleave(torch.arange(len(packing.offsets_k) - 1), torch.diff(torch.tensor(packing.offsets_k)))
    pos_q = torch.arange(q.shape[0]) - torch.tensor(packing.offsets_q)[seq_q]
    pos_k = torch.arange(k.shape[0]) - torch.tensor(packing.offsets_k)[seq_k]
    mask = seq_q[:, None] == seq_k[None, :]
    if packing.causal:
        mask &= pos_k[None, :] <= pos_q[:, None]
    k, v = (x.double().repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    has_key = mask.any(dim=1)  # rows of empty sequences: finite scores, then zeroed
    s = s.masked_fill(~mask & has_key[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v) * has_key[:, None, None]
    return out, lse.t()


def _inputs(num_q, num_k, heads, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, D, generator=gen).to(dtype) for n, h in
            ((num_q, heads[0]), (num_k, heads[1]), (num_k, heads[1]), (num_q, heads[0]))]


CASES = {
    "causal docs with 1-token ones": Packing.of([5, 1, 9, 1, 3]),
    "blocks against longer keys": Packing.of([4, 2, 3], [7, 5, 1], causal=False),
    "an empty sequence": Packing.of([3, 0, 4], [2, 3, 0], causal=False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_dense(backend, heads, case):
    packing = CASES[case]
    kernel, scale = kernels.select(backend), kernels.default_scale(D)
    device = "cuda" if backend in GPU_BACKENDS else "cpu"
    dtype = torch.bfloat16 if backend in GPU_BACKENDS else torch.float32
    q, k, v, dout = _inputs(packing.offsets_q[-1], packing.offsets_k[-1], heads, dtype)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want_out, want_lse = dense(*leaves, packing, scale)
    rows = [i for a, b, ka, kb in packing.sequences() for i in range(a, b)]  # rows with keys
    want_out[rows].backward(dout.double()[rows])
    out, lse = kernel.forward(*(x.to(device) for x in (q, k, v)), packing, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (out.cpu().double()[rows] - want_out[rows]).abs().max() <= tol
    assert (lse.cpu().double()[rows] - want_lse[rows]).abs().max() <= tol
    dout = torch.zeros_like(dout).index_copy_(0, torch.tensor(rows), dout[rows])
    grads = kernel.backward(*(x.to(device) for x in (dout, q, k, v, out)), lse, packing, scale)
    for got, leaf in zip(grads, leaves):
        assert (got.cpu().double() - leaf.grad).abs().max() <= tol * 5


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_key_blocks_merge_and_split_gradients_exactly(backend):
    # Queries against keys [0, 6) at once, and against [0, 2) and [2, 6) separately.
    kernel, scale = kernels.select(backend), kernels.default_scale(D)
    q, k, v, dout = _inputs(4, 6, (4, 2), torch.float32, seed=1)
    whole = Packing.of([4], [6], causal=False)
    out, lse = kernel.forward(q, k, v, whole, scale)
    grads = kernel.backward(dout, q, k, v, out, lse, whole, scale)
    out_acc, lse_acc = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    parts = []
    for a, b in ((0, 2), (2, 6)):
        block = Packing.of([4], [b - a], causal=False)
        merge(out_acc, lse_acc, torch.arange(4), *kernel.forward(q, k[a:b], v[a:b], block, scale))
        parts.append(kernel.backward(dout, q, k[a:b], v[a:b], out, lse, block, scale))  # final out, lse
    assert torch.allclose(out_acc, out, atol=1e-6) and torch.allclose(lse_acc, lse, atol=1e-6)
    assert torch.allclose(parts[0][0] + parts[1][0], grads[0], atol=1e-6)
    for i in (1, 2):
        assert torch.allclose(torch.cat([parts[0][i], parts[1][i]]), grads[i], atol=1e-6)


def test_select(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "installed", lambda name: name not in kernels.PACKAGES)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kernels._gpu_default.cache_clear()
    assert kernels.select().name == "cpu"
    assert kernels.select(device=torch.device("cuda")).name == "cuda"
    assert kernels.select("reference", torch.device("cpu")).name == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels.select(device=torch.device("cpu")).name == "reference"
    assert kernels.select("cpu").name == "cpu"
    with pytest.raises(ValueError, match="unknown attention kernel"):
        kernels.select("flash3")
    with pytest.raises(ValueError, match=r"attention kernel 'fa4' needs the flash-attn-4 package"):
        kernels.select("fa4")
    kernels._gpu_default.cache_clear()


@pytest.mark.parametrize("capability, packages, picked, said", [
    ((9, 0), {"flash_attn", "fa4"}, "fa4", None),
    ((10, 0), {"fa4"}, "fa4", None),
    ((8, 0), {"flash_attn", "fa4"}, "flash_attn", None),  # fa4 is for Hopper and Blackwell
    ((9, 0), {"flash_attn"}, "flash_attn", "flash-attn-4 not installed, using 'flash_attn'"),
    ((9, 0), set(), "cuda", "flash-attn-4 and flash-attn not installed, using 'cuda'"),
    ((8, 6), set(), "cuda", "flash-attn not installed, using 'cuda'"),
])
def test_a_gpu_gets_the_fastest_installed_backend_and_a_fallback_is_said_once(
        monkeypatch, caplog, capability, packages, picked, said):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "installed", lambda name: name not in kernels.PACKAGES or name in packages)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    kernels._gpu_default.cache_clear()
    with caplog.at_level("WARNING", logger=kernels.__name__):
        names = {kernels.select(device=torch.device("cuda")).name for _ in range(3)}
    kernels._gpu_default.cache_clear()
    assert names == {picked}
    warnings = [r.getMessage() for r in caplog.records if r.name == kernels.__name__]
    assert warnings == ([] if said is None else [warnings[0]]) and (said is None or said in warnings[0]), warnings


def test_a_package_backend_is_installed_when_its_module_imports(monkeypatch):
    for module in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    assert not kernels.installed("flash_attn") and not kernels.installed("fa4")
    assert kernels.installed("cuda") and kernels.installed("reference")
    fake = _fake_flash_modules()
    for module, obj in fake.items():
        monkeypatch.setitem(sys.modules, module, obj)
    assert kernels.installed("flash_attn") and kernels.installed("fa4")


# ---- the contract a backend meets, and the flash-attn adapters against fakes ------------


def _flash_forward(q, k, v, cu_q, cu_k, causal, scale):
    """What flash-attn's varlen forward returns (its documented conventions, computed by
    the reference here): out, and the LSE as [H, T] with +inf on a row without keys."""
    packing = Packing(offsets_q=tuple(cu_q.tolist()), offsets_k=tuple(cu_k.tolist()), causal=causal)
    out, lse = kernels.KERNELS["reference"].forward(q, k, v, packing, scale)
    return out, lse.masked_fill(lse == float("-inf"), float("inf")).t().contiguous()


def _flash_backward(dout, q, k, v, out, lse_HT, cu_q, cu_k, causal, scale):
    assert lse_HT.shape == q.shape[1::-1] and not bool((lse_HT == float("-inf")).any()), "FA's LSE: [H, T], +inf"
    packing = Packing(offsets_q=tuple(cu_q.tolist()), offsets_k=tuple(cu_k.tolist()), causal=causal)
    lse = lse_HT.t().masked_fill(lse_HT.t() == float("inf"), float("-inf"))
    return [g.to(q.dtype) for g in kernels.KERNELS["reference"].backward(dout, q, k, v, out, lse, packing, scale)]


def _fake_flash_modules() -> dict[str, types.ModuleType]:
    """Stand-ins for flash-attn 2.8 (`flash_attn_varlen_func(..., return_attn_probs=True)`
    and `flash_attn_interface._flash_attn_varlen_backward`, writing dq/dk/dv in place) and
    flash-attn-4 (`flash_attn.cute.interface._flash_attn_fwd/_bwd`), with their signatures."""
    fa, fa2, cute, fa4 = (types.ModuleType(n) for n in ("flash_attn", "flash_attn.flash_attn_interface",
                                                         "flash_attn.cute", "flash_attn.cute.interface"))

    def varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                    return_attn_probs=False):
        assert dropout_p == 0.0 and return_attn_probs and max_q == int((cu_q[1:] - cu_q[:-1]).max())
        out, lse = _flash_forward(q, k, v, cu_q, cu_k, causal, softmax_scale)
        return out, lse, None

    def varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal,
                        window_left, window_right, softcap, alibi_slopes, deterministic, rng_state=None):
        assert (dropout_p, window_left, window_right, softcap, alibi_slopes) == (0.0, -1, -1, 0.0, None)
        for got, want in zip((dq, dk, dv), _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)):
            got.copy_(want)
        return torch.empty(0)

    def fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, return_lse):
        out, lse = _flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        return out, lse, None, None, None

    def bwd(q, k, v, out, dout, lse, *, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k):
        return tuple(_flash_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale))

    fa.flash_attn_varlen_func, fa2._flash_attn_varlen_backward = varlen_func, varlen_backward
    fa4._flash_attn_fwd, fa4._flash_attn_bwd = fwd, bwd
    fa.flash_attn_interface, fa.cute, cute.interface = fa2, cute, fa4
    return {"flash_attn": fa, "flash_attn.flash_attn_interface": fa2, "flash_attn.cute": cute,
            "flash_attn.cute.interface": fa4}


@pytest.mark.parametrize("backend", ["cpu", "reference"] + GPU_BACKENDS)
def test_the_backends_installed_meet_the_contract(backend):
    on_gpu = backend in GPU_BACKENDS
    assert kernel_contract.check(kernels.select(backend), "cuda" if on_gpu else "cpu",
                                 torch.bfloat16 if on_gpu else torch.float32) == []


@pytest.mark.parametrize("backend", ["flash_attn", "fa4"])
def test_the_flash_attn_adapters_meet_the_contract_on_fakes_of_the_packages(monkeypatch, backend):
    """The adapters' glue (the LSE's layout and its +inf, argument order, GQA gradients)
    against stand-ins with flash-attn's conventions; the kernels themselves run only on a
    GPU (scripts/gpu_check.sh)."""
    for module, obj in _fake_flash_modules().items():
        monkeypatch.setitem(sys.modules, module, obj)
    assert kernel_contract.check(kernels.select(backend), dtype=torch.bfloat16) == []


def _fake(name, forward=None, backward=None):
    ref = kernels.KERNELS["reference"]
    return kernels.Kernel(name=name, forward=forward or ref.forward, backward=backward or ref.backward)


def test_backends_that_break_the_contract_are_caught():
    ref = kernels.KERNELS["reference"]

    def fa_layout(*args):  # flash-attn's own [H, T] LSE, handed through unchanged
        out, lse = ref.forward(*args)
        return out, lse.t().contiguous()

    def log2(*args):
        out, lse = ref.forward(*args)
        return out, lse / math.log(2)

    def plus_inf(*args):  # flash-attn's +inf on rows without keys
        out, lse = ref.forward(*args)
        return out, lse.masked_fill(lse == float("-inf"), float("inf"))

    def gqa_expanded(dout, q, k, v, *rest):  # dk/dv per query head, not summed per K/V head
        return ref.backward(dout, q, k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                            v.repeat_interleave(q.shape[1] // v.shape[1], 1), *rest)

    def half_scale(*args):
        return ref.backward(*args[:-1], args[-1] / 2)

    cases = {"lse (": fa_layout, "lse off by": log2, "without keys is not -inf": plus_inf}
    for what, forward in cases.items():
        problems = kernel_contract.check(_fake(what, forward=forward))
        assert problems and all(what in p for p in problems), (what, problems)
    problems = kernel_contract.check(_fake("g", backward=gqa_expanded))
    assert problems and all("4/2 heads: dk (" in p or "4/2 heads: dv (" in p for p in problems), problems
    assert all("heads: d" in p for p in kernel_contract.check(_fake("s", backward=half_scale)))
    assert kernel_contract.check(_fake("conforming")) == []


def test_packing_validation():
    with pytest.raises(ValueError, match="square"):
        Packing.of([3], [4], causal=True)
    assert Packing.of([3, 0, 5]).max_q == 5 and list(Packing.of([3, 0, 5]).sequences()) == [(0, 3, 0, 3), (3, 8, 3, 8)]
