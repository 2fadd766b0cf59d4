"""Routing: inter-node ring hops over proxy ranks give the very same results as direct hops,
send exactly the bytes the plan predicts, and spread inter-node bytes over the NICs.

Pure checks first (paths, predicted bytes by hand), then one gloo group of 4 ranks
(2 nodes x 2, one NIC each) and one of 8 (2 nodes x 4, two GPUs per NIC).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter

import pytest
import torch
from distributed import run_ranks
from attention_checks import H_KV, D, H, attention_reference, run_attention, total_bytes
from plans_by_hand import hand_plans, make_plan, rails_plan, remap_plan, routed, tangled_plan
from tiny_model import SPEC, batch

import ballonet
from ballonet.plan import InvalidPlan, Plan, Route
from ballonet.runtime import ByteCounter, token_index
from ballonet.runtime.comm import link_bytes, nic_bytes
from ballonet.runtime.routing import (
    hop_paths,
    predicted_bytes,
    relay_meta,
    routes_by_hop,
)
from ballonet.training.parallelism.model import Transformer

ROW = 2 * H_KV * D * 4
"""Bytes of one K/V row (K and V, fp32), and of one fp32 dK/dV row."""
NIC_SPREAD = 1.25


def planner_plan(world: int) -> Plan:
    """The zeppelin planner's plan for a batch with one long document, long enough that
    the planner routes its node-crossing hops (a hop is routed where the cost model says
    it pays: from about 4K tokens on 2 x 2 ranks, 8K on 2 x 4 ranks sharing NICs)."""
    if world == 4:
        cluster, lengths = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2), [6000, 100, 50, 20, 7, 3]
    else:
        cluster = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=4, nics_per_node=2)
        lengths = [12000, 100, 50, 20, 7, 3]
    return ballonet.plan_batch(lengths, cluster, SPEC, double=False)  # single rings: routes are theirs


# ---- pure ------------------------------------------------------------------------------


def test_hop_paths_leave_out_legs_between_equal_ranks():
    assert hop_paths(1, 2, None) == ((1, 2),)
    route = Route(doc=0, src=1, dst=2, proxies=((0, 2), (1, 3), (0, 3)))
    assert hop_paths(1, 2, route) == ((1, 0, 2), (1, 3, 2), (1, 0, 3, 2))


def test_predicted_bytes_by_hand():
    plan = rails_plan()
    # Each hop passes 3 blocks of 4 rows forward; a routed hop cuts each into 2 + 2 rows.
    # 1->2: 1->0->2 and 1->3->2; 3->0: 3->2->0 and 3->1->0; 0->1, 2->3 direct.
    rows = Counter({(0, 1): 12, (1, 0): 6 + 6, (0, 2): 6, (1, 3): 6, (3, 2): 6 + 6, (2, 3): 12, (2, 0): 6, (3, 1): 6})
    predicted = predicted_bytes(plan, H_KV, D, torch.float32)
    assert predicted.forward == Counter({pair: n * ROW for pair, n in rows.items()})
    # The backward passes K/V again and returns 3 dK/dV blocks of 4 fp32 rows per hop.
    assert predicted.backward == Counter({pair: 2 * n * ROW for pair, n in rows.items()})
    assert link_bytes(predicted.forward, plan.node_of_rank) == Counter({"intra": 48 * ROW, "inter": 24 * ROW})
    assert nic_bytes(predicted.forward, plan) == Counter(
        {(way, nic): 6 * ROW for way in ("out", "in") for nic in range(4)})
    direct = predicted_bytes(dataclasses.replace(plan, routes=()), H_KV, D, torch.float32)
    assert nic_bytes(direct.forward, plan) == Counter(
        {("out", 1): 12 * ROW, ("in", 2): 12 * ROW, ("out", 3): 12 * ROW, ("in", 0): 12 * ROW,
         ("out", 0): 0, ("in", 1): 0, ("out", 2): 0, ("in", 3): 0})


def test_unrouted_prediction_is_the_per_link_closed_form():
    # Without routes, every message goes straight. Per link, summed over the steps: the
    # forward is `Ring.forward_link_rows`; the backward passes the same K/V again and
    # returns dK/dV: a "ring" hop out of position i carries every block but position i's,
    # an "allgather" member j gets the gradient of its own block from every other member.
    for name, plan in {**hand_plans(4), "rails": rails_plan(), "tangled": tangled_plan()}.items():
        direct = predicted_bytes(dataclasses.replace(plan, routes=()), H_KV, D, torch.float32)
        forward, grad = Counter(), Counter()
        for ring in plan.rings:
            g, L = len(ring.ranks), plan.lengths[ring.doc]
            for src, dst, rows in ring.forward_link_rows():
                forward[src, dst] += rows * ROW
            for i in range(g):
                for j in range(g):
                    if ring.comm == "allgather" and j != i:
                        grad[ring.ranks[i], ring.ranks[j]] += ring.block_tokens(j) * ROW
                if ring.comm == "ring":
                    grad[ring.ranks[i], ring.ranks[(i + 1) % g]] += (L - ring.block_tokens(i)) * ROW
        assert direct.forward == +forward, name
        assert direct.backward == +(forward + grad), name


def test_relays_by_hand():
    plan, routes = tangled_plan(), routes_by_hop(tangled_plan())
    # Ring 1 (document 1, ranks 1 3): 1->0->2->3 and 3->2->0->1, 3->1.
    index = [r.doc for r in plan.rings].index(1)
    assert [(x.hop.position, x.part, x.stage) for x in relay_meta(plan, index, 0, routes).relays] == [(0, 0, 1), (1, 0, 2)]
    assert [(x.hop.position, x.part, x.stage) for x in relay_meta(plan, index, 2, routes).relays] == [(1, 0, 1), (0, 0, 2)]
    assert relay_meta(plan, index, 1, routes) is None and relay_meta(plan, index, 3, routes) is None


def test_routes_on_all_gather_and_double_rings_are_refused():
    for plan in (make_plan([8], [(0, 2)], (0, 0, 1, 1), comms={0: "allgather"}),
                 make_plan([8], [(0, 2)], (0, 0, 1, 1), groups={0: 2})):
        plan = dataclasses.replace(plan, routes=(Route(doc=0, src=0, dst=2, proxies=((1, 3),)),))
        with pytest.raises(InvalidPlan, match='comm "ring"'):
            plan.validate()
        with pytest.raises(ValueError, match="only P2P rings"):  # the engine's own check
            routes_by_hop(plan)


def nic_spread(nic: Counter) -> float:
    """Busiest NIC direction over the mean of all NIC directions."""
    return max(nic.values()) / statistics.mean(nic.values())


# ---- gloo ------------------------------------------------------------------------------


def _check_plan(name: str, plan: Plan, rank: int, world: int, exact: bool) -> tuple[list[str], dict]:
    """Failed checks of one routed plan on this rank (routed and direct results bit for
    bit, against the float64 attention_reference if `exact`, bytes as predicted), and the counted
    bytes per NIC direction, routed and direct."""
    bad = []
    gen = torch.Generator().manual_seed(plan.num_tokens)
    inputs = [torch.randn(plan.num_tokens, h, D, generator=gen) for h in (H, H_KV, H_KV, H)]
    direct = dataclasses.replace(plan, routes=())
    counters = {"routed": ByteCounter(), "direct": ByteCounter()}
    idx, got = run_attention(plan, rank, inputs, counter=counters["routed"])
    _, want = run_attention(direct, rank, inputs, counter=counters["direct"])
    for what, a, b in zip("out dq dk dv".split(), got, want):
        if not torch.equal(a, b):
            bad.append(f"{name}: routed {what} differs from direct by {(a - b).abs().max().item():.3g}")
    if exact:
        ref = attention_reference(*(x.double() for x in inputs), plan.lengths, math=True)
        for what, a, b in zip("out dq dk dv".split(), got, ref):
            err = (a.double() - b[idx]).abs().max().item() if a.numel() else 0.0
            if err > 1e-5:
                bad.append(f"{name}: routed {what} off the attention_reference by {err:.3g}")
    nic = {}
    for how, p in (("routed", plan), ("direct", direct)):
        total, predicted = total_bytes(counters[how], world), predicted_bytes(p, H_KV, D, torch.float32)
        for phase in ("forward", "backward"):
            if getattr(total, phase) != getattr(predicted, phase):
                bad.append(f"{name} {how} {phase}: sent {dict(getattr(total, phase))}, plan {dict(getattr(predicted, phase))}")
        if link_bytes(total.total(), p.node_of_rank) != link_bytes(predicted.total(), p.node_of_rank):
            bad.append(f"{name} {how}: bytes per link class differ from the plan's")
        nic[how] = nic_bytes(total.total(), p)
        if nic[how] != nic_bytes(predicted.total(), p):
            bad.append(f"{name} {how}: bytes per NIC differ from the plan's")
    return bad, nic


def layer_plan() -> Plan:
    """test_remap's plan (every rank remaps), its one split document's hops routed."""
    return routed(remap_plan(), (0, 0, 2, ((1, 3),)), (0, 2, 0, ((2, 0), (3, 1))))


def _check_layer(plan: Plan, rank: int) -> list[str]:
    """The tiny Llama (attention and remaps in every layer): routed and direct, bit for bit."""
    tokens, labels = batch(plan.lengths)
    ti = token_index(plan, rank)
    results = []
    for p in (plan, dataclasses.replace(plan, routes=())):
        model = Transformer(SPEC, seed=3)
        loss = model.loss(tokens[ti], labels[ti], p, rank)
        loss.backward()
        results.append([loss.detach()] + [q.grad for q in model.parameters()])
    return [f"layer: routed and direct differ in tensor {i}" for i, (a, b) in enumerate(zip(*results))
            if not torch.equal(a, b)]


def _four_ranks(rank: int, world: int, plan: Plan) -> dict:
    bad = []
    for name, hand in (("rails", rails_plan()), ("tangled", tangled_plan())):
        bad += _check_plan(name, hand, rank, world, exact=True)[0]
    more, nic = _check_plan("planner", plan, rank, world, exact=False)
    return {"bad": bad + more + _check_layer(layer_plan(), rank), "nic": nic}


def _eight_ranks(rank: int, world: int, plan: Plan) -> dict:
    more, nic = _check_plan("planner", plan, rank, world, exact=False)
    return {"bad": more, "nic": nic}


def _check_world(world: int, fn) -> None:
    plan = planner_plan(world)
    # The planner routes every node-crossing hop of the long document, over every rail.
    ring = plan.rings[0]
    crossing = {(s, d) for s, d in zip(ring.ranks, ring.ranks[1:] + ring.ranks[:1])
                if plan.node_of_rank[s] != plan.node_of_rank[d]}
    assert {(r.src, r.dst) for r in plan.routes} == crossing, f"the planner routes {plan.routes}, not {crossing}"
    results = run_ranks(world, fn, plan)
    bad = [f"rank {r}: {msg}" for r, res in enumerate(results) for msg in res["bad"]]
    assert not bad, "\n".join(bad)
    nic = results[0]["nic"]
    assert nic_spread(nic["routed"]) <= NIC_SPREAD < nic_spread(nic["direct"]), nic


@pytest.mark.slow
def test_routing_on_four_gloo_ranks():
    _check_world(4, _four_ranks)


@pytest.mark.slow
def test_routing_on_eight_gloo_ranks_sharing_nics():
    _check_world(8, _eight_ranks)
