"""WLB-LLM's outlier delay as a data order of the loader (`ballonet train --outlier-delay
G`, docs/design.md, section 11): the outlier queue.

With `outlier_delay` G a piece that is an outlier (`outliers.outlier_level` of its whole
length, as the stream takes it at a document's or context window's start, against T =
`global_tokens`) waits in its level's queue instead of going in; when a level holds G,
those G start the next batch, which the stream then fills as usual. An outlier whose level
already holds G goes in as any other piece (so a queue never holds more than G), and at
the end of the last epoch (`max_epochs`) the pieces still waiting go in, in the order they
came.

The queue is part of the loader's cursor (`loader.Cursor.waiting`, the pieces in the
order they came), and so of its `state_dict()` (`waiting`: `queue_state`,
`queue_from_state`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from ballonet.errors import InputError
from ballonet.outliers import outlier_level
from ballonet.training.data.corpus import Corpus
from ballonet.training.data.piece import Piece


@dataclasses.dataclass
class OutlierQueue:
    """The outliers waiting while one batch is filled (`loader.take_pieces`), in the order
    they came, against `global_tokens` T over `groups` G (None: no delay, nothing waits)."""

    waiting: list[Piece]
    global_tokens: int
    groups: int | None
    _held: Counter = dataclasses.field(init=False, repr=False)
    """Waiting pieces per level."""

    def __post_init__(self) -> None:
        self._held = Counter(self._level(p) for p in self.waiting)

    def _level(self, piece: Piece) -> int | None:
        """`piece`'s outlier level; None for no outlier, and for every piece without a delay."""
        return outlier_level(piece.end - piece.start, self.global_tokens, self.groups) if self.groups else None

    def release(self) -> list[Piece]:
        """The G waiting outliers of the level that filled first, taken out of the queue
        (they start the batch); none while no level holds G."""
        if not self.groups:
            return []
        levels = [self._level(p) for p in self.waiting]
        count: Counter = Counter()
        for level in levels:
            if level is None:
                continue
            count[level] += 1
            if count[level] == self.groups:
                released = [i for i, k in enumerate(levels) if k == level][:self.groups]
                out = [self.waiting[i] for i in released]
                for i in reversed(released):
                    del self.waiting[i]
                self._held[level] -= self.groups
                return out
        return []

    def hold(self, piece: Piece) -> bool:
        """Whether `piece` (at its document's or context window's start) waits: it is an
        outlier and its level holds fewer than G."""
        level = self._level(piece)
        if not self.groups or level is None or self._held[level] >= self.groups:
            return False
        self.waiting.append(piece)
        self._held[level] += 1
        return True

    def flush(self, budget: int) -> list[Piece]:
        """The data has ended: the waiting pieces go in, in the order they came, up to
        `budget` tokens (the last one cut there, its rest left waiting)."""
        out = []
        while budget > 0 and self.waiting:
            p = self.waiting[0]
            end = min(p.end, p.start + budget)
            out.append(p._replace(end=end))
            budget -= end - p.start
            if end == p.end:
                self.waiting.pop(0)
            else:
                self.waiting[0] = p._replace(start=end)
        return out


def queue_state(waiting: tuple[Piece, ...]) -> list[list[int]]:
    """The queue as the loader's state holds it: [epoch, doc, start, end] per piece."""
    return [list(p) for p in waiting]


def queue_from_state(waiting, *, epoch: int, corpus: Corpus, groups: int | None) -> tuple[Piece, ...]:
    """A state's queue (`queue_state`), each piece checked against `corpus` and the
    state's `epoch`."""
    if not isinstance(waiting, list) or (waiting and not groups):
        raise InputError(f"loader state: 'waiting' must be a list (empty without an outlier delay), got "
                         f"{str(waiting)[:80]}")
    out = []
    for i, item in enumerate(waiting):
        if not (isinstance(item, list) and len(item) == 4 and all(type(x) is int for x in item)):
            raise InputError(f"loader state: waiting[{i}] must be 4 integers [epoch, doc, start, end], got "
                             f"{str(item)[:80]}")
        piece = Piece(*item)
        if not (0 <= piece.epoch <= epoch and 0 <= piece.doc < corpus.num_docs
                and 0 <= piece.start < piece.end <= int(corpus.lengths[piece.doc])):
            raise InputError(f"loader state: waiting[{i}] {item} is no piece of a document of this corpus "
                             f"(epoch up to {epoch})")
        out.append(piece)
    return tuple(out)
