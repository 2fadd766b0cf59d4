"""What a plan's single rings across nodes leave exposed to their members in a step, as the
partitioner's estimates add it (docs/design.md, section 4): each ring priced hop by hop as
level 1 priced it (`ring_pricing.ring_exposed_seconds`), or, where routing cuts its
crossing hops over several rails (`routed_ring_docs`), with its ports run as the
simulator runs them (`routed_ring.routed_waits`), its members' local documents filling
their wait before the second step (`local_attention_seconds`). Running the ports costs
far more, so which routed rings run them is the caller's choice (`PortRuns`): the search
prices its candidates `HOP_BY_HOP` and runs the ports of the few that can still win
(`zeppelin.settling.settle`, first `ports_of` a plan's longest ring for a lower bound)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ballonet.cost.flops import attention_flops
from ballonet.cost.memory import recompute_mode
from ballonet.cost.recompute import recompute_attention
from ballonet.cost.seconds import DP_FORWARD_SHARE, attention_seconds
from ballonet.plan import Plan
from ballonet.planning.devices import Devices
from ballonet.planning.ring_pricing import dp_intra_seconds, ring_exposed_seconds
from ballonet.planning.routed_ring import routed_ring_width, routed_waits
from ballonet.specs import ModelSpec

__all__ = ["EVERY_PORT", "HOP_BY_HOP", "PortRuns", "crossing_exposed_seconds", "local_attention_seconds", "ports_of",
           "routed_ring_docs"]


@dataclass(frozen=True)
class PortRuns:
    """Which of a plan's routed rings (`routed_ring_docs`) `crossing_exposed_seconds` runs
    port by port: every one (`EVERY_PORT`, as the simulator runs them), none (`HOP_BY_HOP`)
    or those of some documents (`ports_of`)."""
    ports: bool = True
    """Run routed rings' ports; off, price them hop by hop (`ring_exposed_seconds`) as the
    other rings: much cheaper than running their ports."""
    only: frozenset[int] | None = None
    """With `ports`, run those of these documents only and count the other routed rings'
    exposure as nothing: an estimate no longer than the one running every ring's ports
    (each ring's exposure is at least nothing, and a step grows with its members'
    exposure), at the cost of a few rings."""


EVERY_PORT = PortRuns()
HOP_BY_HOP = PortRuns(ports=False)


def ports_of(docs) -> PortRuns:
    """The ports of the routed rings of `docs` run, the other routed rings' exposure
    counted as nothing (`PortRuns.only`)."""
    return PortRuns(only=frozenset(docs))


def routed_ring_docs(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray, nic_bw: np.ndarray,
                     rails: np.ndarray) -> list[int]:
    """The documents of `plan`'s single rings across nodes whose crossing hops routing cuts
    over several rails (`routed_ring.routed_ring_width`), longest first: those
    `crossing_exposed_seconds` runs port by port but `HOP_BY_HOP`."""
    docs = []
    for ring in plan.rings:
        if ring.comm == "ring" and ring.kind == "inter":
            r, members = ring.ranks[0], ring.ranks
            nodes = len({dev.node[x] for x in members})
            if routed_ring_width(model, plan.lengths[ring.doc], len(members), nodes, nic_bw[r],
                                 (link_bw[r], int(rails[r]))):
                docs.append(ring.doc)
    return sorted(docs, key=lambda d: (-plan.lengths[d], d))


def crossing_exposed_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray, nic_bw: np.ndarray,
                             rails: np.ndarray, dp_piece: np.ndarray | None = None,
                             runs: PortRuns = EVERY_PORT) -> np.ndarray:
    """[R] what each member of a single ring across nodes leaves exposed in a step (its
    ring's `ring_exposed_seconds`, crossing hops at `nic_bw` routed over `rails`, 1:
    direct), as level 1 priced it (`pricing.inter_node_span`); a ring whose crossing hops
    are cut over several rails as the simulator runs it (`routed_ring.routed_waits`),
    each member's local documents filling its wait before its second step, where `runs`
    runs its ports."""
    out = np.zeros(plan.num_ranks)
    node_size = np.bincount(np.asarray(dev.node))
    for ring in plan.rings:
        if ring.comm == "ring" and ring.kind == "inter":
            r, members = ring.ranks[0], list(ring.ranks)
            piece = (0.0, 0.0) if dp_piece is None else tuple(dp_piece[r])
            dp_intra = DP_FORWARD_SHARE * dp_intra_seconds(model, dev.gpu[r], node_size[dev.node[r]], link_bw[r])
            routed, nodes = (link_bw[r], int(rails[r])), len({dev.node[x] for x in members})
            length = plan.lengths[ring.doc]
            width = routed_ring_width(model, length, len(members), nodes, nic_bw[r], routed) if runs.ports else 0
            if width and runs.only is not None and ring.doc not in runs.only:
                continue
            if not width:
                out[members] += ring_exposed_seconds(model, dev.gpu[r], length, len(members), nic_bw[r],
                                                     routed=routed, dp_piece=piece, dp_intra=dp_intra)
                continue
            (fwd, fwd_first), (bwd, bwd_first) = routed_waits(model, dev.gpu[r], length, len(members), nodes,
                                                              nic_bw[r], link_bw[r], width, piece[0], dp_intra)
            local = local_attention_seconds(plan, dev, model, members)
            out[members] += model.num_layers * (fwd - np.minimum(fwd_first, local[0])
                                                + bwd - np.minimum(bwd_first, local[1]))
    return out


def local_attention_seconds(plan: Plan, dev: Devices, model: ModelSpec, ranks) -> tuple[np.ndarray, np.ndarray]:
    """[len(ranks)] one layer's attention over each of `ranks`' local documents (one call,
    as the runtime runs them), forward and backward (under full recomputation with the
    forward again)."""
    in_ring = plan.ring_of_doc
    rank, block = [], []
    for i, r in enumerate(ranks):
        for d in {s.doc for s in plan.attention[r]} - set(in_ring):
            rank.append(i)
            block.append(plan.lengths[d])
    forward, backward = np.zeros(len(ranks)), np.zeros(len(ranks))
    if rank:
        index, lengths = np.asarray(rank), np.asarray(block, dtype=float)
        flops = attention_flops(model, lengths)
        for i, gpu in enumerate(dev.gpu_types):
            on = dev.type_index[np.asarray(ranks)[index]] == i
            np.add.at(forward, index[on], attention_seconds(model, gpu, flops[on], lengths[on]))
            np.add.at(backward, index[on], attention_seconds(model, gpu, flops[on], lengths[on], backward=True))
    if recompute_attention(recompute_mode(model)):
        backward += forward
    return forward, backward
