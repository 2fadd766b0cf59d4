"""Step 3 of the partitioner: level each split document over its members.

A split document can be cut anywhere (`assembly.zigzag_bounds` gives a member exactly the
tokens asked, at work proportional to them), so once the greedy steps have chosen which
ranks share a document, its tokens are re-spread by water-filling until the members end
level relative to their speed.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import attention_flops
from ballonet.errors import InfeasiblePlan
from ballonet.planning.assembly import Placement
from ballonet.planning.devices import Devices
from ballonet.planning.packing import NoRoom
from ballonet.planning.zeppelin.state import Batch, RankFill
from ballonet.planning.zeppelin.thresholds import THRESHOLDS
from ballonet.planning.zeppelin.water import ordered_sum, water_level_list

__all__ = ["SWEEPS", "Levels", "Sweep", "refine"]


class Sweep(enum.Enum):
    """What a sweep over the split documents does besides re-levelling each one."""
    LEVEL = "level"
    """Re-level only (and, after the first sweep, only documents whose members or
    efficiency changed)."""
    DROP = "drop slivers"
    """Members left with under `Thresholds.sliver` of the mean block leave rings of 3 or
    more (a ring with none is only re-levelled, like `LEVEL`): the ring's large blocks
    pass through a sliver hop by hop, and its short steps hide none of their transfers.
    A sliver stays when its rank is at its memory cap and its block still hides a
    transfer inside the node (`Levels.breakeven`): no other work could take its seat, and
    dropping it would leave the others above it. A ring with one such block among slivers
    keeps its two largest holders. (Measured: docs/planner_evidence.md, step 3.)"""
    GROW = "grow"
    """While a document's members end over the mean level, a rank of their nodes joins."""


SWEEPS = (Sweep.LEVEL, Sweep.DROP, Sweep.GROW, Sweep.LEVEL, Sweep.DROP, Sweep.LEVEL)
"""The last re-levelling can leave slivers again: they are dropped once more and the rest
re-levelled (docs/planner_evidence.md, step 3)."""


@dataclass
class Levels:
    """Per rank work and tokens while split documents are re-spread, and per split
    document its members, the tokens each holds and their work per token. Plain lists:
    rings have a few members, and refinement visits each hundreds of times."""
    load: list[float]
    """[R] work (peak-FLOP units)."""
    tokens: list[float]
    """[R] tokens held."""
    speed: list[float]
    cap: list[float]
    """[R] token caps."""
    node: list[int]
    """[R] node of each rank."""
    node_ranks: list[list[int]]
    mean_level: float
    """Work over speed of a perfectly level cluster."""
    members: dict[int, list[int]]
    held: dict[int, list[float]]
    unit: dict[int, list[float]]
    node_tokens: dict[int, dict[int, float]]
    """Per document split across nodes, its tokens in each node: fixed by level 1, which
    balanced nodes on attention plus linear work (levelling attention alone across nodes
    would undo that)."""
    breakeven: list[float]
    """[R] tokens of a ring block whose step hides its transfer inside the rank's node
    (half the node group's intra-node crossover; inf on a node of one rank)."""

    def spread(self, d: int, m: list[int], unit: list[float], length: int) -> list[float]:
        """Tokens of document `d` for members `m` making them level (`water_level`), node
        by node for a document split across nodes while its nodes have room for their share."""
        shares = self.node_tokens.get(d)
        cap, tokens, load, speed = self.cap, self.tokens, self.load, self.speed
        room = [0.0 if (x := cap[r] - tokens[r]) < 0.0 else x for r in m]  # (`room`, inline)
        if not shares:
            return water_level_list([load[r] for r in m], [speed[r] for r in m], unit, room, length)
        node = [self.node[r] for r in m]
        by_node = {n: [i for i, x in enumerate(node) if x == n] for n in shares}
        if set(shares) == set(node) and all(sum(room[i] for i in by_node[n]) >= t for n, t in shares.items()):
            held = [0.0] * len(m)
            for n, t in shares.items():
                on = by_node[n]
                part = water_level_list([load[m[i]] for i in on], [speed[m[i]] for i in on], [unit[i] for i in on],
                                        [room[i] for i in on], t)
                for i, x in zip(on, part):
                    held[i] = x
            return held
        return water_level_list([load[r] for r in m], [speed[r] for r in m], unit, room, length)

    def level_of(self, m: list[int]) -> float:
        return max(self.load[r] / self.speed[r] for r in m)

    def room(self, m: list[int]) -> list[float]:
        cap, tokens = self.cap, self.tokens
        return [0.0 if (x := cap[r] - tokens[r]) < 0.0 else x for r in m]


def _start(batch: Batch, fill: RankFill, docs: list[int], local_tokens: np.ndarray, attention: dict[int, float],
           efficiency) -> Levels:
    """Levels with each split document's tokens in proportion to its members' work shares
    (`attention`: per split document, its FLOPs per GPU of its tensor-parallel group;
    `efficiency`: the kernel efficiency at a block length, as `split_work`)."""
    dev, lengths, work_list = batch.dev, batch.lengths, batch.work_list
    load = np.array([sum(map(work_list.__getitem__, ds)) for ds in fill.local], dtype=float)
    load += batch.linear_on_rank * local_tokens  # ranks that keep their tokens: their linear work too
    load = load.tolist()
    node = list(dev.node)
    tokens = local_tokens.astype(float).tolist()
    members, all_held, units, node_tokens = {}, {}, {}, {}
    linear = batch.linear_on_rank.tolist()
    breakeven = {g: (batch.crossovers[g].intra or np.inf) / 2 for g in set(dev.group)}
    for d in docs:
        shares = fill.split_shares[d]
        m = sorted(shares)
        w = [shares[r] for r in m]
        length = lengths[d]
        total = ordered_sum(w)
        held = [x * length / total for x in w] if any(w) else list(w)
        members[d], all_held[d] = m, held
        nodes = sorted({node[r] for r in m})
        if len(nodes) > 1:
            node_tokens[d] = {n: ordered_sum([h for r, h in zip(m, held) if node[r] == n]) for n in nodes}
        block = max(length / max(sum(1 for x in w if x), 1), 1.0)
        per_token = attention[d] / efficiency(block) / length
        units[d] = unit = [per_token + linear[r] for r in m]
        for r, u, h in zip(m, unit, held):
            load[r] += u * h
            tokens[r] += h
    return Levels(load=load, tokens=tokens, speed=dev.speed.astype(float).tolist(),
                  cap=dev.token_cap.astype(float).tolist(), node=node, node_ranks=dev.nodes(),
                  mean_level=float(np.sum(load) / dev.speed.sum()), members=members, held=all_held, unit=units,
                  node_tokens=node_tokens, breakeven=list(map(breakeven.__getitem__, dev.group)))


def refine(batch: Batch, fill: RankFill) -> Placement:
    """Step 3: re-spread each split document's tokens over its members so that members end
    level relative to their speed. A member holding T of the L tokens does about T/L of
    the document's FLOPs at the kernel efficiency of a T-token block; the efficiency is
    taken from the previous sweep. While a document's members end over the mean level,
    the least busy rank of their nodes joins them; members left with under a quarter of
    the mean block are dropped (not worth a ring seat; the two largest stay). Tokens stay
    under memory caps."""
    dev, lengths, model = batch.dev, batch.lengths, batch.model
    R = dev.num_ranks
    local_tokens = np.array([sum(map(lengths.__getitem__, docs)) for docs in fill.local], dtype=np.int64)
    work = batch.work_list
    docs = sorted(fill.split_shares, key=lambda d: (-work[d], d))
    flops = attention_flops(model, [lengths[d] for d in docs]).tolist()
    attention = {d: f / model.tp for d, f in zip(docs, flops)}
    efficiency = functools.cache(hardware.profile(batch.gpu).attention_forward.at_one)  # blocks recur across sweeps
    st = _start(batch, fill, docs, local_tokens, attention, efficiency)
    linear, load, tokens = batch.linear_on_rank.tolist(), st.load, st.tokens
    per_token = {d: attention[d] / lengths[d] for d in docs}
    # Every document is levelled in the first sweep, even one whose members level 2 gave
    # alike shares: the whole documents it placed after them are what the shares must
    # even out (docs/planner_evidence.md, step 3).
    stamp, done, clock = [0] * R, dict.fromkeys(docs, -1), 0
    settled: set[int] = set()  # units checked against their shares since they last moved
    sliver, grow_level, change = THRESHOLDS.sliver, THRESHOLDS.grow_above * st.mean_level, THRESHOLDS.settled_change
    members, helds, units, stamp_of = st.members, st.held, st.unit, stamp.__getitem__
    keeps_none = not any(linear)  # (x + 0.0 is x for the positive units: the sum left out)
    for sweep in SWEEPS:
        drop, grow = sweep is Sweep.DROP, sweep is Sweep.GROW
        shared = _Shared.of(st) if grow else None
        for d in docs:
            m, held, unit = members[d], helds[d], units[d]
            dropping = drop and len(m) > 2 and min(held) < sliver * sum(held) / len(held)
            still = not dropping and max(map(stamp_of, m)) <= done[d] and (not grow or st.level_of(m) <= grow_level)
            if still and d in settled:
                continue
            pt = per_token[d]
            if not any(held):
                new_unit = unit
            elif keeps_none:
                new_unit = [pt / efficiency(h) for h in held]
            else:
                new_unit = [pt / efficiency(h) + linear[r] for r, h in zip(m, held)]
            if still and all(abs(a - b) <= change * abs(b) for a, b in zip(new_unit, unit)):
                settled.add(d)
                continue
            settled.discard(d)
            for r, u, h in zip(m, unit, held):  # (`take`, inline)
                load[r] -= u * h
                tokens[r] -= h
            st.unit[d] = new_unit
            if dropping:
                floor = sliver * sum(held) / len(held)
                room = st.room(m)
                keep = [i for i, h in enumerate(held) if h >= floor
                        or (room[i] - h < floor and h >= st.breakeven[m[i]])]
                if len(keep) < 2:  # one large block among slivers: a ring of its two largest
                    keep = sorted(sorted(range(len(held)), key=lambda i: -held[i])[:2])
                if sum(st.room([m[i] for i in keep])) >= lengths[d]:
                    st.members[d] = [m[i] for i in keep]
                    st.held[d] = [held[i] for i in keep]
                    st.unit[d] = [new_unit[i] for i in keep]
            m = st.members[d]
            st.held[d] = st.spread(d, m, st.unit[d], lengths[d])
            if shared is not None:
                _grow(st, d, lengths[d], shared)
            clock += 1
            for r, u, h in zip(st.members[d], st.unit[d], st.held[d]):  # (`put`, inline)
                load[r] += u * h
                tokens[r] += h
                stamp[r] = clock
            done[d] = clock
    return _placement(fill, st, docs, local_tokens, lengths, dev)


def _placement(fill: RankFill, st: Levels, docs: list[int], local_tokens: np.ndarray, lengths,
               dev: Devices) -> Placement:
    """Whole token counts for the members of each split document, under memory caps. The
    shares fit as real numbers; when the rounding of earlier documents leaves a document's
    members a few tokens short, those tokens move along rings to ranks with room
    (`_make_room`) rather than failing the plan. The placement takes `fill.local` as it is
    (refinement is the fill's last reader)."""
    placement = Placement(num_ranks=dev.num_ranks, local=fill.local)
    room = (dev.token_cap - local_tokens).tolist()
    for d in docs:
        m = st.members[d]
        caps = [x if (x := room[r]) > 0 else 0 for r in m]
        short = lengths[d] - sum(caps)
        if short > 0:
            _make_room(placement.split, room, m, short)
            caps = [x if (x := room[r]) > 0 else 0 for r in m]
        try:
            counts = _apportion_list(lengths[d], st.held[d], caps)
        except InfeasiblePlan:
            raise NoRoom from None
        for r, c in zip(m, counts):
            room[r] -= c
        placement.split[d] = {r: c for r, c in zip(m, counts) if c > 0}
    return placement


def _apportion_list(total: int, weights: list[float], caps: list[int]) -> list[int]:
    """`packing.apportion` on lists (a ring has a few members, where numpy's per-call cost
    is most of the work); `ordered_sum` adds the weights as numpy does."""
    n = len(weights)
    out = [0] * n
    free = [True] * n
    left = total
    while left > 0 and any(free):
        w = [x if f else 0.0 for x, f in zip(weights, free)]
        w_sum = ordered_sum(w)
        if w_sum <= 0:
            w = [float(f) for f in free]
            w_sum = ordered_sum(w)
        ideal = [left * x / w_sum for x in w]
        over = [f and x >= float(c - o) for f, x, c, o in zip(free, ideal, caps, out)]
        if any(over):
            for i in range(n):
                if over[i]:
                    left -= caps[i] - out[i]
                    out[i] = caps[i]
                    free[i] = False
            continue
        base = [math.floor(x) for x in ideal]
        rest = left - sum(base)
        frac = [x - b if f else -1.0 for x, b, f in zip(ideal, base, free)]
        for i in sorted(range(n), key=frac.__getitem__, reverse=True)[:rest]:  # (stable: ties to the lower index)
            base[i] += 1
        out = [o + b for o, b in zip(out, base)]
        left = 0
    if left > 0:
        raise InfeasiblePlan(f"{total} tokens do not fit under the memory caps")
    return out


def _make_room(split: dict[int, dict[int, int]], room: list[int], ranks: list[int], tokens: int) -> None:
    """Free `tokens` tokens on `ranks`, one at a time: find a chain of placed split
    documents, each holding a token on a rank it can move to the next of its members,
    that ends on a rank with room (breadth first, so chains stay short), and shift one
    token along it. Raises `NoRoom` when no chain exists."""
    for _ in range(tokens):
        came_from: dict[int, tuple[int, int] | None] = {r: None for r in ranks}
        frontier, end = list(ranks), None
        while frontier and end is None:
            nxt = []
            for r in frontier:
                for e, shares in split.items():
                    if shares.get(r, 0) <= 0:
                        continue
                    for r2 in shares:
                        if r2 not in came_from:
                            came_from[r2] = (r, e)
                            if room[r2] > 0:
                                end = r2
                                break
                            nxt.append(r2)
                    if end is not None:
                        break
                if end is not None:
                    break
            frontier = nxt
        if end is None:
            raise NoRoom
        r2 = end
        while (step := came_from[r2]) is not None:  # document e moves one token from r to r2
            r, e = step
            split[e][r] -= 1
            split[e][r2] += 1
            if not split[e][r]:
                del split[e][r]
            room[r] += 1
            room[r2] -= 1
            r2 = r


def _grow(st: Levels, d: int, length: int, shared: _Shared) -> None:
    """While document `d`'s members end over the mean level, the least busy rank of their
    nodes (with memory to spare) that `_Shared.taken` leaves it joins (its shares not yet
    put back on its members)."""
    m, held, unit = st.members[d], st.held[d], st.unit[d]
    load, speed = st.load, st.speed
    for _ in range(len(m)):
        level = max((load[r] + u * h) / speed[r] for r, u, h in zip(m, unit, held))
        if level <= THRESHOLDS.grow_above * st.mean_level:
            break
        inside = set(m)
        pool = sorted(r for n in sorted({st.node[r] for r in m}) for r in st.node_ranks[n]
                      if r not in inside and not shared.taken(r) and st.cap[r] > st.tokens[r])
        if not pool:
            break
        new = min(pool, key=lambda r: load[r] / speed[r])
        if load[new] / speed[new] >= level:
            break
        m = sorted(m + [new])
        shared.join(new)
        unit = [sum(unit) / len(unit)] * len(m)
        held = st.spread(d, m, unit, length)
    st.members[d], st.held[d], st.unit[d] = m, held, unit



@dataclass
class _Shared:
    """Which ranks hold a split document's share, for `_grow`: it gives no ring a member
    of another. A ring moves step by step behind its transfers and, in the backward, each
    member's partial dK/dV; a rank in two rings holds both chains to its own pace: a
    short document's ring on members of a longer one made that ring wait several times
    its estimate (a 121K-token ring over 18 ranks of cluster A exposed 2.8 s against
    0.5 s for its like rings; a 36K-token ring over 4 ranks of a node 0.5-1.0 s against
    0.16 s; issue 49)."""
    rings: dict[int, int]
    """Per rank, the split documents it holds a share of."""

    @classmethod
    def of(cls, st: Levels) -> _Shared:
        rings: dict[int, int] = {}
        for ms in st.members.values():
            for r in ms:
                rings[r] = rings.get(r, 0) + 1
        return cls(rings=rings)

    def taken(self, rank: int) -> bool:
        """Whether `rank` (not yet a member) may not join a ring."""
        return rank in self.rings

    def join(self, rank: int) -> None:
        self.rings[rank] = self.rings.get(rank, 0) + 1
