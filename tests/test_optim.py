"""The learning-rate schedule against its closed form, stepped forward on resume, and
gradient clipping against torch's own `clip_grad_norm_` (one process; the sharded
norm over ranks is checked in test_train_features.py)."""

import math

import pytest
import torch

from ballonet.training import optim


def _closed_form(step, *, lr, steps, warmup, decay, min_lr):
    """The LR of step `step` (1-based), written from the schedule's definition."""
    if step <= warmup:
        return lr * step / (warmup + 1)
    span = steps - warmup - 1  # from the first decaying step (lr) to the last (min_lr)
    if decay == "constant" or span <= 0:
        return lr
    t = (step - warmup - 1) / span
    if decay == "linear":
        return lr + (min_lr - lr) * t
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * t)) / 2


def _lrs(optimizer, scheduler, n):
    out = []
    for _ in range(n):
        out.append(optim.current_lr(optimizer))
        optimizer.step()
        scheduler.step()
    return out


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=123.0)


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_schedule_follows_its_closed_form(decay, warmup):
    kw = dict(lr=3e-3, steps=12, warmup=warmup, decay=decay, min_lr=0.0 if decay == "constant" else 1e-4)
    opt = _optimizer()
    scheduler = optim.lr_scheduler(opt, lr=kw["lr"], steps=kw["steps"], warmup_steps=warmup, decay=decay,
                                   min_lr=kw["min_lr"])
    got = _lrs(opt, scheduler, kw["steps"])
    want = [_closed_form(s, **kw) for s in range(1, kw["steps"] + 1)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    if decay != "constant":
        assert got[-1] == pytest.approx(kw["min_lr"])  # the last step reaches --min-lr
    assert max(got) == pytest.approx(kw["lr"])


def test_a_resumed_schedule_continues_where_it_stood():
    kw = dict(lr=1e-2, steps=10, warmup_steps=3, decay="cosine", min_lr=1e-3)
    opt = _optimizer()
    straight = _lrs(opt, optim.lr_scheduler(opt, **kw), 10)
    resumed_opt = _optimizer()  # a fresh process: the optimizer's LR is whatever it was built with
    resumed = _lrs(resumed_opt, optim.lr_scheduler(resumed_opt, **kw, start_step=6), 4)
    assert resumed == straight[6:]  # bit for bit


def test_clipping_matches_torch_and_measures_without_clipping():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    grads = [torch.randn_like(p) * 3 for p in params]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t, g in zip(params, twins, grads):
        p.grad, t.grad = g.clone(), g.clone()
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    assert float(optim.clip_gradients(params, None)) == pytest.approx(norm, rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # measured, not clipped
    assert float(optim.clip_gradients(params, 1.0)) == pytest.approx(norm, rel=1e-6)  # the norm before clipping
    torch.nn.utils.clip_grad_norm_(twins, 1.0)
    for p, t in zip(params, twins):
        assert torch.allclose(p.grad, t.grad, rtol=1e-6, atol=0)
    assert torch.cat([p.grad.flatten() for p in params]).norm().item() == pytest.approx(1.0, rel=1e-5)


def test_a_far_resume_sets_the_schedule_at_once():
    """Issue 47.3: a `ballonet.json` step of 1e12 stepped the scheduler one step at a time
    (a hang); the schedule is now closed form. The hang guard: a loop of 1e12 steps takes
    hours, the closed form microseconds."""
    opt = _optimizer()
    optim.lr_scheduler(opt, lr=1e-2, steps=10**12 + 10, warmup_steps=3, decay="linear", min_lr=1e-3,
                       start_step=10**12)
    assert optim.current_lr(opt) == pytest.approx(_closed_form(10**12 + 1, lr=1e-2, steps=10**12 + 10, warmup=3,
                                                               decay="linear", min_lr=1e-3), rel=1e-9)
