"""The pieces of a plan's two layouts: token ranges of documents (`Segment`, the attention
layout) and of a rank's attention-local order (`Transfer`, the remap to the linear
layout), and the near-equal cut of a length (`chunk_bounds`)."""

from __future__ import annotations

from dataclasses import dataclass


class _TokenRange:
    """Tokens [start, end) of something (fields of the dataclasses below)."""

    __slots__ = ()
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Segment(_TokenRange):
    doc: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Transfer(_TokenRange):
    src: int
    dst: int
    start: int
    end: int


def chunk_bounds(length: int, num_chunks: int) -> tuple[int, ...]:
    """num_chunks + 1 boundaries cutting `length` into near-equal parts (no padding)."""
    return tuple(length * j // num_chunks for j in range(num_chunks + 1))
