"""The remap as the runtime runs it, simulated and priced, and the ring waits beside it.

The runtime's remap is one `all_to_all_single` (NCCL: one grouped kernel of sends and
receives per rank, launched when the rank's stream reaches it): a pair's bytes move once
both ranks have posted, and a rank goes on when all of its sends and receives are done.
"""

import dataclasses

import numpy as np
import pytest
from tests.closed_forms import EFF_F, GB, HD, MODEL, PEAK, cluster, cluster_plan, lin, nvlink

from tests.tight_memory import tight

from ballonet import specs, workloads
from ballonet.cost.flops import remap_bytes
from ballonet.plan import Transfer
from ballonet.planning.pricing import rank_remap_seconds
from ballonet.planning.zeppelin.search import CandidateSearch, ZeppelinOptions
from ballonet.simulation.simulator import simulate

pytestmark = pytest.mark.usefixtures("flat_profile")  # conftest.py: the closed forms' calibration profile


def test_remap_pair_moves_once_both_ranks_posted_and_the_sender_waits_for_it():
    # Rank 0 holds two 4000-token documents and remaps the second's tokens to rank 1,
    # whose own 16000-token document ends its attention later than rank 0's (by more than
    # the transfer takes). The output o leaves rank 0 only once rank 1 has posted (its
    # attention done), and rank 0's linear layers wait for that send; then q, k, v go back.
    C = cluster(gpus=2, nics=2, intra=40 * GB)
    base = cluster_plan(C, local={0: [4000, 4000], 1: [16000]})
    plan = dataclasses.replace(base, remap=(Transfer(src=0, dst=1, start=4000, end=8000),)).validate()
    att0 = 2 * 2 * HD * 4000 * 4001 / (PEAK * EFF_F)
    att1 = 2 * HD * 16000 * 16001 / (PEAK * EFF_F)
    o = nvlink(4000 * MODEL.hidden * 2, 40 * GB)
    qkv = nvlink(4000 * (MODEL.hidden + 2 * MODEL.kv_dim) * 2, 40 * GB)
    assert att1 - att0 > o  # sent when rank 0 is ready, it would arrive before rank 1 needs it
    res = simulate(plan, C, MODEL, overlap_grad_allreduce=False)
    assert res.layer_forward_s == pytest.approx(att1 + o + lin(20000) + qkv, rel=1e-9)
    _, tl, start, _, _ = res.timelines[0]
    linear0 = [t for t in range(tl.num_tasks) if tl.label[t][:2] == ("linear", 0)]
    assert linear0 and min(start[t] for t in linear0) == pytest.approx(att1 + o, rel=1e-9)


def test_senders_into_one_rank_end_their_remap_with_its_last_byte():
    # Ranks 1-3 each remap 1000 tokens into rank 0, which also sends 500 to rank 3: rank 0's
    # port carries 3000 tokens' bytes each way and every sender shares it, so each
    # sender's all-to-all ends when rank 0's does.
    C = cluster(gpus=4, nics=4)
    plan = dataclasses.replace(cluster_plan(C, local={0: [500], 1: [1000], 2: [1000], 3: [1000]}), remap=(
        Transfer(src=1, dst=0, start=0, end=1000), Transfer(src=2, dst=0, start=0, end=1000),
        Transfer(src=3, dst=0, start=0, end=1000), Transfer(src=0, dst=3, start=0, end=500))).validate()
    per_token = remap_bytes(MODEL, 1, True) + remap_bytes(MODEL, 1, False)
    bw = np.full(4, 100 * GB)
    busy = 2 * MODEL.num_layers * 3000 * per_token / (100 * GB)  # rank 0 receives 3000 tokens' bytes
    own3 = 2 * MODEL.num_layers * 1000 * per_token / (100 * GB)  # rank 3 sends 1000, receives 500
    assert own3 < busy
    assert rank_remap_seconds(plan, MODEL, bw) == pytest.approx([busy] * 4, rel=1e-12)


def test_remapping_plans_on_a_mixed_cluster_are_estimated_as_simulated():
    # h800+h20, wlbllm batch 1 (seed 0, 16K tokens per GPU, 64K context): every plan the
    # search compares within 3% of its simulated step. Rank 0 of the linear-recomputation
    # remapping plan is in a 4-rank ring of a 563-token document beside a 2-rank ring of a
    # 12,925-token one: the large ring's steps fill its wait for the members' local
    # documents, which `ring_wait_seconds` once charged whole (estimate 5.8% over).
    m = specs.model("llama-7b")
    c = tight(specs.cluster("h800+h20"), m)
    batch = list(workloads.get("wlbllm").batches(16384 * c.num_ranks, 0, 2, 65536))[1]
    search = CandidateSearch(lengths=batch, cluster=c, model=m, options=ZeppelinOptions())
    search.run()
    seen = set()
    for cand, *_ in search.made:
        meta = cand.plan.meta
        seen.add((meta["recompute"], meta["keep_tokens"]))
        assert cand.seconds == pytest.approx(simulate(cand.plan, c, m).step_time_s, rel=0.03), meta
    assert ("linear", False) in seen
