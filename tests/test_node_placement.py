"""Level 2 under memory caps that nearly bind (planning/zeppelin/node_placement.py), and the greedy
spread it rests on (planning/packing.py)."""

import dataclasses
import os

import numpy as np
import pytest

import ballonet
from ballonet import plan_batch, specs, workloads
from ballonet.planning.devices import devices
from ballonet.planning.metrics import plan_metrics
from ballonet.planning.zeppelin import search
from ballonet.planning.zeppelin.node_placement import _levelled
from ballonet.planning.packing import NoRoom, spread
from ballonet.specs import ClusterSpec, NodeGroup

MODEL = specs.model("llama-7b")
REAL_WLBLLM = os.path.join(os.path.dirname(__file__), "..", "data", "workloads", "wlbllm.json")


def test_spread_fills_the_fewest_slots_with_most_room_first():
    shares = spread(np.array([5.0, 20.0, 10.0]), np.array([100.0, 100.0, 100.0]), 25.0, 1.0)
    assert shares == {1: 20.0, 2: 5.0}


def test_spread_of_a_document_no_room_holds_goes_to_the_fewest_slots_with_free_tokens():
    # Every slot is at its work target: the document goes to the slots with most free
    # tokens, as few as hold it, not over every slot (a ring over all of them).
    shares = spread(np.zeros(4), np.array([10.0, 50.0, 30.0, 5.0]), 60.0, 1.0)
    assert shares == {1: 50.0, 2: 10.0}
    with pytest.raises(NoRoom):
        spread(np.zeros(2), np.array([10.0, 5.0]), 20.0, 1.0)


def test_spread_keeps_to_max_slots_while_their_memory_holds_it():
    room, tokens = np.array([10.0, 10.0, 10.0, 10.0]), np.array([100.0, 100.0, 100.0, 100.0])
    assert spread(room, tokens, 35.0, 1.0) == {0: 10.0, 1: 10.0, 2: 10.0, 3: 5.0}
    shares = spread(room, tokens, 35.0, 1.0, max_slots=2)
    assert set(shares) == {0, 1} and sum(shares.values()) == pytest.approx(35.0)
    # Past the two slots' memory, the rest still finds room elsewhere.
    shares = spread(room, np.array([15.0, 15.0, 100.0, 100.0]), 35.0, 1.0, max_slots=2)
    assert shares[0] == shares[1] == 15.0 and sum(shares.values()) == pytest.approx(35.0)


def test_a_split_document_is_levelled_over_its_ranks_in_a_ring_of_three_or_more():
    """Work 7.2 over slots of target 1: filling most room first leaves the 8th slot 0.2
    (a sliver refinement would drop, the others then over target); levelled instead, the
    8 slots hold 0.9 each and whole documents fill up around them. A last share of 0.7
    is levelled too (the ring's steps would wait for the member the whole documents
    fill); a ring of two stays as filled."""
    load, speed, room = np.zeros(8), np.ones(8), np.full(8, 100.0)
    got = _levelled(spread(1.0 - load, room, 7.2, 1.0), load, speed, room, 7.2, 1.0)
    assert sorted(got) == list(range(8)) and all(x == pytest.approx(0.9) for x in got.values())
    got = _levelled({0: 1.0, 1: 1.0, 2: 0.7}, load, speed, room, 2.7, 1.0)
    assert sorted(got) == [0, 1, 2] and all(x == pytest.approx(0.9) for x in got.values())
    assert _levelled({0: 1.0, 1: 0.1}, load, speed, room, 1.1, 1.0) == {0: 1.0, 1: 0.1}
    # Levelled on what the slots already hold, within their memory.
    load = np.array([0.0, 0.0, 0.0, 0.5])
    got = _levelled({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.1}, load, speed, np.array([100.0, 100.0, 100.0, 0.3]), 3.1, 1.0)
    assert got[3] == pytest.approx(0.3) and all(got[i] == pytest.approx(0.9333333) for i in range(3))


def test_a_long_document_over_a_whole_node_leaves_its_ring_members_alike():
    """B llama-3b shortmix's first batch (the main grid of bench/paper.py): a 60723-token
    document over node 0's 8 ranks. Filled most room first, 7 members held 8199 tokens
    and the 8th 20541 (3330 of the document, the node's short documents on top), and the
    ring waited for it: step 1.356 s. Levelled, every member holds about 9.7K tokens."""
    cluster, model = specs.cluster("h800-8nic", num_nodes=4), specs.model("llama-3b")
    batch = next(iter(workloads.get("shortmix").batches(16384 * 32, 0, 1, 65536)))
    plan = plan_batch(batch, cluster, model, "zeppelin")
    ring = next(r for r in plan.rings if batch[r.doc] == max(batch))
    assert ring.ranks == tuple(range(8))
    tokens = [plan.linear_token_counts[r] for r in ring.ranks]
    assert max(tokens) / min(tokens) < 1.02, tokens


def _full_memory_batch(cluster, model, share=0.98):
    """Real wlbllm lengths drawn until they fill `share` of the tokens the cluster holds
    under full recomputation (as `bench/planner.py` builds its 98% batch)."""
    cap = int(devices(cluster, dataclasses.replace(model, recompute="full")).token_cap.sum())
    pool = workloads.get(REAL_WLBLLM).lengths
    rng, lengths = np.random.default_rng(0), []
    while True:
        n = int(pool[rng.integers(len(pool))])
        if sum(lengths) + n > share * cap:
            return lengths
        lengths.append(n)


def test_a_batch_filling_98_percent_of_memory_is_balanced_on_attention_and_on_the_step(monkeypatch):
    # 717 real documents on 32 A800s. Before the second fill, ring ranks spent their
    # targets on a few long-document tokens while the others filled with short documents
    # to their caps: attention imbalance 1.19, compute imbalance 1.05, step 41.4 s.
    # (Checked on the plan of level 1 balanced on the whole step; the search also plans
    # it balanced on the backward, `variants.backward_level`, and keeps that plan where it
    # prices shorter: of the other kind than the best plan's, not made, it ran 42.10 s
    # against 43.86 s here, attention imbalance 1.40, compute 1.004; and its ranks evened
    # in attention tokens, `evened`, which trades up to 1% of attention balance for memory:
    # 43.78 s here.)
    cluster = specs.cluster("a800-4nic", num_nodes=4)
    lengths = _full_memory_batch(cluster, MODEL)
    chosen = ballonet.simulate(plan_batch(lengths, cluster, MODEL), cluster, MODEL).step_time_s
    monkeypatch.setattr(search, "backward_level", lambda level: None)
    monkeypatch.setattr(search, "evened", lambda *args: None)
    plan = plan_batch(lengths, cluster, MODEL)
    m = plan_metrics(plan, cluster, MODEL)
    assert m["attention_imbalance"] <= 1.05 and m["compute_imbalance"] <= 1.02, m
    step = ballonet.simulate(plan, cluster, MODEL).step_time_s
    assert chosen <= step
    wlb = ballonet.simulate(plan_batch(lengths, cluster, MODEL, planner="wlb_llm"), cluster, MODEL).step_time_s
    # It was 9% faster than WLB-LLM's before the simulator ran each rank's kernels in the
    # runtime's order with its waits for partial dK/dV (docs/design.md, section 7): its
    # rings of 2-6 members with unequal local work now move at their slowest member's pace
    # (43.97 s against WLB-LLM's 43.22 s, 39.79 s without those waits).
    assert step < 1.05 * wlb


def test_a_full_node_mixes_long_and_short_documents_on_every_rank():
    # One node, caps nearly full: two long documents and many short ones. Every rank
    # ends with about its cap of tokens, so attention evens out only if each holds its
    # share of long-document tokens: the ring ranks must not be the only ones with them.
    cluster = ClusterSpec(name="one", groups=(NodeGroup(gpu="h200", num_nodes=1, gpus_per_node=8, nics_per_node=8),))
    model = dataclasses.replace(MODEL, recompute="full")
    cap = int(devices(cluster, model).token_cap.sum())
    rng = np.random.default_rng(1)
    lengths = [60_000, 40_000]
    while sum(lengths) < 0.97 * cap:
        lengths.append(int(rng.integers(500, 3000)))
    plan = plan_batch(lengths, cluster, model)
    m = plan_metrics(plan, cluster, model)
    assert m["attention_imbalance"] <= 1.05, m
    holders = {r for ring in plan.rings if plan.lengths[ring.doc] >= 40_000 for r in ring.ranks}
    assert len(holders) == 8


def test_inter_node_span_weighs_the_busiest_nodes_overload_against_the_wider_rings_transfers():
    from ballonet.planning.pricing import inter_node_span, step_weights
    from ballonet.planning.ring_pricing import ring_exposed_seconds
    gpu = specs.cluster("h200-8nic").groups[0].gpu_type
    weights = step_weights(MODEL, gpu, [65536] * 8, 64, specs.cluster("h200-8nic").groups[0].intra_bw)
    length, speed = 65536, gpu.peak_flops * 8
    per_second = speed / (weights.attention_step * MODEL.num_layers)  # step work of one second on a node
    share = 10 * per_second  # a node's share: ten seconds of step
    args = dict(model=MODEL, gpu=gpu, length=length, node_share=share, ranks_per_node=8, num_nodes=8,
                node_speed=speed, weights=weights)
    # Free transfers: as many nodes as its work needs (2.2 shares: 3 nodes, none over).
    assert inter_node_span(step_work=2.2 * share, bandwidth=1e30, **args) == 3
    # Transfers dearer than any overload: it stays in one node.
    assert inter_node_span(step_work=2.2 * share, bandwidth=1e3, **args) == 1
    # Between: a ring over 3 nodes exposes more than one over 2; with each of two nodes over
    # its share by half that difference, two nodes cost least (one node: 10 s over).
    bw = 50e9
    two, three = (ring_exposed_seconds(MODEL, gpu, length, k * 8, bw) for k in (2, 3))
    assert 0 < two < three < 10
    over = (three - two) / 2 * per_second
    assert inter_node_span(step_work=2 * (share + over), bandwidth=bw, **args) == 2


def test_a_document_of_about_two_node_shares_spans_two_nodes():
    # 128 H200s, a prolong batch: its 75K document is 2.2 node shares. Kept in one node
    # (the wider ring over 3 nodes priced dearer than the overload) it left that node at
    # twice the others' step; over 2 nodes each is 10% over, and level 1 widens it to 3
    # (`classes._widened`: simulated 1.714 -> 1.668 s).
    cluster, model = specs.cluster("h200-8nic", num_nodes=16), specs.model("llama-7b", recompute="none")
    lengths = workloads.get("prolong").sample_batch(16384 * 128, 0)
    plan = plan_batch(lengths, cluster, model)
    longest = max(range(len(lengths)), key=lambda d: lengths[d])
    ring = next(r for r in plan.rings if r.doc == longest)
    assert len({r // 8 for r in ring.ranks}) in (2, 3)
    compute = np.array(ballonet.simulate(plan, cluster, model).compute_s)
    assert compute.max() / compute.mean() < 1.15
