"""Step 3 of the partitioner: level each split document over its members (planner.py).

A split document can be cut anywhere (`placement.zigzag_bounds` gives a member exactly the
tokens asked, at work proportional to them), so once the greedy steps have chosen which
ranks share a document, its tokens are re-spread by water-filling until the members end
level relative to their speed.
"""

from __future__ import annotations

import numpy as np

from ballonet import cost_model, hardware
from ballonet.errors import InfeasiblePlan
from ballonet.planning.assembly import Placement
from ballonet.planning.devices import Devices
from ballonet.planning.packing import NoRoom, apportion
from ballonet.specs import ModelSpec


def water_level(base: np.ndarray, speed: np.ndarray, unit: np.ndarray, cap: np.ndarray, total: float) -> np.ndarray:
    """Amounts x (sum `total`, 0 <= x <= cap) making (base + unit * x) / speed as level as
    possible: the lowest slots are topped up to a common level; slots that hit their cap
    are fixed there and the level is solved again for the rest."""
    x = np.zeros(len(base))
    free = cap > 0
    left = total
    while left > 0 and free.any():
        idx = np.nonzero(free)[0]
        ratio = base[idx] / speed[idx]
        order = np.argsort(ratio, kind="stable")
        su, bu = (speed[idx] / unit[idx])[order], (base[idx] / unit[idx])[order]
        level = (left + np.cumsum(bu)) / np.cumsum(su)
        j = int(np.argmax(level <= np.append(ratio[order][1:], np.inf)))  # first j: level below slot j+1
        fill = np.maximum(level[j] * speed[idx] - base[idx], 0.0) / unit[idx]
        over = fill > cap[idx]
        if not over.any():
            x[idx] = fill
            break
        hit = idx[over]
        x[hit] = cap[hit]
        left -= cap[hit].sum()
        free[hit] = False
    return x


def split_work(model: ModelSpec, length: int, num_members: float) -> float:
    """Work of a document split over `num_members` ranks: its FLOPs at the kernel
    efficiency of blocks of length / num_members rows."""
    block = max(length / max(num_members, 1.0), 1.0)
    return cost_model.attention_flops(model, length) / model.tp / hardware.attention_efficiency(block)


def refine(lengths, work, dev: Devices, local, split_shares, model: ModelSpec) -> Placement:
    """Step 3: re-spread each split document's tokens over its members so that members end
    level relative to their speed. A member holding T of the L tokens does about T/L of
    the document's FLOPs at the kernel efficiency of a T-token block; the efficiency is
    taken from the previous sweep. While a document's members end over the mean level,
    the least busy rank of their nodes joins them; members left with under a quarter of
    the mean block are dropped (not worth a ring seat). Tokens stay under memory caps."""
    R = dev.num_ranks
    load = np.zeros(R)
    work_list = work.tolist()
    local_tokens = np.array([sum(lengths[d] for d in docs) for docs in local], dtype=np.int64)
    for r, docs in enumerate(local):
        load[r] = sum(work_list[d] for d in docs)
    tokens = local_tokens.astype(float)
    docs = sorted(split_shares, key=lambda d: (-work[d], d))
    members = {d: np.array(sorted(split_shares[d])) for d in docs}
    held, unit = {}, {}
    for d in docs:
        w = np.array([split_shares[d][r] for r in members[d]])
        held[d] = w * lengths[d] / w.sum() if w.any() else w
        unit[d] = np.full(len(w), split_work(model, lengths[d], max(np.count_nonzero(w), 1)) / lengths[d])
        load[members[d]] += unit[d] * held[d]
        tokens[members[d]] += held[d]
    per_token = {d: cost_model.attention_flops(model, lengths[d]) / model.tp / lengths[d] for d in docs}
    node_ranks = [np.array(rs) for rs in dev.nodes()]
    mean_level = load.sum() / dev.speed.sum()
    stamp, done, clock = np.zeros(R, dtype=np.int64), dict.fromkeys(docs, 0), 0  # skip documents already level
    for sweep in range(4):
        for d in docs:
            m = members[d]
            new_unit = per_token[d] / hardware.attention_efficiency_array(held[d]) if held[d].any() else unit[d]
            if (sweep != 1 or len(m) <= 2) and stamp[m].max() <= done[d] and np.allclose(new_unit, unit[d], rtol=1e-3) \
                    and (sweep != 2 or ((load[m] / dev.speed[m]).max() <= 1.01 * mean_level)):
                continue
            load[m] -= unit[d] * held[d]
            tokens[m] -= held[d]
            unit[d] = new_unit
            if sweep == 1 and len(m) > 2:  # drop members with a sliver of the document
                keep = held[d] >= 0.25 * held[d].mean()
                if keep.sum() >= 2:
                    m, held[d], unit[d] = m[keep], held[d][keep], unit[d][keep]
            cap = np.maximum(dev.token_cap[m] - tokens[m], 0.0)
            held[d] = water_level(load[m], dev.speed[m], unit[d], cap, lengths[d])
            if sweep == 2:
                m, held[d], unit[d] = _grow(m, held[d], unit[d], load, tokens, dev, node_ranks, mean_level, lengths[d])
            members[d] = m
            load[m] += unit[d] * held[d]
            tokens[m] += held[d]
            clock += 1
            stamp[m], done[d] = clock, clock
    placement = Placement(num_ranks=R, local=[list(ds) for ds in local])
    room = dev.token_cap - local_tokens
    for d in docs:
        m = members[d]
        try:
            counts = apportion(lengths[d], held[d], np.maximum(room[m], 0))
        except InfeasiblePlan:
            raise NoRoom from None
        room[m] -= counts
        placement.split[d] = {int(r): int(c) for r, c in zip(m, counts) if c > 0}
    return placement


def _grow(m, held, unit, load, tokens, dev: Devices, node_ranks, mean_level: float, length: int):
    """While a split document's members end over the mean level, the least busy rank of
    their nodes (with memory to spare) joins; returns (members, tokens held, unit cost)."""
    for _ in range(len(m)):
        level = ((load[m] + unit * held) / dev.speed[m]).max()
        if level <= 1.01 * mean_level:
            break
        pool = np.setdiff1d(np.concatenate([node_ranks[n] for n in sorted({dev.node[r] for r in m})]), m)
        pool = pool[dev.token_cap[pool] > tokens[pool]]
        if len(pool) == 0:
            break
        new = pool[np.argmin(load[pool] / dev.speed[pool])]
        if load[new] / dev.speed[new] >= level:
            break
        m = np.sort(np.append(m, new))
        unit = np.full(len(m), unit.mean())
        held = water_level(load[m], dev.speed[m], unit, np.maximum(dev.token_cap[m] - tokens[m], 0.0), length)
    return m, held, unit
