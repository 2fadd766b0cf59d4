"""The partitioner, remap and routing planning, and every baseline, against hand-worked cases."""

import collections
import dataclasses

import numpy as np
import pytest

from tests.tight_memory import tight

import ballonet
from ballonet import PLANNERS, plan_batch, specs, workloads
from ballonet.cost import hardware
from ballonet.cost.flops import attention_flops, kv_bytes, remap_bytes, zigzag_flops
from ballonet.cost.recompute import layers_per_rank
from ballonet.cost.seconds import attention_work, breakeven_chunk_tokens, p2p_time
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import Segment, Transfer
from ballonet.plan.recompute import heaviest
from ballonet.planning import pricing, ring_pricing
from ballonet.planning.assembly import Placement, assemble, zigzag_bounds
from ballonet.planning.devices import devices
from ballonet.planning.metrics import plan_metrics
from ballonet.planning.packing import NoRoom, apportion
from ballonet.planning.remap import plan_remap
from ballonet.planning.zeppelin import crossover_lengths
from ballonet.specs import ClusterSpec, NodeGroup

MODEL = specs.model("llama-7b")


def h200(num_nodes=1, gpus=8, nics=8):
    return ClusterSpec(name="t", groups=(NodeGroup(gpu="h200", num_nodes=num_nodes, gpus_per_node=gpus, nics_per_node=nics),))


def test_two_equal_documents_on_two_gpus_go_one_each():
    plan = plan_batch([8, 8], h200(gpus=2, nics=2), MODEL)
    assert plan.attention == ((Segment(0, 0, 8),), (Segment(1, 0, 8),))
    assert plan.rings == () and plan.remap == () and plan.routes == ()


def test_zigzag_bounds_of_seven_tokens_over_four_ranks():
    # tokens 2, 2, 2, 1: fronts 1, 1, 1, 0 from the start; backs 1, 1, 1, 1 from the end.
    assert zigzag_bounds(7, [2, 2, 2, 1]) == (0, 1, 2, 3, 3, 4, 5, 6, 7)
    dev = devices(h200(gpus=4, nics=4), MODEL)
    placement = Placement(num_ranks=4)
    placement.split[0] = {0: 2, 1: 2, 2: 2, 3: 1}
    plan = assemble("t", [7], dev, placement).validate()
    assert [plan.attention_tokens(r) for r in range(4)] == [2, 2, 2, 1]
    assert plan.attention[0] == (Segment(0, 0, 1), Segment(0, 6, 7))


def test_seven_token_document_over_four_ranks_in_te_cp():
    plan = plan_batch([7], h200(gpus=4, nics=4), MODEL, planner="te_cp", cp_size=4)
    (ring,) = plan.rings
    assert ring.bounds == (0, 0, 1, 2, 3, 4, 5, 6, 7) and ring.ranks == (0, 1, 2, 3)
    assert [plan.attention_tokens(r) for r in range(4)] == [1, 2, 2, 2]


def test_zigzag_positions_do_equal_work_for_equal_tokens():

    bounds = zigzag_bounds(4096, [1024] * 4)
    flops = zigzag_flops(MODEL, bounds).tolist()
    assert sum(flops) == pytest.approx(attention_flops(MODEL, 4096))
    assert max(flops) / min(flops) < 1.001


def test_classes_local_intra_inter_on_two_nodes():
    cluster = h200(num_nodes=2)
    (cross,) = crossover_lengths(cluster, MODEL)
    # 2 * break-even chunk (NVLink) and 2 * 8 * break-even chunk (one 400 Gb/s NIC per GPU).
    gpu = hardware.gpu("h200")
    assert cross.intra == 2 * breakeven_chunk_tokens(MODEL, gpu, gpu.intra_link_bw)
    assert cross.inter == 2 * 8 * breakeven_chunk_tokens(MODEL, gpu, 400e9 / 8, nic=True)
    plan = plan_batch([300_000] + [2_000] * 60, cluster, MODEL)
    kinds = {r.doc: r.kind for r in plan.rings}
    assert kinds.pop(0) == "inter" and set(kinds.values()) <= {"intra"}  # short ones: whole, or split to level
    # Above a rank's share of attention work, below the inter-node crossover: one node.
    medium = plan_batch([20_000] + [2_000] * 200, cluster, MODEL)
    kinds = {r.doc: r.kind for r in medium.rings}
    assert kinds[0] == "intra" and set(kinds.values()) == {"intra"}
    # A batch of equal short documents that divides evenly: nothing to split.
    assert plan_batch([2_000] * 64, cluster, MODEL).rings == ()
    ring = plan.ring_of_doc[0]
    nodes = [plan.node_of_rank[r] for r in ring.ranks]
    assert nodes == sorted(nodes)  # grouped by node: only two hops cross nodes


def test_remap_moves_only_surplus_inside_nodes_first():
    transfers = plan_remap([10, 0, 6, 0], np.array([4, 4, 4, 4]), (0, 0, 1, 1))
    # node 0: rank 0 gives 4 of its 6 extra to rank 1; node 1: rank 2 gives 2 to rank 3;
    # only node 0's net surplus (2 tokens) crosses to node 1.
    assert transfers == (Transfer(0, 1, 4, 8), Transfer(0, 3, 8, 10), Transfer(2, 3, 4, 6))


@pytest.mark.parametrize("price_linear", [True, False])
def test_zeppelin_remap_reaches_equal_tokens_with_surplus_only(price_linear):
    lengths = [100_000, 30_000] + [1_500] * 250
    # Without routing (a crossing hop on one NIC) both long documents stay inside a node;
    # routed, the 100K one goes across the two nodes and every rank keeps its tokens.
    # Under selective recomputation (with linear recomputation every rank keeping its tokens
    # prices, and simulates, shorter: 4.80 s against 4.78 s remapped, 4.99 s selective)
    selective = dataclasses.replace(MODEL, recompute="selective")
    plan = plan_batch(lengths, tight(h200(num_nodes=2), selective), selective, price_linear=price_linear, routing=False)
    assert not plan.meta["keep_tokens"]  # priced: remapping beats every rank keeping its tokens here
    att = [plan.attention_tokens(r) for r in range(16)]
    lin = [plan.linear_tokens(r) for r in range(16)]
    groups = (range(8), range(8, 16)) if price_linear else (range(16),)  # even inside nodes, or everywhere
    for g in groups:
        assert max(lin[r] for r in g) - min(lin[r] for r in g) <= 1
    assert sum(lin) == sum(lengths)
    if price_linear:
        assert all(plan.node_of_rank[t.src] == plan.node_of_rank[t.dst] for t in plan.remap)
    moved = sum(t.num_tokens for t in plan.remap)
    assert moved == sum(max(0, a - x) for a, x in zip(att, lin))
    for src in range(16):  # a rank either sends or receives, never both
        assert not (any(t.src == src for t in plan.remap) and any(t.dst == src for t in plan.remap))


def test_routes_are_rail_aligned_over_distinct_nics():
    cluster = specs.cluster("a800-4nic", num_nodes=4)
    lengths = [400_000] + [2_000] * 100
    # Single rings (routes are theirs): by default the 400K document runs on a double
    # ring, which simulates 4% faster (32.0 against 33.4 s) since its sends are priced.
    plan = plan_batch(lengths, cluster, MODEL, double=False)
    assert plan.routes
    for route in plan.routes:
        srcs = [plan.nic_of_rank[a] for a, _ in route.proxies]
        dsts = [plan.nic_of_rank[b] for _, b in route.proxies]
        assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts) <= 4
        for a, b in route.proxies:
            assert cluster.local_index(a) == cluster.local_index(b)
            assert cluster.node_of(a) == cluster.node_of(route.src) and cluster.node_of(b) == cluster.node_of(route.dst)
    assert plan_batch(lengths, cluster, MODEL, routing=False).routes == ()


def _real_batch(real_data, num_tokens: int) -> list[int]:
    import json

    rng = np.random.default_rng(0)
    pool = json.loads((real_data / "workloads" / "wlbllm.json").read_text())
    lengths, total = [], 0
    while total < num_tokens:
        lengths.append(int(pool[rng.integers(len(pool))]))
        total += lengths[-1]
    return lengths


def test_zeppelin_on_a_real_workload_beats_te_cp_and_moves_less(real_data):
    cluster = h200(num_nodes=4)
    lengths = _real_batch(real_data, 16384 * 32)
    plans = {"zeppelin": plan_batch(lengths, cluster, MODEL), "te_cp": plan_batch(lengths, cluster, MODEL, planner="te_cp"),
             "te_cp_whole": plan_batch(lengths, cluster, MODEL, planner="te_cp", cp_size=cluster.num_ranks)}
    m = {p: plan_metrics(plan, cluster, MODEL) for p, plan in plans.items()}
    step = {p: ballonet.simulate(plan, cluster, MODEL).step_time_s for p, plan in plans.items()}
    assert step["zeppelin"] < step["te_cp"] < step["te_cp_whole"]
    assert m["zeppelin"]["comm_bytes"] * 4 <= m["te_cp_whole"]["comm_bytes"]


def test_zeppelin_balances_compute_and_leads_every_baseline_on_a_real_workload(real_data):
    cluster = h200(num_nodes=4)
    lengths = _real_batch(real_data, 16384 * 32)
    plan = plan_batch(lengths, cluster, MODEL)
    res = ballonet.simulate(plan, cluster, MODEL)
    compute = np.array(res.compute_s)
    assert compute.max() / compute.mean() <= 1.05  # simulated seconds per rank, attention plus linear
    for name in ("te_cp", "wlb_llm", "hybrid_dp", "megatron_hcp", "packed_dp"):
        other = ballonet.simulate(plan_batch(lengths, cluster, MODEL, planner=name), cluster, MODEL)
        assert res.step_time_s <= other.step_time_s, name
    # Pricing linear work pays on this batch: without it the step is longer. (Without
    # pricing recomputation the plan is made for full recomputation's loose caps, and the
    # step recomputes as few layers as its tokens need all the same; what that pricing buys
    # over the main grid is in bench/results/paper.md's pricing ablation.)
    off = plan_batch(lengths, cluster, MODEL, price_linear=False)
    assert res.step_time_s < ballonet.simulate(off, cluster, MODEL).step_time_s


def test_zeppelin_keeps_tokens_where_the_remap_does_not_pay():
    # Two long documents over two nodes: balancing attention plus linear work per rank
    # leaves a shorter step than remapping q, k, v and o inside the nodes.
    cluster = tight(h200(num_nodes=2), MODEL)
    lengths = [120_000, 40_000] + [1_500] * 60
    kept = plan_batch(lengths, cluster, MODEL)
    assert kept.meta["keep_tokens"] and kept.remap == ()
    # With more short documents and both long ones inside their nodes (no routing: a
    # crossing hop on one NIC; routed, the 100K one crosses and every rank keeps its
    # tokens), remapping inside the nodes pays.
    # Under selective recomputation (linear recomputation keeps tokens there, and is
    # shorter still: `test_zeppelin_remap_reaches_equal_tokens_with_surplus_only`).
    more, selective = [100_000, 30_000] + [1_500] * 250, dataclasses.replace(MODEL, recompute="selective")
    remapped = plan_batch(more, cluster, selective, routing=False)
    assert not remapped.meta["keep_tokens"] and remapped.remap
    compute = np.array(ballonet.simulate(kept, cluster, MODEL).compute_s)
    assert compute.max() / compute.mean() < 1.1
    for plan, batch, model, options in ((kept, lengths, MODEL, {}), (remapped, more, selective, {"routing": False})):
        unpriced = plan_batch(batch, cluster, model, price_linear=False, **options)
        assert ballonet.simulate(plan, cluster, model).step_time_s < ballonet.simulate(unpriced, cluster, model).step_time_s


def test_nodes_carry_the_tensor_parallel_collectives_of_their_tokens():
    # llama-30b at tp 4 on four H800 nodes: the sequence-parallel collectives, on the
    # compute stream, cost about half a token's linear work. Level 1 balances them with
    # the rest: the nodes of the two 64K documents take more short ones, no rank waits
    # long for the others (priced as compute alone, those ranks idled 14% of the step).
    cluster, model = specs.cluster("h800-8nic", num_nodes=4), specs.model("llama-30b", tp=4)
    batch = next(iter(workloads.get("wlbllm").batches(16384 * cluster.num_ranks, 0, 1, 65536)))
    result = ballonet.simulate(plan_batch(batch, cluster, model), cluster, model)
    assert max(result.idle_s) < 0.05 * result.step_time_s, result.idle_s


def test_zeppelin_plans_for_the_cheapest_recomputation_that_pays():
    cluster, model = h200(num_nodes=2), specs.model("llama-3b")
    lengths = [4_000] * 64  # fits every rank without recomputation
    plan = plan_batch(lengths, cluster, model)
    assert heaviest(plan.recompute).mode == "none" and ballonet.simulate(plan, cluster, model).recompute == "none"
    assert plan_batch(lengths, cluster, model, price_recompute=False).meta["recompute"] == "full"  # planned under
    forced = specs.model("llama-3b", recompute="selective")
    assert heaviest(plan_batch(lengths, cluster, forced).recompute).mode == "selective"


def test_a_document_over_a_nodes_share_goes_across_nodes_when_it_pays():
    cluster = h200(num_nodes=2)
    # 100K tokens: over one node's share of the step, below the inter-node crossover.
    lengths = [100_000] + [1_000] * 162
    (cross,) = crossover_lengths(cluster, MODEL)
    assert lengths[0] < cross.inter
    plan = plan_batch(lengths, cluster, MODEL)
    assert plan.ring_of_doc[0].kind == "inter"
    compute = np.array(ballonet.simulate(plan, cluster, MODEL).compute_s)
    assert compute.max() / compute.mean() < 1.1
    # Beside 250K tokens of short documents, 60K tokens fit one node's share: split
    # inside it, nothing crosses. (Beside 202K, it is near the share: the plan without
    # recomputation sends it across nodes, one that recomputes for looser caps keeps it
    # in one, and which of them is estimated shorter decides.)
    short = plan_batch([60_000] + [1_000] * 250, cluster, MODEL)
    assert short.ring_of_doc[0].kind == "intra"


def test_mixed_cluster_gets_work_in_proportion_to_speed():
    cluster = ClusterSpec(name="mix", groups=(NodeGroup(gpu="h200", num_nodes=1), NodeGroup(gpu="h20", num_nodes=1)))
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(500, 6000, size=300)] + [60_000]
    plan = plan_batch(lengths, cluster, MODEL)
    compute = np.array(ballonet.simulate(plan, cluster, MODEL).compute_s)
    assert compute.max() / compute.mean() < 1.1  # seconds level though the H200 has 6.7x the H20's peak
    lin = [plan.linear_tokens(r) for r in range(16)]
    assert sum(lin[:8]) > 3 * sum(lin[8:])
    flat = plan_batch(lengths, cluster, MODEL, assume_homogeneous=True)
    flat_compute = np.array(ballonet.simulate(flat, cluster, MODEL).compute_s)
    assert flat_compute.max() / flat_compute.mean() > 1.5  # planned as equals, the H20 node is the straggler


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_empty_batch_and_single_gpu(planner):
    plan = plan_batch([], h200(num_nodes=2), MODEL, planner=planner)
    assert plan.attention == ((),) * 16
    one = h200(gpus=1, nics=1)
    plan = plan_batch([5, 100, 7], one, MODEL, planner=planner)
    assert plan.attention == ((Segment(0, 0, 5), Segment(1, 0, 100), Segment(2, 0, 7)),)


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_too_long_document_names_itself_and_the_limit(planner):
    with pytest.raises(InfeasiblePlan, match=r"document 1 has 1000000000 tokens, over the \d+ tokens"):
        plan_batch([10, 10**9], h200(num_nodes=2), MODEL, planner=planner)


def test_model_state_over_memory_is_infeasible():
    with pytest.raises(InfeasiblePlan, match="weights and optimizer state"):
        plan_batch([10], specs.cluster("cpu"), specs.model("llama-7b"))


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_plans_are_deterministic(planner):
    rng = np.random.default_rng(2)
    lengths = [int(x) for x in rng.lognormal(7.5, 1.2, size=200)] + [90_000]
    cluster = specs.cluster("a800-4nic", num_nodes=2)
    assert plan_batch(lengths, cluster, MODEL, planner=planner).to_json() == \
        plan_batch(list(lengths), cluster, MODEL, planner=planner).to_json()


def test_bad_planner_names_and_options():
    with pytest.raises(InputError, match="unknown planner 'nope'; known: zeppelin, packed_dp"):
        plan_batch([1], h200(), MODEL, planner="nope")
    with pytest.raises(InputError, match="has no option 'routes'"):
        plan_batch([1], h200(), MODEL, routes=False)
    with pytest.raises(InputError, match="cp_size must divide"):
        plan_batch([1], h200(), MODEL, planner="te_cp", cp_size=3)
    for planner in ("te_cp", "llama_cp", "wlb_llm", "magi"):  # a bool is no CP degree, though Python's 1
        with pytest.raises(InputError, match=f"{planner}: cp_size must divide the 8 ranks, got True"):
            plan_batch([1], h200(), MODEL, planner=planner, cp_size=True)
    with pytest.raises(InputError, match="document 1: length must be a positive integer"):
        plan_batch([1, 0], h200(), MODEL)
    assert ballonet.plan_batch([4], h200(), MODEL).planner == "zeppelin"


def test_without_hierarchy_split_documents_span_every_rank():
    plan = plan_batch([300_000] + [2_000] * 60, h200(num_nodes=2), MODEL, hierarchical=False)
    assert plan.ring_of_doc[0].ranks == tuple(range(16))


def test_apportion_by_largest_remainder_under_caps():
    assert apportion(10, np.array([1.0, 1.0, 1.0])).tolist() == [4, 3, 3]
    assert apportion(10, np.array([1.0, 1.0, 1.0]), np.array([2, 9, 9])).tolist() == [2, 4, 4]
    with pytest.raises(InfeasiblePlan):
        apportion(10, np.array([1.0, 1.0]), np.array([2, 2]))


@pytest.mark.parametrize("planner", ["zeppelin", "te_cp", "llama_cp", "hybrid_dp"])
def test_metric_bytes_match_the_plan_pair_by_pair(planner):

    cluster = specs.cluster("a800-4nic", num_nodes=2)
    lengths = [120_000, 9_000, 3_000, 700, 50]
    plan = plan_batch(lengths, cluster, MODEL, planner=planner, **({"cp_size": 16} if planner == "te_cp" else {}))
    rows = collections.Counter()  # the contract's own (step by step) count
    for msg in plan.ring_messages():
        if msg.phase == "forward":
            rows[msg.src, msg.dst] += msg.rows
    pairs = list(rows.items())
    kv = sum(kv_bytes(MODEL, n) for _, n in pairs)
    cross = sum(kv_bytes(MODEL, n) for (a, b), n in pairs if plan.node_of_rank[a] != plan.node_of_rank[b])
    cross += sum(remap_bytes(MODEL, n, True) + remap_bytes(MODEL, n, False) for (a, b), n in plan.remap_tokens().items()
                 if plan.node_of_rank[a] != plan.node_of_rank[b])  # q/k/v one way, o the other
    m = plan_metrics(plan, cluster, MODEL)
    assert m["kv_bytes"] == pytest.approx(kv) and m["inter_node_bytes"] == pytest.approx(cross)
    if planner == "te_cp":  # every document over all 16 ranks: 15 steps of L rows in total
        assert kv == pytest.approx(sum(kv_bytes(MODEL, 15 * L) for L in lengths))


def test_cli_plan_json_and_errors(tmp_path, capsys):
    import json

    from ballonet import cli
    from ballonet.plan import Plan

    lengths = tmp_path / "batch.txt"
    lengths.write_text("\n".join(["9000", "300", "4000", "7"]))
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--cluster", "cpu", "--model", "tiny", "--lengths", str(lengths), "--json",
                     "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["planner"] == "zeppelin" and report["valid"] is True
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    assert sum(r["tokens_attention"] for r in report["ranks"]) == 13307
    assert sum(r["tokens_linear"] for r in report["ranks"]) == 13307
    assert {"attention_imbalance", "linear_imbalance", "compute_imbalance", "comm_bytes", "inter_node_bytes", "max_nic_bytes",
            "plan_ms"} <= set(report["metrics"])
    assert Plan.from_json(out.read_text()).validate().lengths == (9000, 300, 4000, 7)
    assert cli.main(["plan", "--cluster", "cpu", "--model", "tiny", "--workload", "shortmix",
                     "--tokens-per-gpu", "2048", "--planner", "te_cp"]) == 0
    assert "linear imbalance" in capsys.readouterr().out
    assert cli.main(["plan", "--cluster", "cpu", "--model", "tiny", "--planner", "nope"]) == 2
    assert "unknown planner 'nope'" in capsys.readouterr().err


def test_water_level_tops_up_the_lowest_slots():
    from ballonet.planning.zeppelin.water import water_level

    one = np.ones(3)
    # Level 2.5: (4 + 0 + 1) / 2 is below the third slot's 5.
    assert water_level(np.array([0.0, 1.0, 5.0]), one, one, np.full(3, 1e9), 4.0) == pytest.approx([2.5, 1.5, 0.0])
    # The first slot is capped at 1: the other 3 lift the second slot to 4, still below 5.
    assert water_level(np.array([0.0, 1.0, 5.0]), one, one, np.array([1.0, 1e9, 1e9]), 4.0) == \
        pytest.approx([1.0, 3.0, 0.0])
    # A twice-as-fast slot takes twice the work at a common level of (6 + 0) / 3 = 2.
    assert water_level(np.zeros(2), np.array([2.0, 1.0]), np.ones(2), np.full(2, 1e9), 6.0) == pytest.approx([4.0, 2.0])


def test_zeppelin_options_must_be_booleans():
    with pytest.raises(InputError, match="routing must be True or False"):
        plan_batch([1], h200(), MODEL, routing="no")


def test_only_zeppelin_and_distca_plans_are_made_for_the_attention_engine():
    cluster = specs.cluster("a800-4nic", num_nodes=2)
    lengths = [40_000, 9_000, 3_000, 700, 50]
    for name in PLANNERS:
        for options in ([{}, {"routing": False, "remap": False, "hierarchical": False}] if name == "zeppelin" else [{}]):
            plan = plan_batch(lengths, cluster, MODEL, planner=name, **options)
            assert plan.attention_engine == (name in ("zeppelin", "distca")), (name, options)  # distca: ping-pong


def test_lpt_under_tight_caps_matches_the_plain_rule():
    # Each document, largest first, to the least loaded slot with room for it (ties to
    # the lower slot); none with room: spilled. Checked against that rule written plainly.
    from ballonet.planning.packing import lpt
    rng = np.random.default_rng(3)
    for trial in range(40):
        slots, D = int(rng.integers(2, 9)), int(rng.integers(5, 60))
        lengths = [int(x) for x in rng.integers(1, 400, D)]
        work = np.array([L * (1 + L / 200) for L in lengths])
        room = rng.integers(100, 1500, slots).astype(float)
        load, spill = np.zeros(slots), []
        got = lpt(list(range(D)), work, lengths, load, np.ones(slots), room.copy(), spill)
        ref_load, ref_room, ref, ref_spill = [0.0] * slots, room.tolist(), {}, []
        for d in sorted(range(D), key=lambda d: (-work[d], d)):
            fits = [i for i in range(slots) if ref_room[i] >= lengths[d]]
            if not fits:
                ref_spill.append(d)
                continue
            i = min(fits, key=lambda i: (ref_load[i], i))
            ref.setdefault(i, []).append(d)
            ref_load[i] += work[d]
            ref_room[i] -= lengths[d]
        assert got == ref and spill == ref_spill, trial
        assert load.tolist() == pytest.approx(ref_load)


def test_rounding_shares_to_tokens_moves_a_token_along_rings_instead_of_failing():
    from ballonet.planning.zeppelin.refinement import _make_room
    # Ranks 0 and 1 are full; document 7 (ranks 0, 1) and document 8 (ranks 1, 2) chain
    # rank 0 to rank 2, which has room: one token of each moves one rank along.
    split = {7: {0: 5, 1: 5}, 8: {1: 4, 2: 4}}
    room = np.array([0, 0, 3])
    _make_room(split, room, [0], 1)
    assert split == {7: {0: 4, 1: 6}, 8: {1: 3, 2: 5}}
    assert room.tolist() == [1, 0, 2]
    with pytest.raises(NoRoom):  # no chain reaches a rank with room
        _make_room({7: {0: 5, 1: 5}}, np.array([0, 0, 3]), [0], 1)


def test_a_recomputation_mode_is_not_lost_to_rounding():
    # 1024 GPUs of wlbllm under no recomputation: the real-valued shares fit, and once
    # one member was left a token short after rounding, which refused the whole mode.
    cluster, model = ballonet.cluster("h200-8nic", num_nodes=128), ballonet.model("llama-7b")
    lengths = workloads.get("wlbllm").sample_batch(16384 * 1024, 0)
    plan = plan_batch(lengths, cluster, model)
    assert "none" in {c["recompute"] for c in plan.meta["candidates"]}


def test_refinement_cuts_a_ring_of_one_block_among_slivers_to_two_members():
    # Ranks 0-2 are busy with whole documents, rank 3 is free: levelling document 0 over
    # all four leaves rank 3 nearly all of it and slivers elsewhere, which the ring would
    # pass its large block through hop by hop. It keeps its two largest holders.
    from ballonet.planning.zeppelin.refinement import refine
    from ballonet.planning.zeppelin.state import Batch, RankFill
    cluster = ClusterSpec(name="one", groups=(NodeGroup(gpu="h100", num_nodes=1, gpus_per_node=4, nics_per_node=4),))
    dev = devices(cluster, MODEL)
    lengths = [16000, 14000, 14000, 14000]
    work = attention_work(MODEL, lengths, dev.gpu[0])
    batch = Batch(lengths=lengths, length_array=np.array(lengths, float), work=work, work_list=work.tolist(), dev=dev,
                  model=MODEL, gpu=dev.gpu[0], crossovers=crossover_lengths(cluster, MODEL), linear_on_rank=np.zeros(4))
    fill = RankFill(local=[[1], [2], [3], []], split_shares={0: dict.fromkeys(range(4), work[0] / 4)},
                    token_room=dev.token_cap.astype(float))
    placement = refine(batch, fill)
    shares = placement.split[0]
    assert len(shares) == 2 and 3 in shares and sum(shares.values()) == 16000, shares


def test_double_rings_are_planned_where_they_send_a_document_across_nodes(tmp_path, capsys):
    # 32 H800s (wlbllm): the 64K document carries more than a node's share of the step, but
    # a single ring through two nodes would expose its crossing hops, so without double
    # rings (`double=False`) it stays in one node. Priced as a "double" ring (a ring in
    # each node, one NIC transfer a round per rank) it goes over two nodes, and those plans
    # are compared too. Under the runtime's order (a rank's kernels as its host queues
    # them, its waits for partial dK/dV; docs/design.md, section 7) the double ring's plan
    # simulates 5% slower than the single rings' (1.50 against 1.43 s), and the estimate,
    # which prices those waits' local part (`ring_waits.ring_wait_seconds`), keeps the single.
    model = specs.model("llama-3b")
    cluster = tight(specs.cluster("h800-8nic", num_nodes=4), model)
    lengths, other = workloads.get("wlbllm").batches(16384 * 32, 0, 2, 65536)
    longest = max(range(len(lengths)), key=lambda d: lengths[d])
    single, chosen = (plan_batch(lengths, cluster, model, double=d) for d in (False, True))
    assert single.ring_of_doc[longest].kind == "intra"
    assert not any(c["double"] for c in single.meta["candidates"])
    assert any(c["double"] for c in chosen.meta["candidates"])
    best = min(chosen.meta["candidates"], key=lambda c: c["estimated_step_s"])
    assert chosen.meta["double"] == best["double"] and chosen.meta["recompute"] == best["recompute"]
    # The next batch (longest document 13K tokens) sends no more documents across nodes
    # priced for double rings: they are not planned, and the plan is the single rings' one.
    plans = [plan_batch(other, cluster, model, double=d) for d in (False, True)]
    assert not any(c["double"] for c in plans[1].meta["candidates"])
    assert dataclasses.replace(plans[0], meta={}).digest == dataclasses.replace(plans[1], meta={}).digest
    # `ballonet plan --no-double` switches them off; a plan holding one runs on a double ring.
    from ballonet import cli
    from ballonet.plan import Plan

    batch = tmp_path / "batch.txt"
    batch.write_text("\n".join(map(str, lengths)))
    (group,) = cluster.groups
    toml = tmp_path / "cluster.toml"
    toml.write_text(f'name = "h800-tight"\n[[node_groups]]\ngpu = "h800"\nnum_nodes = 4\nmemory_gb = {group.memory_gb!r}\n')
    for flags, double_rings in (([], True), (["--no-double"], False)):
        out = tmp_path / f"plan{len(flags)}.json"
        assert cli.main(["plan", "--cluster", str(toml), "--model", "llama-3b", "--lengths",
                         str(batch), "--out", str(out), *flags]) == 0
        assert any(c["double"] for c in Plan.from_json(out.read_text()).meta["candidates"]) == double_rings
    capsys.readouterr()


def test_zeppelin_recomputes_the_fewest_layers_its_plan_needs():
    # 32 H800s near their memory caps (shortmix, llama-3b): the plan keeps selective
    # recomputation's caps and recomputes on as few of the first layers as its tokens need;
    # the simulator, choosing for the same tokens, runs the same, and memory stays under caps.
    cluster, model = specs.cluster("h800-8nic", num_nodes=4), specs.model("llama-3b")
    lengths = next(iter(workloads.get("shortmix").batches(16384 * 32, 0, 1, 65536)))
    plan = plan_batch(lengths, cluster, model)
    gpus = [cluster.gpu_of(r) for r in range(cluster.num_ranks)]
    per_rank = layers_per_rank(model, plan.linear_token_counts, gpus, plan.num_ranks, plan.attention_token_counts,
                               mode="selective")
    k = max(k for _, k in per_rank)
    assert heaviest(plan.recompute) == ("selective", k) and 1 <= k < model.num_layers
    res = ballonet.simulate(plan, cluster, model)
    assert (res.recompute, res.recompute_layers) == ("selective", k)
    assert all(used <= cap for used, cap in zip(plan.memory_bytes, plan.memory_cap))
    every = ballonet.simulate(plan, cluster, dataclasses.replace(model, recompute="selective"))
    assert res.step_time_s < every.step_time_s


def test_caps_that_bind_where_the_step_is_set_get_a_selective_plan_too():
    # 32 H800s, llama-3b, prolong's first batch: the best plan without recomputation has
    # ranks at their memory caps in the node of its busiest rank, so selective
    # recomputation on a few layers is planned too although on every layer its mean rank
    # is slower; it wins the estimate and the simulated step (0.854 s against 0.878 s).
    # (On the second batch it won until 2026-12-02, when level 2 and refinement made the
    # plan without recomputation 7% shorter, and now loses, as simulated.)
    model = specs.model("llama-3b")
    cluster = tight(specs.cluster("h800-8nic", num_nodes=4), model)
    lengths = next(iter(workloads.get("prolong").batches(16384 * 32, 0, 1, 65536)))
    plan = plan_batch(lengths, cluster, model)
    assert {c["recompute"] for c in plan.meta["candidates"]} == {"none", "selective"}
    mode, layers = heaviest(plan.recompute)
    assert mode == "selective" and 1 <= layers <= 4
    none = plan_batch(lengths, cluster, dataclasses.replace(model, recompute="none"))
    step = ballonet.simulate(plan, cluster, model).step_time_s
    assert step < 0.98 * ballonet.simulate(none, cluster, model).step_time_s
    assert all(used <= cap for used, cap in zip(plan.memory_bytes, plan.memory_cap))
    # Where no cap binds (1024 GPUs' wlbllm batch in bench/planner.py, here 64), the
    # costlier mode stays pruned. (Seed 1: on seed 0's batch a 48-rank double ring's
    # estimate, 21% under its simulated step until its inner steps' shared ports were
    # priced, now leaves full recomputation's bound below it, and those plans lose.)
    cluster = specs.cluster("h200-8nic", num_nodes=8)
    plan = plan_batch(workloads.get("wlbllm").sample_batch(4096 * 64, 1), cluster, specs.model("llama-7b"))
    assert {c["recompute"] for c in plan.meta["candidates"]} == {"none"}


def test_the_estimate_prices_the_layers_where_a_few_ranks_recompute():
    # A 48K document and 214 short ones on two H200 nodes, single rings: one node's ranks
    # hold the short documents at their caps and recompute selectively on their first 10
    # layers; in those layers' backward the other node waits for them (the simulator ends
    # each layer's backward with its slowest rank's). Priced on the mean layer, the
    # estimate was 5% under the simulated layers; layer by layer, with what the step adds
    # after them (`Candidate.tail_s`), it is within 1% of the simulated step (1.709
    # against 1.717 s).
    cluster, model = tight(h200(num_nodes=2), MODEL), MODEL
    plan = plan_batch([48_000] + [1_000] * 214, cluster, model, double=False)
    mode, layers = heaviest(plan.recompute)
    assert mode == "selective" and 0 < layers < model.num_layers
    step = ballonet.simulate(plan, cluster, model).step_time_s
    estimate = min(c["estimated_step_s"] for c in plan.meta["candidates"])
    assert 0.97 * step < estimate < 1.03 * step
    # With double rings too a double ring is estimated 0.3% shorter and simulates 2.2%
    # longer (1.754 s): a close call the estimate (3% under there) does not get right.
    default = plan_batch([48_000] + [1_000] * 214, cluster, model)
    assert ballonet.simulate(default, cluster, model).step_time_s < 1.03 * step


def test_a_models_own_recompute_layers_price_the_estimate():
    # Caps loose either way: the same placement, estimated cheaper with 1 selective layer
    # than with every layer, as the simulator runs it.
    cluster, model = specs.cluster("h800-8nic", num_nodes=1), specs.model("llama-3b")
    lengths = [4096] * 8 + [1024] * 32
    one = dataclasses.replace(model, recompute="selective", recompute_layers=1)
    every = dataclasses.replace(model, recompute="selective")
    a, b = plan_batch(lengths, cluster, one), plan_batch(lengths, cluster, every)
    assert a.attention == b.attention
    est = [p.meta["candidates"][0]["estimated_step_s"] for p in (a, b)]
    sim = [ballonet.simulate(p, cluster, m).step_time_s for p, m in ((a, one), (b, every))]
    assert est[0] < est[1] and sim[0] < sim[1]
    assert est[1] - est[0] > 0.5 * (sim[1] - sim[0])


def test_crossing_hops_are_priced_routed_over_the_nodes_rails():
    # Two H200 nodes: a crossing hop routed over the node's 8 rails costs a NIC transfer
    # of an eighth of it plus 14 dispatch and combine messages over NVLink, so
    # the 100K document goes across the nodes, where priced over one NIC it stays in one.
    cluster = tight(h200(num_nodes=2), MODEL)
    (cross,) = crossover_lengths(cluster, MODEL)
    assert cross.rails == 8
    gpu = hardware.gpu("h200")
    m = kv_bytes(MODEL, 4096)
    direct = p2p_time(m, cross.crossing_bw, True, gpu)
    assert ring_pricing.crossing_seconds(m, cross.crossing_bw, cross.intra_bw, 1, gpu) == direct
    assert ring_pricing.crossing_seconds(m, cross.crossing_bw, cross.intra_bw, 8, gpu) < 0.7 * direct
    lengths = [100_000, 30_000] + [1_500] * 250
    routed, one_nic = plan_batch(lengths, cluster, MODEL), plan_batch(lengths, cluster, MODEL, routing=False)
    # The keep-tokens plan of the first mode sends the 100K document across the nodes
    # either way; its crossing hops priced over 8 rails, it is estimated 9% shorter (5.46
    # against 5.98 s; 13% before its members that also step another ring were charged
    # their rounds, `ring_waits._shared_rounds`, which adds more to the routed plan's).
    first = [c["estimated_step_s"] for c in (routed.meta["candidates"][0], one_nic.meta["candidates"][0])]
    assert first[0] < 0.93 * first[1]
    # Its 15-member ring's backward moves at its slowest member's pace with each member's
    # sends slowing its kernels: simulated, that plan was 20% slower than keeping the
    # document in one node (5.78 against 4.80 s), which the estimate now sees (the
    # overlap slowdown and the last dK/dV wait, `pricing`): both keep it in one node.
    assert routed.ring_of_doc[0].kind == one_nic.ring_of_doc[0].kind == "intra"
    assert ballonet.simulate(routed, cluster, MODEL).step_time_s < 4.9


def test_the_estimate_sees_ranks_taking_turns_at_the_slowest_phase():
    """Layers meet in the forward and again in the backward, so a rank heavy on attention
    (backward 2.5x its forward) and one heavy on linear work take turns at the slowest:
    the step is the slowest forward plus the slowest backward. The estimate
    (`synchronous_step_seconds`) prices that as the simulator does (here 1.6-1.7% over
    the busiest rank, both), and adds nothing where the ranks are alike."""
    c = h200(num_nodes=1, gpus=2, nics=2)
    spec = dataclasses.replace(MODEL, recompute="full")
    dev, bw = devices(c, spec), np.full(2, c.groups[0].gpu_type.intra_link_bw)

    def hand(local):
        docs = [(r, n) for r, lengths in enumerate(local) for n in lengths]
        attention = tuple(tuple(Segment(d, 0, n) for d, (q, n) in enumerate(docs) if q == r) for r in range(2))
        return ballonet.Plan(planner="hand", lengths=tuple(n for _, n in docs), node_of_rank=(0, 0),
                             nic_of_rank=(0, 1), attention=attention).validate()

    def ratios(plan):
        kernels = pricing.attention_kernels(plan, dev, spec)
        attention, linear = pricing.rank_compute_seconds(plan, dev, spec, "full", split=True, kernels=kernels)
        seconds = pricing.rank_step_seconds(plan, dev, spec, bw, (attention, linear))
        estimate = pricing.synchronous_step_seconds(plan, dev, spec, kernels, seconds, attention + linear)
        sim = ballonet.simulate(plan, c, spec)
        busiest = max(x + y for x, y in zip(sim.compute_s, sim.exposed_comm_s))
        return estimate / seconds.max(), sim.step_time_s / busiest

    estimate, simulated = ratios(hand([[16384], [512] * 52]))
    assert estimate > 1.01 and simulated > 1.01 and estimate == pytest.approx(simulated, abs=0.005)
    estimate, simulated = ratios(hand([[8192, 8192], [8192, 8192]]))
    assert estimate == pytest.approx(1.0, abs=1e-12) and simulated == pytest.approx(1.0, abs=1e-9)


def test_level1_node_loads_keep_fractional_shares_where_no_node_holds_a_whole_document():
    """A 400K-token document over both nodes and nothing else: each node's load is its
    share of the document's work, not that share cut to a whole number."""
    from ballonet.planning.devices import devices
    from ballonet.planning.zeppelin.classes import crossover_lengths, level_nodes
    cluster = specs.cluster("h200-8nic", num_nodes=2)
    level = level_nodes([400_000], devices(cluster, MODEL), crossover_lengths(cluster, MODEL), MODEL,
                        hierarchical=True, price_linear=True, routing=True).level1
    assert level.node_docs == {} and set(level.shares[0]) == {0, 1}
    assert [level.node_load[n] for n in (0, 1)] == [level.shares[0][n] for n in (0, 1)]
    assert any(level.shares[0][n] % 1 for n in (0, 1))  # a share with a fraction (else the check could not fail)
