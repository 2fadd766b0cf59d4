"""What the partitioner prices besides attention (docs/design.md, section 4).

Attention work alone does not make a step: every token also runs the linear layers, and
a batch that needs more recomputation pays a second forward. The partitioner therefore

* balances nodes on attention work plus each document's linear work
  (`linear_work_per_token`, in the units of `Batch.work`), so that the remap can stay
  inside each node: a node that holds long documents (much attention, few tokens) takes
  fewer tokens instead of shipping q, k, v and o of the difference across the network
  every layer (`remap.node_linear_targets`);
* plans for each recomputation the batch fits under, cheapest first (`recompute_modes`):
  memory caps per rank follow from the mode, so the partitioner balances within them;
  tighter caps can cost more balance than the recomputation they save, so the plans are
  compared by their busiest rank's compute (`rank_compute_seconds`), and a costlier mode
  is tried only while its average rank could still beat the best plan so far.
"""

from __future__ import annotations

import numpy as np

from ballonet import cost_model, hardware
from ballonet.plan import Plan
from ballonet.planning.devices import Devices
from ballonet.specs import ModelSpec

__all__ = ["linear_work_per_token", "rank_compute_seconds", "recompute_modes"]


def recompute_modes(model: ModelSpec) -> tuple[str, ...]:
    """The recomputation modes to plan for, cheapest first: the model's own when it sets one."""
    return (model.recompute,) if model.recompute else cost_model.RECOMPUTE_MODES


def linear_work_per_token(model: ModelSpec, gpu: hardware.GPUType, lengths, num_ranks: int) -> float:
    """One token's linear layers over a step (forward, backward and the recomputation of
    `model.recompute`), in forward-attention work units on `gpu` (peak FLOP/s times
    seconds, divided by the attention's own step factor), so that for a document of L
    tokens `work + L * this` is in proportion to its share of the step's compute. The
    factors are taken at the batch's mean tokens per rank and its token-weighted mean
    document length."""
    L = np.asarray(lengths, dtype=float)
    if not L.size:
        return 0.0
    mode = cost_model.recompute_mode(model)
    tokens = L.sum() / max(num_ranks, 1)
    linear = cost_model.linear_time(model, gpu, tokens) * gpu.peak_flops / tokens
    linear *= (1 + cost_model.LINEAR_BACKWARD_FACTOR
               + cost_model.recompute_flops_per_token(model, mode) / cost_model.linear_flops_per_token(model))
    typical = float((L * L).sum() / L.sum())
    flops = cost_model.attention_flops(model, typical)
    forward = cost_model.attention_time(model, gpu, flops, typical)
    attention = 1 + cost_model.attention_time(model, gpu, flops, typical, backward=True) / forward
    attention += 1 if cost_model.recompute_attention(mode) else 0
    return linear / attention


def rank_compute_seconds(plan: Plan, dev: Devices, model: ModelSpec, mode: str) -> np.ndarray:
    """[R] seconds of a step's attention and linear kernels on each rank of `plan` (all
    layers, forward, backward and the recomputation `mode` reruns; no launch floors, no
    communication): what the partitioner compares its candidate plans by."""
    R = plan.num_ranks
    rank, length, flops, block = [], [], [], []
    for r in range(R):
        for d in plan.local_docs(r):
            rank.append(r)
            length.append(plan.lengths[d])
    flops = list(cost_model.attention_flops(model, np.asarray(length, dtype=float)))
    block = list(length)
    for ring in plan.rings:
        for i, r in enumerate(ring.ranks):
            rank.append(r)
            flops.append(cost_model.zigzag_rank_flops(model, ring.bounds, i))
            block.append(ring.block_tokens(i))
    rank_a, flops_a, block_a = np.asarray(rank, dtype=np.int64), np.asarray(flops, dtype=float), np.asarray(block, dtype=float)
    redo = 1.0 if cost_model.recompute_attention(mode) else 0.0
    out = np.zeros(R)
    for gpu in set(dev.gpu):
        on = np.array([dev.gpu[r] is gpu for r in rank_a], dtype=bool) if len(set(dev.gpu)) > 1 else slice(None)
        fwd = cost_model.attention_seconds(model, gpu, flops_a[on], block_a[on])
        bwd = cost_model.attention_seconds(model, gpu, flops_a[on], block_a[on], backward=True)
        out += np.bincount(rank_a[on], weights=(1 + redo) * fwd + bwd, minlength=R)
    rerun = cost_model.recompute_flops_per_token(model, mode)
    for r, n in enumerate(plan.linear_token_counts):
        g = dev.gpu[r]
        out[r] += (1 + cost_model.LINEAR_BACKWARD_FACTOR) * cost_model.linear_time(model, g, n) + \
            cost_model.linear_time(model, g, n, rerun)
    return model.num_layers * out
