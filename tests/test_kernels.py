"""The kernel seam against dense float64 attention computed here, forward and backward."""

from __future__ import annotations

import pytest
import torch

from ballonet.runtime import kernels
from ballonet.runtime.engine import merge
from ballonet.runtime.kernels import Packing

D = 8
BACKENDS = ["cpu", "reference"] + (["cuda"] if torch.cuda.is_available() else [])


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
    device = "cuda" if backend == "cuda" else "cpu"
    dtype = torch.bfloat16 if backend == "cuda" else torch.float32
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
    assert kernels.select().name == "cpu"
    assert kernels.select(device=torch.device("cuda")).name == "cuda"
    assert kernels.select("reference", torch.device("cpu")).name == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels.select(device=torch.device("cpu")).name == "reference"
    assert kernels.select("cpu").name == "cpu"
    with pytest.raises(ValueError, match="unknown attention kernel"):
        kernels.select("flash3")


def test_packing_validation():
    with pytest.raises(ValueError, match="square"):
        Packing.of([3], [4], causal=True)
    assert Packing.of([3, 0, 5]).max_q == 5 and list(Packing.of([3, 0, 5]).sequences()) == [(0, 3, 0, 3), (3, 8, 3, 8)]
