"""A document over half a node's step share planned across two nodes too
(`planning/zeppelin/variants.spread_level`).

On B (h800-8nic, 4 nodes), LLaMA-30B at tp 4 has 2 plan ranks a node. Each 64K-token
document of the wlbllm batch fits a node's share, so it was only ever split over the 2
ranks of one node: those ranks ran mostly attention and the other nodes' mostly linear
work, and layers meet in both passes, so each rank idled in one of them (simulated 14.03
s; hybrid_dp, with each document over 4 ranks of 2 nodes, 13.86 s). The figures compared
are the simulator's, never the planner's own estimate.
"""

import dataclasses

import numpy as np
import pytest

from tests.tight_memory import tight

from ballonet import plan_batch, specs, workloads
from ballonet.planning.devices import devices
from ballonet.planning.zeppelin import search
from ballonet.planning.zeppelin.classes import crossover_lengths, level_nodes
from ballonet.planning.zeppelin.variants import spread_level
from ballonet.simulation.simulator import simulate

MODEL = specs.model("llama-30b", tp=4)
CLUSTER = tight(specs.cluster("h800-8nic", num_nodes=4), MODEL)


def _batch() -> list[int]:
    return next(iter(workloads.get("wlbllm").batches(16384 * CLUSTER.num_ranks, 0, 1, 65536)))


def _nodes_of_longest(plan) -> list[int]:
    longest = max(range(len(plan.lengths)), key=lambda d: plan.lengths[d])
    return sorted({plan.node_of_rank[r] for r in plan.ring_of_doc[longest].ranks})


def test_a_heavy_document_is_spread_where_that_simulates_shorter(monkeypatch):
    lengths = _batch()
    plan = plan_batch(lengths, CLUSTER, MODEL)
    step = simulate(plan, CLUSTER, MODEL).step_time_s
    assert len(_nodes_of_longest(plan)) == 2
    hybrid = simulate(plan_batch(lengths, CLUSTER, MODEL, "hybrid_dp", rank_tokens=16384), CLUSTER, MODEL)
    assert step <= hybrid.step_time_s
    monkeypatch.setattr(search, "spread_level", lambda level: None)  # the search before
    monkeypatch.setattr(search, "backward_level", lambda level: None)
    kept = plan_batch(lengths, CLUSTER, MODEL)
    assert len(_nodes_of_longest(kept)) == 1
    assert step < 0.99 * simulate(kept, CLUSTER, MODEL).step_time_s


@pytest.mark.parametrize("cluster, model, spread", [
    ("h800-8nic", ("llama-30b", 4), True),  # 64K over the inter-node crossover (29K tokens)
    ("a800-4nic", ("llama-30b", 4), False),  # 64K under it (76K): its ring would expose its transfers
    ("h800-8nic", ("llama-3b", 1), False),  # (117K)
])
def test_only_documents_whose_ring_across_nodes_hides_its_transfers(cluster, model, spread):
    c = specs.cluster(cluster, num_nodes=4)
    spec = dataclasses.replace(specs.model(model[0], tp=model[1]), recompute="full")
    lengths = _batch()
    level = level_nodes(lengths, devices(c, spec), crossover_lengths(c, spec), spec, hierarchical=True,
                        price_linear=True, routing=True)
    wide = spread_level(level)
    assert (wide is not None) == spread
    if wide is not None:
        moved = np.nonzero(wide.inter & ~level.inter)[0]
        assert {lengths[d] for d in moved} == {65536}
        assert all(wide.span[int(d)] == 2 and len(wide.level1.shares[int(d)]) == 2 for d in moved)
