"""Step 2 of the partitioner (level 2): one node's documents onto its ranks.

The documents to split there and the node's shares of inter-node documents fill the
ranks with most room up to their targets, levelled over those ranks in a ring of 3 or
more; local documents go by LPT, and what no rank has memory for is spread over the
fewest ranks that hold it. Under memory caps that nearly bind, a second fill balances
the work beyond the light documents' mean per token instead (`node_fill`), and the node
keeps whichever ends more level. Then a busiest rank that holds only whole documents
splits its largest with the least busy (`split_to_level`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ballonet.planning.packing import charge, lpt, spread
from ballonet.planning.zeppelin.state import Batch, NodeRanks, RankFill
from ballonet.planning.zeppelin.thresholds import THRESHOLDS
from ballonet.planning.zeppelin.water import ordered_sum, water_level, water_level_list

__all__ = ["NodeFill", "level2", "node_fill", "split_to_level"]


def level2(batch: Batch, fill: RankFill, node: NodeRanks, node_work: float, docs: list[int],
           inter_water: list[tuple[float, int]], min_length: float | None, stepped: dict[float, Batch]) -> None:
    """Step 2, one node: `node_fill`, and once more on the excess over the light
    documents' mean work per token when the first leaves a rank at its memory cap; the
    fill whose busiest rank is least busy is kept; then `split_to_level`. On a node that
    keeps its tokens (no remap inside it), work is attention plus linear work (`stepped`:
    per linear work per token, the batch with it added, shared by alike nodes)."""
    ranks = node.ranks
    per_token = float(batch.linear_on_rank[ranks[0]])
    if per_token:
        if per_token not in stepped:
            with_linear = batch.work + per_token * batch.length_array
            stepped[per_token] = dataclasses.replace(batch, work=with_linear, work_list=with_linear.tolist())
        size, att, step = batch.lengths, batch.work_list, stepped[per_token].work_list  # (lists: read one by one)
        node_work += sum([per_token * size[d] for d in docs]) + \
            sum([w * per_token * size[d] / att[d] for w, d in inter_water])
        inter_water = [(w * step[d] / att[d], d) for w, d in inter_water]
        batch = stepped[per_token]
    lengths, work, speed = batch.lengths, batch.work_list, node.speed
    target = node_work * speed / node.speed_sum
    most_tokens, fair = node.most_tokens, float(target.max())
    splits = ([d for d in docs if lengths[d] > most_tokens] if min_length is None else
              [d for d in docs if (k := lengths[d]) > most_tokens or (k >= min_length and work[d] > fair)])
    water = inter_water + [(work[d], d) for d in splits]
    split_set = set(splits)
    whole = [d for d in docs if d not in split_set]
    fills = [node_fill(batch, target, fill.token_room[ranks], speed, water, whole)]
    if water and whole and (fills[0].room < node.near_cap).any():
        mean = sum([work[d] for d in whole]) / sum([lengths[d] for d in whole])
        light = [d for d in whole if work[d] <= mean * lengths[d]]  # none when rounding puts all above
        if light:
            dense = sum([work[d] for d in light]) / sum([lengths[d] for d in light])  # the light ones' mean
            fills.append(node_fill(batch, target, fill.token_room[ranks], speed, water, whole, dense, mean,
                                   min_length))
    if len(fills) == 1:
        best = fills[0]
    else:  # the fill whose busiest rank is least busy, `(f.load / speed).max()` on lists
        speeds = speed.tolist()
        best = min(fills, key=lambda f: max([x / s for x, s in zip(f.load.tolist(), speeds)]))
    rank_of = ranks.tolist()
    for i, ds in best.local.items():
        fill.local[rank_of[i]] = ds
    for d, sh in best.shares.items():
        got = fill.split_shares.setdefault(d, {})
        for i, w in sh.items():
            got[rank_of[i]] = w
    load, room = best.load, best.room
    if min_length is not None:
        in_water = {r for d in best.shares for r in fill.split_shares.get(d, ())}  # split ranks of this node
        split_to_level(batch, fill, ranks, load, speed, min_length, in_water)
    fill.token_room[ranks] = room


@dataclass
class NodeFill:
    """One way of filling a node's ranks (`node_fill`): slot-indexed."""
    local: dict[int, list[int]]
    shares: dict[int, dict[int, float]]
    """Per split document, the work share of each slot."""
    load: np.ndarray
    room: np.ndarray


def node_fill(batch: Batch, target: np.ndarray, room: np.ndarray, speed: np.ndarray,
              water: list[tuple[float, int]], whole: list[int], dense: float = 0.0, heavy: float = 0.0,
              min_block: float | None = None) -> NodeFill:
    """Fill a node's ranks: split documents (`water`: (work, doc)) fill the ranks with
    most room up to their targets, levelled over them in a ring of 3 or more (`_levelled`),
    then whole documents go by LPT, and what no rank has memory for is spread over the node.

    With `dense` > 0 (under caps that nearly bind), every rank is taken to end with about
    its cap of tokens, the rest made up by documents of about `dense` work per token (the
    light ones): what must then be even is the work beyond `dense` per token. So the whole
    documents of over `heavy` work per token go first by LPT on that excess, the split
    documents raise the ranks to one level of excess (each over at most length /
    `min_block` ranks, so that its blocks still hide their transfers), and the light
    documents fill the rooms by LPT on their work. Otherwise the ring ranks spend their
    targets on a few long-document tokens and the others fill up with short documents to
    their caps, under target (docs/planner_evidence.md, step 2)."""
    lengths, work = batch.lengths, batch.work_list  # (floats: numpy's scalars are slower, alike in value)
    room, load = room.astype(float), np.zeros(len(target))
    shares: dict[int, dict[int, float]] = {}
    spill: list[int] = []
    local: dict[int, list[int]] = {}
    rest = whole
    if dense > 0:
        over = {d: work[d] - dense * lengths[d] for d in whole}
        dense_docs = [d for d in whole if work[d] > heavy * lengths[d]]
        rest = [d for d in whole if work[d] <= heavy * lengths[d]]
        beyond = {d: 1 - dense * lengths[d] / work[d] for _, d in water}
        excess = np.zeros(len(target))
        local = lpt(dense_docs, over, lengths, excess, speed, room, spill)
        for i, ds in local.items():
            load[i] += sum(work[d] for d in ds)
        # The split documents' excess raises the ranks to one level (`water_level`).
        fluid = sum(w * beyond[d] for w, d in water if beyond[d] > 0)
        excess_target = excess + water_level(excess, speed, np.ones(len(target)), np.full(len(target), np.inf),
                                             fluid)
    for w, d in sorted(water, key=lambda x: (-x[0], x[1])):
        if dense > 0 and (b := beyond[d]) > 0:
            got = spread(excess_target - excess, room, w * b, b * work[d] / lengths[d],
                         max(2, int(lengths[d] // min_block)) if min_block else None)
            for i, x in got.items():
                excess[i] += x
            got = {i: x / b for i, x in got.items()}
        else:
            got = _levelled(spread(target - load, room, w, work[d] / lengths[d]), load, speed, room, w,
                            work[d] / lengths[d])
        charge(got, d, work, lengths, load, room, out=shares)
    packed = lpt(rest, batch.work_list, lengths, load, speed, room, spill)
    if local:
        for i, ds in packed.items():
            local.setdefault(i, []).extend(ds)
    else:
        local = packed
    for d in spill:
        got = spread(target - load, room, float(work[d]), work[d] / lengths[d])
        charge(got, d, work, lengths, load, room, out=shares)
    return NodeFill(local=local, shares=shares, load=load, room=room)


def _levelled(got: dict[int, float], load, speed, room, w: float, per_token: float) -> dict[int, float]:
    """A split document's work shares (`spread`), levelled over the same ranks in a ring of
    3 or more. Filled most room first, the last member holds a smaller block and the
    whole documents fill up around it: it then runs more linear work before its K/V can
    go round, and the ring's steps wait for it (where its share is a sliver, refinement
    drops it and leaves the others over their targets). Levelled, the members hold alike
    blocks and alike whole documents. Rings of two stay as filled (levelled, they made
    more configurations longer than shorter: docs/planner_evidence.md, step 2)."""
    if len(got) < 3:
        return got
    slots = sorted(got)
    level = water_level_list(load[slots].tolist(), speed[slots].tolist(), [1.0] * len(slots),
                             (room[slots] * per_token).tolist(), w)
    return {i: x for i, x in zip(slots, level) if x > 0}


def split_to_level(batch: Batch, fill: RankFill, ranks, load, speed, min_length: float, in_water: set[int],
                   tolerance: float = THRESHOLDS.split_tolerance) -> None:
    """Refinement of level 2: while the busiest rank of a node is over the node's mean by
    more than `tolerance` and holds only whole documents, split its largest document that
    is above the intra-node crossover with the least busy rank that holds only whole
    documents too (step 3 levels the two). `load` is the node's, per rank of `ranks`;
    `in_water`, the ranks that hold shares of split documents (updated)."""
    lengths, work, local = batch.lengths, batch.work_list, fill.local
    speeds = speed.tolist()
    speed_sum = ordered_sum(speeds)  # (`speed.sum()`; lists: most nodes return at the first check)
    for _ in range(len(ranks)):
        loads = load.tolist()
        limit = (1 + tolerance) * ordered_sum(loads) / speed_sum
        if not max([x / s for x, s in zip(loads, speeds)]) > limit:
            return
        rel = load / speed
        hi = next((i for i in np.argsort(-rel, kind="stable").tolist() if int(ranks[i]) not in in_water
                   and rel[i] > limit and any(lengths[d] >= min_length for d in local[int(ranks[i])])), None)
        if hi is None:
            return
        lo = next((i for i in np.argsort(rel, kind="stable").tolist() if int(ranks[i]) not in in_water and i != hi),
                  None)
        if lo is None:
            return
        docs = [d for d in local[int(ranks[hi])] if lengths[d] >= min_length]
        d = max(docs, key=lambda d: (work[d], -d))
        local[int(ranks[hi])].remove(d)
        fill.split_shares[d] = {int(ranks[hi]): work[d] / 2, int(ranks[lo]): work[d] / 2}
        in_water |= {int(ranks[hi]), int(ranks[lo])}
        load[hi] -= work[d] / 2
        load[lo] += work[d] / 2


