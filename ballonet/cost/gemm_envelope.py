"""The points whose lower convex hull bounds a data-parallel rank's GEMM and elementwise
seconds over its linear token count n: the batch bounds take that envelope by Jensen's
inequality (`rank_token_seconds` at the mean rank's count, `layout_bound.gemm_cuts`
as the lines of its edges).

A rank runs a step's GEMMs and elementwise work as one call a layer over its n linear
tokens (`seconds.linear_layer_seconds`, `head_seconds`), n c(n) GPU-seconds at the
curves' efficiency at n. Each curve is linear in log2(tokens) between its knots and flat
outside them, so between two consecutive points of a grid holding every knot its
efficiency is at most the larger end's, and n c(n) at least n times the cost at that
efficiency: a straight segment through 0, below n c(n) over the interval, whose ends the
points below are."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.seconds import best_efficiency

if TYPE_CHECKING:
    from ballonet.specs import NodeGroup

__all__ = ["ENVELOPE_STEPS_PER_OCTAVE", "rank_token_seconds", "segment_ends"]


ENVELOPE_STEPS_PER_OCTAVE = 16
"""Token counts looked at between the efficiency curves' knots: the envelope found is
within the curves' change over 1/16 of a doubling (0.1% on the profiles here) of the
exact one, never above it."""


def segment_ends(gpu: hardware.GPUType, flops: float, nbytes: float, tokens: float,
                 *counts: float) -> tuple[np.ndarray, np.ndarray]:
    """(n, GPU-seconds) of (0, 0) and both ends of each grid interval's segment, for a rank
    of GPU type `gpu` running `flops` (GEMMs) and `nbytes` (elementwise, every GPU of its
    tensor-parallel group) per token on n of at most `tokens` (the batch's) linear tokens;
    the grid holds 1, `tokens`, `counts`, every knot and ENVELOPE_STEPS_PER_OCTAVE counts a
    doubling between them. Every point of the segments is at most n c(n) (module
    docstring), so their lower convex hull is too."""
    p = hardware.profile(gpu)
    knots = np.concatenate([p.linear.tokens, p.elementwise.tokens])
    grid = np.exp2(np.arange(np.log2(knots.min()), np.log2(knots.max()), 1 / ENVELOPE_STEPS_PER_OCTAVE))
    n = np.unique(np.clip(np.concatenate([[1.0, *counts, tokens], knots, grid]), 1.0, max(tokens, 1.0)))
    a, b = flops / gpu.peak_flops, nbytes / p.memory_bw
    eff_l, eff_e = p.linear.at(n), p.elementwise.at(n)
    if len(n) == 1:  # every rank at one token count: one segment, (0, 0) to it
        return np.array([0.0, n[0]]), np.array([0.0, n[0] * (a / eff_l[0] + b / eff_e[0])])
    slope = a / np.maximum(eff_l[:-1], eff_l[1:]) + b / np.maximum(eff_e[:-1], eff_e[1:])  # [intervals]
    return (np.concatenate([[0.0], n[:-1], n[1:]]), np.concatenate([[0.0], n[:-1] * slope, n[1:] * slope]))


def rank_token_seconds(group: NodeGroup, flops: float, nbytes: float, tokens: float, num_dp: int,
                       spread: bool) -> float:
    """GPU-seconds a token's `flops` (GEMMs) and `nbytes` (elementwise, every GPU of its
    tensor-parallel group) take at least, on the mean, over any split of the batch's
    `tokens` between `num_dp` data-parallel ranks of `group`'s GPU type (`spread`; else at
    the best efficiency of any token count up to `tokens`, as on a mixed cluster).

    Why: a rank runs its linear layers and LM head as one call over all its linear tokens
    n (`seconds.linear_layer_seconds`, `head_seconds`: the simulator's, DistCA's
    nano-batches halving the seconds at the same n), which takes n c(n) GPU-seconds, c(n)
    those of a token at the curves' efficiency at n. The ranks' n sum to `tokens`, so by
    Jensen's inequality their total is at least `num_dp` times the lower convex envelope of
    n c(n) (with 0 at 0) at the mean n: a rank at the efficiency's peak count may be
    cheaper a token, but then another holds more tokens at a lower efficiency. The best
    efficiency alone (the bound before) is that envelope's first segment, through 0.
    The envelope is the lower convex hull of `segment_ends`' points, whose
    segments are below n c(n); the chord over `mean` of the lowest pair of them around it
    is its value there. Recomputation is left at the best efficiency by the callers (its
    share per rank is the plan's)."""
    t, p = group.gpu_type, hardware.profile(group.gpu_type)
    if not spread or tokens <= 0:
        return (flops / (t.peak_flops * float(best_efficiency(p.linear, tokens)))
                + nbytes / (p.memory_bw * float(best_efficiency(p.elementwise, tokens))))
    mean = tokens / num_dp
    xs, ys = segment_ends(t, flops, nbytes, tokens, mean)
    left, right = xs <= mean, xs >= mean
    xl, yl, xr, yr = xs[left][:, None], ys[left][:, None], xs[right][None, :], ys[right][None, :]
    width = xr - xl
    chord = np.where(width > 0, (yl * (xr - mean) + yr * (mean - xl)) / np.where(width > 0, width, 1.0),
                     np.minimum(yl, yr))
    return float(chord.min() / mean)
