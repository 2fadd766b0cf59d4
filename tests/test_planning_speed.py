"""Speed-ups of the partitioner that must leave its plans as they were: the search's reuse
of placements (a double level 1 that sends the same documents to the same nodes as its
mode's single one is placed as that one was, `search._same_nodes`), and list versions of
numpy steps."""

import numpy as np
import pytest

from ballonet import plan_batch, specs, workloads
from ballonet.errors import InfeasiblePlan
from ballonet.planning.assembly import Placement, assemble
from ballonet.planning.devices import devices
from ballonet.planning.packing import apportion
from ballonet.planning.zeppelin import refinement, search
from ballonet.specs import ClusterSpec, NodeGroup


def test_a_double_level_of_the_same_nodes_plans_as_if_placed_afresh(monkeypatch):
    # bench/planner.py's 128-GPU batch: some double level 1s (selective and linear
    # recomputation's) send the same documents to the same nodes as their single ones, others
    # (none's) do not.
    lengths = workloads.get("wlbllm").sample_batch(16384 * 128, 0)
    cluster, model = specs.cluster("h200-8nic", num_nodes=16), specs.model("llama-7b")
    same, real = [], search._same_nodes
    monkeypatch.setattr(search, "_same_nodes", lambda a, b: same.append(real(a, b)) or same[-1])
    reused = plan_batch(lengths, cluster, model)
    assert True in same and False in same
    monkeypatch.setattr(search, "_same_nodes", lambda a, b: False)
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
