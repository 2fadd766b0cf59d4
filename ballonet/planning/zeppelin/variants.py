"""The search's variant levels: steps 0-1 of a batch again, from a `NodeLevel` already
made (`classes.level_nodes`), with other classes or other weights (docs/design.md,
section 4): double rings across nodes (`doubled_level`), heavy documents over two nodes
(`spread_level`), every document a node holds kept inside one (`inside_level`), level 1
balanced on the layers' backward (`backward_level`) and one double ring over one node
more (`wider_level`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from ballonet.cost.memory import recompute_layer_count, recompute_mode
from ballonet.cost.seconds import linear_layer_seconds
from ballonet.cost.tensor_parallel import tp_layer_seconds
from ballonet.plan import Plan
from ballonet.planning.zeppelin.classes import NodeLevel, classify, node_seconds, with_level1
from ballonet.planning.zeppelin.thresholds import THRESHOLDS

__all__ = ["backward_level", "doubled_level", "inside_level", "spread_level", "wider_level"]


def doubled_level(shared: NodeLevel, *, price_linear: bool, routing: bool) -> NodeLevel | None:
    """Steps 0-1 priced for "double" rings across nodes, when that pricing sends any
    document across nodes (and level 1 finds it room); otherwise None. Also where single
    rings send the same documents across: at 256-1024 GPUs a long document's single ring
    over 16-32 ranks exposes its crossing hops, which its estimate underprices (two scale-grid
    configurations 1.06x and 1.17x faster with double rings; docs/planner_evidence.md)."""
    batch = shared.batch
    if shared.level1 is None or batch.dev.num_nodes < 2:
        return None
    classes = classify(batch, batch.dev.nodes(), shared.per_token, shared.weights, hierarchical=True, double=True,
                       routing=routing)
    if not classes[1].any():
        return None
    return with_level1(batch, shared.weights, shared.per_token, shared.rank_token, classes, hierarchical=True,
                        price_linear=price_linear, double=True, widen=True)


def wider_level(doubled: NodeLevel, doc: int) -> NodeLevel | None:
    """`doubled` (a `doubled_level`) with document `doc`'s double ring across nodes over one
    node more, where there is a node more; otherwise None. A wider double ring has fewer
    members per node, the others free for local documents, which fill its members' waits
    (`member_waits`): B, 256 GPUs, llama-7b, prolong 128K: a 75K-token document over 4
    nodes of 5 ranks, not 3 of 6, 1.908 -> 1.830 s simulated."""
    batch = doubled.batch
    if doubled.level1 is None or not doubled.double or doc not in doubled.span \
            or doubled.span[doc] >= len(batch.dev.nodes()):
        return None
    return with_level1(batch, doubled.weights, doubled.per_token, doubled.rank_token,
                       (doubled.intra, doubled.inter, {**doubled.span, doc: doubled.span[doc] + 1}),
                       hierarchical=True, price_linear=True, double=True, widen=False)


def spread_level(shared: NodeLevel) -> NodeLevel | None:
    """Steps 0-1 with every document kept in one node whose step share is over half a
    node's sent across two nodes instead (single rings), where there is any; otherwise
    None. Kept in one node, such a document leaves that node's ranks heavy on attention
    and the other nodes' on linear work: level 1 evens each node's step, but a layer's
    forward ends with the linear-heavy ranks and its backward (attention's is 2.5x its
    forward) with the attention-heavy ones, so each rank idles in one of them
    (`pricing.synchronous_step_seconds`); over two nodes every rank's mix is nearer the
    mean (on B, LLaMA-30B at tp 4: each 64K document of the wlbllm batch over 4 ranks
    of 2 nodes, not 2 of one, 14.03 -> 13.82 s simulated)."""
    batch = shared.batch
    nodes = batch.dev.nodes()
    if shared.level1 is None or len(nodes) < 2 or shared.per_token <= 0:
        return None
    step = batch.work + shared.per_token * batch.length_array
    node_share = step.sum() * max(batch.dev.speed[rs].sum() for rs in nodes) / batch.dev.speed.sum()
    l_inter = min(t.inter for t in batch.crossovers)  # its ring across two nodes hides its transfers
    wide = (step > THRESHOLDS.spread_share * node_share) & (batch.length_array >= l_inter) & ~shared.inter
    if not wide.any():
        return None
    span = {**shared.span, **{int(d): 2 for d in np.nonzero(wide)[0]}}
    return with_level1(batch, shared.weights, shared.per_token, shared.rank_token,
                       (shared.intra & ~wide, shared.inter | wide, span), hierarchical=True, price_linear=True,
                       double=False, widen=False)


def backward_level(shared: NodeLevel) -> NodeLevel | None:
    """Steps 0-1 of `shared` with level 1 balancing the layers' backward, not the whole
    step: linear work per token weighted by its share of backward over attention's
    (`StepWeights.attention_step`). Layers meet in both passes, so a node heavy on attention
    (backward 2.5x its forward) and one heavy on linear work (2x) take turns at the
    slowest: balanced on the whole step, the attention-heavy node sets every backward
    (A, LLaMA-30B at tp 4, shortmix: a 61K-token document's node ran 26.80 s of compute
    against 26.25 s; planned so, 30.244 -> 30.115 s simulated). The weight is the mode's on
    every layer: where ranks trim selective or linear recomputation to their own tokens,
    moving tokens also moves recomputation, which it does not price (the search plans it
    under none and full only). None without hierarchy or linear pricing."""
    batch, weights = shared.batch, shared.weights
    nodes = batch.dev.nodes()
    if shared.level1 is None or shared.per_token <= 0 or len(nodes) < 2:
        return None
    model, gpu = batch.model, batch.gpu
    tokens = float(batch.length_array.sum()) / batch.dev.num_ranks
    mode = recompute_mode(model)
    lf, lb = linear_layer_seconds(model, gpu, tokens, mode, framework=False, layers=recompute_layer_count(model))
    bw = batch.crossovers[batch.dev.group[int(np.argmax(batch.dev.speed))]].intra_bw
    tf, tb = tp_layer_seconds(model, int(tokens), bw, gpu, mode)
    rho = ((lb + tb) / (lf + lb + tf + tb)) / ((weights.attention_step - 1) / weights.attention_step)
    again = with_level1(batch, weights, shared.per_token * rho, shared.rank_token * rho,
                        (shared.intra, shared.inter, shared.span), hierarchical=True, price_linear=True,
                        double=shared.double, widen=True)
    if again is None or again.level1 is None:
        return None
    return dataclasses.replace(again, node_seconds=node_seconds(batch, nodes, again.level1, shared.rank_token,
                                                                 weights))


def inside_level(shared: NodeLevel, plan: Plan) -> NodeLevel | None:
    """Steps 0-1 of `shared` (the level 1 of `plan`) with every document it sends across
    nodes that one node's memory holds split inside one node instead (single rings),
    where there is any and a member of a ring of `plan` across nodes also steps another
    ring; otherwise None. Step 0 sends a document across nodes when the overload it leaves one
    node costs more than its ring's exposed transfers, each priced alone; but where
    several long documents go across nodes their rings share members with the rings kept
    inside nodes, and a member in two rings steps both in turn, so every ring waits on the
    other's steps (`ring_waits.ring_wait_seconds`), and several documents over a node's
    share each, one to a node, leave no node much over the others. Which is the better
    depends on the whole batch, which the candidates' estimate sees (A, 64 GPUs,
    llama3-8b: a step of WLB-LLM's outlier delay, eight documents of 68-93K tokens, each
    over a node's share: 3 of them across 2-3 nodes, 11.79 s simulated; all inside one
    node each, 8.38 s)."""
    batch = shared.batch
    nodes = batch.dev.nodes()
    if shared.level1 is None or not shared.inter.any() or not _crossing_ring_shares(plan):
        return None
    node_tokens = max(batch.dev.token_cap[rs].sum() for rs in nodes)
    moved = shared.inter & (batch.length_array <= node_tokens)
    if not moved.any():
        return None
    span = {d: k for d, k in shared.span.items() if not moved[d]}
    return with_level1(batch, shared.weights, shared.per_token, shared.rank_token,
                       (shared.intra | moved, shared.inter & ~moved, span), hierarchical=True,
                       price_linear=shared.per_token > 0, double=shared.double and bool((shared.inter & ~moved).any()),
                       widen=False)


def _crossing_ring_shares(plan: Plan) -> bool:
    """Whether a member of a ring of `plan` across nodes is also a member of another ring."""
    rings_of = Counter(r for ring in plan.rings for r in ring.ranks)
    node = plan.node_of_rank
    return any(rings_of[r] > 1 for ring in plan.rings if len({node[x] for x in ring.ranks}) > 1 for r in ring.ranks)
