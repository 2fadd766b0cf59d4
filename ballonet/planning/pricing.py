"""What the partitioner prices besides attention (docs/design.md, section 4).

Attention work alone does not make a step: every token also runs the linear layers, and
a batch that needs more recomputation pays a second forward. The partitioner therefore

* balances nodes on attention work plus each document's linear work
  (`linear_work_per_token`, in the units of `Batch.work`), so that the remap can stay
  inside each node: a node that holds long documents (much attention, few tokens) takes
  fewer tokens instead of shipping q, k, v and o of the difference across the network
  every layer (`remap.node_linear_targets`);
* plans for the cheapest recomputation under which the batch fits (`recompute_modes`):
  memory caps per rank follow from the mode, so the partitioner balances within them.
"""

from __future__ import annotations

import numpy as np

from ballonet import cost_model, hardware
from ballonet.specs import ModelSpec

__all__ = ["linear_work_per_token", "recompute_modes"]


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
