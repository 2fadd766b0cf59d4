"""Baselines as their users run them: WLB-LLM's per-sequence sharding and adaptive choice,
the comparison's degree tuning, and MagiAttention's dispatch."""

from __future__ import annotations

import numpy as np
import pytest

from ballonet import plan_batch, specs, workloads
from ballonet.errors import InputError
from ballonet.plan import chunk_bounds
from ballonet.planning.wlb_llm import per_sequence
from ballonet.simulation import simulate
from ballonet.simulation.comparison import compare, degrees


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
    for name in ("wlb_llm", "te_cp"):
        d = rows[name].options["cp_size"]
        every = [simulate(plan_batch(batch, cluster, model, name, cp_size=c), cluster, model).step_time_s
                 for c in degrees(16) if c >= 2 or name == "wlb_llm"]
        assert d in degrees(16) and rows[name].step_time_s == pytest.approx(min(every))
    assert rows["packed_dp"].options == {}
    assert np.isfinite(rows["te_cp"].speedup_vs_te_cp)
