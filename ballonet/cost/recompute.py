"""Activation recomputation: which mode a plan takes, per rank, and what it reruns.

The policy (a decision procedure on `memory.py`'s bytes): the cheapest mode under which
every rank holds its tokens on every layer, then, per rank, the fewest of the first layers
that must recompute under it (a selective or linear layer reruns only its own local work,
so ranks may differ; full recomputation reruns the layer's remap and ring, so every rank
does it or none); planners record it in `Plan.recompute`, which the simulator and the
trainer read (`plan_recompute`). Then the FLOPs and bytes the backward runs again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ballonet.cost.flops import elementwise_bytes_per_token, linear_flops_per_token, mlp_flops_per_token
from ballonet.cost.memory import BELOW, RECOMPUTE_MODES, activation_bytes, layer_mean, memory_cap, recompute_layer_count
from ballonet.plan import RankRecompute, RecomputeMode

if TYPE_CHECKING:
    from ballonet.plan import Plan
    from ballonet.specs import ModelSpec


def cheapest_mode(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int,
                  attention_tokens=None) -> str | None:
    """The cheapest recomputation under which every rank holds its tokens (`model.recompute`
    when set): `tokens_per_rank` on the linear layout and `attention_tokens` (default the
    same) on the attention layout. None if not even full recomputation fits."""
    att = tokens_per_rank if attention_tokens is None else attention_tokens
    modes = (model.recompute,) if model.recompute else RECOMPUTE_MODES
    for mode in modes:
        if all(activation_bytes(model, n, a, mode, model.recompute_layers if model.recompute else None)
               <= memory_cap(model, g, num_dp_ranks)
               for n, a, g in zip(tokens_per_rank, att, gpus)):
            return mode
    return None


def cheapest_per_rank(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int,
                      attention_tokens=None) -> tuple[str, tuple[tuple[str, int], ...]] | None:
    """(mode, [R] (mode, layers) of each rank): the cheapest mode under which every rank
    holds its tokens on every layer (`cheapest_mode`) and, unless the model fixes
    its recomputation, what each rank then needs of it (`layers_per_rank`): ranks may
    differ there, as a selective or linear layer reruns only its own local work, no
    collective (`training/parallelism/model.py`); full recomputation reruns the layer's remap and
    ring, so every rank does it or none. None if nothing fits."""
    mode = cheapest_mode(model, tokens_per_rank, gpus, num_dp_ranks, attention_tokens)
    if mode is None:
        return None
    if mode not in BELOW or model.recompute:
        k = int(recompute_layer_count(model, mode, model.recompute_layers if model.recompute else None))
        return mode, ((mode, k),) * len(tokens_per_rank)
    per_rank = layers_per_rank(model, tokens_per_rank, gpus, num_dp_ranks, attention_tokens, mode)
    assert per_rank is not None  # every rank holds its tokens under `mode` on every layer
    return mode, tuple(per_rank)


def layers_per_rank(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int, attention_tokens=None,
                    mode: str = "linear") -> list[tuple[str, int]] | None:
    """[R] (mode, layers) of the least each rank must recompute to hold its own tokens
    (`cheapest_mode`'s arguments), of the modes up to `mode` that ranks may choose
    apart ("none", "selective", "linear": `BELOW`): the cheapest under which it holds
    them, on as few of the first layers as it needs, the others one mode below.
    ("none", 0) where nothing needs to; None when not even `mode` on every layer is
    enough on some rank."""
    att = tokens_per_rank if attention_tokens is None else attention_tokens
    by_type = {g: memory_cap(model, g, num_dp_ranks) for g in set(gpus)}  # (a memory_gb override is its own type)
    caps = np.array([by_type[g] for g in gpus])
    lin, att = np.asarray(tokens_per_rank, dtype=float), np.asarray(att, dtype=float)
    over = np.nonzero(activation_bytes(model, lin, att, "none") > caps)[0]  # ranks that do not hold their tokens
    lin, att, caps = lin[over], att[over], caps[over]
    out = [("none", 0)] * len(tokens_per_rank)
    todo, n = np.ones(len(over), dtype=bool), model.num_layers
    for m in [m for m in BELOW if RECOMPUTE_MODES.index(m) <= RECOMPUTE_MODES.index(mode)]:
        keep, drop = activation_bytes(model, lin, att, BELOW[m]), activation_bytes(model, lin, att, m)
        here = np.nonzero(todo & (drop <= caps))[0]
        # The fewest layers k whose recomputation frees keep - cap, each freeing (keep - drop) / n,
        # checked against float rounding as `activation_bytes` counts them.
        k = np.clip(np.ceil(n * (keep[here] - caps[here]) / (keep[here] - drop[here])), 1, n)
        for _ in range(n):
            short = (activation_bytes(model, lin[here], att[here], m, k) > caps[here]) & (k < n)
            if not short.any():
                break
            k[short] += 1
        for i, layers in zip(over[here].tolist(), k.astype(int).tolist()):
            out[i] = (m, layers)
        todo[here] = False
    return None if todo.any() else out


def per_rank_recompute(model: ModelSpec, linear_tokens, gpus, attention_tokens) -> tuple[RankRecompute, ...]:
    """[R] what each rank recomputes to hold `linear_tokens` and `attention_tokens`
    (`cheapest_per_rank`), full on every layer where nothing fits: what a planner puts in
    `Plan.recompute`."""
    found = cheapest_per_rank(model, linear_tokens, gpus, len(linear_tokens), attention_tokens)
    per_rank = found[1] if found else (("full", model.num_layers),) * len(linear_tokens)
    return tuple(RankRecompute(RecomputeMode(m), k) for m, k in per_rank)


def plan_recompute(plan: Plan, model: ModelSpec, gpus) -> tuple[RankRecompute, ...]:
    """[R] what each rank of `plan` recomputes: the planner's decision (`Plan.recompute`),
    or, for a plan without one (built by hand), `per_rank_recompute` of its tokens."""
    if plan.recompute:
        return plan.recompute
    return per_rank_recompute(model, plan.linear_token_counts, gpus, plan.attention_token_counts)


def recompute_attention(mode: str | None) -> bool:
    return mode == "full"


def recompute_flops_per_token(model: ModelSpec, mode: str | None = None, layers: float | None = None) -> float:
    """Linear FLOPs per token and layer (a mean over layers when only `layers` of them
    recompute) run again in the backward by recomputation `mode` (full recomputation also
    reruns the attention forward: `recompute_attention`)."""
    per_layer = {"none": 0.0, "selective": mlp_flops_per_token(model), "linear": linear_flops_per_token(model),
                 "full": linear_flops_per_token(model)}
    return layer_mean(model, per_layer, mode, layers)


def recompute_elementwise_bytes_per_token(model: ModelSpec, mode: str | None = None,
                                          layers: float | None = None) -> float:
    """Elementwise bytes per token and layer (a mean over layers when only `layers` of
    them recompute) run again in the backward by recomputation `mode`: "selective" reruns
    the MLP's norm and silu(gate) * up, "linear" and "full" the layer's."""
    mlp = (2 * model.hidden + 3 * model.ffn_hidden) * model.dtype_bytes / model.tp
    every = elementwise_bytes_per_token(model)
    per_layer = {"none": 0.0, "selective": mlp, "linear": every, "full": every}
    return layer_mean(model, per_layer, mode, layers)
