"""A bound on the batch: seconds no plan of it can beat on a cluster, the same for every
planner (`SimResult.lower_bound_s`)."""

from __future__ import annotations

import functools
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
from ballonet.cost.memory import (
    BELOW,
    RECOMPUTE_MODES,
    activation_bytes,
    activation_bytes_per_token,
    layer_mean,
    memory_cap,
    recompute_layer_count,
)
from ballonet.cost.recompute import (
    recompute_attention,
    recompute_elementwise_bytes_per_token,
    recompute_flops_per_token,
)
from ballonet.cost.seconds import (
    DP_BACKWARD_SHARE,
    DP_FORWARD_SHARE,
    DP_PIECES,
    dp_layer_parts,
    framework_time,
    grad_allreduce_time,
    optimizer_time,
    best_efficiency,
    collective_time,
    p2p_time,
)
from ballonet.cost.gemm_envelope import rank_token_seconds
from ballonet.cost.layout_bound import layout_bound
from ballonet.cost.tensor_parallel import TP_RERUN, tp_layer_seconds, tp_seconds_per_token, tp_step_collectives

if TYPE_CHECKING:
    from ballonet.specs import ClusterSpec, ModelSpec, NodeGroup


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
    seconds for it (`_least_max`). The same for every planner.

    Memory is kept twice, and the larger bound is taken (each is valid, so is the larger):
    pooled, all GPUs' activation memory as one, both layouts' bytes counted
    (`batch_recomputation`); and per group, each group's own memory holding both layouts
    of the tokens whose work it runs, a linear program (`layout_bound`). One group: the
    two are the same memory, and only the pooled one is taken (homogeneous clusters'
    bounds as before the program).

    With `communication`, a third bound adds the compute every rank loses to its layers'
    data-parallel collectives running beside it (`overlap_bound`). Kept for the last few
    batches where built-in profiles price every group (they never change): the simulator
    asks it once per plan, and a mixed cluster's is a few linear programs."""
    key = (tuple(np.asarray(lengths).tolist()), cluster, model, communication)
    if any(hardware.calibrated(g.gpu_type) for g in cluster.groups):
        return _batch_lower_bound.__wrapped__(*key)
    return _batch_lower_bound(*key)


@functools.lru_cache(maxsize=16)
def _batch_lower_bound(lengths: tuple, cluster: ClusterSpec, model: ModelSpec, communication: bool) -> float:
    pooled, held = bound_parts(lengths, cluster, model, communication)
    if communication:
        return max(pooled, held, overlap_bound(lengths, cluster, model))
    return max(pooled, held)


def bound_parts(lengths, cluster: ClusterSpec, model: ModelSpec, communication: bool = True) -> tuple[float, float]:
    """`batch_lower_bound`'s two bounds, (pooled memory, each group's own memory); the
    second is -inf on one group (not computed)."""
    L = np.asarray(lengths, dtype=float)
    T = float(L.sum())
    mode, layers = batch_recomputation(lengths, cluster, model)
    att = attention_flops(model, L)
    layer_flops = model.num_layers * linear_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
    layer_bytes = model.num_layers * elementwise_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    base_flops = layer_flops + head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
    base_bytes = layer_bytes + loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    rc_flops = model.num_layers * recompute_flops_per_token(model, mode, layers)
    rc_bytes = model.num_layers * recompute_elementwise_bytes_per_token(model, mode, layers)
    num_dp = cluster.num_ranks // model.tp
    costs, gpus, fixed, peaks = [], [], [], []
    for g in cluster.groups:
        t, p = g.gpu_type, hardware.profile(g.gpu_type)
        fwd, bwd = best_efficiency(p.attention_forward, L), best_efficiency(p.attention_backward, L)
        per_doc = model.num_layers * (att / fwd + ATTENTION_BACKWARD_FACTOR * att / bwd
                                      + (att / fwd if recompute_attention(mode) else 0)) / t.peak_flops
        per_token = (rc_flops / (t.peak_flops * float(best_efficiency(p.linear, T)))
                     + rc_bytes * model.tp / (p.memory_bw * float(best_efficiency(p.elementwise, T)))  # bytes per GPU: all of a TP group
                     + rank_token_seconds(g, base_flops, base_bytes * model.tp, T, num_dp, len(cluster.groups) == 1))
        if communication:
            per_token += model.tp * (2 * tp_seconds_per_token(model, g) + tp_rerun_seconds_per_token(model, g, mode, layers))
        costs.append(np.append(per_doc, per_token))  # GPU-seconds per whole document, per token
        gpus.append(g.num_nodes * g.gpus_per_node)
        peaks.append(t.peak_flops)
        fixed.append(framework_time(model, t) + optimizer_time(model, t, num_dp))
    amounts = np.append(np.ones(len(L)), T)
    n = np.array(gpus, dtype=float)
    pooled = _least_max(np.array(costs), amounts, n, np.array(fixed), n * np.array(peaks))
    if len(cluster.groups) == 1:  # the layers split perfectly, then the busiest rank's head (`busiest_head_seconds`)
        g = cluster.groups[0]
        layers_only = costs[0].copy()
        layers_only[-1] += (rank_token_seconds(g, layer_flops, layer_bytes * model.tp, T, num_dp, True)
                            - rank_token_seconds(g, base_flops, base_bytes * model.tp, T, num_dp, True))
        pooled = max(pooled, _least_max(layers_only[None, :], amounts, n, np.array(fixed), n)
                     + busiest_head_seconds(model, g, T, num_dp, communication))
    held = -np.inf
    if len(cluster.groups) > 1:
        held = layout_bound(L, cluster, model, n, np.array(fixed), communication)
    if communication:
        bucket = grad_allreduce_time(model, cluster) / model.num_layers
        pooled, held = pooled + bucket, held + bucket
    return pooled, held


FORWARD_SHARE_MIN = 1 / 4.5
"""The least share of a rank's layer compute that its forward takes: a backward runs at
most 2.5x attention's forward plus its rerun under full recomputation, twice the GEMMs'
and elementwise work plus their rerun, and the framework's per-layer work is split evenly
between the passes (`linear_layer_seconds`)."""
BACKWARD_SHARE_MIN = 1 / 3
"""The least share of a rank's layer compute (forward plus the layers' mean backward)
that the backward of any run of its layers takes: a backward is never shorter than the
forward (f), and runs of layers under other recomputation differ by at most one rerun of
the forward, so each is at least the mean backward less f; max(f, 1 - 2f) >= 1/3."""


def overlap_bound(lengths, cluster: ClusterSpec, model: ModelSpec) -> float:
    """`batch_lower_bound` with the compute every rank loses to its layers' data-parallel
    collectives: each rank sends its FSDP shard's collectives beside every layer's forward
    and backward, the same bytes under every plan (`cost.seconds.dp_layer_parts`), and the
    simulator slows a rank's compute in a pass by its GPU's `overlap_slowdown` times the
    seconds of what the rank sends in it, at most that pass's compute.

    Why no plan beats it: take the rank whose layers keep its compute stream longest (its
    kernels and tensor-parallel collectives, every layer). No split of the layers' work
    beats V, that work split perfectly (`_least_max`, as in `bound_parts`, without the LM
    head and the optimizer). Its kernels take at least V less L times the most a layer's TP
    collectives can take on a rank (a rank holds at most the linear tokens its cap holds
    under the recomputation of fewest bytes a token), its forward at least
    `FORWARD_SHARE_MIN` of that and each backward at least `BACKWARD_SHARE_MIN`: so it
    loses at least the slowdown of the smaller of each pass's DP send seconds and its
    floor, L times. The step then adds the busiest rank's LM head and loss (no less than their work
    split perfectly), the slowest optimizer step and the last layer's gradient bucket; and
    where the gradient all-reduce is not overlapped (`simulate(overlap_grad_allreduce=
    False)`: nothing beside the layers) the whole all-reduce instead, so the smaller of the
    two is added and the bound holds under either setting. -inf where memory holds no plan
    of the batch."""
    L = np.asarray(lengths, dtype=float)
    T = float(L.sum())
    mode, layers = batch_recomputation(lengths, cluster, model)
    att = attention_flops(model, L)
    num_dp = cluster.num_ranks // model.tp
    layer_flops = model.num_layers * linear_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
    layer_bytes = model.num_layers * elementwise_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    rc_flops = model.num_layers * recompute_flops_per_token(model, mode, layers)
    rc_bytes = model.num_layers * recompute_elementwise_bytes_per_token(model, mode, layers)
    one = len(cluster.groups) == 1
    least_bytes = min(float(activation_bytes(model, 1, 0, m)) for m in RECOMPUTE_MODES)
    stream, head, gpus, framework, peaks, optimizer, tp_most = [], [], [], [], [], [], 0.0
    for g in cluster.groups:
        t, p = g.gpu_type, hardware.profile(g.gpu_type)
        lin_eff, elt_eff = t.peak_flops * float(best_efficiency(p.linear, T)), p.memory_bw * float(best_efficiency(p.elementwise, T))
        fwd, bwd = best_efficiency(p.attention_forward, L), best_efficiency(p.attention_backward, L)
        per_doc = model.num_layers * (att / fwd + ATTENTION_BACKWARD_FACTOR * att / bwd
                                      + (att / fwd if recompute_attention(mode) else 0)) / t.peak_flops
        per_token = (rc_flops / lin_eff + rc_bytes * model.tp / elt_eff
                     + model.tp * (2 * tp_seconds_per_token(model, g) + tp_rerun_seconds_per_token(model, g, mode, layers))
                     + rank_token_seconds(g, layer_flops, layer_bytes * model.tp, T, num_dp, one))
        stream.append(np.append(per_doc, per_token))
        head.append([rank_token_seconds(g, head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR),
                                        loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR) * model.tp,
                                        T, num_dp, one)])
        gpus.append(g.num_nodes * g.gpus_per_node)
        framework.append(framework_time(model, t))
        peaks.append(t.peak_flops)
        optimizer.append(optimizer_time(model, t, num_dp))
        most_tokens = int(max(0.0, memory_cap(model, t, num_dp)) / least_bytes)
        tp_most = max(tp_most, max(sum(tp_layer_seconds(model, most_tokens, g.intra_bw, t, m))
                                   for m in RECOMPUTE_MODES))
    n, start = np.array(gpus, dtype=float), np.array(gpus, dtype=float) * np.array(peaks)
    layers_s = _least_max(np.array(stream), np.append(np.ones(len(L)), T), n, np.array(framework), start)
    head_s = _least_max(np.array(head), np.array([T]), n, np.zeros(len(n)), start)
    if len(cluster.groups) == 1:
        head_s = max(head_s, busiest_head_seconds(model, cluster.groups[0], T, num_dp, True))
    both = layers_s + head_s
    if len(cluster.groups) > 1:  # each group's own memory, both layouts (`layout_bound`, its compute alone)
        layers_s = max(layers_s, layout_bound(L, cluster, model, n, np.array(framework), True, nic=False,
                                               lm_head=False))
        both = max(layers_s + head_s, layout_bound(L, cluster, model, n, np.array(framework), True, nic=False,
                                                   lm_head=False, busiest_head=True))
    kernels = max(0.0, layers_s / model.num_layers - tp_most)
    floors = (FORWARD_SHARE_MIN * kernels, BACKWARD_SHARE_MIN * kernels)
    lost = min(_dp_slowdown(model, cluster, g, floors) for g in cluster.groups)
    grad = grad_allreduce_time(model, cluster)
    return both + min(optimizer) + min(grad / model.num_layers + model.num_layers * lost, grad)


def tp_rerun_seconds_per_token(model: ModelSpec, group: NodeGroup, mode: str, layers: float) -> float:
    """Seconds of tensor-parallel collectives a token's recomputation reruns on each GPU of
    its TP group, all layers, latency aside, under the batch's least recomputation
    (`batch_recomputation`'s `mode` on `layers`, the others one mode below): the
    backward's rerun all-gathers and reduce-scatters (`tensor_parallel.TP_RERUN`), which
    the simulator runs on the compute stream like the others (`tp_layer_seconds`, a rank's
    own mode and layers).

    Why no plan reruns less: where the model fixes its recomputation, or the batch needs
    full recomputation (every rank, every layer), every plan reruns exactly these. Else
    a plan frees its bytes by some mix of token-layers under selective and linear
    recomputation (pooled, as in `batch_recomputation`); when the reruns' seconds per byte
    freed climb with the modes (selective's per byte at most linear's extra over it per
    extra byte), the mix that climbs the modes in order is the least in reruns as in FLOPs,
    so the reruns of the bound's mix are the least. Full recomputation reruns what linear
    does on every layer, more than any mix. Where they do not climb, 0 (no rerun counted)."""
    if model.tp <= 1:
        return 0.0
    p = hardware.profile(group.gpu_type)
    per_byte = hidden_bytes(model, 1) * (model.tp - 1) / model.tp / group.intra_bw
    ag, rs = (per_byte / p.collective_efficiency[op] for op in ("all_gather", "reduce_scatter"))
    cost = {m: a * ag + r * rs for m, (a, r) in TP_RERUN.items()}
    if not model.recompute and mode != "full":
        freed = {m: float(activation_bytes(model, 1, 1, "none") - activation_bytes(model, 1, 1, m))
                 for m in ("selective", "linear")}
        if cost["selective"] * (freed["linear"] - freed["selective"]) > (cost["linear"] - cost["selective"]) * freed["selective"]:
            return 0.0
    return model.num_layers * float(layer_mean(model, cost, mode, layers))


def busiest_head_seconds(model: ModelSpec, group: NodeGroup, tokens: float, num_dp: int, communication: bool) -> float:
    """Seconds a step spends on its LM head and loss at least, on one node group of
    `num_dp` data-parallel ranks holding `tokens`: the simulator adds, after every rank's
    layers, the most any rank's head, loss and their tensor-parallel collectives take
    (`simulate`: `head_seconds` and `tensor_parallel.tp_step_collectives`, the norms'
    gradient all-reduces included; with `communication`). The rank holding the most linear
    tokens holds at least ceil(tokens / num_dp) = m: its head and loss take at least m
    tokens' work at the best efficiency of any count from m on, its collectives at least
    theirs at m (their bytes grow with the tokens)."""
    t, p = group.gpu_type, hardware.profile(group.gpu_type)
    m = int(np.ceil(tokens / num_dp))
    best = [max(float(c.at(m)), max((e for k, e in zip(c.tokens, c.efficiency) if k >= m), default=0.0))
            for c in (p.linear, p.elementwise)]
    out = m * (head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR) / model.tp / (t.peak_flops * best[0])
               + loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR) / (p.memory_bw * best[1]))
    if communication:
        out += sum(collective_time(op, nbytes, model.tp, group.intra_bw, t) for _, op, nbytes in tp_step_collectives(model, m))
    return out


def _dp_slowdown(model: ModelSpec, cluster: ClusterSpec, group: NodeGroup, floors: tuple[float, float]) -> float:
    """Seconds a layer's compute on a rank of `group` loses to the layer's data-parallel
    collectives, its forward's and its backward's at least `floors` seconds of compute:
    the rank's sends as the simulator runs them (`LayerGraph.data_parallel`: the intra-node
    part in `DP_PIECES` pieces, then the part across nodes in as many over the rank's NIC
    share), each pass's at most its compute."""
    intra_s, nic_bytes = dp_layer_parts(model, cluster)
    bw = group.nic_bw * max(1, model.tp // group.gpus_per_nic) / model.tp
    lost = 0.0
    for share, floor in zip((DP_FORWARD_SHARE, DP_BACKWARD_SHARE), floors):
        sends = share * intra_s
        if nic_bytes > 0 and cluster.num_nodes > 1:
            sends += DP_PIECES * p2p_time(share * nic_bytes / DP_PIECES, bw, True, group.gpu_type)
        lost += min(sends, floor)
    return hardware.profile(group.gpu_type).overlap_slowdown * lost


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
    return _dual_ascent(lambda w: _cheapest_split(w, share, amounts, fixed), start)


def _cheapest_split(w: np.ndarray, share: np.ndarray, amounts: np.ndarray, fixed: np.ndarray) \
        -> tuple[float, np.ndarray]:
    """The split dual's value at weights `w` [G] (each kind of work to the group of least
    weighted seconds, `share` [G, K] seconds a unit takes on one of its GPUs) and each
    group's busy seconds [G] under that split, `fixed` included."""
    weighted = w[:, None] * share
    pick = weighted.argmin(axis=0)
    kinds = np.arange(len(amounts))
    value = float(weighted[pick, kinds] @ amounts + w @ fixed)
    busy = np.bincount(pick, weights=share[pick, kinds] * amounts, minlength=len(w)) + fixed
    return value, busy


def _dual_ascent(evaluate, start: np.ndarray, steps: int = 200) -> float:
    """The best of `evaluate(w)`'s values, each a bound, over weights w on the groups
    (summing to 1): from `start`, multiplicative steps toward the groups that `evaluate`
    leaves busiest (its second result, seconds per group)."""
    w = start / start.sum()
    best = -np.inf
    for step in range(steps):
        value, busy = evaluate(w)
        best = max(best, value)
        w = w * np.exp(1.0 / np.sqrt(step + 1) * (busy / busy.max() - 1))
        w = w / w.sum()
    return best
