"""The per-group bound with both layouts in each group's memory (`cost.layout_bound`)."""

from __future__ import annotations

import pytest

from ballonet import specs
from ballonet.cost import bounds, hardware
from ballonet.cost.flops import (
    ELEMENTWISE_BACKWARD_FACTOR,
    LINEAR_BACKWARD_FACTOR,
    head_flops_per_token,
    loss_bytes_per_token,
)
from ballonet.cost.seconds import best_efficiency, optimizer_time
from ballonet.specs import ClusterSpec, NodeGroup


def test_a_group_without_room_runs_no_attention(monkeypatch):
    """An H100 beside one with no room for activations (1 GB: its weights alone do not
    fit): no plan puts a token of either layout there, so it can run no attention (a
    group running a share w of a document holds at least w/2 of its tokens) and the
    bound is the roomy H100 running the whole batch alone, its single-GPU bound (a few
    short documents: nothing recomputed). The bound that leaves the attention layout out
    lets the cramped GPU take attention for free and stays below it."""
    m = specs.model("llama-3b")
    roomy = NodeGroup(gpu="h100", gpus_per_node=1)
    both = ClusterSpec(name="roomy+none", groups=(roomy, NodeGroup(gpu="h100", gpus_per_node=1, memory_gb=1)))
    alone = ClusterSpec(name="roomy", groups=(roomy,))
    lengths = [2048, 1024, 512, 512]
    assert bounds.batch_recomputation(lengths, alone, m)[1] == 0  # the batch fits without recomputation
    # Beside a second data-parallel rank its optimizer shard is half the model's, and the
    # bound lets the LM head and loss run anywhere: on the cramped GPU, which has nothing else.
    h100, p, T = roomy.gpu_type, hardware.profile(roomy.gpu_type), sum(lengths)
    head = T * (head_flops_per_token(m) * (1 + LINEAR_BACKWARD_FACTOR) / (h100.peak_flops * p.linear.at(T))
                + loss_bytes_per_token(m) * (1 + ELEMENTWISE_BACKWARD_FACTOR) / (p.memory_bw * p.elementwise.at(T)))
    spread = bounds.rank_token_seconds
    with monkeypatch.context() as patch:
        patch.setattr(bounds, "rank_token_seconds", lambda g, f, b, t, n, _: spread(g, f, b, t, n, False))
        patch.setattr(bounds, "busiest_head_seconds", lambda *_: 0.0)
        single = bounds.bound_parts(lengths, alone, m, communication=False)[0]
    expected = single \
        - optimizer_time(m, h100, 1) + optimizer_time(m, h100, 2) - head
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
    program prices a group: GEMMs at their best efficiency of any token count and no
    busiest-head term (a single group's bound has both, `bounds.rank_token_seconds`)."""
    m = specs.model("llama-3b")
    roomy = NodeGroup(gpu="h100", gpus_per_node=1)
    both = ClusterSpec(name="roomy+none", groups=(roomy, NodeGroup(gpu="h100", gpus_per_node=1, memory_gb=1)))
    alone = ClusterSpec(name="roomy", groups=(roomy,))
    lengths = [4096] * 13
    assert bounds.batch_recomputation(lengths, alone, m)[0] == "full"
    h100, p, T = roomy.gpu_type, hardware.profile(roomy.gpu_type), sum(lengths)
    head = T * (head_flops_per_token(m) * (1 + LINEAR_BACKWARD_FACTOR) / (h100.peak_flops * best_efficiency(p.linear, T))
                + loss_bytes_per_token(m) * (1 + ELEMENTWISE_BACKWARD_FACTOR) / (p.memory_bw * best_efficiency(p.elementwise, T)))
    spread = bounds.rank_token_seconds
    with monkeypatch.context() as patch:
        patch.setattr(bounds, "rank_token_seconds", lambda g, f, b, t, n, _: spread(g, f, b, t, n, False))
        patch.setattr(bounds, "busiest_head_seconds", lambda *_: 0.0)
        single = bounds.bound_parts(lengths, alone, m, communication=False)[0]
    expected = single \
        - optimizer_time(m, h100, 1) + optimizer_time(m, h100, 2) - head
    held = bounds.bound_parts(lengths, both, m, communication=False)[1]
    assert held == pytest.approx(expected, rel=1e-5)
    assert held <= expected
