""""heads" documents (DeepSpeed-Ulysses inside one node) in the attention engine.

* On 2 and 4 gloo ranks, hand plans with "heads" documents of 2, 3 and 4 members beside
  local documents, "ring" (routed or not), "allgather" and "double" documents, one node
  and two, with members of uneven tokens and members holding no row: every rank's rows of the output and of the
  q, k, v gradients equal a single-process reference on the unsharded batch (MHA and
  GQA), and the bytes sent equal `routing.predicted_bytes`.
* The metadata and the predicted bytes by hand, against `cost.flops.message_bytes`; a
  member count that does not divide the K/V heads is one ValueError.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import D, check_attention_plan
from distributed import run_ranks
from plans_by_hand import heads_plan, make_plan

import ballonet
from ballonet.cost.flops import message_bytes
from ballonet.runtime import attention
from ballonet.runtime.ring import ring_meta
from ballonet.runtime.routing import heads_row_bytes, predicted_bytes

ONE_NODE, TWO_NODES = (0, 0, 0, 0), (0, 0, 1, 1)


def plans2() -> dict:
    heads = dict.fromkeys((0, 4), "heads")
    return {"two ranks": make_plan([23, 9, 6, 4, 11], [(0, 1), (1, 0), 0, 1, (0, 1)], (0, 0), comms=heads,
                                   seed=1, tokens={4: [11, 0]})}


def plans4() -> dict:
    one = make_plan([37, 13, 20, 9, 5, 3, 17, 14],
                    [(0, 1, 2, 3), (3, 1), (2, 0, 3), (0, 1), 2, 3, (1, 2, 3, 0), (2, 3)], ONE_NODE,
                    comms={0: "heads", 1: "heads", 3: "allgather", 6: "heads", 7: "heads"}, seed=2,
                    tokens={6: [2, 0, 12, 3], 7: [14, 0]})
    two = make_plan([21, 19, 26, 7, 4, 10], [(0, 1), (3, 2), (0, 2, 1, 3), 1, 3, (2, 3)], TWO_NODES,
                    comms={0: "heads", 1: "heads", 5: "heads"}, seed=3, tokens={5: [3, 7]})
    return {"one node": one, "two nodes": two, "beside double and routed rings": heads_plan()}


def plan3() -> dict:
    return {"three members": make_plan([16, 8, 5], [(1, 2, 3), (0, 2), 0], ONE_NODE, comms={0: "heads"},
                                       tokens={0: [7, 0, 9]})}


def _check(rank, world, cases):
    rows = []
    for heads, plans in cases:
        for name, plan in plans.items():
            rows += check_attention_plan(f"{name} H={heads[0]} H_kv={heads[1]}", plan, rank, world, heads=heads)
    return rows


@pytest.mark.parametrize("world", [2, 4])
def test_heads_documents_match_reference_and_predicted_bytes(world):
    if world == 2:
        cases = [((8, 2), plans2()), ((8, 8), plans2())]
    else:
        cases = [((8, 4), plans4()), ((8, 8), plans4()), ((6, 3), plan3())]
    for _, plans in cases:
        assert any(r.comm == "heads" for p in plans.values() for r in p.rings)
    results = run_ranks(world, _check, cases)
    bad = [f"rank {r}: {check}: {err:.3g} > {tol:.3g}" for r, rows in enumerate(results)
           for check, err, tol in rows if not err <= tol]
    assert not bad, "\n".join(bad)
    assert len(results[0]) == 14 * sum(len(plans) for _, plans in cases)


# ---- single process: metadata, predictions, the check -----------------------------------


def test_heads_calls_put_the_document_in_order():
    # Length 8 over 2 members: chunks [0,2) [2,4) [4,6) [6,8); position 0 holds rows 0,1,6,7
    # (slots 0..3 of the gathered buffer), position 1 rows 2..5 (slots 4..7).
    plan = make_plan([3, 8], [1, (0, 1)], (0, 0), comms={1: "heads"})
    first, second = ring_meta(plan, 0)[0], ring_meta(plan, 1)[0]
    assert first.comm == "heads" and first.calls.rows.tolist() == [0, 1, 2, 3]
    assert second.calls.rows.tolist() == [3, 4, 5, 6]  # after rank 1's local document
    assert first.calls.order.tolist() == [0, 1, 4, 5, 6, 7, 2, 3] == second.calls.order.tolist()
    assert first.calls.packing.causal and first.calls.packing.offsets_q == (0, 8)
    # A member holding no row: slots of the gathered buffer [2, 11] are member 0's only.
    uneven = make_plan([11], [(0, 1)], (0, 0), comms={0: "heads"}, tokens={0: [11, 0]})
    assert ring_meta(uneven, 0)[0].calls.order.tolist() == list(range(11))
    assert ring_meta(uneven, 1)[0].calls.rows.numel() == 0


def test_predicted_heads_bytes_by_hand_and_against_the_cost_model():
    # 8 tokens over 2 members, 4 rows each; H=8, H_kv=4, D=8, fp32: a member's share is
    # 4 query and 2 K/V heads, q, k, v (8 heads) 256 bytes a row, o 128 and the LSE 16.
    plan = make_plan([8], [(0, 1)], (0, 0), comms={0: "heads"})
    predicted = predicted_bytes(plan, 4, D, torch.float32, num_heads=8)
    assert predicted.forward[0, 1] == 4 * 256 + 4 * (128 + 16)
    assert predicted.backward[0, 1] == 4 * 256 + 4 * (2 * 128 + 16) + 4 * 256
    with pytest.raises(ValueError, match="num_heads"):
        predicted_bytes(plan, 4, D, torch.float32)
    # Every payload as the cost model prices it ("out" carries each row's LSE: the
    # backward sends it back, and nothing is kept across the passes).
    model = ballonet.model("llama-7b")
    for members in (1, 2, 4, 8):
        mine = heads_row_bytes(model.num_heads, model.num_kv_heads, model.head_dim, torch.bfloat16, members)
        for payload in ("qkv", "out", "dout", "dqkv"):
            assert mine[payload] == message_bytes(model, payload, 1, members), (payload, members)


def test_members_must_divide_the_kv_heads():
    plan = make_plan([12, 5], [(0, 1, 2), 3], ONE_NODE, comms={0: "heads"})
    q, kv = torch.zeros(plan.attention_tokens(0), 6, D), torch.zeros(plan.attention_tokens(0), 2, D)
    with pytest.raises(ValueError, match=r"document 0 splits its heads over 3 ranks.* 2 key/value heads"):
        attention(q, kv, kv, plan, 0)
