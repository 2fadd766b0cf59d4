"""The simulator against hand-built plans whose step time is known in closed form.

Every test runs with a flat calibration profile installed for the H100 (constant
efficiencies, no launch floor, no overlap slowdown, no elementwise, framework or
optimizer seconds), so expected values are written out
from a handful of figures (peak FLOP/s, efficiencies, link bandwidths, latencies), never
taken from the simulator or the cost model's time functions.
"""

import collections
import dataclasses
import json
import random

import pytest
from tests.closed_forms import BWD, EFF_F, FLAT, GB, HD, MODEL, PEAK, cluster, cluster_plan, head, lin, nic, nvlink

from tests.tight_memory import tight

from ballonet import specs
from ballonet.cost import hardware
from ballonet.cost.flops import message_bytes, zigzag_flops
from ballonet.cost.memory import MEMORY_RESERVE, activation_bytes, static_bytes
from ballonet.plan import Plan, RankRecompute, RecomputeMode, Route, Segment, Transfer
from ballonet.simulation.fabric import Fabric
from ballonet.simulation.layer_graph import ring_tables
from ballonet.simulation.simulator import simulate
from ballonet.simulation.timeline import Timeline

pytestmark = pytest.mark.usefixtures("flat_profile")  # conftest.py: the FLAT profile installed


def test_one_gpu_step_time_in_closed_form():
    L = 8192
    res = simulate(cluster_plan(cluster(), {0: [L]}), cluster(), MODEL)
    att = 2 * HD * L * (L + 1) / (PEAK * EFF_F)
    expected = MODEL.num_layers * (att * (1 + BWD) + lin(L) * 3) + head(L)
    assert res.recompute == "none"
    assert res.step_time_s == pytest.approx(expected, rel=1e-9)
    assert res.lower_bound_s == pytest.approx(expected, rel=1e-9)
    assert res.exposed_comm_s[0] == pytest.approx(0, abs=1e-12) and res.idle_s[0] == pytest.approx(0, abs=1e-12)
    flops = 3 * (MODEL.num_layers * (2 * (4 * 1024**2 + 3 * 1024 * 2816) * L + 2 * HD * L * (L + 1))
                 + 2 * 1000 * 1024 * L)
    assert res.mfu == pytest.approx(flops / (expected * PEAK), rel=1e-9)
    assert res.tokens_per_s == pytest.approx(L / expected)


def test_two_gpus_one_ring_step():
    # 4 chunks of c: position 0 holds chunks 0 and 3, position 1 chunks 1 and 2.
    # Step 0: two causal diagonals and one full block each; step 1: two full blocks each.
    c, bw = 2048, 5 * GB  # a slow link, so the K/V transfer is exposed
    C = cluster(gpus=2, nics=2, intra=bw)
    res = simulate(cluster_plan(C, split=[(4 * c, (0, 1))]), C, MODEL, overlap_grad_allreduce=False)
    rate = PEAK * EFF_F
    t0 = (2 * 2 * HD * c * (c + 1) + 4 * HD * c * c) / rate
    t1 = 2 * 4 * HD * c * c / rate
    x = nvlink(2 * 2 * c * MODEL.kv_dim * 2, bw)  # K and V of 2c rows, bf16
    assert x > t0
    assert res.layer_forward_s == pytest.approx(max(t0, x) + t1 + lin(2 * c), rel=1e-9)
    b0, b1 = BWD * t0, BWD * t1
    # backward: K/V sent at once; after step 1 the gradient of the block held there goes
    # home, in fp32 (twice the bytes of bf16 K/V)
    xg = nvlink(2 * 2 * c * MODEL.kv_dim * 4, bw)
    assert res.layer_backward_s == pytest.approx(2 * lin(2 * c) + max(b0, x) + b1 + xg, rel=1e-9)
    assert res.step_time_s >= res.lower_bound_s


def test_nic_shared_by_two_senders_halves_bandwidth():
    for nics, expected_transfers in ((1, 2), (2, 1)):
        C = cluster(nodes=2, gpus=2, nics=nics, nic_gbps=400)
        fab = Fabric(C, 4, 1)
        tl = Timeline(num_streams=4)
        tl.add(0.0)  # a no-op first task, so ids below are not 0
        a = tl.add(fab.transfer_time(0, 2, GB), links=fab.links(0, 2))
        b = tl.add(fab.transfer_time(1, 3, GB), links=fab.links(1, 3))
        _, finish = tl.run()
        one = nic(GB, 400e9 / 8)
        # one NIC: both share it from the start and finish together
        assert finish[a] == pytest.approx(expected_transfers * one, rel=1e-12)
        assert finish[b] == pytest.approx(expected_transfers * one, rel=1e-12)


def test_shared_nic_slows_two_inter_node_rings():
    def forward(nics):
        C = cluster(nodes=2, gpus=2, nics=nics, intra=None)
        plan = cluster_plan(C, split=[(4096, (0, 2)), (4096, (1, 3))])
        return simulate(plan, C, MODEL, overlap_grad_allreduce=False).layer_forward_s

    c = 1024
    rate = PEAK * EFF_F
    t0, t1 = (2 * 2 * HD * c * (c + 1) + 4 * HD * c * c) / rate, 2 * 4 * HD * c * c / rate
    x = nic(2 * 2 * c * MODEL.kv_dim * 2, 400e9 / 8)
    assert forward(2) == pytest.approx(max(t0, x) + t1 + lin(2 * c), rel=1e-9)
    assert forward(1) == pytest.approx(max(t0, 2 * x) + t1 + lin(2 * c), rel=1e-9)


def test_routed_hop_splits_over_proxies():
    C = cluster(nodes=2, gpus=2, nics=2, nic_gbps=100)
    fab = Fabric(C, 4, 1)
    n = 512e6
    tl = Timeline(num_streams=4)
    direct = fab.send(tl, 0, 2, n, [], "direct")
    _, finish = tl.run()
    tl = Timeline(num_streams=4)
    routed = fab.send_routed(tl, 0, 2, n, [], "routed", ((0, 2), (1, 3)))
    _, rfinish = tl.run()
    nvl = hardware.gpu("h100").intra_link_bw
    assert finish[direct] == pytest.approx(nic(n, 100e9 / 8), rel=1e-12)
    # part 1 goes 0 -> 2 directly; part 2 is dispatched to 1, crosses 1 -> 3, combined at 2
    assert rfinish[routed] == pytest.approx(2 * nvlink(n / 2, nvl) + nic(n / 2, 100e9 / 8), rel=1e-12)


def test_routing_option_off_ignores_routes():
    C = cluster(nodes=2, gpus=2, nics=2, nic_gbps=100)
    route = Route(doc=0, src=0, dst=2, proxies=((0, 2), (1, 3)))
    back = Route(doc=0, src=2, dst=0, proxies=((2, 0), (3, 1)))
    plan = cluster_plan(C, split=[(16384, (0, 2))], routes=(route, back))
    routed, direct = simulate(plan, C, MODEL), simulate(plan, C, MODEL, routing=False)
    assert routed.layer_forward_s < direct.layer_forward_s


def test_local_attention_fills_the_wait_and_sends_wait_for_queued_kernels_without_the_engine():
    # A 3-node ring with a long local document on every rank. The runtime queues ring step
    # 0, then the local call, then steps 1 and 2. With the engine the step-1 forwarding
    # send goes as soon as the block has arrived (at x); without it, it is posted behind
    # step 0 and the local call, which outlast the transfer.
    C = cluster(nodes=3, gpus=1, nics=1, nic_gbps=10)
    c, L = 2048, 98304
    plan = cluster_plan(C, local={r: [L] for r in range(3)}, split=[(6 * c, (0, 1, 2))])
    rate = PEAK * EFF_F
    t0, t1 = (2 * 2 * HD * c * (c + 1) + 4 * HD * c * c) / rate, 2 * 4 * HD * c * c / rate
    loc = 2 * HD * L * (L + 1) / rate
    x = nic(2 * 2 * c * MODEL.kv_dim * 2, 10e9 / 8)
    assert t1 < x < loc and 2 * x < t0 + loc + t1
    with_engine = simulate(plan, C, MODEL, overlap_grad_allreduce=False)
    without = simulate(plan, C, MODEL, engine=False, overlap_grad_allreduce=False)
    assert with_engine.layer_forward_s == pytest.approx(t0 + loc + 2 * t1 + lin(2 * c + L), rel=1e-9)
    assert without.layer_forward_s == pytest.approx(t0 + loc + x + t1 + lin(2 * c + L), rel=1e-9)


def test_remap_moves_what_the_model_moves():
    # rank 0 holds two 4000-token documents, rank 1 none; the remap moves the second over:
    # after attention its output o (h a token), before the next attention q, k, v (3h, MHA)
    C = cluster(gpus=2, nics=2, intra=10 * GB)
    base = cluster_plan(C, local={0: [4000, 4000]})
    plan = dataclasses.replace(base, remap=(Transfer(src=0, dst=1, start=4000, end=8000),)).validate()
    att0 = 2 * 2 * HD * 4000 * 4001 / (PEAK * EFF_F)
    o = nvlink(4000 * MODEL.hidden * 2, 10 * GB)
    qkv = nvlink(4000 * (MODEL.hidden + 2 * MODEL.kv_dim) * 2, 10 * GB)
    assert simulate(plan, C, MODEL, overlap_grad_allreduce=False).layer_forward_s == pytest.approx(
        att0 + o + lin(4000) + qkv, rel=1e-9)
    assert simulate(plan, C, MODEL, remap=False, overlap_grad_allreduce=False).layer_forward_s == pytest.approx(att0 + lin(8000), rel=1e-9)


def test_data_parallel_collectives_let_the_remap_through_on_their_own_group():
    # The data-parallel collectives run during the backward on the same NVLink ports as
    # the remap. On separate process groups (the runtime's) they go in pieces, so the
    # remap at the start of the backward waits for a piece, not for all of them; on one
    # group the remap queues behind them all.
    C = cluster(gpus=2, nics=2, intra=10 * GB)
    base = cluster_plan(C, local={0: [4000, 4000]})
    plan = dataclasses.replace(base, remap=(Transfer(src=0, dst=1, start=4000, end=8000),)).validate()
    for cp_group in (True, False):
        _, tl, start, finish, _ = simulate(plan, C, MODEL, cp_group=cp_group).timelines[1]
        sends = [t for t in range(tl.num_tasks) if tl.label[t][0] == "send"]
        bucket = [t for t in sends if tl.label[t][2] == "data-parallel collectives"]
        remap = [t for t in sends if tl.label[t][2] == "remap"]
        assert remap and bucket
        if cp_group:
            assert max(finish[t] for t in remap) < max(finish[t] for t in bucket)
        else:
            assert min(start[t] for t in remap) >= max(finish[t] for t in bucket)


def test_ring_steps_add_up_to_zigzag_flops_and_ring_traffic():
    C = cluster(gpus=8, nics=8)
    plan = cluster_plan(C, split=[(10007, tuple(range(8))), (333, tuple(range(8)))])
    seconds, rows = ring_tables(plan, list(plan.rings), MODEL, Fabric(C, 8, 1))
    for i in range(8):
        weighted = sum(float(zigzag_flops(MODEL, r.bounds)[i])
                       / EFF_F for r in plan.rings)
        assert seconds[i].sum() * PEAK == pytest.approx(weighted, rel=1e-9)
    sent = collections.Counter()
    for msg in plan.ring_messages():
        if msg.phase == "forward":
            sent[msg.step, msg.src] += msg.rows
    for (step, src), n in sent.items():
        assert rows[src, step] == n


def test_step_never_below_lower_bound_and_breakdown_adds_up():
    rng = random.Random(7)
    C = cluster(nodes=2, gpus=4, nics=2, nic_gbps=200)
    for trial in range(6):
        local = {r: [rng.randint(50, 6000) for _ in range(rng.randint(0, 4))] for r in range(8)}
        ranks = rng.sample(range(8), rng.choice([2, 3, 4, 8]))
        split = [(rng.randint(4000, 60000), tuple(ranks))]
        comm_plan = cluster_plan(C, local, split)
        for engine in (True, False):
            res = simulate(comm_plan, C, MODEL, engine=engine)
            assert res.step_time_s >= res.lower_bound_s * (1 - 1e-12)
            for r in range(8):
                assert res.compute_s[r] + res.exposed_comm_s[r] + res.idle_s[r] == pytest.approx(res.step_time_s)
                assert res.exposed_comm_s[r] >= -1e-12 and res.idle_s[r] >= -1e-12


def test_allgather_ring_and_tensor_parallel():
    C = cluster(gpus=4, nics=4)
    plan = cluster_plan(C, split=[(8192, (0, 1, 2, 3))])
    gathered = Plan.from_json(plan.to_json().replace('"comm":"ring"', '"comm":"allgather"')).validate()
    res = simulate(gathered, C, MODEL)
    assert res.step_time_s >= res.lower_bound_s
    tp_model = dataclasses.replace(MODEL, tp=2)
    one_rank = Plan(planner="t", lengths=(4096,), node_of_rank=(0,), nic_of_rank=(0,),
                    attention=((Segment(0, 0, 4096),),))
    one = simulate(one_rank, cluster(), MODEL)
    two = simulate(one_rank, cluster(gpus=2, nics=2), tp_model)
    bw = hardware.gpu("h100").intra_link_bw
    coll = 2 * sum(FLAT.collective_latency_s + 0.5 * 4096 * 1024 * 2 / (bw * FLAT.collective_efficiency[op])
                   for op in ("all_gather", "reduce_scatter"))
    assert two.layer_forward_s == pytest.approx(one.layer_forward_s / 2 + coll, rel=1e-9)
    assert two.num_gpus == 2 and two.mfu == pytest.approx(one.mfu * one.step_time_s / two.step_time_s / 2)


def _as_heads(plan: Plan) -> Plan:
    """`plan` with every split document split by heads ("heads") instead of a ring."""
    return dataclasses.replace(plan, rings=tuple(dataclasses.replace(r, comm="heads") for r in plan.rings)).validate()


def test_a_heads_document_gathers_computes_its_heads_and_returns_by_hand():
    # Two members of 2c rows each (a document of 4c): each gathers the other's rows of
    # q, k and v for its half of the heads, computes them over the whole document, and
    # returns the other's rows of o and their log-sum-exp. Backward: q, k, v and o, dO, log-sum-exp gathered
    # (the two messages share the port: both in after their seconds summed), then dq,
    # dk, dv returned. A slow link, so every message shows.
    c, bw = 2048, 5 * GB
    C = cluster(gpus=2, nics=2, intra=bw)
    plan = _as_heads(cluster_plan(C, split=[(4 * c, (0, 1))]))
    res = simulate(plan, C, MODEL, overlap_grad_allreduce=False)
    h, kv = MODEL.hidden, MODEL.kv_dim
    att = 2 * HD * 4 * c * (4 * c + 1) / 2 / (PEAK * EFF_F)  # half the heads of the whole document
    qkv = nvlink(2 * c * (h + 2 * kv) * 2 / 2, bw)
    out = nvlink(2 * c * (h * 2 + MODEL.num_heads * 4) / 2, bw)  # o and its fp32 log-sum-exp
    dout = nvlink(2 * c * (2 * h * 2 + MODEL.num_heads * 4) / 2, bw)
    assert res.recompute == "none"
    assert res.layer_forward_s == pytest.approx(qkv + att + out + lin(2 * c), rel=1e-9)
    assert res.layer_backward_s == pytest.approx(2 * lin(2 * c) + qkv + dout + BWD * att + qkv, rel=1e-9)


def test_a_heads_documents_sends_are_its_messages_and_full_recomputation_resends_the_forwards():
    # Two "heads" documents over the same 4 ranks (one kernel, one message a pair and
    # payload for both) beside local documents: the bytes per payload and pair are those
    # of `Plan.ring_messages`, priced by `message_bytes`; under full recomputation the
    # backward first reruns the forward, its gathers and returns too.
    C = cluster(gpus=4, nics=4)
    plan = _as_heads(cluster_plan(C, local={0: [3000], 2: [500, 700]},
                                  split=[(10007, (0, 1, 2, 3)), (4096, (0, 1, 2, 3))]))
    heads = ("qkv", "out", "dout", "dqkv")
    for model in (MODEL, dataclasses.replace(MODEL, recompute="full")):
        sent = simulate(plan, C, model).bytes_sent
        for phase in ("forward", "backward"):
            want = collections.Counter()
            for msg in plan.ring_messages():
                if msg.phase == phase:
                    want[msg.payload, msg.src, msg.dst] += message_bytes(model, msg.payload, msg.rows, 4)
            if phase == "backward" and model.recompute == "full":
                for key, n in sent["forward"].items():
                    if key[0] in heads:
                        want[key] += n
            got = {k: v for k, v in sent[phase].items() if k[0] in heads}
            assert got == pytest.approx(dict(want), rel=1e-12), (model.recompute, phase)
            payloads = 2 if phase == "forward" else 3 + (model.recompute == "full")  # "out" again in the rerun
            assert len(got) == 12 * payloads  # every ordered pair of 4 members


def test_chrome_trace_is_valid(tmp_path):
    C = cluster(nodes=2, gpus=2, nics=1)
    res = simulate(cluster_plan(C, {0: [1000], 3: [500]}, [(8000, (0, 1, 2, 3))]), C, MODEL)
    path = tmp_path / "trace.json"
    res.to_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    by_track = {}
    for e in spans:
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for track in by_track.values():  # a stream or a link's lane never does two things at once
        track.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(track, track[1:]))
    assert json.dumps(res.to_dict())


def test_cli_simulate_json_and_errors(capsys, tmp_path):
    from ballonet.cli import main

    args = ["simulate", "--cluster", "a800-4nic", "--nodes", "2", "--model", "llama-3b", "--tokens-per-gpu", "2048",
            "--planners", "zeppelin,te_cp,packed_dp", "--steps", "1", "--seed", "3"]
    assert main(args + ["--json", "--trace", str(tmp_path / "t.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["planner"]: r for r in out["results"]}
    assert list(rows) == ["zeppelin", "te_cp", "packed_dp"]
    assert rows["te_cp"]["speedup_vs_te_cp"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["step_time_s"] >= r["lower_bound_s"] > 0 and 0 < r["mfu"] < 1
        assert r["speedup_vs_te_cp"] == pytest.approx(rows["te_cp"]["step_time_s"] / r["step_time_s"])
    assert (tmp_path / "t.zeppelin.json").exists() and (tmp_path / "t.te_cp.json").exists()
    assert main(args[:-6] + ["--planners", "zeppelin", "--no-routing", "--no-remap", "--plot",
                             str(tmp_path / "p.png")]) == 0
    assert "zeppelin" in capsys.readouterr().out and (tmp_path / "p.png").stat().st_size > 0
    assert main(["simulate", "--planners", "nope"]) == 2
    assert "unknown planner 'nope'" in capsys.readouterr().err
    assert main(["simulate", "--cluster", "a800-4nic", "--nodes", "1", "--model", "llama-13b", "--tp", "3"]) == 2
    capsys.readouterr()


def test_selective_recompute_of_some_layers_is_the_layer_mix_of_both():
    """With 1 of 2 layers recomputing the MLP, a layer's backward is the mean of one that
    recomputes and one that does not, measured against simulating each whole model; with
    the mode left to the cost model, a rank over its `none` cap recomputes as few layers as
    it needs (here: both share one cap, so 1 layer when 1 is enough) and a rank under it
    none: each rank as its own tokens need (`cost.recompute.cheapest_per_rank`)."""
    c = cluster(gpus=2, nics=2)
    plan = cluster_plan(c, local={0: [4096, 2048], 1: [3000]})
    sims = {k: simulate(plan, c, dataclasses.replace(MODEL, recompute="selective", recompute_layers=k))
            for k in (1, 2)}
    none = simulate(plan, c, dataclasses.replace(MODEL, recompute="none"))
    assert (none.recompute, none.recompute_layers, sims[1].recompute_layers) == ("none", 0, 1)
    assert sims[1].layer_backward_s == pytest.approx((sims[2].layer_backward_s + none.layer_backward_s) / 2,
                                                     rel=1e-12)
    assert none.step_time_s < sims[1].step_time_s < sims[2].step_time_s
    assert sims[1].compute_s[0] == pytest.approx((sims[2].compute_s[0] + none.compute_s[0]) / 2, rel=1e-12)
    # Memory just over what `none` holds for rank 0's tokens, under what one selective layer frees.
    per_none = activation_bytes(MODEL, 6144, 6144, "none")
    one = activation_bytes(MODEL, 6144, 6144, "selective", 1)
    static = static_bytes(MODEL, 2)
    memory_gb = (static + (per_none + one) / 2) / MEMORY_RESERVE / 1e9
    tight = specs.ClusterSpec(name="t", groups=(dataclasses.replace(c.groups[0], memory_gb=memory_gb),))
    auto = simulate(plan, tight, MODEL)
    assert (auto.recompute, auto.recompute_layers) == ("selective", 1)
    assert auto.recompute_per_rank == (("selective", 1), ("none", 0))
    assert auto.step_time_s == pytest.approx(sims[1].step_time_s, rel=1e-12)
    assert auto.compute_s[0] == pytest.approx(sims[1].compute_s[0], rel=1e-12)
    assert auto.compute_s[1] == pytest.approx(none.compute_s[1], rel=1e-12)
    assert none.compute_s[1] < sims[1].compute_s[1]


def test_linear_recompute_of_some_layers_mixes_with_selective_on_the_others():
    """Linear recomputation on 1 of 2 layers: a layer's backward is the mean of one that
    reruns every linear layer and one that reruns the MLP only; left to the cost model,
    memory between what selective and linear on every layer hold makes the rank with
    6144 tokens recompute linearly on 1 layer and the one with 1000 nothing."""
    c = cluster(gpus=2, nics=2)
    plan = cluster_plan(c, local={0: [4096, 2048], 1: [1000]})
    one = simulate(plan, c, dataclasses.replace(MODEL, recompute="linear", recompute_layers=1))
    every = simulate(plan, c, dataclasses.replace(MODEL, recompute="linear"))
    selective = simulate(plan, c, dataclasses.replace(MODEL, recompute="selective"))
    assert selective.step_time_s < one.step_time_s < every.step_time_s
    assert one.compute_s[0] == pytest.approx((every.compute_s[0] + selective.compute_s[0]) / 2, rel=1e-12)
    static = static_bytes(MODEL, 2)
    between = (activation_bytes(MODEL, 6144, 6144, "selective")
               + activation_bytes(MODEL, 6144, 6144, "linear", 1)) / 2
    assert activation_bytes(MODEL, 1000, 1000, "none") < between
    tight = specs.ClusterSpec(name="t", groups=(dataclasses.replace(
        c.groups[0], memory_gb=(static + between) / MEMORY_RESERVE / 1e9),))
    auto = simulate(plan, tight, MODEL)
    assert (auto.recompute, auto.recompute_layers, auto.recompute_per_rank) == ("linear", 1, (("linear", 1),
                                                                                              ("none", 0)))
    assert auto.compute_s[0] == pytest.approx(one.compute_s[0], rel=1e-12)
    assert auto.compute_s[1] == pytest.approx(simulate(plan, c, dataclasses.replace(MODEL, recompute="none"))
                                              .compute_s[1], rel=1e-12)


def test_the_simulator_runs_the_recomputation_the_plan_says():
    """`Plan.recompute` decides: a plan whose ranks hold their tokens without recomputing,
    said to recompute one layer selectively on rank 0, simulates that (and is slower);
    the same plan simulated with a model that fixes its own recomputation gets the model's."""
    c = cluster(gpus=2, nics=2)
    plan = cluster_plan(c, local={0: [4096, 2048], 1: [3000]})
    free = simulate(plan, c, MODEL)
    assert free.recompute_per_rank == (("none", 0), ("none", 0))
    said = dataclasses.replace(plan, recompute=(RankRecompute(RecomputeMode.SELECTIVE, 1),
                                                RankRecompute(RecomputeMode.NONE, 0))).validate()
    run = simulate(said, c, MODEL)
    assert (run.recompute, run.recompute_layers, run.recompute_per_rank) == ("selective", 1, (("selective", 1),
                                                                                             ("none", 0)))
    assert run.step_time_s > free.step_time_s
    one = simulate(plan, c, dataclasses.replace(MODEL, recompute="selective", recompute_layers=1))
    assert run.compute_s[0] == pytest.approx(one.compute_s[0], rel=1e-12)
    assert run.compute_s[1] == pytest.approx(free.compute_s[1], rel=1e-12)
    forced = simulate(said, c, dataclasses.replace(MODEL, recompute="none"))
    assert forced.recompute_per_rank == (("none", 0), ("none", 0)) and forced.step_time_s == free.step_time_s


def test_no_engine_posts_double_rings_sends_behind_queued_kernels_too():
    # A "double" ring (2 nodes x 8 ranks, zeppelin's plan of a 64K document among short
    # ones): without the engine its inner and outer sends wait for the kernels queued
    # before them, as every other ring's do, so its step is longer (it was not: double
    # rings always sent early). Without FSDP's collectives on the links, whose pieces a
    # later send can let through first (links serve transfers in order).
    from ballonet import plan_batch
    m = specs.model("llama-7b")
    c = tight(specs.cluster("h200-8nic", num_nodes=2), m)
    plan = plan_batch([64000] + [1000] * 190, c, m)
    assert any(r.comm == "double" for r in plan.rings)
    engine, no_engine = (simulate(plan, c, m, engine=e, overlap_grad_allreduce=False) for e in (True, False))
    assert no_engine.layer_forward_s > engine.layer_forward_s and no_engine.step_time_s > engine.step_time_s


def test_backward_simulated_once_per_run_of_alike_layers_however_many():
    """Ranks recomputing on 10 different numbers of layers make 11 runs, each simulated as
    it is: merging runs would average a rank's seconds over layers the others recompute
    differently, which under-counts each layer's slowest rank."""
    from ballonet.cost.seconds import linear_layer_seconds
    from ballonet.simulation.simulator import _runs_of_layers
    cluster = specs.cluster("h200-8nic", num_nodes=2)
    model = specs.model("llama-7b")
    fabric = Fabric(cluster, 16, 1)
    tokens = [8192] * 16
    per_rank = [("selective", 3 * r) for r in range(10)] + [("selective", 0)] * 6
    gpu = fabric.gpu[0]
    full, below = (linear_layer_seconds(model, gpu, 8192, m) for m in ("selective", "none"))
    runs = _runs_of_layers(model, fabric, tokens, per_rank, [full] * 16, [(0.0, 0.0)] * 16)
    assert [n for n, _, _ in runs] == [3] * 9 + [model.num_layers - 27]
    for i, (_, linear, _) in enumerate(runs):  # run i covers layers [3i, 3i+3): rank r recomputes there iff 3r > 3i
        assert linear == [full if r < 10 and r > i else below for r in range(16)]


def test_a_heads_member_waits_for_its_returns_before_its_next_ring_step():
    # Rank 0 holds a "heads" document and a ring with rank 1. The runtime waits for the
    # heads returns at round (0, GRAD, 0), before any kernel of round (1, KV, 0): the
    # ring's second step starts only once they are in, even where its K/V came earlier.
    C = cluster(gpus=2, nics=2, intra=5 * GB)
    plan = cluster_plan(C, split=[(8192, (0, 1)), (8192, (0, 1))])
    plan = dataclasses.replace(plan, rings=(dataclasses.replace(plan.rings[0], comm="heads"), plan.rings[1]))
    res = simulate(plan.validate(), C, dataclasses.replace(MODEL, recompute="none"))
    _, tl, start, finish, _ = res.timelines[0]  # the forward
    on_rank = {tl.label[t][2]: t for t in range(tl.num_tasks) if tl.label[t][1] == 0 and tl.label[t][0] != "join"}
    returns_in = finish[on_rank["doc 0", "out wait"]]
    assert start[on_rank["doc 1", "step", 1]] >= returns_in > finish[on_rank["doc 1", "kv", 0]]
    assert start[on_rank["doc 0", "heads"]] >= finish[on_rank["doc 1", "step", 0]]  # after round 0's kernels
