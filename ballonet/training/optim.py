"""The optimizer step's settings: AdamW, its learning-rate schedule and gradient clipping,
from PyTorch's own parts (`torch.optim.lr_scheduler`, `torch.nn.utils`).

The schedule, by the step it is applied to (1-based; W warmup steps, S steps in all,
D = S - W decaying steps):

    steps 1..W          lr * s / (W + 1)                       (torchtitan's linear warmup)
    steps W+1..S        from lr at step W+1 to min_lr at step S, cosine or linear (lr throughout
                        with --lr-decay constant)

It is a function of the step alone, written in closed form (`lr_factor`, under torch's
`LambdaLR`), so a resumed run sets it where it stood in O(1), whatever the step
(`lr_scheduler(..., start_step=N)`): the checkpoint holds no scheduler state, and a run
resumed with another `--steps` follows the schedule of its own flags.

Clipping works on FSDP2's sharded gradients: `get_total_norm` over the DTensor shards is
a partial norm, `full_tensor()` reduces it over the ranks (the norm of the whole
gradient, every rank the same), then every shard is scaled by one factor, as torchtitan
does.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

DECAYS = ("constant", "linear", "cosine")


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def lr_factor(step: int, *, lr: float, steps: int, warmup_steps: int = 0, decay: str = "constant",
              min_lr: float = 0.0) -> float:
    """The schedule above as a factor of `lr`, at the scheduler's step `step` (0-based: the
    LR of training step `step + 1`), in closed form."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decaying = steps - warmup_steps - 1  # scheduler steps from the first decaying step to the last
    if decay == "constant" or decaying <= 0:
        return 1.0
    t = min(step - warmup_steps, decaying) / decaying
    if decay == "linear":
        return 1.0 + (min_lr / lr - 1.0) * t
    return (min_lr + (lr - min_lr) * (1 + math.cos(math.pi * t)) / 2) / lr


def lr_scheduler(optimizer: torch.optim.Optimizer, *, lr: float, steps: int, warmup_steps: int = 0,
                 decay: str = "constant", min_lr: float = 0.0, start_step: int = 0) -> LRScheduler:
    """The schedule above on `optimizer` (every group's LR is set to `lr` first), as of
    `start_step` steps already taken, in O(1) whatever `start_step`: the optimizer's LR is
    then the one of step `start_step + 1`. Call `.step()` after each optimizer step."""
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = lr
    factor = functools.partial(lr_factor, lr=lr, steps=steps, warmup_steps=warmup_steps, decay=decay, min_lr=min_lr)
    with warnings.catch_warnings():  # stepping before this process's first optimizer.step()
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        return LambdaLR(optimizer, factor, last_epoch=start_step - 1)  # its first step sets step `start_step`'s LR


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
