"""Routing planning (docs/design.md, "Routing"): spread each inter-node ring hop over idle NICs.

A hop of m bytes per ring step (its real forward K/V blocks, `Ring.forward_link_rows`,
averaged over the steps), cut over k rail-aligned proxy pairs, costs about
2 * t_intra((k-1)/k * m) + t_nic(m / k + b_k) (dispatch, parallel NIC sends, combine)
instead of t_nic(m + b_1) on the sender's own NIC, where b is the traffic the other
inter-node hops of the same phase put on the busiest NIC used. Each side's intra-node
link is its own (NVLink, or PCIe on a PCIe-only node, where dispatch is dear) and a NIC
transfer runs at the slower of the two ends' NICs. k is chosen per hop by that cost.
Proxies are picked rail-aligned (local index j on both nodes), one per NIC, least loaded
first. Hops are handled largest first; ties go to the lower document, ring position and
rail.
"""

from __future__ import annotations

from collections import defaultdict

from ballonet.cost.flops import kv_bytes
from ballonet.cost.seconds import p2p_time
from ballonet.plan import Plan, Route
from ballonet.planning.devices import rank_hardware
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["best_width", "plan_routes"]


def _hops(plan: Plan) -> list[tuple[float, int, int, int, int]]:
    """(-K/V rows per step, doc, position, src, dst) of every node-crossing hop of P2P rings:
    the hop's forward K/V rows (`Ring.forward_link_rows`, the sum of its `Ring.messages`)
    averaged over its g - 1 steps."""
    out = []
    for ring in plan.rings:
        if ring.kind != "inter" or ring.comm != "ring":
            continue
        g = len(ring.ranks)
        rows = {(src, dst): n for src, dst, n in ring.forward_link_rows()}
        for i in range(g):
            src, dst = ring.ranks[i], ring.ranks[(i + 1) % g]
            if plan.node_of_rank[src] != plan.node_of_rank[dst]:
                out.append((-rows.get((src, dst), 0) / (g - 1), ring.doc, i, src, dst))
    return sorted(out)


def plan_routes(plan: Plan, cluster: ClusterSpec, model: ModelSpec, local_index: tuple[int, ...]) -> tuple[Route, ...]:
    nodes: dict[int, dict[int, int]] = defaultdict(dict)  # node -> local index -> rank
    for r, (n, j) in enumerate(zip(plan.node_of_rank, local_index)):
        nodes[n][j] = r
    hw = rank_hardware(cluster, model.tp)
    hops = _hops(plan)
    load: dict[tuple[str, int], float] = defaultdict(float)  # ("out"|"in", nic) -> bytes per step
    for rows, _, _, src, dst in hops:
        load["out", plan.nic_of_rank[src]] += kv_bytes(model, -rows)
        load["in", plan.nic_of_rank[dst]] += kv_bytes(model, -rows)
    routes = []
    for rows, doc, _, src, dst in hops:
        m = kv_bytes(model, -rows)
        load["out", plan.nic_of_rank[src]] -= m
        load["in", plan.nic_of_rank[dst]] -= m
        src_ranks, dst_ranks = nodes[plan.node_of_rank[src]], nodes[plan.node_of_rank[dst]]
        rails: list[tuple[float, int, int, int]] = []
        seen: set[tuple[int, int]] = set()
        for j in sorted(set(src_ranks) & set(dst_ranks)):
            a, b = src_ranks[j], dst_ranks[j]
            key = (plan.nic_of_rank[a], plan.nic_of_rank[b])
            if key[0] not in {k[0] for k in seen} and key[1] not in {k[1] for k in seen}:
                seen.add(key)
                rails.append((max(load["out", key[0]], load["in", key[1]]), j, a, b))
        rails.sort()
        own = max(load["out", plan.nic_of_rank[src]], load["in", plan.nic_of_rank[dst]])
        k = best_width(m, own, [x[0] for x in rails], (hw.intra_bw[src], hw.intra_bw[dst]),
                       min(hw.nic_bw[src], hw.nic_bw[dst]))
        chosen = [(a, b) for _, _, a, b in rails[:k]] if k > 1 else [(src, dst)]
        for a, b in chosen:
            load["out", plan.nic_of_rank[a]] += m / len(chosen)
            load["in", plan.nic_of_rank[b]] += m / len(chosen)
        if k > 1:
            routes.append(Route(doc=doc, src=src, dst=dst, proxies=tuple(chosen)))
    return tuple(sorted(routes, key=lambda r: (r.doc, r.src)))


def best_width(m: float, own: float, rail_load: list[float], intra_bw: tuple[float, float], nic_bw: float) -> int:
    """Proxy count with the least predicted time for a hop of m bytes (1: direct, on NICs
    already carrying `own` bytes; k: the k least loaded rails, `rail_load` ascending),
    over the (source, destination) intra-node links `intra_bw` and NICs of `nic_bw`."""

    def time(k: int) -> float:
        if k == 1:
            return p2p_time(m + own, nic_bw, nic=True)
        part = (k - 1) / k * m
        return (p2p_time(part, intra_bw[0]) + p2p_time(part, intra_bw[1])
                + p2p_time(m / k + rail_load[k - 1], nic_bw, nic=True))
    return min(range(1, max(len(rail_load), 1) + 1), key=lambda k: (time(k), k))
