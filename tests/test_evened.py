"""A remapping plan's ranks evened in attention tokens (`planning/zeppelin/evened.py`).

On B (h800-8nic, 4 nodes), LLaMA-13B at tp 2, the prolong batch: the best plan remaps
under linear recomputation; the first node's ranks did equal attention work on 29216 to
32832 attention tokens, and so recomputed 32 to 38 layers, the most on the rank with the
heaviest attention. Evened, the step is 3.973 -> 3.943 s simulated, under wlb_llm's
3.953 s (its outlier delay's weighted steps, bench/results/wlb_gap.md). The figures
compared are the simulator's, never the planner's own estimate.
"""

import numpy as np

from tests.tight_memory import tight

from ballonet import plan_batch, specs, workloads
from ballonet.planning.assembly import Placement
from ballonet.planning.zeppelin import search
from ballonet.planning.zeppelin.evened import evened
from ballonet.simulation.simulator import simulate


def test_the_rank_holding_most_gives_a_document_to_the_one_holding_fewest():
    lengths = [6000, 1000, 3000, 3000, 3000, 3000]
    work = np.array([float(x) ** 2 for x in lengths])  # 37e6 on rank 0 (7000 tokens), 36e6 on rank 1 (12000)
    placement = Placement(num_ranks=2, local=[[0, 1], [2, 3, 4, 5]])
    # Within 2% of the busiest rank's work no move or swap fits (a 3000-token document is 9e6).
    assert evened(placement, lengths, work, [[0, 1]], 0.02) is None
    # Within 30% (48.1e6): a 3000-token document moves (gap 5000 -> 1000 tokens), then nothing
    # shorter than the remaining gap can.
    out = evened(placement, lengths, work, [[0, 1]], 0.3)
    assert sorted(out.local[0]) == [0, 1, 2] and sorted(out.local[1]) == [3, 4, 5]
    assert placement.local == [[0, 1], [2, 3, 4, 5]]  # the input is not edited
    # Ranks of different nodes trade nothing.
    assert evened(placement, lengths, work, [[0], [1]], 0.3) is None


def test_a_split_documents_share_counts_toward_its_members_tokens():
    # Whole documents alone: 4000 tokens on each rank. With the split document's shares
    # (5000 and 1000 of its 6000): 9000 against 5000.
    lengths = [4000, 6000, 2000, 2000]
    work = np.array([1.0, 10.0, 1.0, 1.0])
    placement = Placement(num_ranks=2, local=[[0], [2, 3]], split={1: {0: 5000, 1: 1000}})
    out = evened(placement, lengths, work, [[0, 1]], 1.0)
    # Swapping the 4000-token document for a 2000-token one closes the 4000-token gap.
    assert sorted(out.local[0]) == [2] and sorted(out.local[1]) == [0, 3]
    assert out.split == placement.split


def test_the_evened_plan_is_planned_where_it_prices_shorter(monkeypatch):
    model = specs.model("llama-13b", tp=2)
    cluster = tight(specs.cluster("h800-8nic", num_nodes=4), model)
    lengths = next(iter(workloads.get("prolong").batches(16384 * cluster.num_ranks, 0, 1, 65536)))
    step = simulate(plan_batch(lengths, cluster, model), cluster, model).step_time_s
    monkeypatch.setattr(search, "evened", lambda *args: None)  # the search before
    before = simulate(plan_batch(lengths, cluster, model), cluster, model).step_time_s
    assert step < 0.995 * before
