"""Documents in, planned global batches out: `BalancedLoader`.

The loader walks a seeded per-epoch permutation of a corpus (`corpus.py`) and cuts the stream into global batches
of exactly `global_tokens` tokens: documents go in whole, except that one longer than
`max_doc_tokens` is cut into context windows and the last one of a batch is cut at the
budget; the rest of a cut document starts the next batch as its own piece. A piece is a
sequence of its own (attention and positions restart), but its labels run on into the
document: only a document's very last token has no label. So every token is an input
once per epoch and every token but a document's first is a label once per epoch.

With `outlier_delay` G the stream is WLB-LLM's order (docs/design.md, section 11): the
outliers wait in a queue and go in G at a time (`outlier_queue.py`); the queue is part of
the cursor, and so of `state_dict()`.

Batch composition depends on (corpus, global_tokens, max_doc_tokens, seed, shuffle,
outlier_delay, position) only, never on the number of ranks: runs on 1, 2 or 4 ranks see
the same batches, and a checkpoint made on one world size resumes on another. Batches are cut and
planned from the corpus's document lengths alone; each rank then reads from the corpus
only the token ranges the plan gives it (plus the one token after each, for its label).

Everything else a step needs is made with it, in the prefetch thread: the layers'
metadata (`runtime.step_meta`, once per step), staged with the tokens in one buffer for
one copy to the device (`RankBatch.staged`), and the digests the plan check compares
(`RankBatch.content`): of a sample of this rank's tokens, and of the same sample of its
successor's share, which is all a rank reads besides its own tokens
(`CONTENT_SAMPLE` tokens), so ranks that read different data fail together before the
first exchange.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ballonet import runtime
from ballonet.errors import InputError
from ballonet.plan import Plan
from ballonet.runtime.layout import (
    LAYOUTS,
    doc_ids,
    doc_ranges,
    position_ids,
    token_index,
)
from ballonet.runtime.staging import Staged
from ballonet.training.data.accumulation import micro_batches
from ballonet.training.data.corpus import Corpus
from ballonet.training.data.outlier_queue import OutlierQueue, queue_from_state, queue_state
from ballonet.training.data.piece import Piece

IGNORE_INDEX = -100
"""Label of a token with no next token in its document (torch cross_entropy's default)."""

CONTENT_SAMPLE = 16
"""Tokens of its successor's share a rank reads for the data check (`sample_offsets`)."""


def sample_offsets(num_tokens: int, index: int) -> np.ndarray:
    """The offsets, in a share of `num_tokens` tokens, that batch `index`'s data check
    samples: `CONTENT_SAMPLE` evenly spaced (all of a smaller share), shifted from batch
    to batch so successive steps sample other tokens."""
    if num_tokens <= CONTENT_SAMPLE:
        return np.arange(num_tokens)
    shift = (index * 0.6180339887) % 1.0
    return ((np.arange(CONTENT_SAMPLE) + shift) * num_tokens / CONTENT_SAMPLE).astype(np.int64)


# ---- batches -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where the stream stands: the next token is at `offset` in the `position`-th
    document of epoch `epoch`'s order; `batch` batches were produced before it; `waiting`:
    the outliers the outlier delay holds, in the order they came (`outlier_queue.py`)."""

    epoch: int = 0
    position: int = 0
    offset: int = 0
    batch: int = 0
    waiting: tuple[Piece, ...] = ()


def document_order(num_docs: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """[D] document ids in the order epoch `epoch` visits them."""
    if not shuffle:
        return np.arange(num_docs)
    return np.random.default_rng([seed, epoch]).permutation(num_docs)


def take_pieces(lengths: np.ndarray, order: Callable[[int], np.ndarray], cursor: Cursor, global_tokens: int,
                max_doc_tokens: int | None, max_epochs: int | None,
                outlier_delay: int | None = None) -> tuple[list[Piece], Cursor]:
    """The pieces of the batch at `cursor` (exactly `global_tokens` tokens unless the last
    epoch runs out; none once it and the outlier queue have) and the cursor after them."""
    window = max_doc_tokens or int(lengths.max())
    epoch, position, offset = cursor.epoch, cursor.position, cursor.offset

    def ended() -> bool:
        return max_epochs is not None and epoch + (position == len(lengths)) >= max_epochs

    queue = OutlierQueue(list(cursor.waiting), global_tokens, outlier_delay)
    pieces = [] if ended() else queue.release()
    budget = global_tokens - sum(p.end - p.start for p in pieces)
    while budget > 0 and not ended():
        if position == len(lengths):
            epoch, position = epoch + 1, 0
        doc = int(order(epoch)[position])
        length = int(lengths[doc])
        end = min(length, (offset // window + 1) * window)
        waits = offset % window == 0 and queue.hold(Piece(epoch, doc, offset, end))
        if not waits:
            end = min(end, offset + budget)
            pieces.append(Piece(epoch, doc, offset, end))
            budget -= end - offset
        position, offset = (position + 1, 0) if end == length else (position, end)
    if ended():  # the last epoch is over: the outliers still waiting go in
        pieces += queue.flush(budget)
    return pieces, Cursor(epoch, position, offset, cursor.batch + (1 if pieces else 0), tuple(queue.waiting))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Batch:
    """One global batch, the same on every rank: the ledger and its plan. Tokens are read
    from the corpus per rank (`rank_view`), only those the rank holds."""

    index: int
    pieces: tuple[Piece, ...]
    """The ledger, in the plan's document order."""
    corpus: Corpus
    plan: Plan
    plan_ms: float
    num_valid_tokens: int
    """Tokens with a label (all but the pieces that end their document), over the batch."""

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(p.end - p.start for p in self.pieces)

    def read(self, ranges: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and labels of `ranges` ((piece, start, end) within the pieces),
        concatenated. Reads from the corpus only those tokens and the one after each range."""
        tokens, labels = [], []
        for piece, start, end in _merge_adjacent(ranges):
            p = self.pieces[piece]
            length = int(self.corpus.lengths[p.doc])
            lo, hi = p.start + start, p.start + end
            ids = self.corpus.tokens_range(p.doc, lo, min(hi + 1, length))
            tokens.append(ids[: hi - lo])
            labels.append(ids[1:] if hi < length else np.append(ids[1:], IGNORE_INDEX))
        if not tokens:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        return (torch.from_numpy(np.concatenate(tokens).astype(np.int64)),
                torch.from_numpy(np.concatenate(labels).astype(np.int64)))

    def read_at(self, ranges: list[tuple[int, int, int]], offsets: np.ndarray) -> np.ndarray:
        """Token ids at `offsets` (increasing) of the concatenation of `ranges` ((piece,
        start, end)), reading those tokens alone."""
        out, cursor, k = [], 0, 0
        for piece, start, end in ranges:
            while k < len(offsets) and offsets[k] < cursor + end - start:
                p, at = self.pieces[piece], start + int(offsets[k]) - cursor
                out.append(self.corpus.tokens_range(p.doc, p.start + at, p.start + at + 1))
                k += 1
            cursor += end - start
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)

    @functools.cached_property
    def tokens_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([T], [T]) every token of the batch and its label: reads the whole batch, for
        single-process references and tests (training reads per rank)."""
        return self.read([(i, 0, p.end - p.start) for i, p in enumerate(self.pieces)])

    @property
    def tokens(self) -> torch.Tensor:
        return self.tokens_labels[0]

    @property
    def labels(self) -> torch.Tensor:
        return self.tokens_labels[1]


def _merge_adjacent(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(piece, start, end) ranges with each one that continues the previous joined to it."""
    merged: list[tuple[int, int, int]] = []
    for piece, start, end in ranges:
        if merged and merged[-1][0] == piece and merged[-1][2] == start:
            merged[-1] = (piece, merged[-1][1], end)
        else:
            merged.append((piece, start, end))
    return merged


def build_batch(corpus: Corpus, pieces: list[Piece], index: int, plan_fn: Callable[[tuple[int, ...]], Plan]) -> Batch:
    """Plan the batch from the pieces' lengths alone (no token is read)."""
    lengths = tuple(p.end - p.start for p in pieces)
    start = time.perf_counter()
    plan = plan_fn(lengths)
    plan_ms = (time.perf_counter() - start) * 1e3
    if tuple(plan.lengths) != lengths:
        raise ValueError(f"batch {index}: the plan is for other document lengths")
    num_ends = sum(p.end == corpus.lengths[p.doc] for p in pieces)
    return Batch(index=index, pieces=tuple(pieces), corpus=corpus, plan=plan, plan_ms=plan_ms,
                 num_valid_tokens=sum(lengths) - int(num_ends))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RankBatch:
    """This rank's share of a global batch, in the loader's layout; all [T_local]."""

    batch: Batch
    rank: int
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    """bool: the label is a real token."""
    position_ids: torch.Tensor
    """Position within the piece (for RoPE)."""
    token_index: torch.Tensor
    """Global position in `batch.tokens`."""
    doc_ids: torch.Tensor
    """Index of the piece within the batch (the plan's document), not the corpus id."""
    num_valid_tokens_global: int
    """Valid labels over the whole batch (of the whole global batch, for a micro-batch):
    the loss denominator on every rank."""
    layout: str = "attention"
    """The plan layout these tokens are in."""
    content: tuple[bytes, bytes] = (b"", b"")
    """Digests of a sample of this rank's tokens and of the same sample of its successor's
    (rank + 1 mod the plan's ranks) as this rank reads them (`sample_offsets`;
    `runtime.check_plan` compares them)."""
    staged: Staged | None = None
    """(`runtime.StepMeta`, input ids, labels) in one buffer: `staged.to(device)` moves
    the step's metadata and tokens with one copy."""
    micro_batch: int = 0
    """Which of its global batch's micro-batches this is (`accumulation.py`)."""
    num_micro_batches: int = 1

    @property
    def plan(self) -> Plan:
        return self.batch.plan

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return self.batch.pieces

    @property
    def plan_ms(self) -> float:
        return self.batch.plan_ms


def rank_view(batch: Batch, rank: int, layout: str = "attention", *, pin: bool = False, **micro) -> RankBatch:
    """`rank`'s tokens, read from the corpus: only the ranges it holds, each with the one
    token after it, so labels are right even where a document's next token lives on
    another rank; with the step's metadata staged for one copy (`pin`: in page-locked
    memory, for a GPU) and the token digests of the plan check (the successor's sampled
    tokens are the only others read). `micro`: a micro-batch's `num_valid_tokens_global`
    (its global batch's), `micro_batch` and `num_micro_batches`."""
    plan = batch.plan
    input_ids, labels = batch.read(doc_ranges(plan, rank, layout))
    successor = doc_ranges(plan, (rank + 1) % plan.num_ranks, layout)
    sampled = batch.read_at(successor, sample_offsets(sum(e - s for _, s, e in successor), batch.index))
    mine = input_ids.numpy()[sample_offsets(len(input_ids), batch.index)]
    meta = runtime.step_meta(plan, rank)
    micro.setdefault("num_valid_tokens_global", batch.num_valid_tokens)
    return RankBatch(batch=batch, rank=rank, input_ids=input_ids, labels=labels,
                     loss_mask=labels != IGNORE_INDEX, position_ids=position_ids(plan, rank, layout),
                     token_index=token_index(plan, rank, layout), doc_ids=doc_ids(plan, rank, layout),
                     layout=layout, content=(runtime.content_digest(mine), runtime.content_digest(sampled)),
                     staged=runtime.stage((meta, input_ids, labels), pin=pin), **micro)


# ---- the loader ----------------------------------------------------------------------


class BalancedLoader:
    """Streams `corpus` into planned global batches and yields this rank's `RankBatch`.

    Every rank computes the same batches and plans (`plan_fn(lengths) -> Plan` must be
    deterministic); each rank reads from the corpus only the tokens it holds. While batch
    n is consumed, batch n+1 is planned and read in a background thread. `state_dict()` counts only yielded batches, so resuming from it
    yields exactly the batches that would have followed, on any world size.

    With `grad_accum` K > 1 each global batch is yielded as its micro-batches
    (`accumulation.micro_batches`), one after the other, each planned on its own; take
    all `num_micro_batches` of them before `state_dict()`.

    `outlier_delay` G (at least 2): WLB-LLM's outlier delay over G groups
    (`outlier_queue.py`).
    """

    def __init__(self, corpus: Corpus, *, global_tokens: int, plan_fn: Callable[[tuple[int, ...]], Plan],
                 rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 max_doc_tokens: int | None = None, max_epochs: int | None = None,
                 layout: str = "attention", prefetch: bool = True, grad_accum: int = 1,
                 outlier_delay: int | None = None):
        if global_tokens < world_size:
            raise InputError(f"global token budget {global_tokens} is smaller than one token per rank "
                             f"({world_size} ranks)")
        if max_doc_tokens is not None and max_doc_tokens < 1:
            raise InputError(f"max document tokens must be positive, got {max_doc_tokens}")
        if outlier_delay is not None and (type(outlier_delay) is not int or outlier_delay < 2):
            raise InputError(f"outlier delay must be an integer of at least 2 groups, got {outlier_delay!r}")
        if layout not in LAYOUTS:
            raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.corpus, self.plan_fn = corpus, plan_fn
        self.global_tokens, self.max_doc_tokens, self.max_epochs = global_tokens, max_doc_tokens, max_epochs
        self.rank, self.world_size, self.layout, self.prefetch = rank, world_size, layout, prefetch
        self.seed, self.shuffle, self.grad_accum, self.outlier_delay = seed, shuffle, grad_accum, outlier_delay
        self._order = functools.lru_cache(maxsize=2)(
            lambda epoch: document_order(corpus.num_docs, epoch, seed, shuffle))
        self._cursor = Cursor()

    def _take(self, cursor: Cursor) -> tuple[list[Piece], Cursor]:
        return take_pieces(self.corpus.lengths, self._order, cursor, self.global_tokens, self.max_doc_tokens,
                           self.max_epochs, self.outlier_delay)

    def next_pieces(self) -> list[Piece]:
        """The pieces of the batch after the last yielded one (none at the end)."""
        return self._take(self._cursor)[0]

    def _start(self, pool: ThreadPoolExecutor, cursor: Cursor) -> tuple[Future, Cursor] | None:
        pieces, after = self._take(cursor)
        if not pieces:
            return None
        return pool.submit(self._view, pieces, cursor.batch), after

    def _view(self, pieces: list[Piece], index: int) -> list[RankBatch]:
        """This rank's view of the global batch `pieces`: [it], or its micro-batches."""
        groups = micro_batches([p.end - p.start for p in pieces], self.grad_accum, self.world_size)
        batches = []
        for g in groups:
            try:
                batches.append(build_batch(self.corpus, [pieces[i] for i in g], index, self.plan_fn))
            except InputError as e:  # the planner's "document i" of the micro-batch, as the global batch's
                def globally(m: re.Match, g=g) -> str:
                    return f"document {g[int(m.group(1))]}" if int(m.group(1)) < len(g) else m.group(0)

                raise InputError(re.sub(r"document (\d+)", globally, str(e))) from None
        for batch in batches:
            if batch.plan.num_ranks != self.world_size:
                raise ValueError(f"batch {batch.index}: the plan has {batch.plan.num_ranks} ranks, "
                                 f"the loader {self.world_size}")
        valid = sum(b.num_valid_tokens for b in batches)
        return [rank_view(b, self.rank, self.layout, pin=torch.cuda.is_available(), num_valid_tokens_global=valid,
                          micro_batch=i, num_micro_batches=len(batches)) for i, b in enumerate(batches)]

    def __iter__(self) -> Iterator[RankBatch]:
        with ThreadPoolExecutor(1, thread_name_prefix="ballonet-plan") as pool:
            pending = self._start(pool, self._cursor)
            while pending is not None:
                future, after = pending
                views = future.result()
                if self.prefetch:
                    pending = self._start(pool, after)
                self._cursor = after
                yield from views
                if not self.prefetch:
                    pending = self._start(pool, after)

    def state_dict(self) -> dict:
        """The stream position after the last yielded batch (the same on every rank)."""
        c = self._cursor
        return {"epoch": c.epoch, "position": c.position, "offset": c.offset, "batch": c.batch,
                "waiting": queue_state(c.waiting), **self._config()}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batch `state` was taken at; call before iterating."""
        for key, value in self._config().items():
            if state.get(key) != value:
                raise InputError(f"loader state was saved with {key}={state.get(key)!r}, this loader has {value!r}")
        cursor = Cursor(state["epoch"], state["position"], state["offset"], state["batch"],
                        queue_from_state(state.get("waiting", []), epoch=state["epoch"], corpus=self.corpus,
                                         groups=self.outlier_delay))
        num_docs = self.corpus.num_docs
        if not 0 <= cursor.position <= num_docs:
            raise InputError(f"loader state: position {cursor.position} is outside the corpus's {num_docs} documents")
        doc = int(self._order(cursor.epoch)[cursor.position]) if cursor.position < num_docs else None
        length = 0 if doc is None else int(self.corpus.lengths[doc])
        if not 0 <= cursor.offset < max(length, 1):  # at the end of an epoch, offset 0
            raise InputError(f"loader state: offset {cursor.offset} is outside the {length} tokens of the document "
                             f"at position {cursor.position}")
        self._cursor = cursor

    def _config(self) -> dict:
        return {"num_docs": self.corpus.num_docs, "num_tokens": self.corpus.num_tokens,
                "global_tokens": self.global_tokens, "max_doc_tokens": self.max_doc_tokens,
                "seed": self.seed, "shuffle": self.shuffle, "outlier_delay": self.outlier_delay}
