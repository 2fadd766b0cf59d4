"""Where a plan puts tokens: global positions and in-document positions per rank.

A global position indexes the concatenation of the batch's documents in input order.
"""

from __future__ import annotations

import torch

from ballonet.plan import Plan

LAYOUTS = ("attention", "linear")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _attention_ranges(plan: Plan, rank: int) -> list[tuple[int, int, int]]:
    """(doc, start, end) of each attention segment of `rank`, in local order."""
    return [(s.doc, s.start, s.end) for s in plan.attention[rank]]


def _linear_ranges(plan: Plan, rank: int) -> list[tuple[int, int, int]]:
    """(doc, start, end) of each run of tokens of `rank`'s linear layout, in local order."""
    out = []
    for src, start, end in plan.linear_pieces(rank):
        cursor = 0
        for doc, s0, s1 in _attention_ranges(plan, src):
            n = s1 - s0
            lo, hi = max(start, cursor), min(end, cursor + n)
            if lo < hi:
                out.append((doc, s0 + lo - cursor, s0 + hi - cursor))
            cursor += n
    return out


def doc_ranges(plan: Plan, rank: int, layout: str = "attention") -> list[tuple[int, int, int]]:
    _check_layout(layout)
    return _attention_ranges(plan, rank) if layout == "attention" else _linear_ranges(plan, rank)


def token_index(plan: Plan, rank: int, layout: str = "attention") -> torch.Tensor:
    """[T_local] global positions of the tokens `rank` holds, in local order."""
    offsets = plan.doc_offsets
    parts = [torch.arange(offsets[d] + s, offsets[d] + e) for d, s, e in doc_ranges(plan, rank, layout)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def position_ids(plan: Plan, rank: int, layout: str = "attention") -> torch.Tensor:
    """[T_local] position of each token of `rank` within its own document (for RoPE)."""
    parts = [torch.arange(s, e) for _, s, e in doc_ranges(plan, rank, layout)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def doc_ids(plan: Plan, rank: int, layout: str = "attention") -> torch.Tensor:
    """[T_local] document index of each token of `rank`."""
    parts = [torch.full((e - s,), d, dtype=torch.long) for d, s, e in doc_ranges(plan, rank, layout)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
