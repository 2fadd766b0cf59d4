"""The search's estimates after its hop-by-hop part (docs/design.md, section 4): the
candidates it priced with their routed single rings across nodes hop by hop
(`crossing_rings.HOP_BY_HOP`), those that can still win re-priced with those rings'
ports run, as the simulator runs them; cheaper than running them for every candidate."""

from __future__ import annotations

import numpy as np

from ballonet.planning.crossing_rings import ports_of, routed_ring_docs
from ballonet.planning.zeppelin.candidates import Candidate
from ballonet.planning.zeppelin.thresholds import THRESHOLDS

__all__ = ["LOWER_RINGS", "settle"]

LOWER_RINGS = 1
"""How many routed rings `settle` runs the ports of for a plan's lower bound before all
of them."""


def settle(pending) -> dict[int, Candidate]:
    """The estimates to compare of `pending` ((its place in the search's compared plans,
    candidate, its `CandidateMaker`) of each plan priced hop by hop) by place: the plans
    with no routed ring (`crossing_rings.routed_ring_docs`) as they are; the others, in
    ascending hop-by-hop estimate until one's is over the least estimate so far by
    `Thresholds.port_margin`, re-priced with their rings' ports run where their estimate with the
    ports of their `LOWER_RINGS` longest such rings run and the others' exposure counted
    as nothing (`crossing_rings.ports_of`, no longer than the whole) is not over it by
    the same margin. The plans left out cannot win."""
    repriced: dict[int, Candidate] = {}
    routed = []
    for index, c, maker in pending:
        links = maker.links
        docs = routed_ring_docs(c.plan, c.dev, maker.model, links.link, links.nic, links.rails)
        if docs:
            routed.append((index, c, maker, docs))
        else:
            repriced[index] = c
    least = min((c.seconds for c in repriced.values()), default=np.inf)
    for index, c, maker, docs in sorted(routed, key=lambda x: x[1].seconds):
        if c.seconds > (1 + THRESHOLDS.port_margin) * least:
            break
        if len(docs) > LOWER_RINGS and least < np.inf \
                and maker.reprice(c, ports_of(docs[:LOWER_RINGS])).seconds > (1 + THRESHOLDS.port_margin) * least:
            continue
        priced = maker.reprice(c)
        repriced[index] = priced
        least = min(least, priced.seconds)
    return repriced
