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


def batch_lower_bound(lengths, cluster: ClusterSpec, model: ModelSpec, communication: bool = True) -> float:
    """Seconds no plan of the batch can beat on `cluster`: every FLOP and elementwise byte
    of the step (attention forward and backward, GEMMs, LM head and loss, the
    recomputation the batch needs at least) at the best efficiency any split or packing
    could give it on each node group's GPU type, plus what each rank pays whatever the
    plan (the framework's per-layer work, its optimizer shard). Attention of a document
    of L tokens runs on chunks of at most L tokens, GEMMs and elementwise work on at most
    the batch's tokens. Two collectives no plan escapes are added (`communication`; off:
    the compute alone): every token's tensor-parallel all-gathers and reduce-scatters at
    their group's bandwidth, which the simulator runs on the compute stream, and the last
    layer's gradient bucket, which nothing is left to hide (`grad_allreduce_time` /
    layers). The work is split perfectly, each piece to any group at that group's own
    seconds for it (`_least_max`). The same for every planner."""
    L = np.asarray(lengths, dtype=float)
    T = float(L.sum())
    mode, layers = batch_recomputation(lengths, cluster, model)
    att = attention_flops(model, L)
    lin_flops = (model.num_layers * (linear_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
                                     + recompute_flops_per_token(model, mode, layers))
                 + head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR))
    elt_bytes = model.num_layers * (elementwise_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
                                    + recompute_elementwise_bytes_per_token(model, mode, layers))
    elt_bytes += loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    num_dp = cluster.num_ranks // model.tp
    costs, gpus, fixed, peaks = [], [], [], []
    for g in cluster.groups:
        t, p = g.gpu_type, hardware.profile(g.gpu_type)
        fwd, bwd = _best(p.attention_forward, L), _best(p.attention_backward, L)
        per_doc = model.num_layers * (att / fwd + ATTENTION_BACKWARD_FACTOR * att / bwd
                                      + (att / fwd if recompute_attention(mode) else 0)) / t.peak_flops
        per_token = (lin_flops / (t.peak_flops * float(_best(p.linear, T)))
                     + elt_bytes * model.tp / (p.memory_bw * float(_best(p.elementwise, T))))  # bytes per GPU: all of a TP group
        if communication:
            per_token += 2 * model.tp * tp_seconds_per_token(model, g)
        costs.append(np.append(per_doc, per_token))  # GPU-seconds per whole document, per token
        gpus.append(g.num_nodes * g.gpus_per_node)
        peaks.append(t.peak_flops)
        fixed.append(framework_time(model, t) + optimizer_time(model, t, num_dp))
    amounts = np.append(np.ones(len(L)), T)
    n = np.array(gpus, dtype=float)
    bound = _least_max(np.array(costs), amounts, n, np.array(fixed), n * np.array(peaks))
    if not communication:
        return bound
    return bound + grad_allreduce_time(model, cluster) / model.num_layers


def _least_max(costs: np.ndarray, amounts: np.ndarray, gpus: np.ndarray, fixed: np.ndarray,
               start: np.ndarray) -> float:
    """A lower bound on the least, over every split of `amounts` [K] of K kinds of work
    between G groups of `gpus` [G] GPUs (each kind split freely, a group's share spread
    evenly over its GPUs), of the most seconds any GPU takes: `costs` [G, K] GPU-seconds a
    unit of each kind takes on a group's GPU, `fixed` [G] seconds each GPU pays anyway.
    It is the split problem's Lagrangian dual: for any weights w on the groups (summing to
    1) no split beats sum_k amounts_k min_g(w_g costs_gk / gpus_g) + sum_g w_g fixed_g.
    The weights start at `start` (each group's peak FLOP/s: the bound of the whole
    cluster as one pool of peak FLOP/s, each kind at the best group's efficiency) and climb toward the dual's maximum by multiplicative steps
    toward the groups left busiest; every value on the way is a bound, the best is kept.
    One group: the work over its GPUs plus its fixed seconds, exactly."""
    if len(gpus) == 1:
        return float(costs[0] @ amounts / gpus[0] + fixed[0])
    share = costs / gpus[:, None]
    w = start / start.sum()
    best = -np.inf
    for step in range(200):
        weighted = w[:, None] * share
        pick = weighted.argmin(axis=0)
        value = float(weighted[pick, np.arange(len(amounts))] @ amounts + w @ fixed)
        best = max(best, value)
        busy = np.bincount(pick, weights=share[pick, np.arange(len(amounts))] * amounts, minlength=len(gpus)) + fixed
        w = w * np.exp(1.0 / np.sqrt(step + 1) * (busy / busy.max() - 1))
        w = w / w.sum()
    return best


def tp_seconds_per_token(model: ModelSpec, group: NodeGroup) -> float:
    """Seconds of tensor-parallel collectives per token on each GPU of a TP group, per
    pass of all layers (two all-gathers and two reduce-scatters of its hidden states a
    layer, sequence parallelism), latency aside: what `collective_time` charges a byte."""
    if model.tp <= 1:
        return 0.0
    p = hardware.profile(group.gpu_type)
    per_token = hidden_bytes(model, 1) * (model.tp - 1) / model.tp / group.intra_bw
    return model.num_layers * 2 * sum(per_token / p.collective_efficiency[op] for op in ("all_gather", "reduce_scatter"))
