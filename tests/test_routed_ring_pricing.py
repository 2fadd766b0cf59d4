"""Single rings whose crossing hops are routed, priced by running their ports as the
simulator shares them (`planning.routed_ring`, `routed_ring.routed_exposed_seconds`):
hand-computed waits, every node alike, and an estimate the simulator confirms."""

import pytest

import ballonet
from ballonet.planning import plan_batch
from ballonet.planning.routed_ring import pass_wait
from ballonet.simulation import simulate


def test_blocks_relayed_over_one_nic_each_wait_what_the_hops_add_up_to_by_hand():
    # One member a node, one rail: every hop is a NIC transfer of d seconds, relayed as
    # soon as it arrives, so step s's block is there at s * d; with compute c < d a
    # member's last step ends at (g - 1) d + c, (g - 1)(d - c) beyond its compute.
    # Of that, d - c before its second step, which its local documents could fill.
    g, c, d = 6, 1.0, 1.5
    assert pass_wait(1, g, 1, c, (0.0, 0.0, d)) == pytest.approx(((g - 1) * (d - c), d - c))
    assert pass_wait(1, g, 1, 2.0, (0.0, 0.0, d)) == (0.0, 0.0)


def test_a_crossing_hop_costs_its_nic_leg_and_an_inner_hop_its_port_by_hand():
    # Two members a node, one rail (local index 0, the crossing hop's destination side),
    # parts free over NVLink: the first member's block goes over NVLink (x) to the second,
    # whose block crosses over the NIC (n) to the next node's first; no link carries two
    # at once, so the second member has its block 1 at x and the first at n; with compute
    # c shorter than both the first waits n - c before its second step.
    x, n, c = 0.4, 1.0, 0.1
    assert pass_wait(2, 2, 1, c, (x, 0.0, n)) == pytest.approx((n - c, n - c))


def test_one_node_standing_for_all_gives_what_running_every_node_gives():
    for per_node, nodes, rails in ((7, 4, 8), (8, 3, 8), (3, 2, 4)):
        members = per_node * nodes
        args = (per_node, members, rails, 1e-3, (4e-4, 6e-5, 2e-4))
        for kw in ({"dp": (1e-3, 1e-4)}, {"grad": (8e-4, 1.2e-4, 4e-4)}):
            assert pass_wait(*args, **kw, nodes=nodes) == pytest.approx(pass_wait(*args, **kw))


def test_the_estimate_of_a_routed_ring_over_three_nodes_is_what_the_simulator_runs():
    # A 126K document on 4 H200 nodes among 2K ones, single rings only: its crossing hops
    # are routed over all 8 rails. Priced hop by hop (each block through dispatch, NIC and
    # combine one after another), a 32-member ring over 4 nodes was picked and its
    # estimate was 9% under the simulated step: the blocks a member relays reach the
    # crossing hops in bursts that share the ports, and the backward's partial dK/dV wait
    # behind them.
    c, m = ballonet.cluster("h200-8nic", num_nodes=4), ballonet.model("llama-7b")
    lengths = [126274] + [2000] * ((16384 * 32 - 126274) // 2000)
    plan = plan_batch(lengths, c, m, double=False)
    assert plan.routes and any(r.comm == "ring" and r.kind == "inter" for r in plan.rings)
    step = simulate(plan, c, m).step_time_s
    assert plan.meta["estimated_step_s"] / step == pytest.approx(1.0, abs=0.05)


def test_the_ports_of_some_rings_bound_the_estimate_with_every_ring_s_ports_from_below():
    # The search's lower bound (`crossing_rings.ports_of`): the routed rings of other
    # documents expose nothing, those of the named ones what running their ports gives;
    # hop by hop (`crossing_rings.HOP_BY_HOP`) no ring is run.
    import numpy as np

    from ballonet.planning.devices import devices
    from ballonet.planning.crossing_rings import HOP_BY_HOP, crossing_exposed_seconds, ports_of, routed_ring_docs
    from ballonet.planning.zeppelin.classes import crossover_lengths

    c, m = ballonet.cluster("h200-8nic", num_nodes=4), ballonet.model("llama-7b")
    lengths = [126274] + [2000] * ((16384 * 32 - 126274) // 2000)
    plan = plan_batch(lengths, c, m, double=False)
    dev = devices(c, m, False)
    cross = crossover_lengths(c, m)[0]
    link, nic = np.full(dev.num_ranks, cross.intra_bw), np.full(dev.num_ranks, cross.crossing_bw)
    rails, piece = np.full(dev.num_ranks, cross.rails), np.zeros((dev.num_ranks, 2))
    docs = routed_ring_docs(plan, dev, m, link, nic, rails)
    assert docs == [0]
    every = crossing_exposed_seconds(plan, dev, m, link, nic, rails, piece)
    assert np.array_equal(crossing_exposed_seconds(plan, dev, m, link, nic, rails, piece, ports_of(docs)), every)
    assert not crossing_exposed_seconds(plan, dev, m, link, nic, rails, piece, ports_of([])).any()
    by_hop = crossing_exposed_seconds(plan, dev, m, link, nic, rails, piece, HOP_BY_HOP)
    members = [r for ring in plan.rings if ring.doc == 0 for r in ring.ranks]
    assert by_hop[members].min() > 0 and not np.allclose(by_hop, every)


def test_a_candidate_repriced_from_its_own_pricing_is_its_plan_priced_anew():
    # `settle` re-prices candidates priced hop by hop with their ports run
    # (`CandidateMaker.reprice`), reading what does not depend on the ports from the
    # candidate: bit for bit what pricing its plan anew gives.
    from ballonet.planning.crossing_rings import HOP_BY_HOP, ports_of
    from ballonet.planning.zeppelin.classes import crossover_lengths
    from ballonet.planning.zeppelin.search import CandidateSearch, ZeppelinOptions

    c, m = ballonet.cluster("h200-8nic", num_nodes=4), ballonet.model("llama-7b")
    lengths = [126274] + [2000] * ((16384 * 32 - 126274) // 2000)
    plan = plan_batch(lengths, c, m, double=False)
    search = CandidateSearch(lengths=lengths, cluster=c, model=m, options=ZeppelinOptions(double=False))
    search.crossovers = crossover_lengths(c, m)
    maker = search._maker(m, trim=True)
    by_hop = maker.price(plan, HOP_BY_HOP)
    for runs in (ports_of([0]), ports_of([])):
        again, anew = maker.reprice(by_hop, runs), maker.price(plan, runs)
        assert (again.seconds, again.busiest_s, again.node_floor_s, again.binds) == \
            (anew.seconds, anew.busiest_s, anew.node_floor_s, anew.binds)
    assert maker.reprice(by_hop).seconds == maker.price(plan).seconds != by_hop.seconds
