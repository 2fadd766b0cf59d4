"""The unit the loader's stream moves (`loader.take_pieces`, `outlier_queue`): a span of
one document, as the ledger of a batch records it."""

from __future__ import annotations

from typing import NamedTuple


class Piece(NamedTuple):
    """Ledger entry: tokens [start, end) of document `doc`, consumed in epoch `epoch`."""

    epoch: int
    doc: int
    start: int
    end: int
