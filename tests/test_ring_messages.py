"""The one walk of ring traffic (`Plan.ring_messages`) against hand-worked rings, its per-link
closed form, the metrics, and what the runtime really sends: on 4 gloo ranks (2 nodes x 2),
zeppelin, te_cp and hybrid_dp plans, routed and unrouted, forward and backward, per
(src, dst) pair, all in one spawned group.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch
from distributed import run_ranks
from attention_checks import H_KV, D, H, run_attention, total_bytes
from plans_by_hand import make_plan
from tiny_model import SPEC

import ballonet
from ballonet.cost import flops
from ballonet.cost.flops import kv_bytes
from ballonet.plan import Plan, Route, ring_schedule
from ballonet.planning.metrics import plan_metrics
from ballonet.runtime import ByteCounter

CLUSTER = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2)
LENGTHS = [6000, 100, 50, 20, 7, 3]
PLANNERS = ("zeppelin", "te_cp", "hybrid_dp")
ROW_BYTES = {"kv": 2 * H_KV * D * 4, "grad": 2 * H_KV * D * 4}
"""K and V (fp32 here), and fp32 dK and dV, per row."""


def test_schedule_and_messages_of_a_ring_by_hand():
    # Length 7 over 3 ranks: chunk bounds 0..7 cut as 0,1,2,3,4,5,7; blocks of 3, 2, 2 rows.
    assert ring_schedule(3).tolist() == [[0, 2, 1], [1, 0, 2], [2, 1, 0]]
    plan = make_plan([7], [(0, 1, 2)], (0, 0, 0))
    got = [(m.phase, m.payload, m.step, m.src, m.dst, m.rows) for m in plan.ring_messages()]
    forward = [("forward", "kv", 0, 0, 1, 3), ("forward", "kv", 0, 1, 2, 2), ("forward", "kv", 0, 2, 0, 2),
               ("forward", "kv", 1, 0, 1, 2), ("forward", "kv", 1, 1, 2, 3), ("forward", "kv", 1, 2, 0, 2)]
    backward = [("backward",) + m[1:] for m in forward]
    grads = [("backward", "grad", 1, 0, 1, 2), ("backward", "grad", 1, 1, 2, 3), ("backward", "grad", 1, 2, 0, 2),
             ("backward", "grad", 2, 0, 1, 2), ("backward", "grad", 2, 1, 2, 2), ("backward", "grad", 2, 2, 0, 3)]
    assert sorted(got) == sorted(forward + backward + grads)


def test_a_heads_documents_messages_by_hand_and_its_metrics_bytes():
    # Length 7 over 3 ranks split by heads: blocks of 3, 2, 2 rows. Step 0: each member's
    # rows of q, k, v to each other member (backward: and o, dO, log-sum-exp), step 1 each
    # member's rows of the others' heads' result back to it.
    plan = make_plan([7, 5], [(0, 1, 2), 3], (0, 0, 0, 0), comms={0: "heads"})
    got = sorted((m.phase, m.payload, m.step, m.src, m.dst, m.rows) for m in plan.ring_messages())
    rows, pairs = {0: 3, 1: 2, 2: 2}, [(i, j) for i in range(3) for j in range(3) if i != j]
    want = [(phase, p, 0, i, j, rows[i]) for phase, payloads in (("forward", ("qkv",)), ("backward", ("qkv", "dout")))
            for p in payloads for i, j in pairs]
    want += [(phase, p, 1, j, i, rows[i]) for phase, p in (("forward", "out"), ("backward", "dqkv")) for i, j in pairs]
    assert got == sorted(want)
    model = ballonet.model("llama-7b")
    forward = sum(flops.message_bytes(model, m.payload, m.rows, 3) for m in plan.ring_messages() if m.phase == "forward")
    metrics = plan_metrics(plan, ballonet.cluster("a800-4nic", num_nodes=1, gpus_per_node=4), model)
    assert metrics["kv_bytes"] == pytest.approx(forward) and forward > 0


def _plans() -> dict[str, Plan]:
    model = ballonet.model("llama-7b")
    cluster = ballonet.cluster("a800-4nic", num_nodes=2)
    lengths = [90_000, 40_000, 9_000, 3_000, 700, 50]
    return {name: ballonet.plan_batch(lengths, cluster, model, name) for name in ballonet.PLANNERS}


def test_link_rows_and_metrics_are_sums_of_the_messages():
    model, cluster = ballonet.model("llama-7b"), ballonet.cluster("a800-4nic", num_nodes=2)
    for name, plan in _plans().items():
        forward = Counter()
        for msg in plan.ring_messages():
            if msg.phase == "forward":
                forward[msg.src, msg.dst] += msg.rows
        closed = Counter()
        for ring in plan.rings:
            for src, dst, rows in ring.forward_link_rows():
                closed[src, dst] += rows
        assert closed == forward, name
        kv = sum(kv_bytes(model, n) for n in forward.values())
        assert plan_metrics(plan, cluster, model)["kv_bytes"] == pytest.approx(kv), name


def message_bytes(plan: Plan) -> ByteCounter:
    """Bytes per (src, dst) and phase from `plan.ring_messages()` alone: a routed hop's
    message cut by `Route.part_bounds`, part j over src -> proxies[j] -> dst, legs
    between equal ranks left out, each leg carrying the part's rows."""
    routes = {(r.doc, r.src, r.dst): r for r in plan.routes}
    out = ByteCounter()
    for msg in plan.ring_messages():
        route = routes.get((msg.doc, msg.src, msg.dst))
        bounds = route.part_bounds(msg.rows) if route else (0, msg.rows)
        for j, (a, b) in enumerate(route.proxies if route else ((msg.src, msg.dst),)):
            legs = [msg.src, a, b, msg.dst]
            legs = [r for k, r in enumerate(legs) if k == 0 or r != legs[k - 1]]
            for x, y in itertools.pairwise(legs):
                if bounds[j + 1] > bounds[j]:
                    out.add(msg.phase, x, y, (bounds[j + 1] - bounds[j]) * ROW_BYTES[msg.payload])
    return out


def routed_everywhere(plan: Plan) -> Plan:
    """`plan` with every node-crossing hop of its P2P rings routed over both rails (the
    rank of the same local index on each node): how te_cp or hybrid_dp would be routed."""
    routes = []
    for ring in plan.rings:
        g = len(ring.ranks)
        for i in range(g if ring.comm == "ring" else 0):
            src, dst = ring.ranks[i], ring.ranks[(i + 1) % g]
            if plan.node_of_rank[src] != plan.node_of_rank[dst]:
                a, b = 2 * plan.node_of_rank[src], 2 * plan.node_of_rank[dst]
                routes.append(Route(doc=ring.doc, src=src, dst=dst, proxies=((a, b), (a + 1, b + 1))))
    return dataclasses.replace(plan, routes=tuple(routes)).validate()


def variants() -> dict[str, Plan]:
    out = {}
    for name in PLANNERS:
        plan = ballonet.plan_batch(LENGTHS, CLUSTER, SPEC, name)
        out[f"{name} unrouted"] = dataclasses.replace(plan, routes=())
        if not plan.routes and all(r.comm == "double" for r in plan.rings if r.kind == "inter"):
            # a double ring's hops are never routed: the routed variant is the single-ring plan
            plan = ballonet.plan_batch(LENGTHS, CLUSTER, SPEC, name, double=False)
        out[f"{name} routed"] = plan if plan.routes else routed_everywhere(plan)
    return out


def _count_on_ranks(rank: int, world: int, plans: dict[str, Plan]) -> dict[str, ByteCounter]:
    totals = {}
    for name, plan in plans.items():
        gen = torch.Generator().manual_seed(plan.num_tokens)
        inputs = [torch.randn(plan.num_tokens, h, D, generator=gen) for h in (H, H_KV, H_KV, H)]
        counter = ByteCounter()
        run_attention(plan, rank, inputs, counter=counter)
        totals[name] = total_bytes(counter, world)
    return totals


@pytest.mark.slow
def test_message_bytes_are_what_four_gloo_ranks_send():
    plans = variants()
    for name, plan in plans.items():  # every plan has node-crossing ring traffic to check
        assert any(plan.node_of_rank[m.src] != plan.node_of_rank[m.dst] for m in plan.ring_messages()), name
        assert bool(plan.routes) == name.endswith(" routed"), name
    counted = run_ranks(4, _count_on_ranks, plans)[0]
    for name, plan in plans.items():
        want = message_bytes(plan)
        for phase in ("forward", "backward"):
            got = getattr(counted[name], phase)
            assert got == getattr(want, phase), f"{name} {phase}: sent {dict(got)}, messages say {dict(getattr(want, phase))}"
