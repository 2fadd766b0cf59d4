"""Level 1 with no document split inside a PCIe-only node (docs/design.md, section 5).

A ring inside a PCIe-only node can leave most of its transfers exposed (`pcie_rings`):
a 64K-token document over 8 L40S exposes about 4 s a step of LLaMA-7B beside 5 s of
compute. Level 1 prices such a ring as extra work of its node and still sends a long
document there when the other nodes are full; whether the node or a fuller NVLink node
is the better home depends on what else each holds, which level 1 does not see but the
candidates' estimate does. So where the best plan puts a ring inside a PCIe-only node,
the search also plans the same batch with every node of those groups unable to split a
document (`unsplit_level`: their intra-node crossover unset, so level 1 charges a long
document there the wait it leaves the node's other ranks, and level 2 keeps documents
whole there), and the estimate chooses. Last, the chosen plan is also priced with its rings
inside PCIe-only nodes split by heads instead (`by_heads`: DeepSpeed-Ulysses, each member
sends the others 1/g of its rows' q, k, v and gets o back, instead of passing every
block's K/V round the ring: about g/2 times fewer bytes forward through each port, though
none of it hides behind the document's own compute), and the estimate chooses again.
"""

from __future__ import annotations

import dataclasses

from ballonet.cost.flops import heads_divide
from ballonet.plan import Plan, Ring
from ballonet.planning.assembly import replaced
from ballonet.planning.devices import Devices
from ballonet.planning.zeppelin.classes import NodeLevel, with_level1
from ballonet.specs import ModelSpec

__all__ = ["by_heads", "inside_pcie_node", "pcie_ring_inside", "unsplit_level"]


def inside_pcie_node(ring: Ring, dev: Devices) -> bool:
    """Whether the members of `ring` all sit in one PCIe-only node."""
    return dev.gpu[ring.ranks[0]].intra_link == "pcie" and len({dev.node[x] for x in ring.ranks}) == 1


def pcie_ring_inside(plan: Plan, dev: Devices) -> bool:
    """Whether `plan` runs a ring inside a PCIe-only node."""
    return any(inside_pcie_node(r, dev) for r in plan.rings)


def by_heads(plan: Plan, dev: Devices, model: ModelSpec) -> Plan | None:
    """`plan` with each of its rings inside a PCIe-only node whose members divide the
    model's K/V heads split by heads (comm "heads"); None where it has none."""
    rings = tuple(dataclasses.replace(r, comm="heads") if r.comm == "ring" and inside_pcie_node(r, dev)
                  and heads_divide(model, len(r.ranks)) else r for r in plan.rings)
    return replaced(plan, rings=rings) if rings != plan.rings else None


def unsplit_level(shared: NodeLevel) -> NodeLevel | None:
    """Steps 0-1 of `shared` with no document split inside a node of a PCIe-only group
    (module docstring); None where there is none, or no other group to take them, or
    without hierarchy or linear pricing (or level 1 finds a document no room)."""
    batch = shared.batch
    dev = batch.dev
    pcie = {g for g, gpu in zip(dev.group, dev.gpu) if gpu.intra_link == "pcie"}
    if shared.level1 is None or shared.per_token <= 0 or not pcie or pcie == set(dev.group):
        return None
    crossovers = [dataclasses.replace(c, intra=None) if g in pcie else c for g, c in enumerate(batch.crossovers)]
    return with_level1(dataclasses.replace(batch, crossovers=crossovers), shared.weights, shared.per_token,
                       shared.rank_token, (shared.intra, shared.inter, shared.span), hierarchical=True,
                       price_linear=True, double=shared.double)
