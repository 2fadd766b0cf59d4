"""Rings inside PCIe-only nodes priced as the simulator runs them (`planning.pcie_rings`):
the exposed seconds of one ring by hand from the link's bandwidth and the kernels'
seconds, the estimate of a plan with such a ring against the simulator, and NVLink nodes
left as they were."""

import dataclasses

import numpy as np
import pytest

from tests.tight_memory import tight

import ballonet
from ballonet import workloads
from ballonet.cost import hardware
from ballonet.cost.flops import heads_divide
from ballonet.cost.recompute import per_rank_recompute
from ballonet.cost.seconds import DP_FORWARD_SHARE, attention_seconds
from ballonet.planning import plan_batch
from ballonet.planning.devices import devices
from ballonet.planning.heads_exposure import heads_exposed_seconds
from ballonet.planning.routing import plan_routes
from ballonet.planning.zeppelin.pcie_level import pcie_ring_inside
from ballonet.planning.zeppelin.search import CandidateSearch, ZeppelinOptions
from ballonet.planning.pcie_rings import (
    backward_exposed_seconds,
    forward_exposed_seconds,
    pcie_ring_exposed_seconds,
    pcie_ring_seconds,
)
from ballonet.simulation import simulate
from ballonet.specs import ClusterSpec, NodeGroup

L40S_NODE = ClusterSpec(name="l40s", groups=(NodeGroup(gpu="l40s", num_nodes=1, gpus_per_node=8, nics_per_node=2,
                                                       nic_gbps=200),))


def test_a_pass_is_as_long_as_its_port_carries_or_its_partials_chain():
    # Forward, 3 members: 2 hops of 2 s against 2 steps of 1 s after the first, 0.5 s of
    # local documents between: 4 - 2 - 0.5 exposed; 1 s of collectives beside them holds
    # the blocks back 1 s, 10 s at most as long as the blocks' own 4 s.
    assert forward_exposed_seconds(3, 1.0, 2.0, 0.5, 0.0) == pytest.approx(1.5)
    assert forward_exposed_seconds(3, 1.0, 2.0, 0.5, 1.0) == pytest.approx(2.5)
    assert forward_exposed_seconds(3, 1.0, 2.0, 0.5, 10.0) == pytest.approx(5.5)
    assert forward_exposed_seconds(3, 3.0, 2.0, 0.0, 0.0) == 0.0
    # Backward, 4 members, K/V 1 s and partials 2 s a hop, steps of 1 s: the port carries
    # 3 x 3 s, of which the last partial is the hop home (priced elsewhere), against 4
    # steps: 9 - 2 - 4. Local work hides K/V, not the partials' chain: 2 x (2 - 1).
    assert backward_exposed_seconds(4, 1.0, 1.0, 2.0, 0.0, 0.0) == pytest.approx(3.0)
    assert backward_exposed_seconds(4, 1.0, 1.0, 2.0, 3.0, 0.0) == pytest.approx(2.0)


def test_a_64k_ring_over_8_l40s_exposes_what_pcie_takes_beyond_its_kernels_by_hand():
    model, gpu = dataclasses.replace(ballonet.model("llama-7b"), recompute="none"), hardware.gpu("l40s")
    p = hardware.profile(gpu)
    link = 25e9  # PCIe Gen4 x16, achieved
    block = 65536 // 8
    hd = model.num_heads * model.head_dim
    flops = 4 * hd * block * block / 2  # a zig-zag step: two of its blocks' four chunk pairs, full
    fwd = attention_seconds(model, gpu, flops, block, launch_floor=True)
    bwd = attention_seconds(model, gpu, flops, block, backward=True, launch_floor=True)
    kv = p.p2p_latency_s + 2 * block * model.kv_dim * 2 / (link * p.p2p_efficiency)  # K and V, bf16
    grad = p.p2p_latency_s + 2 * block * model.kv_dim * 4 / (link * p.p2p_efficiency)  # dK and dV, fp32
    assert kv > fwd and kv + grad > bwd  # PCIe: the transfers outlast the steps
    # one rank a node: no data-parallel collectives inside it to share the port with
    forward, backward = pcie_ring_seconds(model, gpu, [[block] * 8], 8, link, 1)
    assert forward == pytest.approx(32 * 7 * (kv - fwd), rel=1e-9)
    assert backward == pytest.approx(32 * (7 * (kv + grad) - grad - 8 * bwd), rel=1e-9)
    assert (forward + backward > 3.0).all()  # seconds a step: what the estimate missed before
    # full recomputation: each backward step's kernel also reruns its forward
    full = dataclasses.replace(model, recompute="full")
    f, b = pcie_ring_seconds(full, gpu, [[block] * 8], 8, link, 1)
    assert f == pytest.approx(forward, rel=1e-9)
    assert b == pytest.approx(32 * (7 * (kv + grad) - grad - 8 * (bwd + fwd)), rel=1e-9)


@pytest.mark.parametrize("lengths, within", [([32768] + [2048] * 32, 0.01), ([65536] + [2048] * 16, 0.04)])
def test_the_estimate_of_a_ring_inside_a_pcie_node_is_what_the_simulator_runs(lengths, within):
    # Without the ring's PCIe transfers the estimate was 0.76x and 0.68x of the simulated step.
    model = ballonet.model("llama-7b")
    node = tight(L40S_NODE, model)
    plan = plan_batch(lengths, node, model)
    assert any(len(r.ranks) > 2 for r in plan.rings)
    estimate = min(x["estimated_step_s"] for x in plan.meta["candidates"])
    assert estimate / simulate(plan, node, model).step_time_s == pytest.approx(1.0, abs=within)


def test_rings_over_nvlink_are_priced_as_before():
    cluster, model = ballonet.cluster("h800-8nic", num_nodes=1), ballonet.model("llama-7b")
    plan = plan_batch([65536] + [2048] * 16, cluster, model)
    assert plan.rings
    dev = devices(cluster, dataclasses.replace(model, recompute="full"))
    got = pcie_ring_exposed_seconds(plan, dev, model, np.full(plan.num_ranks, 200e9))
    assert not got.forward.any() and not got.backward.any() and not got.members.any()
    assert not got.backward_skew(np.ones(plan.num_ranks)).any()


def test_the_search_also_plans_no_ring_inside_a_pcie_node_and_keeps_it_where_it_is_shorter():
    # bench/hetero.py's a800+l40s prolong batch 6: level 1 puts a 28K-token document's ring
    # over 3 L40S (6.31 s simulated); kept whole on the L40S nodes, the batch runs 5.76 s.
    cluster, model = ballonet.cluster("a800+l40s"), ballonet.model("llama-7b")
    lengths = list(workloads.get("prolong").batches(16384 * cluster.num_ranks, 0, 7, 65536))[6]
    search = CandidateSearch(lengths=lengths, cluster=cluster, model=model, options=ZeppelinOptions())
    plan = search.run()
    assert not pcie_ring_inside(plan, search.best.dev)

    def simulated(p):
        p = dataclasses.replace(p, recompute=per_rank_recompute(model, p.linear_token_counts, search.best.dev.gpu,
                                                                p.attention_token_counts))
        return simulate(p, cluster, model).step_time_s
    inside = [dataclasses.replace(c.plan, routes=plan_routes(c.plan, cluster, c.model, c.dev.local_index))
              for c, *_ in search.made if pcie_ring_inside(c.plan, c.dev)]  # routed, as the chosen plan
    assert inside and simulated(plan) < 0.95 * min(simulated(p) for p in inside)


@pytest.mark.parametrize("tight_caps", [False, True])
def test_a_heads_split_inside_a_pcie_node_beats_its_ring_and_is_estimated_as_simulated(tight_caps):
    # A 32K document over 4 L40S: its ring passes every K/V block through every member's
    # PCIe port; split by heads each port carries 1/4 of q, k, v and o of its own rows to
    # each other member. The attention layout is the same, so memory and recomputation too.
    model = ballonet.model("llama-7b")
    node = tight(L40S_NODE, model) if tight_caps else L40S_NODE
    search = CandidateSearch(lengths=[32768] + [2048] * 32, cluster=node, model=model, options=ZeppelinOptions())
    heads = search.run()  # the search's last variant (`pcie_level.by_heads`)
    maker = next(x.maker for x in search.made if x.candidate is search.best)
    (split,) = heads.rings
    assert split.comm == "heads" and len(split.ranks) == 4 and heads_divide(model, 4)
    plan = dataclasses.replace(heads, rings=(dataclasses.replace(split, comm="ring"),)).validate()
    simulated, estimated = simulate(heads, node, model).step_time_s, maker.price(heads).seconds
    assert simulated < 0.95 * simulate(plan, node, model).step_time_s
    assert estimated / simulated == pytest.approx(1.0, abs=0.05)
    assert maker.price(plan).seconds > estimated  # why the search chose it


def test_a_heads_member_waits_for_its_gathers_then_returns_by_hand():
    # Two members of 1000 rows, nothing else on their streams: each pass's gathers (one
    # message each way and payload) before the kernel, the returns after it, all exposed.
    # The backward's qkv and dout share the port fairly: both in after their seconds summed.
    model, gpu = dataclasses.replace(ballonet.model("llama-7b"), recompute="none"), hardware.gpu("l40s")
    link, rows, L = 25e9, 1000, 2000
    p = hardware.profile(gpu)

    def hop(nbytes):
        return p.p2p_latency_s + nbytes / (link * p.p2p_efficiency)
    qkv = hop(rows * (model.hidden + 2 * model.kv_dim) * 2 / 2)  # 1/2 of the heads of q, k and v, bf16
    out = hop(rows * (model.hidden * 2 + model.num_heads * 4) / 2)  # o and its fp32 log-sum-exp
    dout = hop(rows * (2 * model.hidden * 2 + model.num_heads * 4) / 2)  # o, dO and the fp32 log-sum-exp
    forward, backward = heads_exposed_seconds(model, gpu, [L], [rows, rows], link, 0.0)
    assert forward == pytest.approx([32 * (qkv + out)] * 2, rel=1e-9)
    assert backward == pytest.approx([32 * (qkv + dout + qkv)] * 2, rel=1e-9)  # dq, dk, dv as wide as q, k, v
    # local documents of 1 s a layer fill the gathers; the returns stay exposed
    forward, _ = heads_exposed_seconds(model, gpu, [L], [rows, rows], link, 0.0, fill=(1.0, 1.0))
    assert forward == pytest.approx([32 * out] * 2, rel=1e-9)
    # 1 s of the layer's collectives beside them (longer than every message): each port's
    # messages take as long again as the longest of them
    forward, _ = heads_exposed_seconds(model, gpu, [L], [rows, rows], link, 1.0 / DP_FORWARD_SHARE)
    assert forward == pytest.approx([32 * (2 * qkv + 2 * out)] * 2, rel=1e-9)
