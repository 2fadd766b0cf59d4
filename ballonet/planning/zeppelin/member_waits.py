"""What a plan's "double" rings across nodes leave their members waiting beyond what the
estimate prices (`pricing.rank_step_seconds` adds `double_exposed_seconds` to each
member): the member's waits as the simulator runs them (`ring_pricing.double_wait_seconds`:
every round's inner chain at once on its NVLink port beside the FSDP collectives, its
local documents filling the waits after the ring's first step). The search compares a
plan with its double rings over one node more (`variants.wider_level`) by it alone: the
two place the same documents, and the estimate, which leaves local documents' fill out,
prices a ring of fewer members per node short (docs/design.md, section 4, "Where it falls
short")."""

from __future__ import annotations

import dataclasses

import numpy as np

from ballonet.cost.flops import LINEAR_BACKWARD_FACTOR, attention_flops
from ballonet.cost.memory import recompute_mode
from ballonet.cost.recompute import recompute_attention
from ballonet.cost.seconds import attention_seconds
from ballonet.planning.pricing import rank_compute_seconds
from ballonet.planning.ring_pricing import double_exposed_seconds, double_wait_seconds

__all__ = ["double_wait_excess"]


def corrected_step(candidate, crossovers) -> float:
    """`candidate`'s estimated step plus the most a member of its double rings waits
    beyond its estimate (`double_wait_excess`): each layer's forward and backward end
    with every rank's, so a member's waits delay the layer, not that rank's step alone."""
    return candidate.seconds + max(double_wait_excess(candidate, crossovers).values(), default=0.0)


def double_wait_excess(candidate, crossovers) -> dict[int, float]:
    """{document: seconds} of each double ring of `candidate` (a `candidates.Candidate`):
    the most one of its members waits, its local documents filling
    (`ring_pricing.double_wait_seconds`), beyond the ring's `double_exposed_seconds`, which
    the estimate prices. `crossovers`: the batch's (`classes.crossover_lengths`), whose
    links and FSDP piece the estimate used."""
    plan, dev = candidate.plan, candidate.dev
    rings = [ring for ring in plan.rings if ring.comm == "double"]
    if not rings:
        return {}
    priced = dataclasses.replace(candidate.model, recompute=plan.meta["recompute"])
    redo = recompute_attention(recompute_mode(priced))
    local_f, local_b = _local_attention(plan, dev, priced)
    _, linear = rank_compute_seconds(plan, dev, priced, recompute_mode(priced), split=True)
    intra = min(t.intra_bw for t in crossovers)
    nic = min(t.rank_nic_bw for t in crossovers)
    piece = max(t.dp_piece for t in crossovers)
    node_ranks = np.bincount(np.asarray(dev.node))
    out = {}
    for ring in rings:
        ranks = list(ring.ranks)
        length, k, n = plan.lengths[ring.doc], ring.groups, ring.group_size
        # a layer's backward linear layers, which run before its attention while the FSDP collectives start
        lead = float(linear[ranks].mean()) / priced.num_layers * LINEAR_BACKWARD_FACTOR / (1 + LINEAR_BACKWARD_FACTOR)
        r = ranks[int(np.argmin(local_b[ranks]))]  # the least filled member waits the most
        fill = (float(local_f[r]), float(local_b[r] + (local_f[r] if redo else 0.0)))
        wait = double_wait_seconds(priced, dev.gpu[r], length, k, n, intra, nic, int(node_ranks[dev.node[r]]), lead,
                                   fill)
        out[ring.doc] = wait - double_exposed_seconds(priced, dev.gpu[r], length, k, n, intra, nic, piece)
    return out


def _local_attention(plan, dev, model) -> tuple[np.ndarray, np.ndarray]:
    """([R], [R]) one layer's forward and backward attention of each rank's local documents."""
    in_ring = plan.ring_of_doc
    ranks: list[int] = []
    tokens: list[int] = []
    add_rank, add_tokens = ranks.append, tokens.append
    for r, segs in enumerate(plan.attention):
        for s in segs:
            if s.doc not in in_ring:
                add_rank(r)
                add_tokens(s.end - s.start)  # (`num_tokens`, without its property call)
    fwd, bwd = np.zeros(plan.num_ranks), np.zeros(plan.num_ranks)
    if not ranks:
        return fwd, bwd
    rank = np.array(ranks, dtype=np.int64)
    block = np.array(tokens, dtype=float)
    for i, gpu in enumerate(dev.gpu_types):
        on = dev.type_index[rank] == i
        if on.any():
            flops = attention_flops(model, block[on])
            np.add.at(fwd, rank[on], attention_seconds(model, gpu, flops, block[on]))
            np.add.at(bwd, rank[on], attention_seconds(model, gpu, flops, block[on], backward=True))
    return fwd, bwd
