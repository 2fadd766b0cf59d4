import dataclasses
import json

import pytest
import torch
from plans_by_hand import small_plan

from ballonet import runtime
from ballonet.plan import (
    InvalidPlan,
    Plan,
    RankRecompute,
    RecomputeMode,
    Ring,
    Route,
    Segment,
    Transfer,
    chunk_bounds,
)


def test_chunk_bounds_need_no_divisibility():
    assert chunk_bounds(7, 8) == (0, 0, 1, 2, 3, 4, 5, 6, 7)
    assert chunk_bounds(7, 4) == (0, 1, 3, 5, 7)


def test_small_plan_validates_and_counts():
    plan = small_plan().validate()
    assert [plan.attention_tokens(r) for r in range(4)] == [3, 5, 4, 3]
    assert [plan.linear_tokens(r) for r in range(4)] == [4, 4, 4, 3]
    assert plan.local_docs(1) == [0] and plan.local_docs(0) == []
    # One ring step each way: rank 0 passes its 3 rows to rank 2, rank 2 its 4 rows to rank 0;
    # the backward passes them again, then returns the dK/dV of the block each one held.
    sent = [(m.phase, m.payload, m.step, m.src, m.dst, m.rows) for m in plan.ring_messages()]
    assert sent == [("forward", "kv", 0, 0, 2, 3), ("forward", "kv", 0, 2, 0, 4),
                    ("backward", "kv", 0, 0, 2, 3), ("backward", "kv", 0, 2, 0, 4),
                    ("backward", "grad", 1, 0, 2, 4), ("backward", "grad", 1, 2, 0, 3)]
    assert dict(plan.remap_tokens()) == {(1, 0): 1}


def test_token_index_and_positions_in_both_layouts():
    plan = small_plan()
    # Global positions: document 0 is 0..4, document 1 is 5..11, document 2 is 12..14.
    assert runtime.token_index(plan, 0).tolist() == [5, 10, 11]
    assert runtime.position_ids(plan, 0).tolist() == [0, 5, 6]
    assert runtime.token_index(plan, 0, layout="linear").tolist() == [5, 10, 11, 4]
    assert runtime.token_index(plan, 1, layout="linear").tolist() == [0, 1, 2, 3]
    assert runtime.position_ids(plan, 0, layout="linear").tolist() == [0, 5, 6, 4]
    assert runtime.doc_ids(plan, 0, layout="linear").tolist() == [1, 1, 1, 0]
    every = torch.cat([runtime.token_index(plan, r, layout=lay) for r in range(4) for lay in ["linear"]])
    assert sorted(every.tolist()) == list(range(15))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention=((Segment(1, 0, 1),), (Segment(0, 0, 5),), (Segment(1, 1, 3), Segment(1, 3, 5)),
                         (Segment(2, 0, 3),))), "document 1: covered up to 5 of 7"),
        (dict(rings=(Ring(doc=1, kind="intra", ranks=(0, 2), bounds=(0, 1, 3, 5, 7)),)), "kind intra spans 2 nodes"),
        (dict(rings=(Ring(doc=1, kind="inter", ranks=(0, 2), bounds=(0, 2, 3, 5, 7)),)), "rank 0 holds"),
        (dict(rings=(Ring(doc=1, kind="inter", ranks=(0, 2), bounds=(0, 3, 1, 5, 7)),)), "bounds"),
        (dict(rings=(Ring(doc=1, kind="inter", ranks=(0, 0), bounds=(0, 1, 3, 5, 7)),)), r"ranks \(0, 0\)"),
        (dict(rings=(Ring(doc=1, kind="inter", ranks=(0, 2), bounds=(0, 1, 3, 5, 7), comm="heads"),)),
         "comm heads spans 2 nodes"),
        (dict(remap=(Transfer(1, 0, 4, 5), Transfer(1, 2, 3, 5))), "overlapping"),
        (dict(remap=(Transfer(3, 0, 2, 4),)), "sends more tokens than it holds"),
        (dict(routes=(Route(doc=1, src=0, dst=2, proxies=((1, 0),)),)), "proxy pair"),
        (dict(memory_bytes=(10.0, 30.0, 10.0, 10.0)), "rank 1: .* over its cap"),
        (dict(rings=()), "document 1 spans ranks but has no ring"),
    ],
)
def test_validate_rejects_broken_plans(changes, message):
    with pytest.raises(InvalidPlan, match=message):
        small_plan(**changes).validate()


def test_json_round_trip_is_byte_identical():
    plan = small_plan(meta={"note": "x", "b": 1})
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again.to_json() == text and again.digest == plan.digest
    assert again == plan
    other = dataclasses.replace(plan, remap=())
    assert other.digest != plan.digest


def test_recompute_is_typed_checked_and_round_trips():
    """`Plan.recompute`: one (mode, layers) per rank, the mode a `RecomputeMode`, full on
    every rank or none; it is part of the JSON (and so of the digest) and comes back typed."""
    per_rank = (RankRecompute(RecomputeMode.SELECTIVE, 3), RankRecompute(RecomputeMode.NONE, 0),
                RankRecompute(RecomputeMode.LINEAR, 1), RankRecompute(RecomputeMode.FULL, 2))
    plan = small_plan(recompute=per_rank)  # (full on one rank only: refused below)
    again = Plan.from_json(plan.to_json())
    assert again.recompute == per_rank and all(isinstance(m, RecomputeMode) for m, _ in again.recompute)
    assert again.digest == plan.digest != small_plan().digest
    assert json.loads(plan.to_json())["recompute"] == [["selective", 3], ["none", 0], ["linear", 1], ["full", 2]]
    assert f"{RecomputeMode.LINEAR}" == "linear" and RecomputeMode("full") == "full"
    for bad in (per_rank[:3], (("selective", 3),) * 4, (RankRecompute(RecomputeMode.NONE, 2),) * 4,
                (RankRecompute(RecomputeMode.FULL, -1),) * 4, per_rank):
        with pytest.raises(InvalidPlan, match="recompute"):
            small_plan(recompute=bad).validate()


def test_rank_hardware_by_hand():
    from ballonet.cost import hardware
    from ballonet.errors import InputError
    from ballonet.planning.devices import rank_hardware
    from ballonet.specs import cluster

    # h800 nodes: 8 GPUs, one NIC each; h20 nodes: 8 GPUs, two per NIC. tp = 2: plan rank r
    # is GPUs 2r and 2r + 1, four ranks per node.
    hw = rank_hardware(cluster("h800+h20"), 2)
    assert hw.num_ranks == 16 and hw.node == tuple(r // 4 for r in range(16))
    assert hw.local_index == tuple(r % 4 for r in range(16))
    assert hw.nic[:8] == tuple(range(0, 16, 2)) and hw.nic[8:] == (16, 17, 18, 19, 20, 21, 22, 23)
    assert hw.nics[0] == (0, 1) and hw.nics[8] == (16,)
    assert hw.group == (0,) * 8 + (1,) * 8
    assert hw.gpu[0] == hardware.gpu("h800") and hw.gpu[15] == hardware.gpu("h20")
    assert (hw.nic_bw[0], hw.nic_bw[15]) == (400e9 / 8, 200e9 / 8)  # 400 and 200 Gb/s NICs
    assert hw.intra_bw[15] == hardware.gpu("h20").intra_link_bw
    with pytest.raises(InputError, match="tp=3"):
        rank_hardware(cluster("h800+h20"), 3)


# ---- "double" rings: a ring inside each node, rounds across nodes ---------------------------


def double_plan(**ring_changes) -> Plan:
    """One 8-token document over 2 nodes x 2 ranks as a "double" ring (blocks of 2 rows)."""
    ring = Ring(doc=0, kind="inter", ranks=(0, 1, 2, 3), bounds=chunk_bounds(8, 8), comm="double", groups=2)
    ring = dataclasses.replace(ring, **ring_changes)
    attention = [() for _ in range(4)]
    for i, r in enumerate(ring.ranks):
        attention[r] = ring.chunks_of(i)
    return Plan(planner="hand", lengths=(8,), node_of_rank=(0, 0, 1, 1), nic_of_rank=(0, 1, 2, 3),
                attention=tuple(attention), rings=(ring,))


def test_double_schedule_and_messages_by_hand():
    ring = double_plan().validate().rings[0]
    # Round 0 (steps 0-1) on the node's own blocks, round 1 (steps 2-3) on the other node's.
    assert ring.schedule().tolist() == [[0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 0, 1], [3, 2, 1, 0]]
    got = sorted((m.phase, m.payload, m.step, m.src, m.dst, m.rows) for m in ring.messages())
    kv = [(0, 0, 1), (0, 1, 0), (0, 2, 3), (0, 3, 2),  # inner ring, round 0
          (0, 0, 2), (0, 1, 3), (0, 2, 0), (0, 3, 1),  # round 0's first blocks to the next node
          (2, 0, 1), (2, 1, 0), (2, 2, 3), (2, 3, 2)]  # inner ring, round 1
    grad = [(1, 0, 1), (1, 1, 0), (1, 2, 3), (1, 3, 2), (3, 0, 1), (3, 1, 0), (3, 2, 3), (3, 3, 2),
            (3, 0, 2), (3, 1, 3), (3, 2, 0), (3, 3, 1)]  # after round 1: each node's sum to the block's owner
    want = [(phase, "kv", s, a, b, 2) for phase in ("backward", "forward") for s, a, b in kv]
    want += [("backward", "grad", s, a, b, 2) for s, a, b in grad]
    assert got == sorted(want)


@pytest.mark.parametrize("k, n", [(2, 2), (3, 2), (2, 3), (3, 1), (4, 3)])
def test_double_messages_deliver_every_block_and_gradient(k, n):
    """Replay the walk: every block a position holds at a step reached it by a K/V message
    of an earlier step, and every position's gradient sums every position's contribution."""
    g = k * n
    ranks = tuple(range(g))
    ring = Ring(doc=0, kind="inter", ranks=ranks, bounds=tuple(range(2 * g + 1)), comm="double", groups=k)
    held = ring.schedule()
    assert all(sorted(row) == list(range(g)) for row in held)  # each position sees every block once
    has = [{i} for i in range(g)]
    msgs = [m for m in ring.messages() if m.phase == "forward"]
    for step in range(g):
        for i in range(g):
            assert held[i][step] in has[i], (i, step)
        for m in msgs:
            if m.step == step:
                # a position sends only what it holds now or got earlier, to a rank that gets it next
                assert held[m.src][step] in has[m.src]
                has[m.dst].add(held[m.src][step])
    # Gradients: sets of contributing positions travel with the messages: inside a node the
    # partial sum of the block the sender holds, across nodes a node's sum home to its owner.
    partial: dict[tuple[int, int], set] = {}  # (position, block) -> positions summed in
    for step in range(g):
        for i in range(g):
            partial.setdefault((i, held[i][step]), set()).add(i)
        grads = [m for m in ring.messages() if m.payload == "grad" and m.step == step]
        for m in sorted(grads, key=lambda m: m.src // n != m.dst // n):  # inner ones first
            block = held[m.src][step] if m.src // n == m.dst // n else m.dst
            assert m.rows == 2  # every block: chunks of one token each
            partial.setdefault((m.dst, block), set()).update(partial.pop((m.src, block)))
    for i in range(g):
        assert partial[i, i] == set(range(g)), (i, partial[i, i])


def test_double_rings_are_checked_and_round_trip():
    plan = double_plan().validate()
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(InvalidPlan, match="not one node each"):
        double_plan(ranks=(0, 2, 1, 3)).validate()
    with pytest.raises(InvalidPlan, match="4 ranks in 3 groups"):
        double_plan(groups=3).validate()
    with pytest.raises(InvalidPlan, match="groups 2 with comm ring"):
        double_plan(comm="ring").validate()
    routed = dataclasses.replace(plan, routes=(Route(doc=0, src=1, dst=2, proxies=((1, 3),)),))
    with pytest.raises(InvalidPlan, match="no inter-node ring of comm"):
        routed.validate()
