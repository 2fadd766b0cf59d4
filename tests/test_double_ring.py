"""The engine on "double" rings (an inner ring inside each node, rounds across nodes): the
held blocks follow `Ring.schedule`, transfers across nodes go over the second group
(`P2P.across`) and the others over the first, and on 4 gloo ranks (2 nodes x 2) and 6
(3 nodes x 2) each rank's output and q, k, v gradients equal the single-process reference
and the bytes sent per (src, dst) equal `routing.predicted_bytes`, beside "ring",
"allgather", routed and local documents, with and without the second group.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from helpers import H_KV, SPEC, D, H, batch, check_attention_plan, make_plan

from ballonet.plan import Plan, Route
from ballonet.runtime import attention, comm, token_index
from ballonet.runtime.ring import ring_meta, ring_pass
from ballonet.runtime.routing import relay_meta, routes_by_hop
from ballonet.training.model import Transformer

NODES4, NODES6 = (0, 0, 1, 1), (0, 0, 1, 1, 2, 2)


def plans4() -> dict[str, Plan]:
    lengths = [37, 13, 5, 20, 9, 7, 3, 11, 6]
    placement = [(0, 1, 2, 3), (0, 2), (2, 3, 0, 1), (0, 1, 2, 3), (2, 3), 1, 3, (3, 1), (1, 2)]
    mixed = make_plan(lengths, placement, NODES4, comms={8: "allgather"}, seed=3,
                      groups={0: 2, 1: 2, 2: 2, 7: 2}, tokens={0: [11, 7, 12, 7], 1: [8, 5], 2: [2, 0, 3, 0]})
    routes = (Route(doc=3, src=1, dst=2, proxies=((0, 2), (1, 3))), Route(doc=3, src=3, dst=0, proxies=((2, 0), (3, 1))))
    return {
        "alone": make_plan([64], [(0, 1, 2, 3)], NODES4, groups={0: 2}, tokens={0: [20, 12, 18, 14]}),
        "mixed": mixed,
        "mixed routed": dataclasses.replace(mixed, routes=routes).validate(),
    }


def plans6() -> dict[str, Plan]:
    lengths = [45, 12, 10, 8, 15, 6, 4]
    placement = [(0, 1, 2, 3, 4, 5), (4, 0, 2), (2, 3, 4, 5), (5, 1), (1, 3, 5), 0, 4]
    return {"three nodes": make_plan(lengths, placement, NODES6, seed=5, groups={0: 3, 1: 3, 2: 2, 3: 2},
                                     tokens={0: [9, 6, 8, 7, 10, 5], 1: [5, 3, 4]})}


def test_held_blocks_follow_the_schedule():
    plan = plans4()["mixed"]
    assert [r.comm for r in plan.rings] == ["double", "double", "double", "ring", "ring", "double", "allgather"]
    by_hand = {0: [0, 1, 2, 3], 1: [1, 0, 3, 2], 2: [2, 3, 0, 1], 3: [3, 2, 1, 0]}  # k = 2, n = 2
    for rank in range(4):
        metas = {m.doc: m for m in ring_meta(plan, rank, "cpu", routes_by_hop(plan))}
        assert list(metas[0].held) == by_hand[rank] and metas[0].groups == 2
        assert metas[0].out_hop is None and metas[0].in_hop is None
        ring = metas[3]
        assert list(ring.held) == [(ring.position - s) % 4 for s in range(4)] and ring.groups == 1
        for m in metas.values():
            assert m.held == tuple(plan.ring_of_doc[m.doc].schedule()[m.position].tolist())
    for index, ring in enumerate(plan.rings):
        if ring.comm == "double":
            assert all(relay_meta(plan, index, r, routes_by_hop(plan)) is None for r in range(4))


class _Posts:
    """A stand-in `P2P` that records which group each message would go over."""

    def __init__(self, group: str, log: list):
        self.group, self.log = group, log

    def across(self) -> _Posts:
        return _Posts("outer", self.log)

    def post(self, sends, recvs) -> list:
        self.log += [(self.group, peer) for peer, _, _ in sends + recvs]
        return []


def test_transfers_across_nodes_go_over_the_second_group():
    plan = plans4()["alone"]  # one document over 2 nodes x 2 ranks
    for rank in range(4):
        meta = ring_meta(plan, rank, "cpu", routes_by_hop(plan))[0]
        log: list = []
        kv = torch.zeros(2, meta.block_rows[meta.position], H_KV, D)
        backward = ring_pass(_Posts("group", log), meta, kv, lambda step, held: torch.zeros_like(held))
        for _ in backward:  # a backward pass: K/V and dK/dV, round sums home
            pass
        assert {g for g, peer in log if NODES4[peer] != NODES4[rank]} == {"outer"}
        assert {g for g, peer in log if NODES4[peer] == NODES4[rank]} == {"group"}
        assert sum(g == "outer" for g, _ in log) == 4  # K/V round send and receive; dK/dV sum home, both ways


def _check_model(name: str, plan: Plan, rank: int, outer) -> tuple:
    """The tiny Llama's gradients on the plan with the second group (`outer`, as the
    trainer passes it) and without: (check, tensors that differ plus double-ring passes
    that did not get the second group when given it, 0)."""
    tokens, labels = batch(plan.lengths)
    idx = token_index(plan, rank)
    runs, given, across = [], [], comm.P2P.across

    def recorded(p2p):
        given.append(p2p.outer is outer)
        return across(p2p)

    for group in (None, outer):
        model = Transformer(SPEC, seed=3)
        comm.P2P.across = recorded
        try:
            model.loss(tokens[idx], labels[idx], plan, rank, outer_group=group).backward()
        finally:
            comm.P2P.across = across
        runs.append([p.grad for p in model.parameters()])
    half = len(given) // 2  # forward and backward of each layer's double rings, in each run
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
