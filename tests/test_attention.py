"""The attention engine against a single-process reference on the unsharded batch.

Hand-built plans (te_cp-like, llama_cp-like, packed, mixed, random) and planner plans run
on 1, 2 and 4 gloo ranks (4 = 2 nodes x 2); each rank checks its rows of the output and
of the q, k, v gradients, and the bytes sent are checked against the plan's prediction.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from distributed import run_ranks
from attention_checks import H_KV, D, H, attention_reference, check_attention_plan, run_attention
from plans_by_hand import hand_plans, make_plan

import ballonet
from ballonet.plan import Plan
from ballonet.runtime import attention, token_index
from ballonet.runtime.ring import ring_meta
from ballonet.runtime.routing import predicted_bytes

PLANNERS = ("zeppelin", "te_cp", "llama_cp", "hybrid_dp")
PLANNER_LENGTHS = [300, 180, 37, 1, 5, 64, 9, 120, 2]


def planner_plans() -> dict[str, Plan]:
    cluster, model = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2), ballonet.model("tiny")
    whole = {"cp_size": cluster.num_ranks}  # CP over the whole cluster, so their rings cross nodes
    plans = {name: ballonet.plan_batch(PLANNER_LENGTHS, cluster, model, planner=name,
                                       **(whole if name in ("te_cp", "llama_cp") else {})) for name in PLANNERS}
    plans["zeppelin (intra)"] = ballonet.plan_batch([400, 300, 200, 37, 1, 5, 64, 9, 2], cluster, model)
    return plans


def _check_all(rank, world, plans):
    rows = []
    for name, plan in plans.items():
        rows += check_attention_plan(name, plan, rank, world)
    if world > 1:  # a rank with another plan fails loudly on every rank
        plan = plans["te_cp"] if rank != 1 else plans["packed"]
        idx = token_index(plan, rank)
        try:
            attention(torch.zeros(len(idx), H, D), torch.zeros(len(idx), H_KV, D), torch.zeros(len(idx), H_KV, D),
                      plan, rank)
            rows.append(("mismatch raised", 1.0, 0.0))
        except RuntimeError as e:
            rows.append((f"mismatch message: {e}", float("disagree" not in str(e) or "[1]" not in str(e)), 0.0))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_engine_matches_reference(world):
    plans = hand_plans(world)
    if world == 4:
        plans.update({f"planner {k}": v for k, v in planner_plans().items()})
        kinds = {(r.kind, r.comm) for p in plans.values() if p.planner != "hand" for r in p.rings}
        assert kinds == {("inter", "ring"), ("intra", "ring"), ("inter", "allgather")}
    results = run_ranks(world, _check_all, plans)
    bad = [f"rank {r}: {check}: {err:.3g} > {tol:.3g}" for r, rows in enumerate(results)
           for check, err, tol in rows if not err <= tol]
    assert not bad, "\n".join(bad)
    assert len(results[0]) >= 10 * len(plans)


# ---- single process: world size 1 without torch.distributed, metadata, predictions -----


def test_one_rank_without_process_group():
    plan = make_plan([9, 1, 4], [0, (0,), 0], (0,), seed=1)  # (0,): a ring of one
    inputs = [torch.randn(plan.num_tokens, h, D) for h in (H, H_KV, H_KV, H)]
    idx, got = run_attention(plan, 0, inputs, torch.float32)
    for a, b in zip(got, attention_reference(*(x.double() for x in inputs), plan.lengths, math=True)):
        assert (a.double() - b[idx]).abs().max().item() <= 1e-5


def test_wrong_shapes_are_refused():
    plan = make_plan([5], [0], (0,))
    with pytest.raises(ValueError, match="5 tokens"):
        attention(torch.zeros(4, H, D), torch.zeros(4, H_KV, D), torch.zeros(4, H_KV, D), plan, 0)
    with pytest.raises(ValueError, match="multiple"):
        attention(torch.zeros(5, 3, D), torch.zeros(5, 2, D), torch.zeros(5, 2, D), plan, 0)


def test_step_calls_follow_document_offsets():
    # Length 8 over 2 ranks: chunks [0,2) [2,4) [4,6) [6,8); position 0 holds 0 and 3.
    plan = make_plan([8], [(0, 1)], (0, 0))
    first, second = ring_meta(plan, 0)[0], ring_meta(plan, 1)[0]
    assert first.calls.rows.tolist() == [0, 1, 2, 3] and first.block_rows == (4, 4)
    diag = first.calls.calls[0]
    assert diag.packing.causal and diag.packing.offsets_q == (0, 4)
    # Position 0 holding position 1's block: only its chunk [6,8) sees [2,4) and [4,6).
    call = first.calls.calls[1]
    assert call.q_index.tolist() == [2, 3] and call.k_index.tolist() == [0, 1, 2, 3]
    assert call.packing.offsets_q == (0, 2) and call.packing.offsets_k == (0, 4) and not call.packing.causal
    # Position 1 holding position 0's block: both its chunks see [0,2), not [6,8).
    call = second.calls.calls[1]
    assert call.q_index.tolist() == [0, 1, 2, 3] and call.k_index.tolist() == [0, 1]


def grad_rows(plan) -> Counter:
    """dK/dV rows per (src, dst) of the plan's ring messages."""
    out = Counter()
    for msg in plan.ring_messages():
        if msg.payload == "grad":
            out[msg.src, msg.dst] += msg.rows
    return out


def test_grad_rows_by_hand():
    # Length 7 over 3 ranks: chunk bounds 0,1,2,3,4,5,7; blocks hold 3, 2, 2 rows.
    ring_plan = make_plan([7], [(0, 1, 2)], (0, 0, 0))
    assert grad_rows(ring_plan) == Counter({(0, 1): 4, (1, 2): 5, (2, 0): 5})
    gather_plan = make_plan([7], [(0, 1, 2)], (0, 0, 0), comms={0: "allgather"})
    assert grad_rows(gather_plan) == Counter(
        {(0, 1): 2, (0, 2): 2, (1, 0): 3, (1, 2): 2, (2, 0): 3, (2, 1): 2})
    # Forward 0->1 passes blocks 0 then 2 (5 rows); K and V, 2 heads of 8, bf16: 5*2*2*8*2 bytes;
    # the backward adds fp32 dK/dV of blocks 2 and 1 (4 rows).
    predicted = predicted_bytes(ring_plan, 2, 8, torch.bfloat16)
    assert predicted.forward[0, 1] == 320 and predicted.backward[0, 1] == 320 + 4 * 2 * 2 * 8 * 4
