"""Activation recomputation: the same loss and gradients as without it, and fewer bytes
held for the backward (selective < none, full < selective), measured with autograd's
saved-tensor hooks on one process."""

import torch
from test_remap import one_rank_plan

import ballonet
from ballonet.training.model import IGNORE_INDEX, Transformer

SPEC = ballonet.model("tiny")


def _run(mode: str, plan, ids, labels):
    model = Transformer(SPEC, seed=1, recompute=mode)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(ids, labels, plan, 0)
    held = sum(saved)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, held


def test_recompute_keeps_results_and_holds_less():
    lengths = (300, 200, 12)
    plan = one_rank_plan(lengths)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SPEC.vocab_size, (sum(lengths),), generator=gen)
    labels = ids.roll(-1).clone()
    labels[[299, 499, 511]] = IGNORE_INDEX
    runs = {mode: _run(mode, plan, ids, labels) for mode in ("none", "selective", "full")}
    loss, grads, held = runs["none"]
    for mode in ("selective", "full"):
        other_loss, other_grads, _ = runs[mode]
        torch.testing.assert_close(other_loss, loss, rtol=0, atol=0)
        for name, g in grads.items():
            torch.testing.assert_close(other_grads[name], g, rtol=1e-6, atol=1e-7)
    assert runs["full"][2] < runs["selective"][2] < held, {m: r[2] for m, r in runs.items()}
