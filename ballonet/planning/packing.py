"""Greedy packing shared by every planner: LPT over slots of equal or unequal speed,
spreading a splittable document's work over as few slots as hold it, and apportioning an
integer total in proportion to weights under caps."""

from __future__ import annotations

from collections.abc import Iterable
from heapq import heapify, heappop, heappush, heapreplace

import numpy as np

from ballonet.errors import InfeasiblePlan

__all__ = ["NoRoom", "apportion", "charge", "lpt", "spread"]


class NoRoom(Exception):
    """A greedy step found no slot with memory for document `doc`."""

    def __init__(self, doc: int = -1):
        super().__init__(doc)
        self.doc = doc


def lpt(docs: Iterable[int], work, lengths: list[int], load: np.ndarray, speed: np.ndarray,
        token_room: np.ndarray, spill: list[int] | None = None) -> dict[int, list[int]]:
    """Whole documents, largest first, each to the slot that would finish it earliest
    ((load + work) / speed) among those with memory for it; ties to the lower slot.
    `work` is [D], or [slots, D] when a document costs more on some slots (unrelated
    machines; largest first by its least cost). Updates `load` and `token_room`; returns
    {slot: docs}. A document no slot has memory for raises `NoRoom`, or is appended to
    `spill` when given."""
    per_slot = isinstance(work, np.ndarray) and work.ndim == 2  # (np.ndim would copy a list each call)
    if per_slot and (work == work[0]).all():
        work, per_slot = work[0], False  # alike slots (a homogeneous cluster): the cheaper heap below
    if per_slot:
        ids = np.array(list(docs), dtype=np.int64)
        order = ids[np.lexsort((ids, -np.min(work, axis=0)[ids]))].tolist()  # ties in document order
        return _lpt_uniform(order, work, lengths, load, speed, token_room, spill)
    costs = work.tolist() if isinstance(work, np.ndarray) else work  # (indexing an array one by one is slow)
    if isinstance(work, np.ndarray) and len(docs := list(docs)) > 64:  # (level 1: every document of the batch)
        ids = np.array(docs, dtype=np.int64)
        order = ids[np.lexsort((ids, -work[ids]))].tolist()  # ties in document order
    else:
        order = sorted(sorted(docs), key=costs.__getitem__, reverse=True)  # ties in document order
    speeds = speed.tolist()
    if speeds and speeds.count(speeds[0]) < len(speeds):
        return _lpt_uniform(order, work, lengths, load, speed, token_room, spill)
    loads, rooms = load.tolist(), token_room.tolist()
    heap = list(zip(loads, range(len(loads))))  # equal speeds: least loaded finishes first
    heapify(heap)
    # Slots without room for the last document wait in `parked` (most room first) until a
    # shorter one comes: under tight caps most slots are full for the long documents, and
    # popping them past every document would cost O(slots) each.
    parked: list[tuple[float, float, int]] = []
    # A slot's load lives in its heap (or parked) entry alone until the end.
    out: dict[int, list[int]] = {}
    replace, pop, push = heapreplace, heappop, heappush
    for d in order:
        L = lengths[d]
        while parked and -parked[0][0] >= L:
            _, li, i = pop(parked)
            push(heap, (li, i))
        while heap and rooms[heap[0][1]] < L:
            li, i = pop(heap)
            push(parked, (-rooms[i], li, i))
        if not heap:
            if spill is None:
                raise NoRoom(d)
            spill.append(d)
            continue
        li, i = heap[0]
        got = out.get(i)
        if got is None:
            out[i] = [d]
        else:
            got.append(d)
        rooms[i] -= L
        replace(heap, (li + costs[d], i))  # (li + float(c) is li + c where li or c is a float, as here)
    for li, i in heap:
        loads[i] = li
    for _, li, i in parked:
        loads[i] = li
    load[:] = loads
    token_room[:] = rooms
    return out


def _lpt_uniform(order, work, lengths, load, speed, token_room, spill) -> dict[int, list[int]]:
    """`lpt` on slots of unequal speed (uniform machines), one vector step per document."""
    out: dict[int, list[int]] = {}
    per_slot = isinstance(work, np.ndarray) and work.ndim == 2  # (np.ndim would copy a list)
    costs = work.T if per_slot else work.tolist() if isinstance(work, np.ndarray) else work  # (work.T[d]: d's per slot)
    finish = np.empty(len(load))
    rooms = token_room.tolist()  # (read one by one; `token_room` kept alike for the mask)
    least = min(rooms) if rooms else np.inf  # every slot has room for a document up to it
    add, divide = np.add, np.divide
    for d in order:
        w, L = costs[d], lengths[d]
        add(load, w, out=finish)
        divide(finish, speed, out=finish)
        if L > least:
            finish[token_room < L] = np.inf
            i = int(finish.argmin())
            if finish[i] == np.inf:
                if spill is None:
                    raise NoRoom(d)
                spill.append(d)
                continue
        else:
            i = int(finish.argmin())
        got = out.get(i)
        if got is None:
            out[i] = [d]
        else:
            got.append(d)
        load[i] += w[i] if per_slot else w
        rooms[i] = left = rooms[i] - L
        token_room[i] = left
        if left < least:
            least = left
    return out


def spread(room: np.ndarray, token_room: np.ndarray, work: float, per_token: float,
          max_slots: int | None = None) -> dict[int, float]:
    """Spread `work` (of a document costing `per_token` per token) over as few slots as
    possible, most room first: {slot: work share}; at most `max_slots` while their memory
    holds it. Slots are bounded by their token room; what no room takes goes to the slots
    with most free tokens (those already taken first), as few as hold it: a document
    spilled under full caps would otherwise ring over every slot."""
    # On lists: a node has a few slots, where numpy's per-call cost is most of the work.
    caps = [min(r if r > 0.0 else 0.0, t * per_token) for r, t in zip(room.tolist(), token_room.tolist())]
    shares: dict[int, float] = {}
    left = work
    for i in sorted(range(len(caps)), key=caps.__getitem__, reverse=True):  # most room first, ties to the lower slot
        if left <= 0 or caps[i] <= 0 or len(shares) == max_slots:
            break
        take = min(caps[i], left)
        shares[i] = take
        left -= take
    if left > 1e-9 * work:
        free = token_room * per_token - np.array([shares.get(i, 0.0) for i in range(len(room))])
        if free.sum() < left * (1 - 1e-9):
            raise NoRoom
        free = free.tolist()
        for i in sorted(range(len(free)), key=lambda i: (i not in shares, -free[i])):
            if left <= 1e-9 * work:
                break
            if free[i] <= 0:
                continue
            take = min(free[i], left)
            shares[i] = shares.get(i, 0.0) + take
            left -= take
    return shares


def charge(shares: dict[int, float], d: int, work, lengths, load, token_room, out: dict | None = None) -> None:
    """Add a document's work shares {slot: work} to `load` and take their tokens from
    `token_room`; record them as `out[d]`."""
    for i, w in shares.items():
        load[i] += w
        token_room[i] -= w * lengths[d] / work[d]
        if out is not None:
            out.setdefault(d, {})[i] = w


def apportion(total: int, weights: np.ndarray, caps: np.ndarray | None = None) -> np.ndarray:
    """Integers summing to `total` in proportion to `weights` (largest remainder, ties to
    the lower index), none above its cap: capped shares are fixed and the rest re-spread."""
    weights = np.asarray(weights, dtype=float)
    n = len(weights)
    caps = np.full(n, np.iinfo(np.int64).max // 4, dtype=np.int64) if caps is None else np.asarray(caps, np.int64)
    out = np.zeros(n, dtype=np.int64)
    free = np.ones(n, dtype=bool)
    left = total
    while left > 0 and free.any():
        w = np.where(free, weights, 0.0)
        if w.sum() <= 0:
            w = free.astype(float)
        ideal = left * w / w.sum()
        over = free & (ideal >= caps - out)
        if over.any():
            left -= int((caps - out)[over].sum())
            out[over] = caps[over]
            free &= ~over
            continue
        base = np.floor(ideal).astype(np.int64)
        rest = left - int(base.sum())
        frac = np.where(free, ideal - base, -1.0)
        order = np.lexsort((np.arange(n), -frac))
        base[order[:rest]] += 1
        out += base
        left = 0
    if left > 0:
        raise InfeasiblePlan(f"{total} tokens do not fit under the memory caps")
    return out
