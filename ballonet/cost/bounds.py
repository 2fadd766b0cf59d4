"""A bound on the batch: seconds no plan of it can beat on a cluster, the same for every
planner (`SimResult.lower_bound_s`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import (
    ATTENTION_BACKWARD_FACTOR,
    ELEMENTWISE_BACKWARD_FACTOR,
    LINEAR_BACKWARD_FACTOR,
    attention_flops,
    elementwise_bytes_per_token,
    head_flops_per_token,
    hidden_bytes,
    linear_flops_per_token,
    loss_bytes_per_token,
)
from ballonet.cost.memory import BELOW, RECOMPUTE_MODES, activation_bytes_per_token, memory_cap, recompute_layer_count
from ballonet.cost.recompute import (
    recompute_attention,
    recompute_elementwise_bytes_per_token,
    recompute_flops_per_token,
)
from ballonet.cost.seconds import framework_time, grad_allreduce_time, optimizer_time

if TYPE_CHECKING:
    from ballonet.specs import ClusterSpec, ModelSpec, NodeGroup


def _best(curve, upto) -> np.ndarray:
    """The best efficiency of `curve` at any token count up to each of `upto`."""
    x = np.asarray(upto, dtype=float)
    knots = np.asarray(curve.tokens)
    eff = np.asarray(curve.efficiency)
    best_knot = np.array([eff[knots <= v].max(initial=0.0) for v in np.ravel(x)]).reshape(x.shape)
    return np.maximum(best_knot, curve.at(x))


def batch_recomputation(lengths, cluster: ClusterSpec, model: ModelSpec) -> tuple[str, float]:
    """(the cheapest recomputation under which the cluster could hold the batch at all
    (total token capacity), the layers that must recompute under it for that capacity to
    hold the batch, or the model's `recompute_layers`): no plan of the batch recomputes
    less. Selective or linear layers left to the plan are a mean over the batch's tokens,
    not a whole number: ranks recompute on as few layers as their own tokens need
    (`recompute.cheapest_per_rank`), so
    the least any plan recomputes is the total shortfall over what a layer's
    recomputation frees (each mode frees its bytes at a higher cost per byte than the one
    below it, so the cheapest plan climbs the modes in order)."""
    gpus = [cluster.gpu_of(r) for r in range(0, cluster.num_ranks, model.tp)]
    num_dp = cluster.num_ranks // model.tp
    capacity = sum(max(0.0, memory_cap(model, g, num_dp)) for g in gpus)
    tokens = float(sum(lengths))
    modes = (model.recompute,) if model.recompute else RECOMPUTE_MODES
    fixed = model.recompute_layers if model.recompute else None
    for mode in modes:
        if capacity / activation_bytes_per_token(model, mode, fixed) >= tokens:
            break
    if mode not in BELOW or model.recompute:
        return mode, recompute_layer_count(model, mode, fixed)
    keep, drop = activation_bytes_per_token(model, BELOW[mode]), activation_bytes_per_token(model, mode)
    return mode, model.num_layers * min(1.0, (tokens * keep - capacity) / (tokens * (keep - drop)))


def _best_elementwise_units(profiles_by_type, upto: float) -> float:
    """Peak-FLOP units per byte of elementwise work on the GPU type that does it cheapest
    relative to its peak: peak / (bandwidth * best efficiency at up to `upto` tokens)."""
    return min(g.peak_flops / (p.memory_bw * float(_best(p.elementwise, upto)))
               for g, p in profiles_by_type)


def batch_lower_bound(lengths, cluster: ClusterSpec, model: ModelSpec, communication: bool = True) -> float:
    """Seconds no plan of the batch can beat on `cluster`: every FLOP and elementwise byte
    of the step (attention forward and backward, GEMMs, LM head and loss, the
    recomputation the batch needs at least) at the best efficiency any split or packing
    could give it, on all GPUs busy together, plus what each rank pays whatever the plan
    (the framework's per-layer work, its optimizer shard). Attention of a document of L
    tokens runs on chunks of at most L tokens, GEMMs and elementwise work on at most the
    batch's tokens; the GPU type best at each kind of work (relative to its peak) sets its
    cost, and the work is spread over the sum of the GPUs' peaks. Two collectives no plan
    escapes are added (`communication`; off: the compute alone): every token's
    tensor-parallel all-gathers and reduce-scatters at their bandwidth on the cheapest
    group, which the simulator runs on the compute stream, and the last layer's gradient
    bucket, which nothing is left to hide (`grad_allreduce_time` / layers). The same for
    every planner."""
    L = np.asarray(lengths, dtype=float)
    T = float(L.sum())
    types = {g.gpu_type.name: g.gpu_type for g in cluster.groups}
    by_type = [(t, hardware.profile(t)) for t in types.values()]
    profiles = [p for _, p in by_type]
    fwd = np.max([_best(p.attention_forward, L) for p in profiles], axis=0)
    bwd = np.max([_best(p.attention_backward, L) for p in profiles], axis=0)
    lin = max(float(_best(p.linear, T)) for p in profiles)
    mode, layers = batch_recomputation(lengths, cluster, model)
    att = attention_flops(model, L)
    att_work = np.sum(att / fwd + ATTENTION_BACKWARD_FACTOR * att / bwd + (att / fwd if recompute_attention(mode) else 0))
    lin_flops = (linear_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
                 + recompute_flops_per_token(model, mode, layers))
    elt_bytes = model.num_layers * (elementwise_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
                                    + recompute_elementwise_bytes_per_token(model, mode, layers))
    elt_bytes += loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    work = model.num_layers * (att_work + lin_flops * T / lin) + head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR) * T / lin
    work += elt_bytes * model.tp * T * _best_elementwise_units(by_type, T)  # bytes per GPU: all of a TP group
    gpus = [cluster.gpu_of(r) for r in range(cluster.num_ranks)]
    num_dp = cluster.num_ranks // model.tp
    work += sum(g.peak_flops * (framework_time(model, g) + optimizer_time(model, g, num_dp)) for g in gpus)
    peak = sum(g.peak_flops for g in gpus)
    if not communication:
        return float(work / peak)
    work += _best_tp_units(cluster, model) * T
    return float(work / peak) + grad_allreduce_time(model, cluster) / model.num_layers


def tp_seconds_per_token(model: ModelSpec, group: NodeGroup) -> float:
    """Seconds of tensor-parallel collectives per token on each GPU of a TP group, per
    pass of all layers (two all-gathers and two reduce-scatters of its hidden states a
    layer, sequence parallelism), latency aside: what `collective_time` charges a byte."""
    if model.tp <= 1:
        return 0.0
    p = hardware.profile(group.gpu_type)
    per_token = hidden_bytes(model, 1) * (model.tp - 1) / model.tp / group.intra_bw
    return model.num_layers * 2 * sum(per_token / p.collective_efficiency[op] for op in ("all_gather", "reduce_scatter"))


def _best_tp_units(cluster: ClusterSpec, model: ModelSpec) -> float:
    """Peak-FLOP-seconds of tensor-parallel collectives a token costs at least, forward and
    backward, on the group where they cost least: every token crosses its TP group's
    collectives whatever the plan, and they run on the compute stream (the simulator's
    "tp" tasks), so all of a TP group's GPUs wait for them."""
    return min(2 * model.tp * g.gpu_type.peak_flops * tp_seconds_per_token(model, g) for g in cluster.groups)
