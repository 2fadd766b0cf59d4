"""The bound's linear work at the mean rank's token count (`gemm_envelope.rank_token_seconds`):
no split of a batch's tokens between ranks runs its GEMMs cheaper, on the mean, than the
lower convex envelope of a rank's seconds at the mean."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tight_memory import tight

from ballonet import plan_batch, simulate, specs
from ballonet.cost import bounds, gemm_envelope, hardware
from ballonet.specs import NodeGroup

H800 = NodeGroup(gpu="h800", gpus_per_node=8)
PEAK = H800.gpu_type.peak_flops  # flops of one second at efficiency 1: `a` = 1 s a token below


def test_hand_computed_envelope():
    """The H800's GEMM curve peaks at 0.720 on 8192 tokens and stays at 0.692 from 32768 on
    (`cost/profiles.py`). One rank with all 131072 tokens: 1/0.692 s a token. Four ranks
    with 8192 each: the peak, 1/0.720. The bound before (best efficiency, 1/0.720) holds
    for both; the first is 4% above it."""
    p = hardware.profile(H800.gpu_type)
    assert p.linear.at(131072) == pytest.approx(0.692) and p.linear.at(8192) == pytest.approx(0.72)
    assert gemm_envelope.rank_token_seconds(H800, PEAK, 0.0, 131072, 1, True) == pytest.approx(1 / 0.692, rel=1e-12)
    assert gemm_envelope.rank_token_seconds(H800, PEAK, 0.0, 4 * 8192, 4, True) == pytest.approx(1 / 0.72, rel=1e-12)
    # a mixed cluster: the best efficiency up to the batch, as before
    assert gemm_envelope.rank_token_seconds(H800, PEAK, 0.0, 131072, 1, False) == pytest.approx(1 / 0.72, rel=1e-12)


def test_no_split_beats_it():
    """Two ranks holding 65536 tokens: every split of them (in steps of 64 tokens, 0 and
    65536 included) costs at least the bound on the mean, and one of them, 8192 at the
    peak beside 57344 at 0.692, costs (8192/0.72 + 57344/0.692)/65536 = 1.43807 s a token,
    the bound not above it: ranks at the peak leave the rest to the others. The equal
    split (1/0.692 = 1.44509) is not the least."""
    p = hardware.profile(H800.gpu_type)
    elt_bytes = 1e3  # elementwise work too: its curve is flat from 8192 on
    T = 65536.0

    def rank(n):  # what the simulator charges a rank holding n tokens (`seconds._per_call`)
        return np.where(n > 0, n / p.linear.at(n) + n * elt_bytes / (p.memory_bw * p.elementwise.at(n)), 0.0)
    n1 = np.arange(0, T + 1, 64.0)
    least = float(((rank(n1) + rank(T - n1)) / T).min())
    got = gemm_envelope.rank_token_seconds(H800, PEAK, elt_bytes, T, 2, True)
    assert got <= least * (1 + 1e-12)
    assert got >= least * 0.998  # the envelope of a 64-token grid is near it
    only = gemm_envelope.rank_token_seconds(H800, PEAK, 0.0, T, 2, True)
    assert 1 / 0.72 < only <= (8192 / 0.72 + 57344 / 0.692) / T < 1 / 0.692


@pytest.mark.parametrize("planner", ["zeppelin", "packed_dp", "te_cp", "wlb_llm"])
def test_simulated_steps_above_it(planner):
    """Plans of a batch on one H800 node, every rank at its own token count: none
    simulates under the batch's bound (the GEMMs are priced at each rank's count)."""
    c, m = specs.cluster("h800-8nic", num_nodes=1), specs.model("llama-3b")
    lengths = [30000, 12000, 9000, 8000, 6000, 5000, 4000, 3000, 2500, 2000, 1500, 1000, 800, 500, 300, 200] * 2
    res = simulate(plan_batch(lengths, c, m, planner), c, m)
    assert res.step_time_s >= res.lower_bound_s


def test_tp_reruns_by_hand():
    """LLaMA-13B at tp 2 on an H800 node: a token's hidden states are 5120 x 2 bytes, of
    which one GPU sends half in an all-gather or a reduce-scatter, over 200 GB/s at NCCL's
    0.78 and 0.685. Linear recomputation on 30 of the 40 layers reruns 2 all-gathers and a
    reduce-scatter there and selective's one all-gather on the other 10; selective on 10
    layers reruns 10 all-gathers; none, nothing (`tensor_parallel.TP_RERUN`)."""
    m, g = specs.model("llama-13b", tp=2), H800
    ag, rs = 5120 / 200e9 / 0.78, 5120 / 200e9 / 0.685
    assert bounds.tp_rerun_seconds_per_token(m, g, "linear", 30) == pytest.approx(30 * (2 * ag + rs) + 10 * ag, rel=1e-12)
    assert bounds.tp_rerun_seconds_per_token(m, g, "selective", 10) == pytest.approx(10 * ag, rel=1e-12)
    assert bounds.tp_rerun_seconds_per_token(m, g, "none", 0) == 0.0
    assert bounds.tp_rerun_seconds_per_token(specs.model("llama-7b"), g, "linear", 32) == 0.0  # no TP


def test_tp_plans_above_it():
    """A batch that LLaMA-13B at tp 2 on one H800 node holds only under linear
    recomputation on most layers: no plan simulates under the bound, which now counts the
    TP collectives the recomputation reruns."""
    m = specs.model("llama-13b", tp=2)
    c = tight(specs.cluster("h800-8nic", num_nodes=1), m)
    lengths = [24000, 18000, 12000, 7200, 4800, 4800, 3600, 2400, 1200, 643]  # 9.8K tokens a GPU
    mode, layers = bounds.batch_recomputation(lengths, c, m)
    assert mode == "linear" and layers > 10
    for planner in ("zeppelin", "packed_dp", "te_cp", "wlb_llm"):
        res = simulate(plan_batch(lengths, c, m, planner), c, m)
        assert res.step_time_s >= res.lower_bound_s, planner


def test_busiest_head_by_hand():
    """LLaMA-13B at tp 2, 65536 tokens on two data-parallel ranks of H800s: the step adds
    the busiest rank's head and loss after the layers, and that rank holds at least 32768
    tokens: its head GEMM at 0.692 (the best from 32768 on), the loss at 0.70, and its TP
    collectives at 200 GB/s plus 40 us each: the embedding's and head's all-gathers and
    reduce-scatters of 32768 x 5120 x 2 bytes (half of it sent), three all-reduces of
    32768 fp32 losses and 81 of a norm's 5120 x 2-byte gradient (twice half of it sent)."""
    from ballonet.cost.flops import (ELEMENTWISE_BACKWARD_FACTOR, LINEAR_BACKWARD_FACTOR, head_flops_per_token,
                                     loss_bytes_per_token)
    m, p = specs.model("llama-13b", tp=2), hardware.profile(H800.gpu_type)
    n = 32768
    compute = n * (head_flops_per_token(m) * (1 + LINEAR_BACKWARD_FACTOR) / 2 / (PEAK * 0.692)
                   + loss_bytes_per_token(m) * (1 + ELEMENTWISE_BACKWARD_FACTOR) / (p.memory_bw * 0.70))
    half = n * 5120 * 2 / 2 / 200e9
    tp = (2 * (40e-6 + half / 0.78) + 2 * (40e-6 + half / 0.685)
          + 3 * (40e-6 + n * 4 / 200e9 / 0.94) + 81 * (40e-6 + 5120 * 2 / 200e9 / 0.94))
    assert bounds.busiest_head_seconds(m, H800, 2 * n, 2, False) == pytest.approx(compute, rel=1e-9)
    assert bounds.busiest_head_seconds(m, H800, 2 * n, 2, True) == pytest.approx(compute + tp, rel=1e-9)


def test_distca_ping_pong_above_it():
    """Two A800s on two nodes, LLaMA-3B, 26K tokens of short documents (a random case
    that found it): DistCA's ping-pong sent half the FSDP collectives' bytes across nodes
    (its nano-batch scale applied to them) and simulated 1.6% under the bound, where
    `overlap_bound` charges every plan the slowdown of the full collectives."""
    from ballonet.specs import ClusterSpec
    c = ClusterSpec(name="two", groups=(NodeGroup(gpu="a800", num_nodes=2, gpus_per_node=1, nics_per_node=2,
                                                  nic_gbps=200.0),))
    m = specs.model("llama-3b")
    lengths = [2124, 2016, 1836, 1732, 1487, 1359, 1302, 1235, 1204, 1039, 923, 915, 871, 777, 755, 733, 494, 433,
               423, 364, 351, 338, 301, 286, 280, 228, 219, 217, 202, 168, 159, 158, 151, 145, 143] + [50] * 20
    for planner in ("distca", "zeppelin"):
        res = simulate(plan_batch(lengths, c, m, planner), c, m)
        assert res.step_time_s >= res.lower_bound_s, planner
        assert res.bytes_sent["forward"]  # the layer's bytes are recorded
