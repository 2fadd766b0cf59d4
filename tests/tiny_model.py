"""The tiny model (`SPEC`) against an independent reference, one document at a time:
its logits and loss on a whole batch in one process (`model_reference`), and a rank's loss,
gradients and logits on its tokens of a plan (`rank_outputs`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ballonet
from ballonet.runtime import token_index
from ballonet.training.parallelism.model import IGNORE_INDEX, NORM_EPS, ROPE_THETA, Transformer

SPEC = ballonet.model("tiny")
"""The model of the model-level tests."""


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


def _rope(x_LHD, theta=ROPE_THETA):
    """Rotate pairs (i, i + D/2) as complex numbers by pos * theta^(-2i/D), pos = 0..L-1."""
    L, _, D = x_LHD.shape
    freqs = torch.arange(L, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rot = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
    z = torch.complex(x_LHD[..., : D // 2].double(), x_LHD[..., D // 2:].double()) * rot
    return torch.cat([z.real, z.imag], -1).to(x_LHD.dtype)


def reference_logits(model: Transformer, ids_L: torch.Tensor) -> torch.Tensor:
    """[L] token ids of one document -> [L, V] logits, causal attention over the document."""
    p, L = dict(model.named_parameters()), ids_L.shape[0]
    H, K, D = SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_dim
    x = p["embed.weight"][ids_L]
    for i in range(SPEC.num_layers):
        w = {name.split(".", 2)[2]: t for name, t in p.items() if name.startswith(f"layers.{i}.")}
        h = _rms(x, w["attention_norm.weight"])
        q = _rope((h @ w["wq.weight"].T).view(L, H, D))
        k = _rope((h @ w["wk.weight"].T).view(L, K, D)).repeat_interleave(H // K, 1)
        v = (h @ w["wv.weight"].T).view(L, K, D).repeat_interleave(H // K, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        x = x + o.transpose(0, 1).reshape(L, H * D) @ w["wo.weight"].T
        h = _rms(x, w["ffn_norm.weight"])
        x = x + (F.silu(h @ w["w1.weight"].T) * (h @ w["w3.weight"].T)) @ w["w2.weight"].T
    return _rms(x, p["norm.weight"]) @ p["head.weight"].T


def batch(lengths, seed=0):
    """Global token ids and labels [N]: the next token of the document, IGNORE_INDEX at a
    document's end and (a loss mask) at every 7th token."""
    tokens = torch.randint(0, SPEC.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    labels, start = tokens.roll(-1).clone(), 0
    for n in lengths:
        labels[start + n - 1] = IGNORE_INDEX
        start += n
    labels[::7] = IGNORE_INDEX
    return tokens, labels


def model_reference(model: Transformer, lengths, tokens, labels):
    """Global logits [N, V] and summed loss; gradients land in `model`."""
    logits = torch.cat([reference_logits(model, doc) for doc in tokens.split(list(lengths))])
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return logits.detach(), loss.detach()


def rank_outputs(model: Transformer, plan, rank: int) -> tuple:
    """This rank's loss, parameter gradients and logits on its tokens of `plan`'s batch.
    numpy, not tensors: a tensor crosses the result queue as shared memory that dies with the rank."""
    tokens, labels = batch(plan.lengths)
    ti = token_index(plan, rank)
    loss = model.loss(tokens[ti], labels[ti], plan, rank)
    loss.backward()
    with torch.no_grad():
        logits = model(tokens[ti], plan, rank)
    return loss.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}, logits.numpy()


def assert_grads_close(grads: dict, ref_model, **tol):
    for name, p in ref_model.named_parameters():
        assert torch.allclose(grads[name], p.grad, **tol), name
