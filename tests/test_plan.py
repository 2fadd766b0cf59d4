import dataclasses

import pytest
import torch

from ballonet import runtime
from ballonet.plan import (
    InvalidPlan,
    Plan,
    Ring,
    Route,
    Segment,
    Transfer,
    chunk_bounds,
)


def small_plan(**changes) -> Plan:
    """2 nodes x 2 ranks; documents of 5, 7 and 3 tokens; the 7-token one split over
    ranks 0 and 2 (chunks 0,3 on rank 0 and 1,2 on rank 2); rank 1 gives one token to rank 0."""
    fields = dict(
        planner="hand",
        lengths=(5, 7, 3),
        node_of_rank=(0, 0, 1, 1),
        nic_of_rank=(0, 1, 2, 3),
        attention=(
            (Segment(1, 0, 1), Segment(1, 5, 7)),
            (Segment(0, 0, 5),),
            (Segment(1, 1, 3), Segment(1, 3, 5)),
            (Segment(2, 0, 3),),
        ),
        rings=(Ring(doc=1, kind="inter", ranks=(0, 2), bounds=(0, 1, 3, 5, 7)),),
        remap=(Transfer(1, 0, 4, 5),),
        routes=(Route(doc=1, src=0, dst=2, proxies=((0, 2), (1, 3))),),
        memory_bytes=(10.0, 10.0, 10.0, 10.0),
        memory_cap=(20.0, 20.0, 20.0, 20.0),
    )
    fields.update(changes)
    return Plan(**fields)


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


def test_rank_hardware_by_hand():
    from ballonet import hardware
    from ballonet.errors import InputError
    from ballonet.specs import cluster, rank_hardware

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
