"""Step 0 and step 1 of the partitioner: each document's class (local, split inside a
node, split across nodes) and level 1, the documents' nodes (docs/design.md, section 4).

`level_nodes` makes both under one recomputation's memory caps (`NodeLevel`), for the
single rings; `with_level1` makes a level 1 from given classes, which the search's
variant levels (`variants.py`) call with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from ballonet.cost.seconds import attention_work, breakeven_chunk_tokens, dp_piece_seconds
from ballonet.planning.devices import Devices
from ballonet.planning.packing import NoRoom, charge, lpt, spread
from ballonet.planning.pricing import (
    StepWeights,
    inter_node_span,
    linear_work_per_token,
    step_weights,
)
from ballonet.planning.ring_pricing import ring_exposed_seconds
from ballonet.planning.zeppelin.state import Batch, Crossover, node_ranks
from ballonet.planning.zeppelin.thresholds import THRESHOLDS
from ballonet.planning.zeppelin.water import split_work, water_level
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["Level1", "NodeLevel", "classify", "crossover_lengths", "level1", "level_nodes", "node_seconds",
           "node_tokens", "with_level1"]


@dataclass(frozen=True)
class Level1:
    """Step 1's outcome: the documents' nodes."""
    node_load: np.ndarray
    """[nodes] attention work each node got (peak-FLOP units)."""
    node_docs: dict[int, list[int]]
    """Per node, the documents it holds whole (or splits over its own ranks)."""
    shares: dict[int, dict[int, float]]
    """Per document split across nodes, each of its nodes' attention work."""


@dataclass(frozen=True)
class NodeLevel:
    """Steps 0-1 of a batch under one recomputation's memory caps: what the remap and the
    keep-tokens plans share (neither reads `Batch.linear_on_rank`)."""
    batch: Batch
    rank_token: np.ndarray
    """[R] linear work per token of each rank's GPU type (0 without `price_linear`)."""
    intra: np.ndarray
    level1: Level1 | None
    """None without hierarchy (every split document over all ranks)."""
    node_seconds: float
    """The busiest node's step compute as level 1 left it (its attention and linear work
    over its ranks' speed; no communication, no tensor parallelism): about what its
    busiest rank's will be once level 2 evens the node out (0 without hierarchy)."""
    inter: np.ndarray
    """[D] the documents step 0 sent across nodes."""
    span: dict[int, int]
    """Of `inter`, the number of nodes pricing sent each to (`classify`)."""
    weights: StepWeights
    per_token: float
    """Linear work per token in level 1 (0 without `price_linear`)."""
    double: bool
    """Priced for "double" rings across nodes (`doubled_level`)."""


def crossover_lengths(cluster: ClusterSpec, model: ModelSpec) -> list[Crossover]:
    """Per node group: the lengths above which a document's ring hides its transfers
    inside a node (`intra`) and across two nodes (`inter`)."""
    out = []
    for g in cluster.groups:
        ranks_per_node = g.gpus_per_node // model.tp
        c_intra = breakeven_chunk_tokens(model, g.gpu_type, g.intra_bw)
        c_inter = breakeven_chunk_tokens(model, g.gpu_type, g.nic_bw / g.gpus_per_nic, nic=True)
        out.append(Crossover(intra=2 * c_intra if ranks_per_node > 1 else None, inter=2 * ranks_per_node * c_inter,
                             intra_bw=g.intra_bw, crossing_bw=g.nic_bw,
                             rank_nic_bw=g.nic_bw / g.gpus_per_nic,
                             rails=max(1, min(g.gpus_per_node // g.gpus_per_nic, ranks_per_node)),
                             dp_piece=dp_piece_seconds(model, g, cluster.num_nodes)))
    return out


def classify(batch: Batch, nodes, per_token: float, weights: StepWeights, *, hierarchical: bool, double: bool,
             routing: bool) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
    """(intra, inter, span): masks of the documents split inside a node / across nodes
    (module docstring), and the number of nodes of each inter-node document that pricing
    sent there. A document whose attention plus linear work is over a node's share (and
    that one node's memory holds) goes across nodes when the node's overload it saves is
    more than the ring's exposed communication would cost, over as many nodes as leave the
    least of the two (`pricing.inter_node_span`: crossing hops routed over the nodes' rails
    with `routing`; with `double`, priced as a "double" ring, counting the tokens its node
    must hold under binding caps). Without `price_linear` (no step weights) the crossover
    rule alone sends it: across nodes from the inter-node crossover up."""
    L, work, dev, crossovers = batch.length_array, batch.work, batch.dev, batch.crossovers
    speed = dev.speed
    rank_share = work.sum() * speed.max() / speed.sum()
    step = work + per_token * L
    node_speed = max(speed[rs].sum() for rs in nodes)
    node_share = step.sum() * node_speed / speed.sum()
    l_intra = min((t.intra for t in crossovers if t.intra), default=None)
    l_inter = min(t.inter for t in crossovers)
    can_intra = (L >= l_intra) if l_intra else np.zeros(len(L), dtype=bool)
    intra = (L > dev.token_cap.max()) | ((work > rank_share) & can_intra)
    inter, span = np.zeros(len(L), dtype=bool), {}
    if hierarchical and len(nodes) > 1:
        node_tokens = max(dev.token_cap[rs].sum() for rs in nodes)
        # With `double`: under memory caps that bind, a node holds at least the tokens the
        # other nodes cannot, so a document's node also carries that many tokens' linear
        # work; and every document over a node's share is priced, above the crossover too.
        least = max(float(L.sum()) - (dev.token_cap.sum() - node_tokens), 0.0) if double else 0.0
        heavy = step + np.maximum(least - L, 0.0) * per_token > node_share
        inter = (L > node_tokens) | (heavy & (L >= l_inter))
        n = max(len(rs) for rs in nodes)
        rank_nic = min(t.rank_nic_bw if double else t.crossing_bw for t in crossovers)
        to_price = heavy & ~(L > node_tokens)
        for d in np.nonzero(to_price)[0] if per_token > 0 else ():  # priced with `price_linear` only
            k = inter_node_span(batch.model, batch.gpu, int(L[d]), step[d], node_share, n, len(nodes), rank_nic,
                                node_speed, weights, min_tokens=least, fill_per_token=per_token,
                                intra_bw=min(t.intra_bw for t in crossovers) if double else None,
                                routed=(min(t.intra_bw for t in crossovers), min(t.rails for t in crossovers))
                                if routing and not double else None,
                                dp_piece=max(t.dp_piece for t in crossovers))
            inter[d] = k > 1
            if k > 1:
                span[int(d)] = k
    return intra & ~inter, inter, span


def level1(batch: Batch, nodes, intra, inter, span: dict[int, int], per_token: float,
           weights: StepWeights | None, rank_token: np.ndarray) -> Level1 | None:
    """Step 1: inter-node documents fill the nodes with most room (one priced to `span[d]`
    nodes goes to that many, leaving them level); the rest go whole to nodes by LPT
    (documents to split inside a node only to nodes of 2 or more ranks); a document no
    node has memory for is spread across nodes. None when a document has no room (a
    greedy step's `NoRoom`)."""
    try:
        return _level1(batch, nodes, intra, inter, span, per_token, weights, rank_token)
    except NoRoom:
        return None


def _level1(batch: Batch, nodes, intra, inter, span: dict[int, int], per_token: float,
            weights: StepWeights | None, rank_token: np.ndarray) -> Level1:
    lengths, att = batch.lengths, batch.work
    work = att + per_token * batch.length_array
    facts = node_ranks(batch, nodes)
    node_speed = np.array([f.speed_sum for f in facts])
    node_target = work.sum() * node_speed / node_speed.sum()
    node_load = np.zeros(len(nodes))
    node_room = np.array([f.token_sum for f in facts], dtype=float)
    shares: dict[int, dict[int, float]] = {}
    for d in sorted(np.nonzero(inter)[0].tolist(), key=lambda d: (-work[d], d)):
        got = _span_nodes(node_target - node_load, node_load, node_speed, node_room, work[d], work[d] / lengths[d],
                          span[d]) if d in span else None
        if got is None:
            got = spread(node_target - node_load, node_room, work[d], work[d] / lengths[d])
        charge(got, d, work, lengths, node_load, node_room, out=shares)
    node_token = np.array([rank_token[rs[0]] for rs in nodes])  # a node's own GPUs' linear work per token
    node_work = _node_work(batch, nodes, weights)
    if node_work.ndim == 1 and (node_token == node_token[0]).all():  # alike nodes: one row, no [nodes, D] copies
        per_node = node_work + node_token[0] * batch.length_array
    else:
        per_node = node_work + node_token[:, None] * batch.length_array
    node_docs: dict[int, list[int]] = {}
    multi = np.array([len(rs) > 1 for rs in nodes])
    spill: list[int] = []
    intra, inter = np.asarray(intra, dtype=bool), np.asarray(inter, dtype=bool)
    for docs, pool in ((np.nonzero(intra)[0].tolist(), multi if multi.any() else ~multi),
                       (np.nonzero(~intra & ~inter)[0].tolist(), np.ones(len(nodes), bool))):
        idx = np.nonzero(pool)[0]
        sub_load, sub_room = node_load[idx], node_room[idx]
        cost = per_node if per_node.ndim == 1 or len(idx) == len(nodes) else per_node[idx]
        for i, ds in lpt(docs, cost, lengths, sub_load, node_speed[idx], sub_room, spill).items():
            node_docs.setdefault(int(idx[i]), []).extend(ds)
        node_load[idx], node_room[idx] = sub_load, sub_room
    for d in spill:
        got = spread(node_target - node_load, node_room, work[d], work[d] / lengths[d])
        charge(got, d, work, lengths, node_load, node_room, out=shares)
    att_shares = {d: {n: w * att[d] / work[d] for n, w in sh.items()} for d, sh in shares.items()}
    node_att = np.zeros(len(nodes))  # each node's documents added in their order (`np.add.at`: one by one)
    if node_docs:
        np.add.at(node_att, np.repeat(list(node_docs), [len(ds) for ds in node_docs.values()]),
                  att[list(chain.from_iterable(node_docs.values()))])
    for sh in att_shares.values():
        for n, w in sh.items():
            node_att[n] += w
    return Level1(node_load=node_att, node_docs=node_docs, shares=att_shares)


def _span_nodes(room, load, speed, token_room, work: float, per_token: float, k: int) -> dict[int, float] | None:
    """`work` over the `k` nodes with most room, leaving them level relative to speed
    ({node: work}), or None when their memory cannot hold it."""
    chosen = np.argsort(-room, kind="stable")[:k]
    got = water_level(load[chosen], speed[chosen], np.ones(k), token_room[chosen] * per_token, work)
    if got.sum() < work * (1 - THRESHOLDS.rounding):
        return None
    return {int(n): float(x) for n, x in zip(chosen, got) if x > 0}


def _node_work(batch: Batch, nodes, weights: StepWeights | None) -> np.ndarray:
    """[nodes, D] work of each document if it goes whole to each node ([D] where every
    node's is alike): a document above
    a rank's fair share there (and above the node group's intra-node crossover) will be
    split over about work / share of its ranks, at their shorter blocks' efficiency, and
    (with `weights`) its ring's exposed transfers on the node's own links are added
    (`ring_pricing.ring_exposed_seconds`: nothing over NVLink, much over PCIe). With `weights`,
    one that node cannot split (below its crossover, or a node of one rank) also counts
    the wait it leaves the node's other ranks: (work - fair share) each. On a mixed
    cluster the same document is split more, so costs more, on slower nodes. Made once per
    batch, nodes and weights (`Batch.memo`: the search's level 1s of one batch share it)."""
    key = ("node_work", weights, tuple(map(tuple, nodes)))
    if key not in batch.memo:
        batch.memo[key] = _node_work_of(batch, nodes, weights)
        batch.memo[key].setflags(write=False)
    return batch.memo[key]


def _node_work_of(batch: Batch, nodes, weights: StepWeights | None) -> np.ndarray:
    lengths, work, dev = batch.lengths, batch.work, batch.dev
    L = batch.length_array
    rows: dict[tuple, np.ndarray] = {}  # alike nodes (most of a cluster) share one row
    of_node = []
    for rs in nodes:
        fair = work.sum() * dev.speed[rs].max() / dev.speed.sum()
        cross = batch.crossovers[dev.group[rs[0]]]
        l_intra = cross.intra if len(rs) > 1 else None
        key = (fair, l_intra, len(rs), cross.intra_bw, dev.gpu[rs[0]].name)
        if key not in rows:
            row = work.copy()
            heavy = work > fair
            for d in np.nonzero(heavy & (L >= l_intra))[0] if l_intra is not None else ():
                members = min(np.ceil(work[d] / fair), len(rs))
                row[d] = max(work[d], split_work(batch.model, lengths[d], members, batch.gpu))
                if weights is not None:
                    exposed = ring_exposed_seconds(batch.model, dev.gpu[rs[0]], lengths[d], int(members),
                                                   cross.intra_bw, nic=False)
                    row[d] += exposed * dev.speed[rs].sum() / (weights.attention_step * batch.model.num_layers)
            if weights is not None:
                whole = heavy & ~(L >= l_intra) if l_intra is not None else heavy
                row[whole] += (work[whole] - fair) * (len(rs) - 1)
            rows[key] = row
        of_node.append(rows[key])
    return of_node[0] if len(rows) == 1 else np.array(of_node)


def level_nodes(lengths, dev: Devices, crossovers, model: ModelSpec, *, hierarchical: bool, price_linear: bool,
                routing: bool) -> NodeLevel | None:
    """Steps 0-1 for single rings under the caps of `model.recompute` (`NodeLevel`); None
    when level 1 finds a document no room."""
    R, nodes = dev.num_ranks, dev.nodes()
    gpu = dev.gpu[int(np.argmax(dev.speed))]
    work = attention_work(model, lengths, gpu)
    # A document above a rank's fair share will be split over about work / share ranks,
    # whose shorter blocks run at a lower kernel efficiency: count it at that efficiency.
    # The share is the fastest rank's (it goes to the fastest ranks first).
    fair = work.sum() * dev.speed.max() / dev.speed.sum()
    for d in np.nonzero(work > fair)[0]:
        for _ in range(THRESHOLDS.work_rounds):  # fixed point: more members, shorter blocks, more work
            work[d] = split_work(model, lengths[d], min(np.ceil(work[d] / fair), R), gpu)
    tp_bw = [crossovers[g].intra_bw for g in dev.group]  # a TP group's GPUs share a node
    weights = step_weights(model, gpu, lengths, R, tp_bw[int(np.argmax(dev.speed))])
    per_token = weights.linear_per_token if price_linear else 0.0
    tokens = sum(lengths) / R
    by_group = {g: linear_work_per_token(model, dev.gpu[r], tokens, weights.attention_step, tp_bw[r])
                for g, r in ((g, dev.group.index(g)) for g in set(dev.group))}  # at each group's first rank
    rank_token = np.array([by_group[g] for g in dev.group]) if price_linear else np.zeros(R)
    batch = Batch(lengths=lengths, length_array=np.asarray(lengths, dtype=float), work=work,
                  work_list=work.tolist(), dev=dev, model=model, gpu=gpu, crossovers=crossovers,
                  linear_on_rank=np.zeros(R))
    classes = classify(batch, nodes, per_token, weights, hierarchical=hierarchical, double=False, routing=routing)
    return with_level1(batch, weights, per_token, rank_token, classes, hierarchical=hierarchical,
                        price_linear=price_linear, double=False, widen=True)


def with_level1(batch: Batch, weights: StepWeights, per_token: float, rank_token: np.ndarray, classes, *,
                 hierarchical: bool, price_linear: bool, double: bool, widen: bool = False) -> NodeLevel | None:
    """`NodeLevel` from step 0's classes ((intra, inter, span) of `classify`); None when
    level 1 finds a document no room. With `widen` (step 0's own levels, single and
    double, and `backward_level`), `_widened`."""
    nodes = batch.dev.nodes()
    intra, inter, span = classes
    lv = None
    if hierarchical:
        lv = level1(batch, nodes, intra, inter, span, per_token, weights if price_linear else None, rank_token)
        if lv is None:
            return None
        if widen and price_linear:
            lv, span = _widened(batch, nodes, intra, inter, span, per_token, weights, rank_token, lv)
    return NodeLevel(batch=batch, rank_token=rank_token, intra=intra, inter=inter, span=span, level1=lv,
                     node_seconds=node_seconds(batch, nodes, lv, rank_token, weights) if lv else 0.0,
                     weights=weights, per_token=per_token, double=double)


def _node_totals(batch: Batch, nodes, lv: Level1, rank_token: np.ndarray) -> np.ndarray:
    """[nodes] each node's attention plus linear work after level 1, over its ranks' speed."""
    tokens = node_tokens(batch, nodes, lv)
    return np.array([(lv.node_load[n] + rank_token[rs[0]] * tokens[n]) / f.speed_sum
                     for n, (rs, f) in enumerate(zip(nodes, node_ranks(batch, nodes)))])


def _widened(batch: Batch, nodes, intra, inter, span: dict[int, int], per_token: float, weights: StepWeights,
             rank_token: np.ndarray, lv: Level1) -> tuple[Level1, dict[int, int]]:
    """(level 1, spans), where level 1 leaves its busiest node over `Thresholds.widen_over`
    times the mean node and that node holds a share of a document across nodes, with the
    heaviest such document over one more node, if that lowers the busiest node. `classify`
    prices a span against a node's share of the step, but the node also takes its share of
    the other documents' linear work (under binding caps about a full node's tokens), and
    level 1 counts a long document at the kernel efficiency of its fair share's blocks:
    its ring's nodes end well over the others (C, 128 GPUs, llama3-8b, wlbllm 64K: 64K
    documents' double rings over 2 of 16 nodes left their nodes 11-13% over the mean node,
    2.223 -> 2.170 s simulated with one of them over 3 nodes). Once: widening again, or
    in every variant level 1 (`spread_level`, `recomputed.recomputed_levels`), changed no
    scale-grid plan for the better and cost up to 20 more level 1s (11% of the planning
    time) on bench/planner.py's batch at 1024 GPUs (`Thresholds.widen_over`)."""
    totals = _node_totals(batch, nodes, lv, rank_token)
    busiest = int(np.argmax(totals))
    if totals[busiest] <= (1 + THRESHOLDS.widen_over) * totals.mean():
        return lv, span
    docs = [d for d, sh in lv.shares.items() if busiest in sh and d in span and span[d] < len(nodes)]
    if not docs:
        return lv, span
    d = max(docs, key=lambda d: batch.work[d])
    wider = {**span, d: span[d] + 1}
    got = level1(batch, nodes, intra, inter, wider, per_token, weights, rank_token)
    if got is None or _node_totals(batch, nodes, got, rank_token).max() >= totals[busiest]:
        return lv, span
    return got, wider


def node_seconds(batch: Batch, nodes, lv: Level1, rank_token: np.ndarray, weights: StepWeights) -> float:
    """`NodeLevel.node_seconds` from level 1's node loads and the tokens each node holds."""
    node_att = lv.node_load
    tokens = node_tokens(batch, nodes, lv)
    per_node = [(node_att[n] + rank_token[rs[0]] * tokens[n]) / f.speed_sum
                for n, (rs, f) in enumerate(zip(nodes, node_ranks(batch, nodes)))]
    return max(per_node) * weights.attention_step * batch.model.num_layers


def node_tokens(batch: Batch, nodes, lv: Level1) -> np.ndarray:
    """[nodes] tokens each node holds after level 1."""
    lengths, work = batch.lengths, batch.work
    tokens = np.array([float(sum(map(lengths.__getitem__, lv.node_docs.get(n, ())))) for n in range(len(nodes))])
    for d, sh in lv.shares.items():
        for n, w in sh.items():
            tokens[n] += w * lengths[d] / work[d]
    return tokens
