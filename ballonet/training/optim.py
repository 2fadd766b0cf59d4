"""The optimizer step's settings: AdamW, its learning-rate schedule and gradient clipping,
from PyTorch's own parts (`torch.optim.lr_scheduler`, `torch.nn.utils`).

The schedule, by the step it is applied to (1-based; W warmup steps, S steps in all,
D = S - W decaying steps):

    steps 1..W          lr * s / (W + 1)                       (LinearLR; torchtitan's warmup)
    steps W+1..S        from lr at step W+1 to min_lr at step S (CosineAnnealingLR or LinearLR;
                        lr throughout with --lr-decay constant)

It is a function of the step alone, so a resumed run rebuilds it and steps it forward to
where it stood (`lr_scheduler(..., start_step=N)`): the checkpoint holds no scheduler
state, and a run resumed with another `--steps` follows the schedule of its own flags.

Clipping works on FSDP2's sharded gradients: `get_total_norm` over the DTensor shards is
a partial norm, `full_tensor()` reduces it over the ranks (the norm of the whole
gradient, every rank the same), then every shard is scaled by one factor, as torchtitan
does.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

DECAYS = ("constant", "linear", "cosine")


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def lr_scheduler(optimizer: torch.optim.Optimizer, *, lr: float, steps: int, warmup_steps: int = 0,
                 decay: str = "constant", min_lr: float = 0.0, start_step: int = 0) -> LRScheduler:
    """The schedule above on `optimizer` (every group's LR is set to `lr` first), stepped
    forward over the `start_step` steps already taken: the optimizer's LR is then the one
    of step `start_step + 1`. Call `.step()` after each optimizer step."""
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = lr
    phases, milestones = [], []
    if warmup_steps > 0:
        phases.append(LinearLR(optimizer, start_factor=1 / (warmup_steps + 1), end_factor=1.0,
                               total_iters=warmup_steps))
        milestones.append(warmup_steps)
    decaying = steps - warmup_steps - 1  # scheduler steps from the first decaying step to the last
    if decay == "cosine" and decaying > 0:
        phases.append(CosineAnnealingLR(optimizer, T_max=decaying, eta_min=min_lr))
    elif decay == "linear" and decaying > 0:
        phases.append(LinearLR(optimizer, start_factor=1.0, end_factor=min_lr / lr, total_iters=decaying))
    else:
        phases.append(ConstantLR(optimizer, factor=1.0, total_iters=0))
    scheduler = phases[0] if len(phases) == 1 else SequentialLR(optimizer, phases, milestones=milestones)
    with warnings.catch_warnings():  # stepping forward before this process's first optimizer.step()
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        for _ in range(start_step):
            scheduler.step()
    return scheduler


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def clip_gradients(parameters, max_norm: float | None) -> torch.Tensor:
    """The L2 norm of the whole gradient (over every rank's shards; collective when the
    gradients are DTensors), before clipping, as a 0-dim tensor on the gradients' device
    (read it when the step is done: no host synchronisation here); scales the gradients
    to `max_norm` when the norm exceeds it (None: measure only)."""
    parameters = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters], norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the partial norms of the shards, reduced over the ranks
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total
