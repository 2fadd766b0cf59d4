"""The engine on "double" rings (an inner ring inside each node, rounds across nodes): the
held blocks follow `Ring.schedule`, transfers across nodes go over the second group
(`P2P.outer`) and the others over the first, and on 4 gloo ranks (2 nodes x 2) and 6
(3 nodes x 2) each rank's output and q, k, v gradients equal the single-process reference
and the bytes sent per (src, dst) equal `routing.predicted_bytes`, beside "ring",
"allgather", routed and local documents, with and without the second group.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from attention_checks import H_KV, D, H, check_attention_plan
from plans_by_hand import NODES4, plans4, plans6
from tiny_model import SPEC, batch

from ballonet.plan import Plan
from ballonet.runtime import attention, comm, token_index
from ballonet.runtime.ring import ring_meta
from ballonet.runtime.routing import relay_meta, routes_by_hop
from ballonet.runtime.schedule import record
from ballonet.training.parallelism.model import Transformer

def test_held_blocks_follow_the_schedule():
    plan = plans4()["mixed"]
    assert [r.comm for r in plan.rings] == ["double", "double", "double", "ring", "ring", "double", "allgather"]
    by_hand = {0: [0, 1, 2, 3], 1: [1, 0, 3, 2], 2: [2, 3, 0, 1], 3: [3, 2, 1, 0]}  # k = 2, n = 2
    for rank in range(4):
        metas = {m.doc: m for m in ring_meta(plan, rank, routes_by_hop(plan))}
        assert list(metas[0].held) == by_hand[rank] and metas[0].groups == 2
        assert metas[0].out_hop is None and metas[0].in_hop is None
        ring = metas[3]
        assert list(ring.held) == [(ring.position - s) % 4 for s in range(4)] and ring.groups == 1
        for m in metas.values():
            assert m.held == tuple(plan.ring_of_doc[m.doc].schedule()[m.position].tolist())
    for index, ring in enumerate(plan.rings):
        if ring.comm == "double":
            assert all(relay_meta(plan, index, r, routes_by_hop(plan)) is None for r in range(4))


def test_transfers_across_nodes_go_over_the_second_group():
    for name, plan in plans4().items():
        for outer in (True, False):
            b = record(plan, outer_group=outer)
            seen = set()
            for i in range(b.num_batches):
                for peer, _, _ in b.sends[i] + b.recvs[i]:
                    across = NODES4[peer] != NODES4[b.rank[i]]
                    seen.add((b.group[i], across))
            # Double rings cross nodes over the second group, when there is one; "ring" and
            # "allgather" documents (not in "alone") cross them in the first.
            want = {("inner", False), ("inner", True)}
            if outer:
                want = {("inner", False), ("across", True)} | ({("inner", True)} if name != "alone" else set())
            assert seen == want, (name, outer, seen)


def _check_model(name: str, plan: Plan, rank: int, outer) -> tuple:
    """The tiny Llama's gradients on the plan with the second group (`outer`, as the
    trainer passes it) and without: (check, tensors that differ plus double-ring passes
    that did not get the second group when given it, 0)."""
    tokens, labels = batch(plan.lengths)
    idx = token_index(plan, rank)
    runs, given, post = [], [], comm.P2P.post

    def recorded(p2p, posts):
        if any(p.sends_across or p.recvs_across for p in posts):
            given.append(p2p.outer is outer)
        return post(p2p, posts)

    for group in (None, outer):
        model = Transformer(SPEC, seed=3)
        comm.P2P.post = recorded
        try:
            model.loss(tokens[idx], labels[idx], plan, rank, outer_group=group).backward()
        finally:
            comm.P2P.post = post
        runs.append([p.grad for p in model.parameters()])
    half = len(given) // 2  # rounds with transfers across nodes of each layer's double rings, in each run
    missed = sum(given[half:]) != half or any(given[:half]) or half == 0
    return (f"{name} model, second group", float(sum(not torch.equal(a, b) for a, b in zip(*runs)) + missed), 0.0)


def _check_all(rank: int, world: int, plans: dict[str, Plan]) -> list:
    outer = dist.new_group(list(range(world)))
    rows = []
    for name, plan in plans.items():
        rows += check_attention_plan(name, plan, rank, world)
        rows += check_attention_plan(f"{name}, second group", plan, rank, world, outer_group=outer)
        rows.append(_check_model(name, plan, rank, outer))
    pair = dist.new_group([0, 1])  # every rank joins new_group; only 0 and 1 are in it
    if rank < 2:
        plan = next(iter(plans.values()))
        n = len(token_index(plan, rank))
        try:
            attention(torch.zeros(n, H, D), torch.zeros(n, H_KV, D), torch.zeros(n, H_KV, D), plan, rank,
                      outer_group=pair)
            rows.append(("outer group of other ranks raised", 1.0, 0.0))
        except ValueError as e:
            rows.append((f"outer group message: {e}", float("not the ranks of the group" not in str(e)), 0.0))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 6])
def test_double_rings_match_reference_and_predicted_bytes(world):
    plans = plans4() if world == 4 else plans6()
    results = run_ranks(world, _check_all, plans)
    bad = [f"rank {r}: {check}: {err:.3g} > {tol:.3g}" for r, rows in enumerate(results)
           for check, err, tol in rows if not err <= tol]
    assert not bad, "\n".join(bad)
    # 12 values and 2 byte counts per plan and group, and the model; ranks 0 and 1 check the refusal
    assert [len(rows) for rows in results] == [29 * len(plans) + (r < 2) for r in range(world)]
