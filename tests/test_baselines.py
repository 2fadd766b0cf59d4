"""Baselines as their users run them: WLB-LLM's per-sequence sharding and adaptive choice,
the comparison's degree tuning, and MagiAttention's dispatch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ballonet import plan_batch, specs, workloads
from ballonet.cost.flops import kv_bytes
from ballonet.errors import InputError
from ballonet.plan import Plan, Ring, Segment, Transfer, chunk_bounds
from ballonet.planning.magi import dispatch
from ballonet.planning.wlb_llm import outlier_steps, per_sequence
from ballonet.simulation import simulate
from ballonet.simulation.comparison import budgets, compare, degrees
from ballonet.simulation.layer_graph import prefix_rows
from ballonet.specs import ClusterSpec, NodeGroup


def test_per_sequence_sharding_by_hand():
    # Documents of 5, 3 and 8 tokens concatenated (16) and cut into 4 chunks of 4: chunk 0
    # and 3 to rank 0, chunks 1 and 2 to rank 1. The first document holds chunk 0 and one
    # token of chunk 1; the second lies in chunk 1; the third fills chunks 2 and 3.
    whole, split = per_sequence([5, 3, 8], [0, 1, 2], 2)
    assert whole == {1: 1}
    assert split[0] == ((0, 1), (0, 4, 5, 5, 5))  # front chunks only
    assert split[2] == ((0, 1), (0, 0, 0, 4, 8))  # back chunks: rank 1 before rank 0


def test_wlb_llm_shardings_and_adaptive_choice():
    cluster, model = specs.cluster("h800-8nic", num_nodes=2), specs.model("llama-3b")
    shorts = [700] * 300  # per-document chunks of 44 tokens: the per-sequence sharding wins
    longs = [30_000] * 4 + [2_000] * 40  # long documents: per-document keeps the ranks even
    for lengths, faster in ((shorts, "sequence"), (longs, "document")):
        plans = {s: plan_batch(lengths, cluster, model, "wlb_llm", cp_size=8, sharding=s)
                 for s in ("document", "sequence", "adaptive")}
        steps = {s: simulate(p, cluster, model).step_time_s for s, p in plans.items()}
        assert steps[faster] < steps["document" if faster == "sequence" else "sequence"]
        assert steps["adaptive"] <= steps[faster] * 1.001, steps
        assert plans["adaptive"].meta["groups_by_sharding"][faster] >= 1
        seq = plans["sequence"]
        for g in range(2):
            tokens = seq.attention_token_counts[8 * g: 8 * g + 8]
            assert max(tokens) - min(tokens) <= 1
        assert all(len(r.ranks) == 8 and r.bounds == chunk_bounds(lengths[r.doc], 16)
                   for r in plans["document"].rings)
    with pytest.raises(InputError, match="sharding"):
        plan_batch(shorts, cluster, model, "wlb_llm", sharding="both")


def test_tuned_comparison_runs_each_degree_baseline_at_its_fastest_degree():
    cluster, model = specs.cluster("h800-8nic", num_nodes=2), specs.model("llama-3b")
    assert degrees(16) == [1, 2, 4, 8, 16] and degrees(48) == [1, 2, 4, 8, 16]
    rows = {r.planner: r for r in compare(cluster, model, "prolong", 8192, ["wlb_llm", "te_cp", "packed_dp"],
                                          max_length=32768, tune=True)}
    batch = next(iter(workloads.get("prolong").batches(8192 * 16, 0, 1, 32768)))
    assert rows["wlb_llm"].options["cp_size"] in degrees(16)  # priced over its outlier delay: below
    for name in ("te_cp",):
        d = rows[name].options["cp_size"]
        every = [simulate(plan_batch(batch, cluster, model, name, cp_size=c), cluster, model).step_time_s
                 for c in degrees(16) if c >= 2 or name == "wlb_llm"]
        assert d in degrees(16) and rows[name].step_time_s == pytest.approx(min(every))
    assert rows["packed_dp"].options == {}
    assert np.isfinite(rows["te_cp"].speedup_vs_te_cp)


def test_tuned_comparison_runs_each_budget_baseline_at_its_fastest_budget():
    # largest first: the power of two holding the longest document whole, down to 1024
    assert budgets([[5000, 30], [8192]]) == [8192, 4096, 2048, 1024] and budgets([[8193]])[0] == 16384
    cluster, model = specs.cluster("h800-8nic", num_nodes=2), specs.model("llama-3b")
    rows = {r.planner: r for r in compare(cluster, model, "prolong", 8192, ["megatron_hcp", "hybrid_dp"],
                                          max_length=32768, tune=True)}
    batch = next(iter(workloads.get("prolong").batches(8192 * 16, 0, 1, 32768)))
    for name in ("megatron_hcp", "hybrid_dp"):
        every = {b: simulate(plan_batch(batch, cluster, model, name, rank_tokens=b), cluster, model).step_time_s
                 for b in budgets([batch])}
        assert rows[name].options["rank_tokens"] in every
        assert rows[name].step_time_s == pytest.approx(min(every.values())), every


def test_wlb_llm_outlier_delay_by_hand():
    # 1440 tokens, 4 groups: a group's share is 360, outliers are (180, 360]: 300 and 350,
    # one level (257-512). Released 4 at a time, one per group: 300, 350, 300, 350 (1300
    # tokens, the batch's two are half of them: weight 0.5), filled with the batch's other
    # documents up to the first that would overflow 1440 (100). Normal steps carry the
    # rest (weight 0.5): the other documents (790), then the filler's (not its outlier 200)
    # up to the first that would overflow (30, after 1420).
    steps = outlier_steps([100, 100, 300, 350, 50, 500, 40], 4, [10, 200, 20, 600, 30])
    assert steps == [(0.5, [100, 100, 50, 500, 40, 10, 20, 600]), (0.5, [300, 350, 300, 350, 100])]
    assert outlier_steps([100, 100, 10], 4, []) == [(1.0, [100, 100, 10])]  # share 52.5: none in (26.25, 52.5]
    assert outlier_steps([300, 350, 100], 1, []) == [(1.0, [300, 350, 100])]  # one group: nothing to wait for


def test_tuned_wlb_llm_is_priced_over_its_delay_steps_per_token():
    cluster, model = specs.cluster("h800-8nic", num_nodes=2), specs.model("llama-3b")
    row = compare(cluster, model, "prolong", 8192, ["wlb_llm"], max_length=32768, tune=True)[0]
    cp = row.options["cp_size"]
    batch = next(iter(workloads.get("prolong").batches(8192 * 16, 0, 1, 32768)))
    filler = [L for k in range(1, 5) for L in workloads.get("prolong").sample_batch(8192 * 16, (0, 0, k), 32768)]
    steps = outlier_steps(batch, 16 // cp, filler)
    times = [simulate(plan_batch(docs, cluster, model, "wlb_llm", cp_size=cp), cluster, model).step_time_s
             for _, docs in steps]
    per_token = sum(w * t for (w, _), t in zip(steps, times)) / sum(w * sum(docs) for w, docs in steps)
    assert row.step_time_s == pytest.approx(per_token * sum(batch), rel=1e-9)
    assert row.first.num_tokens == sum(batch)


def test_zeppelin_is_also_priced_in_wlb_llms_training_order():
    # Four nodes of two GPUs: wlb_llm's default CP degree is a node's 2, so 4 CP groups;
    # 32768 tokens a batch, a group's share 8192, outliers (4096, 8192]: both batches have some.
    cluster = ClusterSpec(name="pairs", groups=(NodeGroup(gpu="h100", num_nodes=4, gpus_per_node=2, nics_per_node=2),))
    model, work = specs.model("llama-3b"), workloads.get("prolong")
    rows = {r.planner: r for r in compare(cluster, model, "prolong", 4096, ["zeppelin", "wlb_llm"], steps=2,
                                          max_length=16384)}
    by_hand = {"zeppelin": 0.0, "wlb_llm": 0.0}
    for step, batch in enumerate(work.batches(4096 * 8, 0, 2, 16384)):
        filler = [L for k in range(1, 5) for L in work.sample_batch(4096 * 8, (0, step, k), 16384)]
        steps = outlier_steps(batch, 4, filler)
        assert len(steps) == 2
        for name in by_hand:
            times = [simulate(plan_batch(docs, cluster, model, name), cluster, model).step_time_s for _, docs in steps]
            per_token = sum(w * t for (w, _), t in zip(steps, times)) / sum(w * sum(docs) for w, docs in steps)
            by_hand[name] += per_token * sum(batch) / 2
    zep = rows["zeppelin"]
    assert zep.step_in_wlb_order_s == pytest.approx(by_hand["zeppelin"], rel=1e-9)
    assert rows["wlb_llm"].step_time_s == pytest.approx(by_hand["wlb_llm"], rel=1e-9)  # the same order as its row
    as_given = [simulate(plan_batch(b, cluster, model, "zeppelin"), cluster, model).step_time_s
                for b in work.batches(4096 * 8, 0, 2, 16384)]
    assert zep.step_time_s == pytest.approx(sum(as_given) / 2, rel=1e-9)  # its own row stays the batch as given
    assert zep.to_dict()["step_in_wlb_order_s"] == zep.step_in_wlb_order_s
    assert rows["wlb_llm"].step_in_wlb_order_s is None
    without = compare(cluster, model, "prolong", 4096, ["zeppelin", "te_cp"], steps=2, max_length=16384)[0]
    assert without.step_in_wlb_order_s is None and without.to_dict()["step_in_wlb_order_s"] is None
    # 2 groups of 8 on 131072 tokens: outliers would be (32768, 65536], longer than the context
    two_nodes = specs.cluster("h800-8nic", num_nodes=2)
    no_outliers = compare(two_nodes, model, "prolong", 8192, ["zeppelin", "wlb_llm"], max_length=32768)[0]
    assert no_outliers.step_in_wlb_order_s is None


def test_magi_dispatch_by_hand_and_its_plans():
    # Chunks of 512 over documents of 1024 and 512 tokens: areas 131328, 393472 (rows
    # 512-1023 of the first) and 131328. Largest first, at most 2 chunks a rank: the
    # second chunk to rank 0, the first and the third to rank 1.
    assert dispatch([1024, 512], [0, 1], 2, 512) == [{0: 512}, {0: 512, 1: 512}]
    cluster, model = specs.cluster("h800-8nic", num_nodes=2), specs.model("llama-3b")
    batch = next(iter(workloads.get("prolong").batches(8192 * 16, 0, 1, 32768)))
    plan = plan_batch(batch, cluster, model, "magi", cp_size=8)
    assert plan.meta["kv_prefix"] and all(r.comm == "allgather" for r in plan.rings)
    assert all(max(r.ranks) // 8 == min(r.ranks) // 8 for r in plan.rings)  # inside a CP group
    for g in range(2):  # every rank of a group holds its chunks: tokens equal within one chunk
        tokens = plan.attention_token_counts[8 * g: 8 * g + 8]
        assert max(tokens) - min(tokens) <= 512
    with pytest.raises(InputError, match="cp_size"):
        plan_batch(batch, cluster, model, "magi", cp_size=3)


def _gather_plan(meta):
    ring = Ring(doc=0, kind="intra", ranks=(0, 1), bounds=(0, 2, 4, 6, 8), comm="allgather")
    return Plan(planner="t", lengths=(8,), node_of_rank=(0, 0), nic_of_rank=(0, 1),
                attention=(ring.chunks_of(0), ring.chunks_of(1)), rings=(ring,), meta=meta).validate()


def test_prefix_gathers_send_only_what_the_queries_attend_to():
    # Member 0 holds chunks [0, 2) and [6, 8), member 1 [2, 4) and [4, 6). Member 1's last
    # query is row 5: it needs rows 0-1 of member 0 only; member 0 needs all of member 1's.
    plan = _gather_plan({"kv_prefix": True})
    assert prefix_rows(list(plan.rings)).tolist() == [[0, 2], [4, 0]]
    model = specs.model("tiny")
    row = kv_bytes(model, 1)
    for meta, expected in (({"kv_prefix": True}, (2, 4)), ({}, (4, 4))):
        sent = simulate(_gather_plan(meta), _two_gpus(), model).bytes_sent["forward"]
        assert (sent["kv", 0, 1], sent["kv", 1, 0]) == (expected[0] * row, expected[1] * row)


def _two_gpus():
    return ClusterSpec(name="two", groups=(NodeGroup(gpu="h100", num_nodes=1, gpus_per_node=2, nics_per_node=2),))


def test_ping_pong_hides_the_remap_behind_the_other_nano_batch():
    # Rank 0 holds two 4000-token documents and remaps the second's linear work to rank 1
    # (o out, q/k/v back). In DistCA's ping-pong each nano-batch's remap runs while the
    # other computes, so on a fast link the steady-state forward layer is rank 0's compute
    # alone; run as one batch it adds both transfers.
    cluster, model = _two_gpus(), specs.model("llama-7b")
    base = _local_plan()
    plan = dataclasses.replace(base, remap=(Transfer(src=0, dst=1, start=4000, end=8000),)).validate()
    plain = simulate(plan, cluster, model, overlap_grad_allreduce=False)
    pp = simulate(dataclasses.replace(plan, meta={"ping_pong": True}), cluster, model,
                  overlap_grad_allreduce=False)
    compute0 = plain.compute_s[0]
    assert pp.layer_forward_s < plain.layer_forward_s
    assert pp.compute_s == pytest.approx(plain.compute_s)
    per_layer = (compute0 - pp.head_s - pp.optimizer_s) / model.num_layers  # forward + backward
    assert pp.layer_forward_s + pp.layer_backward_s == pytest.approx(per_layer, rel=1e-6)
    for phase in ("forward", "backward"):
        assert dict(pp.bytes_sent[phase]) == pytest.approx(dict(plain.bytes_sent[phase]))


def _local_plan():
    return Plan(planner="t", lengths=(4000, 4000), node_of_rank=(0, 0), nic_of_rank=(0, 1),
                attention=((Segment(0, 0, 4000), Segment(1, 0, 4000)), ())).validate()


def test_simulate_cli_tunes_degrees_and_changes_the_setting_for_every_planner(capsys):
    import json

    from ballonet.cli import main
    args = ["simulate", "--cluster", "h800-8nic", "--nodes", "2", "--model", "llama-3b", "--workload", "prolong",
            "--tokens-per-gpu", "4096", "--max-length", "16384", "--planners", "magi,te_cp", "--json"]
    rows = {}
    for flags in ([], ["--tune"], ["--no-engine", "--one-group"]):
        assert main(args + flags) == 0
        rows[tuple(flags)] = {r["planner"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert rows[("--tune",)]["magi"]["options"]["cp_size"] in degrees(16) and rows[()]["magi"]["options"] == {}
    assert rows[("--tune",)]["magi"]["step_time_s"] <= rows[()]["magi"]["step_time_s"] * (1 + 1e-12)
    for name in ("magi", "te_cp"):  # the setting applies to every planner with CP traffic, not zeppelin alone
        assert rows[("--no-engine", "--one-group")][name]["step_time_s"] != rows[()][name]["step_time_s"]
