"""Step 3 of the partitioner: level each split document over its members (zeppelin.py).

A split document can be cut anywhere (`assembly.zigzag_bounds` gives a member exactly the
tokens asked, at work proportional to them), so once the greedy steps have chosen which
ranks share a document, its tokens are re-spread by water-filling until the members end
level relative to their speed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ballonet import cost_model, hardware
from ballonet.errors import InfeasiblePlan
from ballonet.planning.assembly import Placement
from ballonet.planning.devices import Devices
from ballonet.planning.packing import NoRoom, apportion
from ballonet.planning.state import Batch, RankFill
from ballonet.specs import ModelSpec

__all__ = ["SWEEPS", "Levels", "Sweep", "refine", "split_work", "water_level"]


def water_level(base: np.ndarray, speed: np.ndarray, unit: np.ndarray, cap: np.ndarray, total: float) -> np.ndarray:
    """Amounts x (sum `total`, 0 <= x <= cap) making (base + unit * x) / speed as level as
    possible: x_i = clip((level * speed_i - base_i) / unit_i, 0, cap_i) at the one level
    where they sum to `total` (every slot at its cap when the caps hold less)."""
    b, s, u, c = base.tolist(), speed.tolist(), unit.tolist(), cap.tolist()
    slots = [i for i in range(len(b)) if c[i] > 0]
    if total <= 0 or not slots:
        return np.zeros(len(b))
    if sum(c[i] for i in slots) <= total:
        return np.where(cap > 0, cap, 0.0)
    # The filled amount grows piecewise linearly with the level: slot i adds s_i / u_i per
    # unit of level between b_i / s_i (its start) and (b_i + u_i c_i) / s_i (its cap).
    events = []
    for i in slots:
        rate = s[i] / u[i]
        events += [(b[i] / s[i], rate), ((b[i] + u[i] * c[i]) / s[i], -rate)]
    events.sort(key=lambda e: e[0])
    filled, rate, at = 0.0, 0.0, events[0][0]
    for point, change in events:
        more = filled + rate * (point - at)
        if more >= total and rate > 0:
            break
        filled, at, rate = more, point, rate + change
    else:  # the caps hold `total` only up to rounding
        return np.where(cap > 0, cap, 0.0)
    level = at + (total - filled) / rate
    return np.clip((level * speed - base) / unit, 0.0, np.where(cap > 0, cap, 0.0))


def split_work(model: ModelSpec, length: int, num_members: float, gpu=None) -> float:
    """Work of a document split over `num_members` ranks: its FLOPs at the kernel
    efficiency of blocks of length / num_members rows (on `gpu`'s profile)."""
    block = max(length / max(num_members, 1.0), 1.0)
    return cost_model.attention_flops(model, length) / model.tp / hardware.attention_efficiency(block, gpu)


class Sweep(enum.Enum):
    """What a sweep over the split documents does besides re-levelling each one."""
    LEVEL = "level"
    """Re-level only (and only documents whose members or efficiency changed)."""
    DROP = "drop slivers"
    """Members left with under a quarter of the mean block leave rings of 3 or more: the
    ring's large blocks pass through a sliver hop by hop, and its short steps hide none of
    their transfers."""
    GROW = "grow"
    """While a document's members end over the mean level, a rank of their nodes joins."""


SWEEPS = (Sweep.LEVEL, Sweep.DROP, Sweep.GROW, Sweep.LEVEL, Sweep.DROP, Sweep.LEVEL)
"""The last re-levelling can leave slivers again: they are dropped once more and the rest
re-levelled (on the main grid of `bench/paper.py` this took 0.5% off the mean step, on
batches of another seed too)."""


@dataclass
class Levels:
    """Per rank work and tokens while split documents are re-spread, and per split
    document its members, the tokens each holds and their work per token."""
    dev: Devices
    load: np.ndarray
    """[R] work (peak-FLOP units)."""
    tokens: np.ndarray
    """[R] tokens held."""
    node: np.ndarray
    """[R] node of each rank."""
    node_ranks: list[np.ndarray]
    mean_level: float
    """Work over speed of a perfectly level cluster."""
    members: dict[int, np.ndarray]
    held: dict[int, np.ndarray]
    unit: dict[int, np.ndarray]
    node_tokens: dict[int, dict[int, float]]
    """Per document split across nodes, its tokens in each node: fixed by level 1, which
    balanced nodes on attention plus linear work (levelling attention alone across nodes
    would undo that)."""

    def spread(self, d: int, m: np.ndarray, unit: np.ndarray, length: int) -> np.ndarray:
        """Tokens of document `d` for members `m` making them level (`water_level`), node
        by node for a document split across nodes while its nodes have room for their share."""
        shares = self.node_tokens.get(d)
        node = self.node[m]
        room = self.room(m)
        if shares and set(shares) == set(node.tolist()) and \
                all(room[node == n].sum() >= t for n, t in shares.items()):
            held = np.zeros(len(m))
            for n, t in shares.items():
                on = node == n
                held[on] = water_level(self.load[m[on]], self.dev.speed[m[on]], unit[on], room[on], t)
            return held
        return water_level(self.load[m], self.dev.speed[m], unit, room, length)

    def take(self, d: int) -> None:
        """Remove document `d`'s current shares from its members."""
        m = self.members[d]
        self.load[m] -= self.unit[d] * self.held[d]
        self.tokens[m] -= self.held[d]

    def put(self, d: int) -> None:
        m = self.members[d]
        self.load[m] += self.unit[d] * self.held[d]
        self.tokens[m] += self.held[d]

    def level_of(self, m: np.ndarray) -> float:
        return (self.load[m] / self.dev.speed[m]).max()

    def room(self, m: np.ndarray) -> np.ndarray:
        return np.maximum(self.dev.token_cap[m] - self.tokens[m], 0.0)


def _start(batch: Batch, fill: RankFill, docs: list[int], local_tokens: np.ndarray) -> Levels:
    """Levels with each split document's tokens in proportion to its members' work shares."""
    dev, lengths, work_list = batch.dev, batch.lengths, batch.work_list
    load = np.array([sum(work_list[d] for d in ds) for ds in fill.local], dtype=float)
    load += batch.linear_on_rank * local_tokens  # ranks that keep their tokens: their linear work too
    node = np.asarray(dev.node)
    st = Levels(dev=dev, load=load, tokens=local_tokens.astype(float), node=node, node_ranks=[np.array(rs) for rs in dev.nodes()],
                mean_level=0.0, members={}, held={}, unit={}, node_tokens={})
    for d in docs:
        st.members[d] = np.array(sorted(fill.split_shares[d]))
        w = np.array([fill.split_shares[d][r] for r in st.members[d]])
        st.held[d] = w * lengths[d] / w.sum() if w.any() else w
        nodes = node[st.members[d]]
        if len(set(nodes.tolist())) > 1:
            st.node_tokens[d] = {int(n): float(st.held[d][nodes == n].sum()) for n in sorted(set(nodes.tolist()))}
        st.unit[d] = np.full(len(w), split_work(batch.model, lengths[d], max(np.count_nonzero(w), 1), batch.gpu)
                             / lengths[d]) + batch.linear_on_rank[st.members[d]]
        st.put(d)
    st.mean_level = st.load.sum() / dev.speed.sum()
    return st


def refine(batch: Batch, fill: RankFill) -> Placement:
    """Step 3: re-spread each split document's tokens over its members so that members end
    level relative to their speed. A member holding T of the L tokens does about T/L of
    the document's FLOPs at the kernel efficiency of a T-token block; the efficiency is
    taken from the previous sweep. While a document's members end over the mean level,
    the least busy rank of their nodes joins them; members left with under a quarter of
    the mean block are dropped (not worth a ring seat). Tokens stay under memory caps."""
    dev, lengths, model = batch.dev, batch.lengths, batch.model
    R = dev.num_ranks
    local_tokens = np.array([sum(lengths[d] for d in docs) for docs in fill.local], dtype=np.int64)
    docs = sorted(fill.split_shares, key=lambda d: (-batch.work[d], d))
    st = _start(batch, fill, docs, local_tokens)
    per_token = {d: cost_model.attention_flops(model, lengths[d]) / model.tp / lengths[d] for d in docs}
    stamp, done, clock = np.zeros(R, dtype=np.int64), dict.fromkeys(docs, 0), 0  # skip documents already level
    for sweep in SWEEPS:
        for d in docs:
            m, held = st.members[d], st.held[d]
            new_unit = (per_token[d] / hardware.attention_efficiency_array(held, batch.gpu)
                        + batch.linear_on_rank[m]) if held.any() else st.unit[d]
            dropping = sweep is Sweep.DROP and len(m) > 2
            if not dropping and stamp[m].max() <= done[d] and (np.abs(new_unit - st.unit[d]) <= 1e-3 * np.abs(st.unit[d])).all() \
                    and (sweep is not Sweep.GROW or st.level_of(m) <= 1.01 * st.mean_level):
                continue
            st.take(d)
            st.unit[d] = new_unit
            if dropping:
                keep = held >= 0.25 * held.mean()
                if keep.sum() >= 2 and st.room(m[keep]).sum() >= lengths[d]:
                    st.members[d], st.held[d], st.unit[d] = m[keep], held[keep], st.unit[d][keep]
            m = st.members[d]
            st.held[d] = st.spread(d, m, st.unit[d], lengths[d])
            if sweep is Sweep.GROW:
                _grow(st, d, lengths[d])
            st.put(d)
            clock += 1
            stamp[st.members[d]], done[d] = clock, clock
    return _placement(fill, st, docs, local_tokens, lengths)


def _placement(fill: RankFill, st: Levels, docs: list[int], local_tokens: np.ndarray, lengths) -> Placement:
    """Whole token counts for the members of each split document, under memory caps."""
    placement = Placement(num_ranks=st.dev.num_ranks, local=[list(ds) for ds in fill.local])
    room = st.dev.token_cap - local_tokens
    for d in docs:
        m = st.members[d]
        try:
            counts = apportion(lengths[d], st.held[d], np.maximum(room[m], 0))
        except InfeasiblePlan:
            raise NoRoom from None
        room[m] -= counts
        placement.split[d] = {int(r): int(c) for r, c in zip(m, counts) if c > 0}
    return placement


def _grow(st: Levels, d: int, length: int) -> None:
    """While document `d`'s members end over the mean level, the least busy rank of their
    nodes (with memory to spare) joins (its shares not yet put back on its members)."""
    m, held, unit, dev = st.members[d], st.held[d], st.unit[d], st.dev
    for _ in range(len(m)):
        level = ((st.load[m] + unit * held) / dev.speed[m]).max()
        if level <= 1.01 * st.mean_level:
            break
        pool = np.setdiff1d(np.concatenate([st.node_ranks[n] for n in sorted({dev.node[r] for r in m})]), m)
        pool = pool[dev.token_cap[pool] > st.tokens[pool]]
        if len(pool) == 0:
            break
        new = pool[np.argmin(st.load[pool] / dev.speed[pool])]
        if st.load[new] / dev.speed[new] >= level:
            break
        m = np.sort(np.append(m, new))
        unit = np.full(len(m), unit.mean())
        held = st.spread(d, m, unit, length)
    st.members[d], st.held[d], st.unit[d] = m, held, unit
