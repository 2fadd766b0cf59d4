"""Rings across nodes priced as the simulator runs them (`planning.pricing`): a zig-zag
step's compute, a routed hop's stages one block after another, the layer's FSDP
collectives sharing a ring's ports, and an estimate the simulator confirms."""

import dataclasses

import numpy as np
import pytest

import ballonet
from ballonet import calibration
from ballonet.cost import hardware
from ballonet.cost.flops import block_flops, kv_bytes
from ballonet.cost.seconds import attention_seconds, p2p_time
from ballonet.planning import plan_batch, ring_pricing
from ballonet.simulation import simulate


def test_ports_shared_with_the_fsdp_collectives_cost_what_fair_sharing_gives_by_hand():
    # A transfer of 1 s alone beside 2 s of collectives, each step's compute 1.5 s: the
    # transfer takes 2 s (half the port), the collectives progress 1 s a step, so two
    # steps are slowed, each exposing 0.5 s more.
    assert ring_pricing.dp_shared_seconds(1.0, 1.5, 10, 2.0) == pytest.approx(1.0)
    # Cut into 8 parts the transfer keeps 8/9 of the port: 0.8 s -> 0.9 s, the collectives
    # 0.1 s a step, so 0.2 s of them slow two steps by 0.1 s each beyond the 0.1 s exposed.
    assert ring_pricing.dp_shared_seconds(0.8, 0.7, 10, 0.2, parts=8) == pytest.approx(0.2)
    # Compute that hides even the slowed transfer hides the collectives too; fewer steps, less.
    assert ring_pricing.dp_shared_seconds(1.0, 2.5, 10, 2.0) == 0.0
    assert ring_pricing.dp_shared_seconds(1.0, 1.5, 1, 2.0) == pytest.approx(0.5)


def test_a_routed_hop_passes_blocks_through_its_stages_one_after_another():
    gpu = ballonet.cluster("h200-8nic").groups[0].gpu_type
    m, nic, intra = 80e6, 50e9, 450e9
    first, each, k = ring_pricing.crossing_pipeline(m, nic, intra, 8, gpu)
    assert first == ring_pricing.crossing_seconds(m, nic, intra, 8, gpu) and k > 1
    # a block a step: the slowest stage, the source's port carrying k parts (k - 1
    # dispatches and the combine of the hop into its node), each part its own message
    assert each == pytest.approx(max(k * p2p_time(m / k, intra, False, gpu), p2p_time(m / k, nic, True, gpu)))
    assert each < first
    assert ring_pricing.crossing_pipeline(m, nic, intra, 1, gpu) == (p2p_time(m, nic, True, gpu),) * 2 + (1,)


def test_crossing_hops_priced_as_arrays_cost_what_each_costs_alone():
    gpu = ballonet.cluster("h200-8nic").groups[0].gpu_type
    nbytes = np.array([0.0, 1e3, 80e6, 80e6, 3e8])
    nic, intra, rails = np.full(5, 50e9), np.array([450e9, 450e9, 450e9, 900e9, 450e9]), np.array([8, 1, 8, 4, 0])
    each = ring_pricing.crossing_seconds_each(nbytes, nic, intra, rails, gpu)
    assert each.tolist() == [ring_pricing.crossing_seconds(float(m), n, i, int(k), gpu)
                             for m, n, i, k in zip(nbytes, nic, intra, rails)]


def test_a_ring_step_computes_half_of_two_full_blocks():
    # Zig-zag: a member's two chunks against another member's two, two of the four pairs
    # full; over NVLink the ring hides its transfer once that compute does.
    model = ballonet.model("llama-7b")
    gpu = ballonet.cluster("h200-8nic").groups[0].gpu_type
    length, members = 65536, 8
    block = length // members
    step = attention_seconds(model, gpu, block_flops(model, block, block) / 2, block, launch_floor=True)
    just_hidden = kv_bytes(model, block) / (step * 0.999)  # a link whose transfer a step just hides
    bw = just_hidden / hardware.profile(gpu).p2p_efficiency
    assert ring_pricing.ring_exposed_seconds(model, gpu, length, members, bw * 1.5, nic=False) == 0.0
    assert ring_pricing.ring_exposed_seconds(model, gpu, length, members, bw / 1.5, nic=False) > 0.0


def test_rings_priced_once_per_shape_are_priced_anew_under_an_installed_profile():
    # The partitioner caches a ring's exposed seconds under the built-in profiles only: a
    # profile installed by calibration.use (here a NIC at half the efficiency) prices anew.
    model = ballonet.model("llama-7b")
    gpu = ballonet.cluster("h200-8nic").groups[0].gpu_type
    ring = (model, gpu, 131072, 16, 50e9)
    double = (model, gpu, 131072, 2, 8, 450e9, 50e9)
    before = ring_pricing.ring_exposed_seconds(*ring), ring_pricing.double_exposed_seconds(*double)
    slow = dataclasses.replace(hardware.profile(gpu), nic_efficiency=hardware.profile(gpu).nic_efficiency / 2)
    with calibration.use(slow):
        during = ring_pricing.ring_exposed_seconds(*ring), ring_pricing.double_exposed_seconds(*double)
    assert during[0] > before[0] > 0 and during[1] > before[1] > 0
    assert (ring_pricing.ring_exposed_seconds(*ring), ring_pricing.double_exposed_seconds(*double)) == before


def test_the_estimate_of_a_double_ring_across_two_nodes_is_what_the_simulator_runs():
    # An 80K document on 2 H800 nodes: zeppelin runs it as a "double" ring, its rounds
    # over the NICs and its inner steps over ports the layer's FSDP collectives share.
    # Priced with a ring step's full blocks and no sharing, the estimate was 6.8% under.
    c, m = ballonet.cluster("h800-8nic", num_nodes=2), ballonet.model("llama-7b")
    plan = plan_batch([80000] + [1200] * 160, c, m)
    assert any(r.comm == "double" and r.kind == "inter" for r in plan.rings)
    estimate = min(x["estimated_step_s"] for x in plan.meta["candidates"])
    assert estimate / simulate(plan, c, m).step_time_s == pytest.approx(1.0, abs=0.05)
