"""Speed-ups of the partitioner that must leave its plans as they were: the search's reuse
of placements (a double level 1 that sends the same documents to the same nodes as its
mode's single one is placed as that one was, `prunes.same_nodes`), list versions of
numpy steps."""

import dataclasses

import numpy as np
import pytest

from ballonet import plan_batch, specs, workloads
from ballonet.errors import InfeasiblePlan
from ballonet.planning.assembly import Placement, assemble
from ballonet.planning.devices import devices
from ballonet.planning import pricing
from ballonet.planning.packing import apportion, lpt
from ballonet.planning.remap import linear_targets, node_linear_targets
from ballonet.planning.zeppelin import refinement, search
from ballonet.planning.zeppelin.water import ordered_sum, water_level_list
from ballonet.specs import ClusterSpec, NodeGroup


def test_a_double_level_of_the_same_nodes_plans_as_if_placed_afresh(monkeypatch):
    # bench/planner.py's 128-GPU batch: some double level 1s (selective and linear
    # recomputation's) send the same documents to the same nodes as their single ones, others
    # (none's) do not.
    lengths = workloads.get("wlbllm").sample_batch(16384 * 128, 0)
    cluster, model = specs.cluster("h200-8nic", num_nodes=16), specs.model("llama-7b")
    same, real = [], search.same_nodes
    monkeypatch.setattr(search, "same_nodes", lambda a, b: same.append(real(a, b)) or same[-1])
    reused = plan_batch(lengths, cluster, model)
    assert True in same and False in same
    monkeypatch.setattr(search, "same_nodes", lambda a, b: False)
    fresh = plan_batch(lengths, cluster, model)
    assert reused.digest == fresh.digest
    assert reused.meta["candidates"] == fresh.meta["candidates"]
    assert sum(c["double"] for c in fresh.meta["candidates"]) >= sum(same)  # every reused level was planned


def test_assembling_a_copy_leaves_the_placement_as_it_was():
    cluster = ClusterSpec(name="t", groups=(NodeGroup(gpu="h200", num_nodes=1, gpus_per_node=2, nics_per_node=2),))
    dev = devices(cluster, specs.model("llama-7b"))
    placement = Placement(num_ranks=2, local=[[1], []], split={0: {0: 0, 1: 8}})
    copy = placement.copy()
    plan = assemble("t", [8, 4], dev, copy)  # a split document of one member becomes local
    assert copy.local == [[1], [0]]
    assert placement.local == [[1], []] and placement.split == {0: {0: 0, 1: 8}}
    assert plan.attention_token_counts == (4, 8)


def test_apportion_on_lists_gives_numpys_integers_at_every_ring_size():
    rng = np.random.default_rng(0)
    for n in [1, 2, 3, 7, 8, 9, 16, 33] * 25:
        weights = (rng.random(n) * rng.choice([1e-3, 1.0, 1e4])).tolist()
        if rng.random() < 0.2:
            weights[int(rng.integers(n))] = 0.0
        caps = rng.integers(0, 5000, n).tolist()
        total = int(rng.integers(0, sum(caps) + 2))
        try:
            want = apportion(total, np.array(weights), np.array(caps)).tolist()
        except InfeasiblePlan:
            with pytest.raises(InfeasiblePlan):
                refinement._apportion_list(total, weights, caps)
            continue
        assert refinement._apportion_list(total, weights, caps) == want


def test_ordered_sum_is_numpys_sum_bit_for_bit():
    rng = np.random.default_rng(0)
    for n in list(range(0, 40)) + [63, 64, 65, 127, 128, 129, 200]:
        for scale in (1.0, 1e9):
            for _ in range(20):
                xs = (rng.uniform(-1, 1, n) * scale * 10.0 ** rng.integers(-6, 6, n)).tolist()
                assert ordered_sum(xs) == float(np.sum(xs)), (n, xs)
    xs = [1e16, 1.0] + [0.0] * 7 + [1.0] + [0.0] * 6  # in order 1e16; numpy's (and so ordered_sum's) 1e16 + 2
    assert ordered_sum(xs) == 1e16 + 2


def test_node_linear_targets_are_each_nodes_own_apportion():
    rng = np.random.default_rng(1)
    for case in range(300):
        num_nodes, size = int(rng.integers(1, 12)), int(rng.integers(1, 9))
        counts = rng.integers(0, 20000, num_nodes * size)
        speed = np.ones(len(counts)) if case % 3 == 0 else rng.uniform(0.3, 1.7, len(counts))
        caps = rng.integers(1000, 30000, len(counts)) if case % 2 else np.full(len(counts), 10**9)
        nodes = [list(range(n * size, (n + 1) * size)) for n in range(num_nodes)][::1 + case % 2]
        if case % 7 == 0:
            nodes[-1] = nodes[-1][:-1] or nodes[-1]  # nodes of two sizes
        want = counts.copy()
        try:
            for ranks in nodes:
                want[ranks] = linear_targets(int(counts[ranks].sum()), speed[ranks], caps[ranks])
        except InfeasiblePlan:
            with pytest.raises(InfeasiblePlan):
                node_linear_targets(counts, speed, caps, nodes)
            continue
        assert np.array_equal(node_linear_targets(counts, speed, caps, nodes), want)



def test_remap_pairs_are_counted_once_per_plan():
    cluster = ClusterSpec(name="t", groups=(NodeGroup(gpu="h200", num_nodes=1, gpus_per_node=4, nics_per_node=4),))
    lengths = workloads.get("wlbllm").sample_batch(16384 * 4, 0)
    plan = plan_batch(lengths, cluster, specs.model("llama-7b"))
    src, dst, n = pricing.remap_pairs(plan)
    assert sorted(zip(src.tolist(), dst.tolist(), n.tolist())) == sorted(
        (s, d, k) for (s, d), k in plan.remap_tokens().items())
    assert len(src) and plan.remap_pairs is plan.remap_pairs  # the plan's own, not counted again
    assert pricing.remap_pairs(dataclasses.replace(plan, remap=()))[0].size == 0  # a new plan counts anew


def _water_level_by_events(b, s, u, c, total):
    """The water level as it was before the two-list version: a sorted list of (point, change) events."""
    capped = [x if x > 0 else 0.0 for x in c]
    if total <= 0 or not any(capped):
        return [0.0] * len(b)
    if sum(capped) <= total:
        return capped
    events = []
    for bi, si, ui, ci in zip(b, s, u, c):
        if ci > 0:
            events += [(bi / si, si / ui), ((bi + ui * ci) / si, -si / ui)]
    events.sort(key=lambda e: e[0])
    filled, rate, at = 0.0, 0.0, events[0][0]
    for point, change in events:
        more = filled + rate * (point - at)
        if more >= total and rate > 0:
            break
        filled, at, rate = more, point, rate + change
    else:
        return capped
    level = at + (total - filled) / rate
    return [min(max((level * si - bi) / ui, 0.0), ci) for bi, si, ui, ci in zip(b, s, u, capped)]


def test_water_level_list_is_the_event_sweep_bit_for_bit():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n = int(rng.integers(1, 12))
        b = rng.choice([0.0, 1e5, 3e5], n) if rng.random() < 0.3 else rng.random(n) * 1e6  # ties among the points
        s, u = rng.choice([1.0, 0.5], n), rng.random(n) * 10 + 1
        c = np.where(rng.random(n) < 0.2, 0.0, rng.random(n) * 5000)
        total = float(rng.random() * c.sum() * 1.1)
        args = [x.tolist() for x in (b, s, u, c)]
        assert water_level_list(*args, total) == _water_level_by_events(*args, total)


def test_assembled_plans_count_their_attention_tokens_as_their_segments_hold():
    cluster = ClusterSpec(name="t", groups=(NodeGroup(gpu="h200", num_nodes=2, gpus_per_node=2, nics_per_node=2),))
    dev = devices(cluster, specs.model("llama-7b"))
    placement = Placement(num_ranks=4, local=[[1], [], [2, 3], []],
                          split={0: {0: 5, 1: 0, 2: 6, 3: 9}, 4: {1: 7, 3: 1}, 5: {3: 4}})
    plan = assemble("t", [20, 3, 4, 5, 8, 4], dev, placement)
    assert "attention_token_counts" in plan.__dict__  # set by `assemble`
    fresh = dataclasses.replace(plan)  # counts its segments
    assert "attention_token_counts" not in fresh.__dict__
    assert plan.attention_token_counts == fresh.attention_token_counts == (8, 7, 15, 14)


def test_a_batch_memo_is_that_batch_s_own():
    # `Batch.memo` keeps what the search's level 1s and placements of one batch share; a batch
    # made from it by `dataclasses.replace` (other work, other linear work on ranks) starts empty.
    from ballonet.planning.zeppelin import classes
    from ballonet.planning.zeppelin.state import node_ranks
    cluster, model = specs.cluster("h200-8nic", num_nodes=4), specs.model("llama-7b")
    dev = devices(cluster, model)
    lengths = workloads.get("wlbllm").sample_batch(16384 * dev.num_ranks, 0)
    level = classes.level_nodes(lengths, dev, classes.crossover_lengths(cluster, model), model, hierarchical=True,
                                price_linear=True, routing=True)
    batch, nodes = level.batch, dev.nodes()
    assert batch.memo  # level 1 read its node work through it
    heavier = dataclasses.replace(batch, work=batch.work * 2, work_list=(batch.work * 2).tolist())
    assert heavier.memo == {}
    work = classes._node_work(heavier, nodes, level.weights)
    assert classes._node_work(heavier, nodes, level.weights) is work  # kept
    assert np.array_equal(work, classes._node_work_of(heavier, nodes, level.weights))
    assert not np.array_equal(work, classes._node_work(batch, nodes, level.weights))
    for rs, node in zip(nodes, node_ranks(batch, nodes)):
        assert node.ranks.tolist() == rs and node.speed_sum == dev.speed[rs].sum()
        assert node.token_sum == dev.token_cap[rs].sum() and node.most_tokens == dev.token_cap[rs].max()


def _lpt_by_scan(docs, work, lengths, load, speed, token_room):
    """`packing.lpt` as its docstring says, slot by slot: each document, largest first (by
    its least cost; ties in document order), to the first slot of least (load + cost) /
    speed among those with memory for it, or least load where speeds are alike."""
    work = np.asarray(work, dtype=float)
    per_slot = work.ndim == 2 and not (work == work[0]).all()
    cost = work if per_slot else np.broadcast_to(work[0] if work.ndim == 2 else work, (len(load), work.shape[-1]))
    alike = len(set(speed.tolist())) == 1
    out: dict[int, list[int]] = {}
    spill = []
    for d in sorted(docs, key=lambda d: (-float(cost[:, d].min()), d)):
        fits = [i for i in range(len(load)) if token_room[i] >= lengths[d]]
        if not fits:
            spill.append(d)
            continue
        i = min(fits, key=lambda i: (float(load[i]), i) if alike and not per_slot else
                ((load[i] + cost[i, d]) / speed[i], i))
        out.setdefault(i, []).append(d)
        load[i] += cost[i, d]
        token_room[i] -= lengths[d]
    return out, spill


@pytest.mark.parametrize("shape", ["one row", "alike rows", "rows per slot", "unequal speeds"])
def test_lpt_places_as_a_scan_of_the_slots_bit_for_bit(shape):
    rng = np.random.default_rng(7)
    slots, D = 8, 300
    lengths = rng.integers(100, 5000, D).tolist()
    row = rng.random(D) * np.asarray(lengths)
    work = {"one row": row, "alike rows": np.tile(row, (slots, 1)),
            "rows per slot": row * rng.choice([1.0, 1.25, 1.5], (slots, 1)), "unequal speeds": row}[shape]
    speed = rng.choice([1.0, 2.0], slots) if shape == "unequal speeds" else np.full(slots, 3.0)
    docs = rng.permutation(D)[:250].tolist()
    room = np.full(slots, float(sum(lengths) // 10))  # tight: the last documents find no room
    load = rng.random(slots) * row.sum() / 50
    got_load, got_room, spill = load.copy(), room.copy(), []
    got = lpt(docs, work, lengths, got_load, speed, got_room, spill)
    want_load, want_room = load.copy(), room.copy()
    want, want_spill = _lpt_by_scan(docs, work, lengths, want_load, speed, want_room)
    assert spill and want_spill == spill
    assert list(got.items()) == list(want.items())  # the same slots, in the order they got their first
    assert got_load.tobytes() == want_load.tobytes() and got_room.tobytes() == want_room.tobytes()
