from collections import Counter

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from plans_by_hand import one_rank_plan, remap_plan, small_plan

from ballonet import runtime
from ballonet.plan import Plan
from ballonet.runtime import ByteCounter
from ballonet.runtime.remapping import link_bytes, plan_move, predicted_bytes, remap

# ---- metadata: pure -------------------------------------------------------------------


def test_plan_move_by_hand():
    plan = remap_plan()
    m0 = plan_move(plan, 0)
    # Rank 0 holds [0, 1, 6, 7, 8, 23, 24]; sends local [1, 3) to rank 2; gets 3 from rank 1.
    assert m0.keep_src.tolist() == [0, 3, 4, 5, 6] and m0.keep_dst.tolist() == [0, 1, 2, 3, 4]
    assert m0.send_src.tolist() == [1, 2] and m0.send_splits == (0, 0, 2, 0)
    assert m0.recv_splits == (0, 3, 0, 0) and m0.recv_dst.tolist() == [5, 6, 7]
    assert (m0.num_in, m0.num_out) == (7, 8)
    m1 = plan_move(plan, 1)
    # Sent rows leave by (dst, start): [2, 3) and [7, 9) to rank 0, then [5, 6) to rank 3.
    assert m1.send_src.tolist() == [2, 7, 8, 5] and m1.send_splits == (3, 0, 0, 1)
    assert m1.keep_src.tolist() == [0, 1, 3, 4, 6] and m1.recv_splits == (0, 0, 0, 3)
    back = plan_move(plan, 1, "linear", "attention")
    assert back.send_src.tolist() == [5, 6, 7] and back.send_splits == (0, 0, 0, 3)
    assert back.recv_dst.tolist() == [2, 7, 8, 5] and back.recv_splits == (3, 0, 0, 1)
    assert (back.num_in, back.num_out) == (8, 9)


def _emulate(plan: Plan, xs: list, src: str, dst: str) -> list:
    """Every rank's remap, with the all-to-all done by hand in one process."""
    moves = [plan_move(plan, r, src, dst) for r in range(plan.num_ranks)]
    sends = [x[m.send_src].split(list(m.send_splits)) for x, m in zip(xs, moves)]
    outs = []
    for r, (x, m) in enumerate(zip(xs, moves)):
        out = torch.full((m.num_out,), -1, dtype=x.dtype)
        out[m.keep_dst] = x[m.keep_src]
        recv = torch.cat([sends[p][r] for p in range(plan.num_ranks)])
        assert recv.shape[0] == sum(m.recv_splits)
        out[m.recv_dst] = recv
        outs.append(out)
    return outs


@pytest.mark.parametrize("plan", [remap_plan(), small_plan()], ids=["remap_plan", "small_plan"])
def test_moves_reach_the_other_layout(plan):
    att = [runtime.token_index(plan, r) for r in range(plan.num_ranks)]
    lin = [runtime.token_index(plan, r, "linear") for r in range(plan.num_ranks)]
    assert [t.tolist() for t in _emulate(plan, att, "attention", "linear")] == [t.tolist() for t in lin]
    assert [t.tolist() for t in _emulate(plan, lin, "linear", "attention")] == [t.tolist() for t in att]


def test_remap_linear_layout_by_hand():
    plan = remap_plan()
    # Kept [0, 7, 8, 23, 24], then rank 1's local [2, 3) and [7, 9): tokens 11, 16, 17.
    assert runtime.token_index(plan, 0, "linear").tolist() == [0, 7, 8, 23, 24, 11, 16, 17]
    assert [plan.linear_tokens(r) for r in range(4)] == [8, 8, 8, 8]


def test_one_rank_or_no_transfers_is_a_no_op_without_process_group():
    assert not dist.is_initialized()
    x = torch.randn(8, 3, requires_grad=True)
    assert remap(x, one_rank_plan(), 0) is x
    assert remap(x, one_rank_plan(), 0, "linear", "attention") is x
    no_moves = small_plan(remap=())
    y = torch.randn(5, 2)
    assert remap(y, no_moves, 1) is y


def test_remap_rejects_bad_arguments():
    plan = remap_plan()
    with pytest.raises(ValueError, match="two layouts"):
        remap(torch.zeros(7), plan, 0, "attention", "attention")
    with pytest.raises(ValueError, match="rank 0 holds 7 tokens in the attention layout, got a tensor of 8"):
        remap(torch.zeros(8), plan, 0)


def test_link_bytes_classifies_pairs():
    pair_bytes = Counter({(0, 1): 10, (1, 2): 7, (3, 2): 5, (2, 0): 1})
    assert link_bytes(pair_bytes, (0, 0, 1, 1)) == Counter({"intra": 15, "inter": 8})


def test_predicted_bytes_by_hand():
    there = predicted_bytes(remap_plan(), 10)
    assert there.forward == Counter({(1, 0): 30, (1, 3): 10, (0, 2): 20, (3, 1): 30, (2, 3): 10})
    assert there.backward == Counter({(0, 1): 30, (3, 1): 10, (2, 0): 20, (1, 3): 30, (3, 2): 10})
    back = predicted_bytes(remap_plan(), 10, src="linear")
    assert (back.forward, back.backward) == (there.backward, there.forward)


# ---- gloo, 4 ranks as 2 nodes x 2 ---------------------------------------------------


def _global_values(num_tokens: int) -> torch.Tensor:
    """[N, 2, 3] float64 values, distinct per token."""
    return torch.arange(num_tokens * 6, dtype=torch.float64).reshape(num_tokens, 2, 3) / 7 + 0.25


def _check_remap_plan(rank: int, plan: Plan, intra_inter: tuple[int, int]) -> None:
    ti_att, ti_lin = runtime.token_index(plan, rank), runtime.token_index(plan, rank, "linear")
    X = _global_values(plan.num_tokens)
    bytes_per_token = 6 * 8

    # Values there and back; bytes sent match the plan's per-pair prediction.
    counter = ByteCounter()
    x_att = X[ti_att].clone().requires_grad_()
    y_lin = remap(x_att, plan, rank, counter=counter)
    assert torch.equal(y_lin, X[ti_lin])
    assert torch.equal(remap(y_lin.detach(), plan, rank, "linear", "attention"), X[ti_att])
    forward_pairs = Counter({(s, d): n * bytes_per_token for (s, d), n in plan.remap_tokens().items() if s == rank})
    assert counter.forward == forward_pairs and not counter.backward
    everyone = [None] * plan.num_ranks
    dist.all_gather_object(everyone, counter.forward)
    total = sum(everyone, Counter())
    assert total == Counter({pair: n * bytes_per_token for pair, n in plan.remap_tokens().items()})
    intra, inter = intra_inter
    assert link_bytes(total, plan.node_of_rank) == Counter(
        {k: v for k, v in (("intra", intra * bytes_per_token), ("inter", inter * bytes_per_token)) if v})

    # Gradients against a single-process reference on the whole batch.
    W = torch.linspace(-1, 1, plan.num_tokens * 6, dtype=torch.float64).reshape(X.shape)
    X_ref = X.clone().requires_grad_()
    (torch.tanh(X_ref) * W).sum().backward()
    (torch.tanh(y_lin) * W[ti_lin]).sum().backward()
    assert torch.allclose(x_att.grad, X_ref.grad[ti_att])
    # The backward is the reverse move: it sent the mirror of the forward's traffic.
    back_pairs = Counter({(d, s): n * bytes_per_token for (s, d), n in plan.remap_tokens().items() if d == rank})
    assert counter.forward == forward_pairs and counter.backward == back_pairs
    predicted = predicted_bytes(plan, bytes_per_token)
    assert counter.backward == Counter({pair: n for pair, n in predicted.backward.items() if pair[0] == rank})

    # Linear -> attention as the forward op: gradients match too.
    z_lin = X[ti_lin].clone().requires_grad_()
    z_att = remap(z_lin, plan, rank, "linear", "attention")
    (z_att.sin() * W[ti_att]).sum().backward()
    X_ref.grad = None
    (X_ref.sin() * W).sum().backward()
    assert torch.allclose(z_lin.grad, X_ref.grad[ti_lin])

    # Metadata moved by remap equals what the layout computes locally.
    mask = (torch.arange(plan.num_tokens) % 3 != 0).long()
    meta_att = torch.stack([runtime.position_ids(plan, rank), runtime.doc_ids(plan, rank), mask[ti_att]], 1)
    meta_lin = torch.stack([runtime.position_ids(plan, rank, "linear"), runtime.doc_ids(plan, rank, "linear"),
                            mask[ti_lin]], 1)
    assert torch.equal(remap(meta_att, plan, rank), meta_lin)
    assert torch.equal(remap(meta_lin, plan, rank, "linear", "attention"), meta_att)


def _run_checks(rank: int, world_size: int) -> None:
    # remap_plan: intra (1->0) 3 + (2->3) 1 tokens; inter (1->3) 1 + (0->2) 2 + (3->1) 3.
    _check_remap_plan(rank, remap_plan(), (4, 6))
    # small_plan: one token 1->0 inside node 0; ranks 2 and 3 send and receive nothing.
    _check_remap_plan(rank, small_plan(), (1, 0))


@pytest.mark.slow
def test_remap_on_four_gloo_ranks():
    run_ranks(4, _run_checks)
