"""Transfers sharing a link's bandwidth (processor sharing, `simulation/timeline.py`),
on hand-made timelines whose finish times are worked out here by hand."""

import pytest

from ballonet.simulation.timeline import Timeline

LINK, OTHER = 7, 8


def run(transfers):
    """transfers: [(seconds alone, links, start time)]; their finish times."""
    tl = Timeline(num_streams=len(transfers))
    ids = []
    for i, (seconds, links, at) in enumerate(transfers):
        gate = tl.add(at, stream=i) if at else None  # a kernel on a stream of its own delays the start
        ids.append(tl.add(seconds, links=links, after=[gate]))
    _, finish = tl.run()
    return [finish[i] for i in ids]


def test_two_equal_transfers_starting_together_each_take_twice_as_long():
    assert run([(1.0, (LINK,), 0.0), (1.0, (LINK,), 0.0)]) == pytest.approx([2.0, 2.0], rel=1e-12)


def test_a_transfer_joining_halfway():
    # A: alone for 0.5 s (half done), then both at half speed: A's last half takes 1 s,
    # so A ends at 1.5; B has done 0.5 by then and ends alone at 2.0.
    tl = Timeline(num_streams=1)
    a = tl.add(1.0, links=(LINK,))
    gate = tl.add(0.5, stream=0)
    b = tl.add(1.0, links=(LINK,), after=[gate])
    start, finish = tl.run()
    assert (start[b], finish[a], finish[b]) == pytest.approx((0.5, 1.5, 2.0), rel=1e-12)


def test_unequal_transfers_and_a_link_of_their_own():
    # On LINK: 1 s and 3 s from time 0: both at half speed until the short one ends at 2;
    # the long one has 2 s left and ends at 4. The long one also crosses OTHER, alone
    # there (done at 3): it is done when both links have carried it, at 4.
    assert run([(1.0, (LINK,), 0.0), (3.0, (LINK, OTHER), 0.0)]) == pytest.approx([2.0, 4.0], rel=1e-12)


def test_three_transfers_in_turn():
    # 0-1: A alone (1 of 2 s done); 1-2: A and B at half (A 1.5, B 0.5 done); at 2 C joins:
    # three at a third; A's last 0.5 takes 1.5 s (ends 3.5, B 1.0 done, C 0.5); then B and
    # C at half: C's remaining 0.5 and B's remaining 1.0: C ends at 4.5, B at 5.0.
    assert run([(2.0, (LINK,), 0.0), (2.0, (LINK,), 1.0), (1.0, (LINK,), 2.0)]) == \
        pytest.approx([3.5, 5.0, 4.5], rel=1e-12)


def test_successor_of_a_shared_transfer_starts_when_it_ends():
    tl = Timeline(num_streams=1)
    a = tl.add(1.0, links=(LINK,))
    tl.add(1.0, links=(LINK,))
    k = tl.add(0.25, stream=0, after=[a])
    start, finish = tl.run()
    assert (start[k], finish[k]) == pytest.approx((2.0, 2.25), rel=1e-12)
