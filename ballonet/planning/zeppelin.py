"""The hierarchical sequence partitioner (docs/design.md, section 4).

Every document gets a class, from the cost model and the batch:

* *local*: whole on one rank, no communication;
* *intra-node*: split over ranks of one node (a ring over NVLink);
* *inter-node*: split over ranks of several nodes.

Splitting pays K/V traffic linear in L to save attention work quadratic in L, and only
pays off once a ring step's compute hides its transfer: once each member's block of L/g
rows reaches the break-even chunk c* of the link (`cost.seconds.breakeven_chunk_tokens`).
So the crossover lengths are L_intra = 2 c*_nvlink (two GPUs of a node) and
L_inter = 2 n c*_nic (two whole nodes of n ranks, each crossing hop on one NIC). A
document above a crossover is split only when the batch needs it: when its attention
work exceeds one rank's fair share (intra), or its step share (attention plus linear
work, `pricing.StepWeights`) exceeds one node's (inter). Such a document goes across
nodes, over as many as pay best, only when the overload it would leave on one node costs
more than the wider ring's exposed transfers, its crossing hops routed over the nodes'
rails as the routing layer sends them (`pricing.inter_node_span`, `crossing_seconds`;
above L_inter too: a ring over many nodes has blocks too short to hide even its NVLink
hops); candidate plans' estimates add those exposed transfers to each member
(`crossing_exposed_seconds`). A document that does not fit a rank's (a node's) memory is
split regardless. Splitting more than needed only adds traffic.

Placement, with work in peak-FLOP units so a rank's time is work / its peak:
  Step 1 (level 1, nodes): nodes are balanced on step shares, so the remap can stay
    inside each node. Each inter-node document fills the nodes with the most room left,
    as few as cover it; then the other documents go whole to nodes, largest first, to
    the node that would finish them first, within each node's memory (LPT; on a mixed
    cluster a document that a slower node must split over more ranks costs more there,
    `_node_work`); one that no node can hold whole is spread across nodes.
  Step 2 (level 2, inside each node, on attention work: the remap evens the tokens;
    `node_placement.py`): documents that must be split there, and the node's shares of
    inter-node documents, fill the ranks with the most room, levelled over them in a ring
    of 3 or more (members with alike blocks hold alike local documents, so no ring step
    waits for one); then local documents go to ranks by LPT, within each rank's memory.
    Under caps that nearly bind, where every rank ends with about its cap of tokens, the
    node is filled once more on each document's work beyond the light documents' mean
    per token, and the more level fill is kept. If the busiest rank still holds only
    whole documents and is over the node's mean, its largest document above L_intra is
    split with the least busy such rank.
  Step 3 (refinement): each split document's tokens are re-spread over its members by
    water-filling so that members end level relative to their speed (a split document
    can be cut anywhere: see `assembly.zigzag_bounds`); members join or leave a ring
    when that evens the load (`refinement.py`).
  Step 4: remap targets (each node's tokens over its ranks, in proportion to speed,
    under memory caps) and routes for inter-node hops (`remap.py`, `routing.py`).

The steps run once per recomputation mode the batch fits under, cheapest first, while a
costlier mode could still win (its mean rank, and its level 1's busiest node, are not
already slower than the best plan), steps 2-4 first with every rank keeping its tokens
(no remap; ranks balanced on attention plus linear work) and then with the remap, from
the same level 1, unless the first is already as level as its nodes allow; the plan
with the shortest estimated step is kept: its busiest rank's (`pricing.rank_step_seconds`)
or, when longer, its slowest forward plus its slowest backward, layer by layer
(`pricing.synchronous_step_seconds`).
When the recomputation is left to the partitioner, in a selective or linear plan each
rank recomputes as little as its own tokens need (`cost.recompute.layers_per_rank`) and
is estimated so; it is made as the mode on every layer prices it, and a selective plan
is made whatever that price when the best plan so far has a rank at its memory cap in the
node that sets its step (`_caps_bind`): there a few layers' looser caps may pay.
Then, with `double` (the default), each mode planned is priced once more for "double"
rings across nodes (a ring inside each node, rounds between rail peers: one NIC transfer
a round to hide instead of one a step), where that pricing sends a document across nodes
that single rings keep in one and its level 1 could still beat the best plan; its plans
run such documents as double rings and join the comparison (`_doubled`).
A batch the greedy steps cannot fit under memory caps falls back to cutting the batch in
speed-proportional runs of tokens (valid, not balanced; `meta["fallback"]`).
Without `hierarchical`, a document that must be split spans every rank (the ablation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ballonet.cost.memory import BELOW, RECOMPUTE_MODES, activation_bytes, recompute_layer_count, recompute_mode
from ballonet.cost.recompute import layers_per_rank, most_layers
from ballonet.cost.seconds import attention_work, breakeven_chunk_tokens
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import Plan
from ballonet.planning.assembly import Placement, assemble, with_memory
from ballonet.planning.devices import Devices, check_feasible, check_lengths, devices
from ballonet.planning.node_placement import level2
from ballonet.planning.packing import NoRoom, apportion, charge, lpt, spread
from ballonet.planning.pricing import (
    StepWeights,
    attention_kernels,
    crossing_exposed_seconds,
    inter_node_span,
    linear_work_per_token,
    rank_compute_seconds,
    rank_step_seconds,
    recompute_modes,
    remaps_inside,
    ring_exposed_seconds,
    step_weights,
    synchronous_step_seconds,
)
from ballonet.planning.refinement import refine, split_work, water_level
from ballonet.planning.remap import linear_targets, node_linear_targets, plan_remap
from ballonet.planning.routing import plan_routes
from ballonet.planning.state import Batch, Crossover, RankFill
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["crossover_lengths", "finish", "zeppelin"]


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
                             rails=max(1, min(g.gpus_per_node // g.gpus_per_nic, ranks_per_node))))
    return out


def _classify(batch: Batch, nodes, hierarchical: bool, per_token: float, weights: StepWeights, double: bool,
              routing: bool = True):
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
                                if routing and not double else None)
            inter[d] = k > 1
            if k > 1:
                span[int(d)] = k
    return intra & ~inter, inter, span


def _level1(batch: Batch, nodes, intra, inter, span: dict[int, int], per_token: float,
            weights: StepWeights | None, rank_token: np.ndarray):
    """Step 1: inter-node documents fill the nodes with most room (one priced to `span[d]`
    nodes goes to that many, leaving them level); the rest go whole to nodes by LPT
    (documents to split inside a node only to nodes of 2 or more ranks); a document no
    node has memory for is spread across nodes. Returns (node load, docs per node,
    inter-node shares {doc: {node: work}})."""
    lengths, att, dev = batch.lengths, batch.work, batch.dev
    work = att + per_token * batch.length_array
    node_speed = np.array([dev.speed[rs].sum() for rs in nodes])
    node_target = work.sum() * node_speed / node_speed.sum()
    node_load = np.zeros(len(nodes))
    node_room = np.array([dev.token_cap[rs].sum() for rs in nodes], dtype=float)
    shares: dict[int, dict[int, float]] = {}
    for d in sorted(np.nonzero(inter)[0].tolist(), key=lambda d: (-work[d], d)):
        got = _span_nodes(node_target - node_load, node_load, node_speed, node_room, work[d], work[d] / lengths[d],
                          span[d]) if d in span else None
        if got is None:
            got = spread(node_target - node_load, node_room, work[d], work[d] / lengths[d])
        charge(got, d, work, lengths, node_load, node_room, out=shares)
    node_token = np.array([rank_token[rs[0]] for rs in nodes])  # a node's own GPUs' linear work per token
    per_node = _node_work(batch, nodes, weights) + node_token[:, None] * batch.length_array
    node_docs: dict[int, list[int]] = {}
    multi = np.array([len(rs) > 1 for rs in nodes])
    spill: list[int] = []
    for docs, pool in (([d for d in range(len(lengths)) if intra[d]], multi if multi.any() else ~multi),
                       ([d for d in range(len(lengths)) if not intra[d] and not inter[d]], np.ones(len(nodes), bool))):
        idx = np.nonzero(pool)[0]
        sub_load, sub_room = node_load[idx], node_room[idx]
        for i, ds in lpt(docs, per_node[idx], lengths, sub_load, node_speed[idx], sub_room, spill).items():
            node_docs.setdefault(int(idx[i]), []).extend(ds)
        node_load[idx], node_room[idx] = sub_load, sub_room
    for d in spill:
        got = spread(node_target - node_load, node_room, work[d], work[d] / lengths[d])
        charge(got, d, work, lengths, node_load, node_room, out=shares)
    att_shares = {d: {n: w * att[d] / work[d] for n, w in sh.items()} for d, sh in shares.items()}
    node_att = np.array([sum(att[d] for d in node_docs.get(n, [])) for n in range(len(nodes))])
    for sh in att_shares.values():
        for n, w in sh.items():
            node_att[n] += w
    return node_att, node_docs, att_shares


def _span_nodes(room, load, speed, token_room, work: float, per_token: float, k: int) -> dict[int, float] | None:
    """`work` over the `k` nodes with most room, leaving them level relative to speed
    ({node: work}), or None when their memory cannot hold it."""
    chosen = np.argsort(-room, kind="stable")[:k]
    got = water_level(load[chosen], speed[chosen], np.ones(k), token_room[chosen] * per_token, work)
    if got.sum() < work * (1 - 1e-9):
        return None
    return {int(n): float(x) for n, x in zip(chosen, got) if x > 0}


def _node_work(batch: Batch, nodes, weights: StepWeights | None) -> np.ndarray:
    """[nodes, D] work of each document if it goes whole to each node: a document above
    a rank's fair share there (and above the node group's intra-node crossover) will be
    split over about work / share of its ranks, at their shorter blocks' efficiency, and
    (with `weights`) its ring's exposed transfers on the node's own links are added
    (`pricing.ring_exposed_seconds`: nothing over NVLink, much over PCIe). With `weights`,
    one that node cannot split (below its crossover, or a node of one rank) also counts
    the wait it leaves the node's other ranks: (work - fair share) each. On a mixed
    cluster the same document is split more, so costs more, on slower nodes."""
    lengths, work, dev = batch.lengths, batch.work, batch.dev
    L = batch.length_array
    out = np.tile(work, (len(nodes), 1))
    rows: dict[tuple, np.ndarray] = {}  # alike nodes (most of a cluster) share one row
    for n, rs in enumerate(nodes):
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
        out[n] = rows[key]
    return out


@dataclass(frozen=True)
class _Candidate:
    """A plan one recomputation mode made (`_candidates`)."""
    plan: Plan
    seconds: float
    """Its estimated step."""
    binds: bool
    """Whether caps bind where that step is set (`_caps_bind`)."""
    kernels: tuple
    """Its `pricing.attention_kernels`."""


@dataclass(frozen=True)
class _Nodes:
    """Steps 0-1 of a batch under one recomputation's memory caps: what the remap and the
    keep-tokens plans share (neither reads `Batch.linear_on_rank`)."""
    batch: Batch
    rank_token: np.ndarray
    """[R] linear work per token of each rank's GPU type (0 without `price_linear`)."""
    intra: np.ndarray
    level1: tuple | None
    """`_level1`'s (node load, docs per node, inter-node shares); None without hierarchy."""
    node_seconds: float
    """The busiest node's step compute as level 1 left it (its attention and linear work
    over its ranks' speed; no communication, no tensor parallelism): about what its
    busiest rank's will be once level 2 evens the node out (0 without hierarchy)."""
    inter: np.ndarray
    """[D] the documents step 0 sent across nodes."""
    weights: StepWeights
    per_token: float
    """Linear work per token in level 1 (0 without `price_linear`)."""
    double: bool
    """Priced for "double" rings across nodes (`_doubled`)."""


KEEP_MARGIN = 0.01
"""The remap plan is not made when the keep-tokens plan's busiest rank is within this of
its busiest node's mean compute (on the main grid and the planner bench, seeds 0 and 7,
the remap plan was estimated faster in none of the 48 of 166 cases so skipped)."""

CAP_SLACK = 0.02
"""A rank within this share of its memory is at its cap (`_caps_bind`)."""

NODE_PRUNE_MARGIN = 0.05
"""A recomputation mode is not planned when its level 1 already leaves a node this much
slower than the best plan so far (level 1's estimate is within about 3% of its plans'
estimated step on the main grid of `bench/paper.py` and on `bench/planner.py`)."""


def _nodes(lengths, dev: Devices, crossovers, options: dict, model: ModelSpec) -> _Nodes:
    R, nodes = dev.num_ranks, dev.nodes()
    hierarchical, price_linear = options["hierarchical"], options["price_linear"]
    gpu = dev.gpu[int(np.argmax(dev.speed))]
    work = attention_work(model, lengths, gpu)
    # A document above a rank's fair share will be split over about work / share ranks,
    # whose shorter blocks run at a lower kernel efficiency: count it at that efficiency.
    # The share is the fastest rank's (it goes to the fastest ranks first).
    fair = work.sum() * dev.speed.max() / dev.speed.sum()
    for d in np.nonzero(work > fair)[0]:
        for _ in range(4):  # fixed point: more members, shorter blocks, more work
            work[d] = split_work(model, lengths[d], min(np.ceil(work[d] / fair), R), gpu)
    weights = step_weights(model, gpu, lengths, R)
    per_token = weights.linear_per_token if price_linear else 0.0
    tokens = sum(lengths) / R
    by_type = {g.name: linear_work_per_token(model, g, tokens, weights.attention_step) for g in set(dev.gpu)}
    rank_token = np.array([by_type[g.name] for g in dev.gpu]) if price_linear else np.zeros(R)
    batch = Batch(lengths=lengths, length_array=np.asarray(lengths, dtype=float), work=work,
                  work_list=work.tolist(), dev=dev, model=model, gpu=gpu, crossovers=crossovers,
                  linear_on_rank=np.zeros(R))
    intra, inter, span = _classify(batch, nodes, hierarchical, per_token, weights, False, options["routing"])
    return _level1_nodes(batch, weights, per_token, rank_token, (intra, inter, span), options, double=False)


def _level1_nodes(batch: Batch, weights: StepWeights, per_token: float, rank_token: np.ndarray, classes,
                  options: dict, double: bool) -> _Nodes:
    """`_Nodes` from step 0's classes ((intra, inter, span) of `_classify`)."""
    nodes = batch.dev.nodes()
    intra, inter, span = classes
    level1 = _level1(batch, nodes, intra, inter, span, per_token, weights if options["price_linear"] else None,
                     rank_token) if options["hierarchical"] else None
    return _Nodes(batch=batch, rank_token=rank_token, intra=intra, inter=inter, level1=level1,
                  node_seconds=_node_seconds(batch, nodes, level1, rank_token, weights) if level1 else 0.0,
                  weights=weights, per_token=per_token, double=double)


def _doubled(shared: _Nodes, options: dict) -> _Nodes | None:
    """Steps 0-1 priced for "double" rings across nodes, when that pricing sends a document
    across nodes that single rings keep inside one; otherwise None (the same documents
    cross: planning them as double rings too, as `double` did before 2026-12-02, chose no
    double ring on any batch of the main grid of `bench/paper.py` or of the wlbllm batches
    of `bench/planner.py`, at 2.2-2.8x the planning time)."""
    batch = shared.batch
    if shared.level1 is None or batch.dev.num_nodes < 2:
        return None
    classes = _classify(batch, batch.dev.nodes(), True, shared.per_token, shared.weights, True, options["routing"])
    if not (classes[1] & ~shared.inter).any():
        return None
    return _level1_nodes(batch, shared.weights, shared.per_token, shared.rank_token, classes, options, double=True)


def _node_seconds(batch: Batch, nodes, level1: tuple, rank_token: np.ndarray, weights: StepWeights) -> float:
    """`_Nodes.node_seconds` from level 1's node loads and the tokens each node holds."""
    node_att, node_docs, shares = level1
    lengths, work, speed = batch.lengths, batch.work, batch.dev.speed
    tokens = np.array([float(sum(lengths[d] for d in node_docs.get(n, []))) for n in range(len(nodes))])
    for d, sh in shares.items():
        for n, w in sh.items():
            tokens[n] += w * lengths[d] / work[d]
    per_node = [(node_att[n] + rank_token[rs[0]] * tokens[n]) / speed[rs].sum() for n, rs in enumerate(nodes)]
    return max(per_node) * weights.attention_step * batch.model.num_layers


def _place(shared: _Nodes, keep_tokens: bool) -> tuple[Placement, dict]:
    """Steps 2-3 on `shared`: every rank keeping its tokens, or remapping inside NVLink nodes."""
    dev = shared.batch.dev
    R, nodes, lengths, intra = dev.num_ranks, dev.nodes(), shared.batch.lengths, shared.intra
    keeps = np.array([keep_tokens or not remaps_inside(g) for g in dev.gpu])
    batch = dataclasses.replace(shared.batch, linear_on_rank=np.where(keeps, shared.rank_token, 0.0))
    fill = RankFill(local=[[] for _ in range(R)], split_shares={}, token_room=dev.token_cap.astype(float))
    if shared.level1 is None:  # every split document over all ranks, shares set by refinement
        solid = [d for d in range(len(lengths)) if not intra[d]]
        for i, docs in lpt(solid, batch.work_list, lengths, np.zeros(R), dev.speed, fill.token_room).items():
            fill.local[i] = docs
        fill.split_shares = {int(d): dict.fromkeys(range(R), 0.0) for d in np.nonzero(intra)[0]}
        return refine(batch, fill), {}
    node_load, node_docs, inter_shares = shared.level1
    stepped: dict[float, Batch] = {}
    for n, ranks in enumerate(nodes):
        water = [(w, d) for d, sh in inter_shares.items() if (w := sh.get(n, 0.0)) > 0]
        level2(batch, fill, np.array(ranks), node_load[n], node_docs.get(n, []), water,
                batch.crossovers[dev.group[ranks[0]]].intra, stepped)
    return refine(batch, fill), {"inter_docs": len(inter_shares)}


def _fallback(lengths: list[int], dev: Devices) -> Placement:
    """Runs of the batch in input order, cut at speed-proportional token counts."""
    quota = apportion(sum(lengths), dev.speed, dev.token_cap)
    placement = Placement(num_ranks=dev.num_ranks)
    r = 0
    for d, L in enumerate(lengths):
        parts, left = {}, L
        while left:
            while quota[r] == 0:
                r += 1
            take = min(left, int(quota[r]))
            parts[r] = take
            quota[r] -= take
            left -= take
        if len(parts) == 1:
            placement.local[next(iter(parts))].append(d)
        else:
            placement.split[d] = parts
    return placement


def zeppelin(lengths, cluster: ClusterSpec, model: ModelSpec, *, routing: bool = True, remap: bool = True,
             hierarchical: bool = True, assume_homogeneous: bool = False, price_linear: bool = True,
             price_recompute: bool = True, double: bool = True) -> Plan:
    """The Ballonet planner. `routing`, `remap`, `hierarchical` switch its layers off for
    ablations (without hierarchy a split document spans every rank); `assume_homogeneous`
    plans as if every GPU were the first type (memory caps stay real). `price_linear`
    balances nodes on attention plus linear work, remaps inside nodes only, and keeps
    every rank's tokens instead where that prices shorter (off: attention alone, remap
    across the cluster); `price_recompute` plans for each recomputation the batch fits
    under and keeps the best (off: the model's, full when unset); `double` also
    plans, after the search with single rings, the modes where pricing a ring across nodes
    as a "double" ring (a ring in each node, rounds between rail peers,
    `pricing.double_exposed_seconds`) sends more documents across nodes (off: every ring
    across nodes is one ring through the nodes, its crossing hops routed). The plan's meta
    says what was chosen (`recompute`, `recompute_layers`, `keep_tokens`, `double`) and
    among which plans (`candidates`: the recomputation, its layers, keep_tokens, double
    and estimated step seconds of each)."""
    options = {"routing": routing, "remap": remap, "hierarchical": hierarchical, "assume_homogeneous": assume_homogeneous,
               "price_linear": price_linear, "price_recompute": price_recompute, "double": double}
    for key, value in options.items():
        if not isinstance(value, bool):
            raise InputError(f"zeppelin option {key} must be True or False, got {value!r}")
    lengths = check_lengths(lengths)
    crossovers = crossover_lengths(cluster, model)
    modes = recompute_modes(model) if price_recompute else (recompute_mode(model),)
    trim = price_recompute and model.recompute is None  # selective on as few layers as a plan needs
    best, best_s, best_binds, error, compared = None, np.inf, False, None, []

    def compare(plans: list[_Candidate], dev: Devices, spec: ModelSpec) -> None:
        nonlocal best, best_s, best_binds
        for c in plans:
            compared.append({"recompute": c.plan.meta["recompute"], "keep_tokens": c.plan.meta["keep_tokens"],
                             "recompute_layers": c.plan.meta["recompute_layers"], "estimated_step_s": c.seconds,
                             "double": c.plan.meta["double"]})
            if c.seconds < best_s:
                best, best_s, best_binds = (c.plan, dev, spec), c.seconds, c.binds

    looser = False  # the next mode is planned for its looser caps, whatever its cost on every layer
    planned: list[tuple[ModelSpec, _Nodes]] = []  # each mode's level 1 of single rings, for `double`
    for i, mode in enumerate(modes):
        spec = dataclasses.replace(model, recompute=mode)
        mode_trim = trim and mode in BELOW
        try:
            plans, dev, shared = _candidates(lengths, cluster, spec, crossovers, options,
                                             fallback=i == len(modes) - 1 and best is None,
                                             beat=np.inf if looser else best_s, trim=mode_trim)
        except (NoRoom, InfeasiblePlan) as e:
            error = e
            continue
        if not plans:
            break  # its level 1 already leaves a node slower than the best plan (costlier modes too)
        compare(plans, dev, spec)
        if shared is not None:
            planned.append((spec, shared))
        first = plans[0]
        if i + 1 < len(modes):
            # Selective recomputation on as few layers as a plan needs costs little more than
            # none: where caps bind in the node that sets the step, its looser caps may pay.
            # (Planned so for linear recomputation's looser caps too, on the main grid of
            # bench/paper.py: 10 of 72 batches changed, by -1.5% to +1.0%, at 1.7x the time.)
            looser = trim and modes[i + 1] == "selective" and best_binds
            # A costlier mode's compute of this plan spread over the ranks by speed (on every
            # layer) is already slower than the best plan's estimate:
            if not looser and np.average(rank_compute_seconds(first.plan, dev, spec, modes[i + 1],
                                                              kernels=first.kernels), weights=dev.speed) >= best_s:
                break
    # After the single-ring search, so that it prunes as without `double`; the most
    # promising level 1 first, so that the others' prune meets the best plan it makes.
    doubled = [(d, spec) for spec, shared in planned if double and (d := _doubled(shared, options)) is not None]
    for level1, spec in sorted(doubled, key=lambda x: x[0].node_seconds):
        if level1.node_seconds <= (1 + NODE_PRUNE_MARGIN) * best_s:
            plans, dev, _ = _candidates(lengths, cluster, spec, crossovers, options, fallback=False,
                                        trim=trim and spec.recompute in BELOW, level1=level1)
            compare(plans, dev, spec)
    if best is None:
        raise error
    plan, dev, spec = best
    plan = dataclasses.replace(plan, meta={**plan.meta, "candidates": compared})
    if routing:
        plan = dataclasses.replace(plan, routes=plan_routes(plan, cluster, spec, dev.local_index))
    return plan.validate()


def _crossing_exposed(plan: Plan, dev: Devices, model: ModelSpec, crossovers, routing: bool) -> np.ndarray:
    """[R] what single rings across nodes expose (`pricing.crossing_exposed_seconds`; their
    crossing hops routed over the node's rails with `routing`)."""
    return crossing_exposed_seconds(plan, dev, model, np.array([crossovers[g].intra_bw for g in dev.group]),
                                    np.array([crossovers[g].crossing_bw for g in dev.group]),
                                    np.array([crossovers[g].rails if routing else 1 for g in dev.group]))


def _step_seconds(plan: Plan, dev: Devices, model: ModelSpec, crossovers, compute,
                  routing: bool) -> tuple[np.ndarray, np.ndarray]:
    """[R] what the partitioner compares its candidate plans by (`pricing.rank_step_seconds`),
    and [R] the part of it single rings across nodes expose (`_crossing_exposed`)."""
    exposed = _crossing_exposed(plan, dev, model, crossovers, routing)
    start, linear = compute
    seconds = rank_step_seconds(plan, dev, model, np.array([crossovers[g].intra_bw for g in dev.group]),
                                (start + exposed, linear), np.array([crossovers[g].rank_nic_bw for g in dev.group]))
    return seconds, exposed


def _candidates(lengths, cluster, model, crossovers, options, fallback: bool, beat: float = np.inf,
                trim: bool = False, level1: _Nodes | None = None) -> tuple[list[_Candidate], Devices, _Nodes | None]:
    """The plans of one recomputation (`_Candidate`), under the memory
    caps of `model.recompute`, from one level 1: every rank keeping its tokens (attention
    plus linear work balanced per rank; when pricing may prefer it), then remapping tokens
    inside nodes, unless the keep-tokens plan's busiest rank is already within
    `KEEP_MARGIN` of its busiest node's mean compute (no plan of the same nodes goes below
    that mean, and the remap only adds traffic); none when level 1 leaves a node slower
    than `beat` seconds by `NODE_PRUNE_MARGIN`. A plan the greedy steps cannot fit is left
    out; with `fallback`, a batch they fit no way is cut in runs (`_fallback`) rather than
    refused. With `trim` (selective or linear recomputation), each rank of a plan
    recomputes as little as its tokens need (`cost.recompute.layers_per_rank`), its
    estimate priced so. The level 1 is the single rings' (`_nodes`), or `level1` (one of
    `_doubled`: its plans hold double rings). Returns (plans, devices, the level 1: None
    where the greedy steps failed before it)."""
    dev = devices(cluster, model, options["assume_homogeneous"])
    check_feasible(lengths, dev, model)
    meta = {"options": options, "crossover_lengths": [dataclasses.asdict(t) for t in crossovers],
            "recompute": model.recompute, "recompute_layers": recompute_layer_count(model),
            "keep_tokens": False, "fallback": False}

    def build(placement: Placement, facts: dict, keep: bool, double: bool = False) -> tuple[_Candidate, bool]:
        """(the plan as a candidate, whether its busiest rank is within `KEEP_MARGIN` of its
        busiest node's mean compute)."""
        plan = finish(lengths, dev, placement, {**meta, **facts, "keep_tokens": keep, "double": double},
                       remap=options["remap"] and not keep, node_remap=options["price_linear"],
                       double=double)
        priced, layers = model, recompute_layer_count(model)  # the model's own, or every layer
        if trim:
            lin, att = plan.linear_token_counts, plan.attention_token_counts
            layers = layers_per_rank(model, lin, dev.gpu, dev.num_ranks, att, model.recompute)
            if layers is None:  # (the caps hold every layer's activations of the mode; rounding aside)
                layers = [(model.recompute, model.num_layers)] * dev.num_ranks
            mode = max((m for m, _ in layers), key=RECOMPUTE_MODES.index)
            most = most_layers(mode, layers)
            priced = dataclasses.replace(model, recompute=mode, recompute_layers=most if mode != "none" else None)
            used = tuple(dev.static_bytes + activation_bytes(model, a, b, m, k)
                         for a, b, (m, k) in zip(lin, att, layers))
            plan = dataclasses.replace(plan, memory_bytes=used, meta={
                **plan.meta, "recompute": mode, "recompute_layers": most})
        kernels = attention_kernels(plan, dev, priced)
        attention, linear = rank_compute_seconds(plan, dev, priced, priced.recompute, split=True, layers=layers,
                                                 kernels=kernels)
        seconds, exposed = _step_seconds(plan, dev, priced, crossovers, (attention, linear), options["routing"])
        # The busiest node's mean compute, plus what its rings across nodes expose (no
        # remap of the same nodes takes that off): `KEEP_MARGIN`'s floor.
        node = max((attention[rs] + linear[rs] + exposed[rs]).mean() for rs in dev.nodes())
        busiest = float(seconds.max())
        step = max(busiest, synchronous_step_seconds(plan, dev, priced, kernels, seconds, attention + linear,
                                                     layers if trim else None))
        return _Candidate(plan, step, _caps_bind(plan, dev, seconds), kernels), busiest <= (1 + KEEP_MARGIN) * node

    def from_nodes(shared: _Nodes) -> list[_Candidate]:
        out = []
        if options["price_linear"] and options["remap"]:
            try:
                kept, level = build(*_place(shared, keep_tokens=True), keep=True, double=shared.double)
                out = [kept]
                if level:
                    return out
            except (NoRoom, InfeasiblePlan):
                pass
        try:
            out.append(build(*_place(shared, keep_tokens=False), keep=False, double=shared.double)[0])
        except (NoRoom, InfeasiblePlan):
            if not out:
                raise
        return out

    if level1 is not None:
        try:
            return from_nodes(level1), dev, level1
        except (NoRoom, InfeasiblePlan):
            return [], dev, level1
    shared = None
    try:
        shared = _nodes(lengths, dev, crossovers, options, model)
        if shared.node_seconds > (1 + NODE_PRUNE_MARGIN) * beat:
            return [], dev, shared
        return from_nodes(shared), dev, shared
    except (NoRoom, InfeasiblePlan):
        if not fallback:
            raise
        return [build(_fallback(lengths, dev), {"fallback": True}, keep=False)[0]], dev, shared


def _caps_bind(plan: Plan, dev: Devices, seconds: np.ndarray) -> bool:
    """Whether a rank of the node whose rank sets the estimated step (`seconds`, [R]) is
    at its memory cap: only then can looser caps (a costlier recomputation) shorten it."""
    ranks = dev.nodes()[dev.node[int(np.argmax(seconds))]]
    return any(plan.memory_bytes[r] >= (1 - CAP_SLACK) * dev.memory_total[r] for r in ranks)


def finish(lengths, dev: Devices, placement: Placement, meta, *, remap: bool, node_remap: bool,
           double: bool) -> Plan:
    """Step 4 but routes, on a placement: remap (inside nodes, or across the cluster) and
    memory (raises `InfeasiblePlan`); the chosen plan gets its routes and is validated by
    `zeppelin` (`bench/hill_climb.py` rebuilds moved placements with it)."""
    plan = assemble("zeppelin", lengths, dev, placement, double=double, attention_engine=True, meta=meta)
    if remap:
        counts = plan.attention_token_counts
        nodes = [rs for rs in dev.nodes() if remaps_inside(dev.gpu[rs[0]])]
        targets = (node_linear_targets(counts, dev.speed, dev.token_cap, nodes) if node_remap
                   else linear_targets(sum(lengths), dev.speed, dev.token_cap))
        plan = dataclasses.replace(plan, remap=plan_remap(list(counts), targets, dev.node))
    return with_memory(plan, dev)
