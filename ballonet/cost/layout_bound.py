"""The per-group memory bound of a mixed cluster (`bounds.batch_lower_bound`'s second
part, and the layers' work of `bounds.overlap_bound` there): a linear program over where
each group holds both layouts of the tokens whose work it runs."""

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
    remap_bytes,
)
from ballonet.cost.gemm_envelope import segment_ends
from ballonet.cost.memory import RECOMPUTE_MODES, activation_bytes, layer_mean, memory_cap, recompute_layer_count
from ballonet.cost.recompute import recompute_elementwise_bytes_per_token, recompute_flops_per_token
from ballonet.cost.seconds import best_efficiency
from ballonet.cost.tensor_parallel import TP_RERUN, tp_seconds_per_token

if TYPE_CHECKING:
    from ballonet.specs import ClusterSpec, ModelSpec, NodeGroup

__all__ = ["TANGENTS", "gemm_cuts", "layout_bound"]


TANGENTS = (0.0, 0.5, 0.75, 0.9, 0.97, 0.995)
"""Attention shares w at which `layout_bound` cuts 1 - sqrt(1 - w) by its tangent."""


def gemm_cuts(gpu: hardware.GPUType, flops: float, nbytes: float, tokens: float) -> tuple[np.ndarray, np.ndarray]:
    """(intercepts, slopes) of lines a + b n, each at most the GPU-seconds a data-parallel
    rank of GPU type `gpu` takes for `flops` (GEMMs) and `nbytes` (elementwise, every GPU
    of its tensor-parallel group) per token over its n linear tokens, for every n from 0 to
    `tokens` (the batch's): the lower convex envelope of n c(n) that
    `gemm_envelope.rank_token_seconds` evaluates, as the lines through its segments.

    Why each line is below: every point of `gemm_envelope.segment_ends`' segments is at
    most n c(n), so the lower convex hull of their ends and (0, 0) is, and so is each of
    its edges' lines (its intercepts are at most 0: the first edge is
    the best cost a token through 0). A group of N such ranks holding t tokens takes at
    least N a + b t GPU-seconds by each line (sum over its ranks; a rank holding none
    takes 0 >= a), the Jensen bound N E(t / N) where the lines meet."""
    xs, ys = segment_ends(gpu, flops, nbytes, tokens)
    hull: list[tuple[float, float]] = []  # the lower hull, left to right (Andrew's monotone chain)
    for x, y in sorted(zip(xs.tolist(), ys.tolist())):
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (y - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])) <= 0:
            hull.pop()
        if hull and hull[-1][0] == x:
            continue  # the lower of two points at one x came first
        hull.append((x, y))
    h = np.array(hull)
    slopes = np.diff(h[:, 1]) / np.diff(h[:, 0])
    return h[:-1, 1] - slopes * h[:-1, 0], slopes


def layout_bound(L: np.ndarray, cluster: ClusterSpec, model: ModelSpec, gpus: np.ndarray, fixed: np.ndarray,
                  communication: bool, nic: bool = True, lm_head: bool = True, busiest_head: bool = False) -> float:
    """`batch_lower_bound`'s compute with each group's own memory holding both layouts,
    a linear program (`scipy.optimize.linprog`, HiGHS): the least S such that, per group,
    its GPUs' mean busy seconds (`fixed` plus the attention, GEMM, elementwise, TP and
    LM-head work of the tokens it holds, over its GPUs) is at most S, and so are the seconds its NIC
    links need for the remap across groups.

    Kept (what every plan the simulator runs obeys): a rank holds its linear-layout
    tokens and the tokens whose queries it attends (the attention layout: q, k, v and o
    kept for the backward where the attention kernels run) within its cap,
    `activation_bytes(model, lin, att, mode, layers)` <= `memory_cap`, linear in the two
    counts for a mode and in its layers (layers split between a mode and the one below
    are a convex mix); a token's GEMMs, elementwise work and recomputation run where its
    linear layout sits, the recomputation at no better than that group's best efficiency,
    priced per mode as `recompute.py` prices it; a rank runs its layers' GEMMs and
    elementwise work and its LM head and loss (with `lm_head`) as one call each over its n
    linear tokens, at the curves' efficiency at n, so a group of N data-parallel ranks
    holding t of them takes at least N a + b t GPU-seconds for every line a + b n of
    `gemm_cuts` (by Jensen's inequality: N times the convex envelope of a rank's seconds at
    the mean n, each line below it; the best efficiency alone, the cut before, is its
    first line), and its TP collectives and the ones its recomputation reruns
    (`tensor_parallel.TP_RERUN`, per mode: the program mixes the modes) on its compute
    stream, latency aside; a group that runs a share w of a causal document's
    attention holds at least 1 - sqrt(1 - w) of its tokens (the most work a share f of
    the queries has is that of the last f, 2f - f^2 of it, less with the diagonal); full
    recomputation reruns every rank's attention (the simulator's layer graph reruns every
    attention kernel once any rank recomputes fully), and a plan recomputes fully on
    every layer of every rank or on none (`Plan.validate` refuses full recomputation on
    some ranks only; the runtime's full recomputation has no layer count,
    `Llama.set_recompute`), so the program is solved twice, without full recomputation,
    and with every token of both layouts under it and every document's attention rerun,
    and the smaller optimum is taken; a token whose layouts sit on two groups (two nodes) is
    remapped each layer, q, k, v one way and o the other in each pass (`remap_bytes`),
    over both ends' NICs: each transfer holds the rank's NIC links at least its bytes over
    the NIC bandwidth (`Fabric.path`, at the best `nic_efficiency` of the cluster's
    types), shared links serve one transfer's worth at a time, so a group's NIC links
    are busy at least that within the step. That is all the remap is charged: the
    simulator runs it on the NICs, not on a compute stream (a rank's linear layers wait
    for its data, but charging the wait would need each rank's own order of kernels and
    transfers, which a group's pooled seconds do not keep). Without `nic` (or
    `communication`) the NICs are left out and the optimum bounds the busiest rank's
    compute (`overlap_bound`); without `lm_head` so are the LM head and loss. With
    `busiest_head` they are counted as the simulator adds them, after every rank's layers,
    the busiest rank's, on every group's S instead of in its work: the rank of a
    group holding the most linear tokens holds at least the group's mean t / N, and its
    head and loss take at least the convex envelope of a rank's seconds for them at that
    count (`gemm_cuts`, over its tp GPUs: the envelope is through 0, convex and at least
    0, so it climbs with the count); so the optimum bounds the busiest rank's layers plus
    the busiest rank's head (both over any group).

    Relaxed (each makes the bound lower): a group pools its GPUs' memory and compute
    (the mean is at most the busiest), modes and layers mix freely and apart for the two
    layouts, 1 - sqrt(1 - w) is cut by its tangents (`TANGENTS`), the crossing tokens
    are at least the difference of a group's two layouts' counts, a group's token count
    t a real number (the Jensen cuts at t / N, not whole tokens on whole ranks), the
    busiest rank's LM head not counted after the layers, a document's attention at its best efficiency at its length, latencies and
    the data-parallel collectives' NIC bytes left out; the optimum is lowered by 1e-6 of
    itself for the solver's tolerances. It keeps every constraint of the bound it
    replaced (each group's linear layout within its memory, attention anywhere, solved
    by dual ascent), so it is not lower than that one (2.5-10% higher on the mixed
    presets' batches and small-memory groups). Assumed, as there: no rank holds more
    than its cap under full recomputation (the simulator would run such a plan;
    `bench/hetero.py` checks every planner against the bound). -inf where neither program is feasible (no plan holds
    the batch). With tensor parallelism a rank is tp GPUs, each holding `activation_bytes`
    of its tokens."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    T = float(L.sum())
    num_dp = cluster.num_ranks // model.tp
    fixed_layers = model.recompute_layers if model.recompute else None
    modes = (model.recompute,) if model.recompute else RECOMPUTE_MODES
    att = attention_flops(model, L)
    nic_eff = max(hardware.profile(g.gpu_type).nic_efficiency for g in cluster.groups)
    cross_bytes = 2 * model.num_layers * model.tp * (remap_bytes(model, 1, True) + remap_bytes(model, 1, False))
    layer_flops = model.num_layers * linear_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
    layer_bytes = model.num_layers * elementwise_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    if lm_head and not busiest_head:
        layer_flops += head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
        layer_bytes += loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    per_doc, rerun, lin_s, cuts, caps, nic_s, head_cuts = [], [], [], [], [], [], []
    for g, n in zip(cluster.groups, gpus):
        t, p = g.gpu_type, hardware.profile(g.gpu_type)
        lin_eff, elt_eff = t.peak_flops * float(best_efficiency(p.linear, T)), p.memory_bw * float(best_efficiency(p.elementwise, T))
        fwd, bwd = best_efficiency(p.attention_forward, L), best_efficiency(p.attention_backward, L)
        per_doc.append(model.num_layers * (att / fwd + ATTENTION_BACKWARD_FACTOR * att / bwd) / t.peak_flops / n)
        rerun.append(model.num_layers * att / fwd / t.peak_flops / n)
        row = []
        for mode in modes:
            layers = recompute_layer_count(model, mode, fixed_layers)
            s = (model.num_layers * recompute_flops_per_token(model, mode, layers) / lin_eff
                 + model.num_layers * recompute_elementwise_bytes_per_token(model, mode, layers) * model.tp / elt_eff)
            if communication:
                s += model.tp * (2 * tp_seconds_per_token(model, g) + _tp_rerun_seconds_per_token(model, g, mode, layers))
            row.append(s / n)
        lin_s.append(row)
        a, b = gemm_cuts(t, layer_flops, layer_bytes * model.tp, T)
        cuts.append((n / model.tp * a / n, b / n))  # the group's n / tp ranks, over its n GPUs
        a, b = gemm_cuts(t, head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR),
                         loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR) * model.tp, T)
        head_cuts.append((a / model.tp, b / model.tp / (n / model.tp)))  # one rank's seconds at t / N
        caps.append(n / model.tp * max(0.0, memory_cap(model, t, num_dp)))
        links = g.num_nodes * (g.gpus_per_node // g.gpus_per_nic)
        nic_s.append(cross_bytes / (g.nic_bw * nic_eff) / links if communication and nic else 0.0)
    best = np.inf
    for full in ({False, True} if "full" in modes else {False}):
        ms = [i for i, m in enumerate(modes) if (m == "full") == full]
        if not ms:
            continue
        value = _layout_program(L, T, modes, ms, full, np.array(per_doc) + (np.array(rerun) if full else 0),
                                np.array(lin_s), cuts, head_cuts if busiest_head else None, np.array(caps),
                                np.array(nic_s), fixed,
                                model, fixed_layers, linprog, coo_matrix)
        best = min(best, value)
    return best * (1 - 1e-6) if np.isfinite(best) else -np.inf


def _tp_rerun_seconds_per_token(model: ModelSpec, group: NodeGroup, mode: str, layers: float) -> float:
    """Seconds of tensor-parallel collectives a token's recomputation under `mode` on
    `layers` layers (the others one mode below) reruns on each GPU of its TP group, all
    layers, latency aside (`tensor_parallel.TP_RERUN`, as `bounds.tp_rerun_seconds_per_token`
    prices them; the program mixes the modes itself, so each mode's own reruns)."""
    if model.tp <= 1:
        return 0.0
    p = hardware.profile(group.gpu_type)
    per_byte = hidden_bytes(model, 1) * (model.tp - 1) / model.tp / group.intra_bw
    ag, rs = (per_byte / p.collective_efficiency[op] for op in ("all_gather", "reduce_scatter"))
    return model.num_layers * float(layer_mean(model, {m: a * ag + r * rs for m, (a, r) in TP_RERUN.items()},
                                               mode, layers))


def _layout_program(L, T, modes, ms, full, per_doc, lin_s, cuts, head_cuts, caps, nic_s, fixed, model, fixed_layers,
                    linprog, coo_matrix) -> float:
    """`layout_bound`'s program for the modes `ms` (indices into `modes`): its optimum S,
    +inf where infeasible. Variables: S; per group and document the attention share a and
    the share of the document's tokens held on the attention layout y; per group and mode
    the batch's shares X (linear layout) and V (attention layout); per group its GPUs'
    mean seconds of GEMMs and elementwise work Z (at least each of its `cuts`, lines in
    its linear tokens T sum X) and the share of tokens crossing between its layouts; with
    `head_cuts`, the busiest rank's head B, at least each group's lines in its tokens."""
    G, D, M = len(caps), len(L), len(ms)
    al = np.array([float(activation_bytes(model, 1, 0, modes[i], fixed_layers)) for i in ms])
    aa = np.array([float(activation_bytes(model, 0, 1, modes[i], fixed_layers)) for i in ms])
    off = {"a": 1, "y": 1 + G * D, "X": 1 + 2 * G * D, "V": 1 + 2 * G * D + G * M}
    off["Z"] = off["V"] + G * M
    off["C"] = off["Z"] + G
    off["B"] = off["C"] + G
    nvar = off["B"] + 1
    rows, cols, vals, rhs = [], [], [], []
    r = 0

    def add(entries, bound):
        nonlocal r
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        rhs.append(bound)
        r += 1

    share = L / T
    for g in range(G):
        a_g, y_g, X_g, V_g = (off[k] + g * (D if k in "ay" else M) for k in ("a", "y", "X", "V"))
        add([(0, -1.0)] + [(a_g + d, per_doc[g, d]) for d in range(D)]
            + [(X_g + j, T * lin_s[g, ms[j]]) for j in range(M)] + [(off["Z"] + g, 1.0), (off["B"], 1.0)], -fixed[g])
        for a, b in zip(*cuts[g]):
            add([(X_g + j, T * b) for j in range(M)] + [(off["Z"] + g, -1.0)], -a)
        for a, b in zip(*head_cuts[g]) if head_cuts is not None else ():
            add([(X_g + j, T * b) for j in range(M)] + [(off["B"], -1.0)], -a)
        scale = caps[g] if caps[g] > 0 else 1.0
        add([(X_g + j, T * al[j] / scale) for j in range(M)] + [(V_g + j, T * aa[j] / scale) for j in range(M)],
            caps[g] / scale)
        cross = [(X_g + j, 1.0) for j in range(M)] + [(y_g + d, -share[d]) for d in range(D)]
        add(cross + [(off["C"] + g, -1.0)], 0.0)
        add([(c, -v) for c, v in cross] + [(off["C"] + g, -1.0)], 0.0)
        add([(0, -1.0), (off["C"] + g, T * nic_s[g])], 0.0)
        for w0 in TANGENTS:
            root = np.sqrt(1 - w0)
            slope, at = 1 / (2 * root), 1 - root
            for d in range(D):
                add([(a_g + d, slope), (y_g + d, -1.0)], slope * w0 - at)
    A_ub = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    b_ub = np.array(rhs)
    rows, cols, vals, rhs = [], [], [], []
    r = 0
    for d in range(D):
        add([(off["a"] + g * D + d, 1.0) for g in range(G)], 1.0)
        add([(off["y"] + g * D + d, 1.0) for g in range(G)], 1.0)
    add([(off["X"] + i, 1.0) for i in range(G * M)], 1.0)
    for g in range(G):
        add([(off["V"] + g * M + j, 1.0) for j in range(M)] + [(off["y"] + g * D + d, -share[d]) for d in range(D)],
            0.0)
    A_eq = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    c = np.zeros(nvar)
    c[0] = 1.0
    res = linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=np.array(rhs), bounds=(0, None), method="highs")
    if res.status == 2:
        return np.inf
    if res.status != 0:
        raise RuntimeError(f"the bound's linear program failed: {res.message}")
    return float(res.fun)
