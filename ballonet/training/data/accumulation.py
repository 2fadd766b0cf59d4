"""Gradient accumulation (`--grad-accum K`): one global batch as K micro-batches, each
planned and balanced on its own, one optimizer step for all of them.

A micro-batch holds whole pieces of the global batch (a piece is a sequence of its own:
cutting it again would change its attention), so the K micro-batches hold exactly the
global batch's tokens and labels. Each micro-batch's loss is its sum of token losses
divided by the valid labels of the whole global batch, so the gradients the micro-batches
add up are the gradient of the global batch's mean loss: the step equals the unaccumulated
one (to float rounding), whatever K. The split evens the micro-batches' tokens (what
bounds the activation memory, the reason to accumulate): longest piece first, each into
the micro-batch with the fewest tokens (LPT).
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(lengths: Sequence[int], k: int, min_tokens: int = 1) -> list[list[int]]:
    """[micro-batch][the indices of its pieces, in batch order]: up to `k` micro-batches
    of the pieces of `lengths`, their token counts evened (LPT); none is empty, and one
    under `min_tokens` tokens (a plan needs a token per rank) joins the smallest other.
    Deterministic: every rank splits alike."""
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    groups: list[list[int]] = [[] for _ in range(min(k, len(lengths)))]
    tokens = [0] * len(groups)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        emptiest = min(range(len(groups)), key=lambda g: (tokens[g], g))
        groups[emptiest].append(i)
        tokens[emptiest] += lengths[i]
    while len(groups) > 1 and min(tokens) < min_tokens:
        small = min(range(len(groups)), key=lambda g: (tokens[g], g))
        into = min((g for g in range(len(groups)) if g != small), key=lambda g: (tokens[g], g))
        groups[into] += groups[small]
        tokens[into] += tokens[small]
        del groups[small], tokens[small]
    return [sorted(g) for g in groups]
