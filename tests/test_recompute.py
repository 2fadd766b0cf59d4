"""Activation recomputation: the same loss and gradients as without it, and fewer bytes
held for the backward (selective < none, full < selective), measured with autograd's
saved-tensor hooks on one process."""

import dataclasses

import torch
from plans_by_hand import one_rank_plan
from tiny_model import SPEC
from torch.utils.checkpoint import checkpoint

import ballonet
from ballonet.training.parallelism import model as model_module
from ballonet.training.parallelism.model import IGNORE_INDEX, Transformer


def _batch():
    lengths = (300, 200, 12)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SPEC.vocab_size, (sum(lengths),), generator=gen)
    labels = ids.roll(-1).clone()
    labels[[299, 499, 511]] = IGNORE_INDEX
    return one_rank_plan(lengths), ids, labels


def _run(model: Transformer, plan, ids, labels):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(ids, labels, plan, 0)
    held = sum(saved)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, held


def _assert_same_results(run, reference):
    (loss, grads, _), (ref_loss, ref_grads, _) = run, reference
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7)


def test_recompute_keeps_results_and_holds_less():
    batch = _batch()
    modes = ("none", "selective", "linear", "full")
    runs = {mode: _run(Transformer(SPEC, seed=1, recompute=mode), *batch) for mode in modes}
    for mode in modes[1:]:
        _assert_same_results(runs[mode], runs["none"])
    held = [runs[m][2] for m in modes]
    assert held == sorted(held, reverse=True) and len(set(held)) == 4, dict(zip(modes, held))


def test_linear_recompute_reruns_no_exchange(monkeypatch):
    """Under "linear" the backward reruns the block's local pieces (QKV, the output side)
    but neither its remaps nor its attention, so ranks may recompute differently; under
    "full" it reruns both. The first `layers` blocks recompute so, the others selectively."""
    phase, calls = ["forward"], []
    real_remap = model_module.remap
    monkeypatch.setattr(model_module, "remap", lambda *a, **k: (calls.append((phase[0], "remap")),
                                                                real_remap(*a, **k))[1])

    def attention(q, k, v, plan, rank, group):
        calls.append((phase[0], "attention"))
        return ballonet.runtime.attention(q, k, v, plan, rank, group, verify_plan=False)

    plan, ids, labels = _batch()
    counts = {}
    for mode in ("linear", "full"):
        model = Transformer(SPEC, seed=1, attention_fn=attention)
        model.set_recompute(mode, 1)
        phase[0], calls[:] = "forward", []
        loss = model.loss(ids, labels, plan, 0)
        phase[0] = "backward"
        loss.backward()
        counts[mode] = {p: [c for q, c in calls if q == p] for p in ("forward", "backward")}
        if mode == "linear":
            assert [b.recompute for b in model.layers] == ["linear", "selective"]
    assert counts["linear"]["forward"] == counts["full"]["forward"] == ["remap"] + ["remap", "attention", "remap"] * 2
    assert counts["linear"]["backward"] == []
    assert counts["full"]["backward"] == ["remap", "attention", "remap"] * 2


def test_selective_recompute_of_the_first_layers_only(monkeypatch):
    """recompute_layers=1 of the tiny model's 2: only the first block's MLP runs under the
    checkpoint; the same loss and gradients, and bytes held between none and every layer."""
    assert SPEC.num_layers == 2
    batch = _batch()
    spec = dataclasses.replace(SPEC, recompute="selective", recompute_layers=1)
    model = Transformer(spec, seed=1, recompute="selective")
    checkpointed = []

    def spy(fn, *args, **kwargs):
        checkpointed.append(fn.__self__)
        return checkpoint(fn, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(model_module, "checkpoint", spy)
        run = _run(model, *batch)
    assert [b.recompute for b in model.layers] == ["selective", "none"]
    assert checkpointed == [model.layers[0]], checkpointed
    none = _run(Transformer(SPEC, seed=1), *batch)
    every = _run(Transformer(SPEC, seed=1, recompute="selective"), *batch)
    _assert_same_results(run, none)
    assert every[2] < run[2] < none[2], (every[2], run[2], none[2])
