"""What a plan decided about activation recomputation, per rank (`Plan.recompute`)."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class RecomputeMode(str, Enum):
    """Activation recomputation of a layer, cheapest first: "none"; "selective" (the MLP's
    intermediates); "linear" (every linear layer, not attention nor the exchanges); "full"
    (the whole layer, its exchanges included, so every rank or none). A `str`, so it
    compares, hashes and prints as its value (`enum.StrEnum` is Python 3.11+)."""

    NONE = "none"
    SELECTIVE = "selective"
    LINEAR = "linear"
    FULL = "full"

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class RankRecompute(NamedTuple):
    """One rank's recomputation: `mode` on its first `layers` layers, the mode below on the
    others (selective: none; linear: selective; `cost.memory.BELOW`)."""

    mode: RecomputeMode
    layers: int


def heaviest(per_rank) -> RankRecompute:
    """The costliest mode any rank recomputes under, and the most layers any rank
    recomputes under it itself ("none", 0 for no ranks)."""
    modes = list(RecomputeMode)
    mode = max(map(RecomputeMode, {m for m, _ in per_rank}), key=modes.index, default=RecomputeMode.NONE)
    return RankRecompute(mode, max((k for m, k in per_rank if m == mode), default=0))
