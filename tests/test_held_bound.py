"""The per-group bound with both layouts in each group's memory (`cost.layout_bound`)."""

from __future__ import annotations

import numpy as np
import pytest

from ballonet import specs
from ballonet.cost import bounds, gemm_envelope, hardware
from ballonet.cost.flops import (
    ELEMENTWISE_BACKWARD_FACTOR,
    LINEAR_BACKWARD_FACTOR,
    elementwise_bytes_per_token,
    head_flops_per_token,
    linear_flops_per_token,
    loss_bytes_per_token,
)
from ballonet.cost.layout_bound import gemm_cuts, layout_bound
from ballonet.cost.seconds import optimizer_time
from ballonet.specs import ClusterSpec, NodeGroup


def _at_tokens(m, gpu, T, linear, elementwise):
    """Seconds the layers' GEMMs and elementwise work and the LM head's and loss's, over
    `T` tokens on one GPU, take more at the efficiencies at T than at the best of any
    count up to T: `linear` and `elementwise` each (best, at T)."""
    flops = m.num_layers * linear_flops_per_token(m) * (1 + LINEAR_BACKWARD_FACTOR) \
        + head_flops_per_token(m) * (1 + LINEAR_BACKWARD_FACTOR)
    nbytes = m.num_layers * elementwise_bytes_per_token(m) * (1 + ELEMENTWISE_BACKWARD_FACTOR) \
        + loss_bytes_per_token(m) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    bw = hardware.profile(gpu).memory_bw
    return T * (flops / gpu.peak_flops * (1 / linear[1] - 1 / linear[0]) + nbytes / bw * (1 / elementwise[1] - 1 / elementwise[0]))


def test_a_group_without_room_runs_no_attention(monkeypatch):
    """An H100 beside one with no room for activations (1 GB: its weights alone do not
    fit): no plan puts a token of either layout there, so it can run no attention (a
    group running a share w of a document holds at least w/2 of its tokens) and the
    bound is the roomy H100 running the whole batch alone, its single-GPU bound (a few
    short documents: nothing recomputed), its LM head with its linear tokens. The bound
    that leaves the attention layout out lets the cramped GPU take attention for free and
    stays below it. The reference is the roomy H100's own pooled bound without its
    busiest-head term (the program has none), its GEMMs and elementwise work at their best
    efficiency of any count up to the batch's 4096 tokens: the efficiency at 4096 itself
    (both curves climb to 8192), which is what the program's GEMM cuts give one rank
    holding the whole batch (the envelope's right end, n c(n) itself)."""
    m = specs.model("llama-3b")
    roomy = NodeGroup(gpu="h100", gpus_per_node=1)
    both = ClusterSpec(name="roomy+none", groups=(roomy, NodeGroup(gpu="h100", gpus_per_node=1, memory_gb=1)))
    alone = ClusterSpec(name="roomy", groups=(roomy,))
    lengths = [2048, 1024, 512, 512]
    assert bounds.batch_recomputation(lengths, alone, m)[1] == 0  # the batch fits without recomputation
    # Beside a second data-parallel rank its optimizer shard is half the model's.
    h100 = roomy.gpu_type
    spread = gemm_envelope.rank_token_seconds
    with monkeypatch.context() as patch:
        patch.setattr(bounds, "rank_token_seconds", lambda g, f, b, t, n, _: spread(g, f, b, t, n, False))
        patch.setattr(bounds, "busiest_head_seconds", lambda *_: 0.0)
        single = bounds.bound_parts(lengths, alone, m, communication=False)[0]
    expected = single - optimizer_time(m, h100, 1) + optimizer_time(m, h100, 2)
    pooled, held = bounds.bound_parts(lengths, both, m, communication=False)
    assert held == pytest.approx(expected, rel=1e-5)
    assert held <= expected
    assert pooled < expected * 0.9  # pooled: the two GPUs' compute, the attention split


def test_full_recomputation_is_every_token_on_every_rank(monkeypatch):
    """The same two GPUs, a batch the roomy H100 holds only under full recomputation
    (1.4x what linear recomputation on every layer holds): the runtime recomputes fully
    on every layer of every rank or on none (`Plan.validate`, `Llama.set_recompute`), so
    no plan keeps some tokens' tensors for the backward and only reruns the others; the
    bound is the roomy H100 running the whole batch under full recomputation alone. A
    program that mixes full recomputation with the modes below it over a group's tokens
    stays 7% below it. The reference is the roomy H100's own pooled bound, priced as the
    program prices a group: its GEMMs and elementwise work (the layers', the LM head's and
    the loss's; not the recomputation's) at the efficiency at the one rank's 53,248 tokens
    (0.692 and 0.7: both curves flat past their last knots, 32768 and 8192), moved by hand
    from the best efficiency (0.72, 0.7), and no busiest-head term."""
    m = specs.model("llama-3b")
    roomy = NodeGroup(gpu="h100", gpus_per_node=1)
    both = ClusterSpec(name="roomy+none", groups=(roomy, NodeGroup(gpu="h100", gpus_per_node=1, memory_gb=1)))
    alone = ClusterSpec(name="roomy", groups=(roomy,))
    lengths = [4096] * 13
    assert bounds.batch_recomputation(lengths, alone, m)[0] == "full"
    h100, T = roomy.gpu_type, sum(lengths)
    spread = gemm_envelope.rank_token_seconds
    with monkeypatch.context() as patch:
        patch.setattr(bounds, "rank_token_seconds", lambda g, f, b, t, n, _: spread(g, f, b, t, n, False))
        patch.setattr(bounds, "busiest_head_seconds", lambda *_: 0.0)
        single = bounds.bound_parts(lengths, alone, m, communication=False)[0]
    expected = single - optimizer_time(m, h100, 1) + optimizer_time(m, h100, 2) \
        + _at_tokens(m, h100, T, (0.72, 0.692), (0.7, 0.7))
    held = bounds.bound_parts(lengths, both, m, communication=False)[1]
    assert held == pytest.approx(expected, rel=1e-5)
    assert held <= expected


def test_gemm_cuts_are_the_envelope_of_a_rank_s_seconds():
    """An H100's GEMM curve (0.72 at 8192 tokens, the peak; 0.692 from 32768 on, linear in
    log2 tokens between), GEMMs only, one FLOP/s of peak a token (a = 1 / peak): the first
    cut is the best cost a token through 0, 1 / 0.72; a rank holding all 65,536 tokens runs
    them at 0.692, where the cuts meet; every cut is below n / eff(n) at every count; and
    two ranks holding 32,768 tokens take at least twice one at 16,384 tokens on the
    envelope, above what the best efficiency alone gives (32,768 / 0.72)."""
    gpu = NodeGroup(gpu="h100", gpus_per_node=1).gpu_type
    p = hardware.profile(gpu)
    assert (p.linear.at(8192), p.linear.at(32768), p.linear.at(65536)) == (0.72, 0.692, 0.692)
    a, b = gemm_cuts(gpu, gpu.peak_flops, 0.0, 65536)
    assert (a[0], b[0]) == (0.0, pytest.approx(1 / 0.72))
    assert (a <= 1e-12).all()
    envelope = lambda n: float(np.max(a + b * n))  # noqa: E731
    assert envelope(65536) == pytest.approx(65536 / 0.692, rel=1e-12)
    n = np.unique(np.round(np.exp2(np.linspace(0, 16, 2001))))
    assert (a[None, :] + b[None, :] * n[:, None] <= n[:, None] / p.linear.at(n)[:, None] * (1 + 1e-12)).all()
    # Two ranks, 32,768 tokens: between the envelope's first segment and a rank at 16,384 (0.706).
    two = float(np.max(2 * a + b * 32768))
    assert 32768 / 0.72 * 1.001 < two <= 32768 / 0.706


def test_busiest_head_follows_the_layers():
    """`overlap_bound`'s program with the busiest rank's LM head (`busiest_head`): the
    roomy H100 beside the cramped one holds every linear token (4096), so the busiest
    head is its head and loss over all of them, at the curves' efficiency at 4096 tokens
    (GEMMs 0.7135, halfway in log2 between 2048's 0.707 and 8192's 0.72; elementwise
    0.65, two thirds from 1024's 0.55 to 8192's 0.7), added to the layers' optimum: by
    hand, 2 h V FLOPs a token forward (h 3200, V 32000), three passes' worth; the final
    norm, the logits cast to fp32 and log-softmax, 2 h 2 + V (2 + 4) + 2 V 4 bytes, three."""
    m = specs.model("llama-3b")
    both = ClusterSpec(name="roomy+none", groups=(NodeGroup(gpu="h100", gpus_per_node=1),
                                                  NodeGroup(gpu="h100", gpus_per_node=1, memory_gb=1)))
    h100 = both.groups[0].gpu_type
    L, gpus, fixed = np.array([2048.0, 1024, 512, 512]), np.ones(2), np.zeros(2)
    layers = layout_bound(L, both, m, gpus, fixed, False, nic=False, lm_head=False)
    with_head = layout_bound(L, both, m, gpus, fixed, False, nic=False, lm_head=False, busiest_head=True)
    head = 4096 * (3 * 2 * 3200 * 32000 / (h100.peak_flops * 0.7135)
                   + 3 * (2 * 3200 * 2 + 32000 * 6 + 2 * 32000 * 4) / (hardware.profile(h100).memory_bw * 0.65))
    assert with_head - layers == pytest.approx(head * (1 - 1e-6), rel=1e-6)


def test_gemm_cuts_meet_where_the_homogeneous_envelope_is():
    """The program's cuts and the one-group bound's envelope (`gemm_envelope.rank_token_seconds`)
    are the same envelope: at a group's mean token count the cuts meet at its value, on
    two GPU types, GEMMs and elementwise work together."""
    for gpu in ("h800", "l40s"):
        group = NodeGroup(gpu=gpu, gpus_per_node=8)
        a, b = gemm_cuts(group.gpu_type, 4e10, 3e6, 524288)
        for ranks in (16, 64, 160, 4096):
            mean = 524288 / ranks
            assert float(np.max(a + b * mean)) == pytest.approx(
                mean * gemm_envelope.rank_token_seconds(group, 4e10, 3e6, 524288, ranks, True), rel=1e-12)
