"""What the partitioner prices besides attention (docs/design.md, section 4).

Attention work alone does not make a step: every token also runs the linear layers, and
a batch that needs more recomputation pays a second forward. The partitioner therefore

* balances nodes on attention work plus each document's linear work (`StepWeights`, in
  the units of `Batch.work`), so that the remap can stay inside each node: a node that
  holds long documents (much attention, few tokens) takes fewer tokens instead of
  shipping q, k, v and o of the difference across the network every layer;
* sends a document over a node's share across nodes when the overload it saves beats the
  wider ring's exposed transfers, over as many nodes as pays best (`inter_node_span`;
  a ring's steps as the simulator runs them, `ring_pricing`: its crossing hops routed
  over the nodes' rails as the routing layer sends them, its ports shared with the
  layer's FSDP collectives; estimates add them, `crossing_rings`), and prices
  a ring on a node's own links (nothing over NVLink, much over PCIe);
* remaps inside NVLink nodes, or keeps every rank's tokens (balancing attention plus
  linear work per rank; always on PCIe-only nodes, `remaps_inside`), whichever leaves
  the shorter estimated step (`rank_step_seconds`): moving a token's q, k, v and o can
  cost more than the linear work it evens out;
* plans for each recomputation the batch fits under, cheapest first (`recompute_modes`):
  memory caps per rank follow from the mode, so the partitioner balances within them;
  tighter caps can cost more balance than the recomputation they save, so the plans are
  compared by their estimated step, and a costlier mode is tried only while its
  average rank could still beat the best plan so far.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import attention_flops, remap_bytes
from ballonet.cost.memory import BELOW, RECOMPUTE_MODES, recompute_layer_count, recompute_mode
from ballonet.cost.recompute import recompute_attention
from ballonet.cost.seconds import DP_FORWARD_SHARE, attention_seconds, linear_layer_seconds
from ballonet.cost.tensor_parallel import tp_layer_seconds
from ballonet.plan import Plan
from ballonet.planning.devices import Devices
from ballonet.planning.ring_pricing import (
    double_exposed_seconds,
    dp_intra_seconds,
    ring_exposed_seconds,
)
from ballonet.specs import ModelSpec

__all__ = ["StepWeights", "attention_kernels", "inter_node_span", "linear_work_per_token", "rank_compute_seconds",
           "rank_remap_seconds", "rank_step_seconds", "rank_tp_seconds", "recompute_modes", "remap_pairs",
           "remaps_inside", "step_weights", "synchronous_step_seconds"]


_doc = attrgetter("doc")


def recompute_modes(model: ModelSpec) -> tuple[str, ...]:
    """The recomputation modes to plan for, cheapest first: the model's own when it sets one."""
    return (model.recompute,) if model.recompute else RECOMPUTE_MODES


@dataclass(frozen=True)
class StepWeights:
    """How the partitioner turns forward attention work (`Batch.work`, peak-FLOP units)
    and tokens into a step's compute."""
    linear_per_token: float
    """One token's linear layers over a step, in forward-attention work units: for a
    document of L tokens, `work + L * this` is in proportion to its share of the step."""
    attention_step: float
    """Step seconds of attention per forward second: forward, backward, and the forward
    again under full recomputation."""


def step_weights(model: ModelSpec, gpu: hardware.GPUType, lengths, num_ranks: int, tp_bw: float) -> StepWeights:
    """`StepWeights` on `gpu` under `model.recompute`, at the batch's mean tokens per rank
    (for the GEMMs' efficiency) and its token-weighted mean document length; `tp_bw`: the
    links of its TP group (`linear_work_per_token`)."""
    L = np.asarray(lengths, dtype=float)
    if not L.size:
        return StepWeights(linear_per_token=0.0, attention_step=1.0)
    mode = recompute_mode(model)
    typical = float((L * L).sum() / L.sum())
    flops = attention_flops(model, typical)
    forward = attention_seconds(model, gpu, flops, typical, launch_floor=True)
    attention = 1 + attention_seconds(model, gpu, flops, typical, backward=True, launch_floor=True) / forward
    attention += 1 if recompute_attention(mode) else 0
    tokens = L.sum() / max(num_ranks, 1)
    return StepWeights(linear_per_token=linear_work_per_token(model, gpu, tokens, attention, tp_bw),
                       attention_step=attention)


def linear_work_per_token(model: ModelSpec, gpu: hardware.GPUType, tokens: float, attention_step: float,
                          tp_bw: float) -> float:
    """One token's linear layers over a step on `gpu` (GEMMs and elementwise work, forward,
    backward and the recomputation of `model.recompute`, at `tokens` tokens a call) and,
    with tensor parallelism, its sequence-parallel collectives over the TP group's links
    of `tp_bw` bytes/s (on the compute stream, so as dear as compute), in forward-attention
    work units: seconds times the GPU's peak over `attention_step`."""
    if tokens <= 0:
        return 0.0
    mode = recompute_mode(model)
    seconds = sum(linear_layer_seconds(model, gpu, tokens, mode, framework=False, layers=recompute_layer_count(model)))
    seconds += sum(tp_layer_seconds(model, int(tokens), tp_bw, gpu, mode))
    return seconds * gpu.peak_flops / tokens / attention_step


def remaps_inside(gpu: hardware.GPUType) -> bool:
    """Whether the remap evens tokens inside a node of `gpu`s: over NVLink moving a token's
    q, k, v and o costs a small part of its linear work; over PCIe (`intra_link` "pcie")
    the blocking all-to-all costs about as much as the work it evens out, so those nodes
    keep their tokens and balance attention plus linear work per rank instead."""
    return gpu.intra_link == "nvlink"


def inter_node_span(model: ModelSpec, gpu: hardware.GPUType, length: int, step_work: float, node_share: float,
                    ranks_per_node: int, num_nodes: int, bandwidth: float, node_speed: float,
                    weights: StepWeights, min_tokens: float = 0.0, fill_per_token: float = 0.0,
                    intra_bw: float | None = None, routed: tuple[float, int] | None = None,
                    dp_piece: tuple[float, float] = (0.0, 0.0)) -> int:
    """How many nodes a document whose step work (attention plus linear, `StepWeights`
    units) is over a node's share runs fastest on: 1 (kept in one node) or k >= 2 (a ring
    over k whole nodes), whichever leaves the least of the busiest node's overload (its
    ranks' extra step seconds) plus the ring's exposed communication
    (`ring_exposed_seconds`, or with `intra_bw` a "double" ring's,
    `double_exposed_seconds`). Fewer nodes than the work needs can win: a wider ring has
    shorter blocks and more hops to hide. Under memory caps that bind, a node holds at
    least `min_tokens` tokens: the node of a share of L / k tokens also carries the rest
    at `fill_per_token` work each."""
    seconds_per_work = weights.attention_step * model.num_layers / node_speed
    most = int(min(np.ceil((step_work + min_tokens * fill_per_token) / node_share), num_nodes))

    def cost(k: int) -> float:
        fill = max(min_tokens - length / k, 0.0) * fill_per_token
        overload = max(step_work / k + fill - node_share, 0.0) * seconds_per_work
        if k == 1:
            return overload
        if intra_bw is not None:
            return overload + double_exposed_seconds(model, gpu, length, k, ranks_per_node, intra_bw, bandwidth,
                                                     dp_piece)
        dp_intra = DP_FORWARD_SHARE * dp_intra_seconds(model, gpu, ranks_per_node, routed[0]) if routed else 0.0
        return overload + ring_exposed_seconds(model, gpu, length, k * ranks_per_node, bandwidth, routed=routed,
                                               dp_piece=dp_piece, dp_intra=dp_intra)

    return min(range(1, max(most, 1) + 1), key=lambda k: (cost(k), k))


def attention_kernels(plan: Plan, dev: Devices, model: ModelSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, forward seconds, backward seconds) of every attention kernel of one layer:
    each local document and each ring position. The same under every recomputation
    (`rank_compute_seconds` adds the forward again under "full")."""
    rank, block = _local_kernels(plan)
    ring_rank, ring_flops, ring_block = _ring_kernels(model, plan.rings)
    rank_a = np.concatenate([rank, np.asarray(ring_rank, dtype=np.int64)])
    flops_a = np.concatenate([attention_flops(model, block), ring_flops])
    block_a = np.concatenate([block, ring_block])
    fwd, bwd = np.zeros(len(rank_a)), np.zeros(len(rank_a))
    for i, gpu in enumerate(dev.gpu_types):
        on = dev.type_index[rank_a] == i
        fwd[on] = attention_seconds(model, gpu, flops_a[on], block_a[on])
        bwd[on] = attention_seconds(model, gpu, flops_a[on], block_a[on], backward=True)
    return rank_a, fwd, bwd


def _local_kernels(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(rank, tokens) of every local document's kernel (a document in no ring), each
    rank's in the order of the set of its segments' documents: the sets are built in C
    (`map`), the documents in rings dropped and the lengths read by numpy."""
    sets = list(map(set, map(functools.partial(map, _doc), plan.attention)))
    docs = np.fromiter(itertools.chain.from_iterable(sets), dtype=np.int64)
    rank = np.repeat(np.arange(len(sets), dtype=np.int64), list(map(len, sets)))
    in_ring = np.zeros(len(plan.lengths), dtype=bool)
    in_ring[list(plan.ring_of_doc)] = True
    keep = ~in_ring[docs]
    return rank[keep], np.asarray(plan.lengths, dtype=float)[docs[keep]]


def _ring_kernels(model: ModelSpec, rings) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(rank, forward FLOPs, block tokens) of every position of `rings`, in ring order (a
    "heads" document's member: 1/g of its attention FLOPs, and its whole length, at whose
    efficiency its kernel runs): `zigzag_flops` of them all at once, a position's blocks its chunks i and 2g-1-i
    (`Ring.block_tokens`); every ring's bounds in one array, its chunks' starts and sizes
    and positions' chunk indices read off it by numpy."""
    rank = list(itertools.chain.from_iterable(ring.ranks for ring in rings))
    bounds = [ring.bounds for ring in rings]
    flat = np.fromiter(itertools.chain.from_iterable(bounds), dtype=float)
    last = np.zeros(len(flat), dtype=bool)  # each ring's last bound, which starts no chunk
    last[np.cumsum([len(b) for b in bounds], dtype=np.int64) - 1] = True
    start, q = flat[~last], (flat[1:] - flat[:-1])[~last[:-1]]
    g = np.array([len(ring.ranks) for ring in rings], dtype=np.int64)
    chunks = np.array([len(b) - 1 for b in bounds], dtype=np.int64)
    first = np.cumsum(chunks) - chunks  # each ring's first chunk
    within = np.arange(int(g.sum()), dtype=np.int64) - np.repeat(np.cumsum(g) - g, g)
    front, back = np.repeat(first, g) + within, np.repeat(first + 2 * g - 1, g) - within
    chunk = 4.0 * model.num_heads * model.head_dim * q * start + attention_flops(model, q)  # as `zigzag_flops`
    flops, block = chunk[front] + chunk[back], q[front] + q[back]
    if any(ring.comm == "heads" for ring in rings):  # 1/g of the whole document's heads, at its length
        heads = np.repeat([ring.comm == "heads" for ring in rings], g)
        length = np.repeat([float(ring.bounds[-1] - ring.bounds[0]) for ring in rings], g)
        flops[heads] = attention_flops(model, length[heads]) / np.repeat(g, g)[heads]
        block[heads] = length[heads]
    return rank, flops, block


def rank_compute_seconds(plan: Plan, dev: Devices, model: ModelSpec, mode: str | None, split: bool = False,
                         layers=None, kernels=None):
    """[R] seconds of a step's attention and linear kernels on each rank of `plan` (all
    layers, forward, backward and the recomputation `mode` reruns on `layers` of them:
    default all; or [R] (mode, layers) per rank, `cost.recompute.layers_per_rank`, the
    other layers one mode below; no launch floors, no communication); with `split`, the
    pair ([R] attention, [R] linear). `kernels`: the plan's `attention_kernels`, when known."""
    R = plan.num_ranks
    rank, fwd, bwd = kernels or attention_kernels(plan, dev, model)
    redo = 1.0 if recompute_attention(mode) else 0.0
    attention = np.bincount(rank, weights=model.num_layers * ((1 + redo) * fwd + bwd), minlength=R)
    tokens, names = np.asarray(plan.linear_token_counts, dtype=float), dev.gpu_names
    linear = np.zeros(R)
    # rank r's first k layers recompute as m, the others below it (a list: no array made to ask its ndim)
    if layers is not None and (isinstance(layers, list) or np.ndim(layers) > 0):
        code = {m: i for i, m in enumerate(dict.fromkeys(m for m, _ in layers))}  # each mode's number: no string array
        modes = np.fromiter((code[m] for m, _ in layers), dtype=np.int64, count=len(layers))
        share = np.array([k for _, k in layers], dtype=float) / model.num_layers
        for gpu in dev.gpu_types:
            for m, i in code.items():
                on = (names == gpu.name) & (modes == i)
                if not on.any():
                    continue
                redo = sum(linear_layer_seconds(model, gpu, tokens[on], m, framework=False))
                keep = sum(linear_layer_seconds(model, gpu, tokens[on], BELOW.get(m, m), framework=False))
                linear[on] = share[on] * redo + (1 - share[on]) * keep
    else:
        for gpu in dev.gpu_types:
            on = names == gpu.name
            linear[on] = sum(linear_layer_seconds(model, gpu, tokens[on], mode, framework=False, layers=layers))
    linear *= model.num_layers
    return (attention, linear) if split else attention + linear


def rank_step_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray,
                      compute: tuple[np.ndarray, np.ndarray] | None = None,
                      nic_bw: np.ndarray | None = None, dp_piece: np.ndarray | None = None) -> np.ndarray:
    """[R] a step's seconds per rank as the partitioner compares plans (under
    `model.recompute`): a rank's linear layers start once its own attention and that of
    every rank remapping tokens to it are done (the remap is a meeting point); then the
    remap's all-to-alls (`rank_remap_seconds`) and, with tensor parallelism, the
    sequence-parallel collectives over its tokens. Ring transfers, and the waits of ring
    members whose shares differ, are not priced: the attention engine forwards K/V as it
    arrives and fills waits with local documents (a term for the backward's dK/dV waits
    was tried and mispredicted more choices than it fixed), but for rings across nodes,
    whose members wait for NIC transfers local work rarely fills: with `nic_bw` ([R] a
    rank's NIC share) each member of a "double" ring adds its `double_exposed_seconds`
    (of a single ring, `crossing_rings.crossing_exposed_seconds`, which the partitioner
    adds to `compute`). `compute`: the plan's `rank_compute_seconds(..., split=True)` under
    `model.recompute`, when known."""
    start, linear = compute or rank_compute_seconds(plan, dev, model, model.recompute, split=True)
    start = start.copy()
    for ring in plan.rings if nic_bw is not None else ():
        if ring.comm == "double":
            r, nic = ring.ranks[0], np.asarray(nic_bw)
            piece = (0.0, 0.0) if dp_piece is None else tuple(dp_piece[r])
            start[list(ring.ranks)] += double_exposed_seconds(model, dev.gpu[r], plan.lengths[ring.doc], ring.groups,
                                                              ring.group_size, link_bw[r], nic[r], piece)
    ready = start.copy()
    src, dst, _ = remap_pairs(plan)
    np.maximum.at(ready, dst, start[src])
    np.maximum.at(ready, src, start[dst])  # and the same meeting on the way back
    return ready + linear + rank_remap_seconds(plan, model, link_bw) + rank_tp_seconds(plan, dev, model, link_bw)


def synchronous_step_seconds(plan: Plan, dev: Devices, model: ModelSpec, kernels, seconds: np.ndarray,
                             compute: np.ndarray, layers=None) -> float:
    """A step's seconds when each layer's forward and each layer's backward end with the
    slowest rank's (the remap and ring exchanges meet in both, as the simulator runs
    them): the busiest rank's forward plus, layer by layer, the busiest rank's backward,
    where ranks heavy on attention (whose backward is 2.5x its forward) and on linear work
    (2x) take turns. A rank's forward is its attention kernels' and linear layers'
    forward plus half of what its estimated `seconds` add to its `compute` (remap,
    tensor-parallel collectives, exposed transfers, waits); its backward the rest. With
    `layers` ([R] (mode, k) of `cost.recompute.layers_per_rank`), a rank's first k layers
    rerun its mode's recomputation in their backward and the others the mode below, so
    the layers where a few ranks recompute end with theirs. `kernels`: the plan's
    `attention_kernels`."""
    rank, fwd, _ = kernels
    L, R = model.num_layers, plan.num_ranks
    forward = L * np.bincount(rank, weights=fwd, minlength=R).astype(float)
    tokens, names = np.asarray(plan.linear_token_counts, dtype=float), dev.gpu_names
    extra = np.zeros(R)  # [R] a recomputing layer's backward over the same layer's below its mode
    code = {m: i for i, m in enumerate(dict.fromkeys(m for m, _ in layers or ()))}  # each mode's number
    modes = np.fromiter((code[m] for m, _ in layers or ()), dtype=np.int64, count=len(layers or ()))
    for gpu in dev.gpu_types:
        on = names == gpu.name
        forward[on] += L * linear_layer_seconds(model, gpu, tokens[on], "none", framework=False)[0]
        for m in set(code) & set(BELOW):
            sub = on & (modes == code[m])
            extra[sub] = (linear_layer_seconds(model, gpu, tokens[sub], m, framework=False)[1]
                          - linear_layer_seconds(model, gpu, tokens[sub], BELOW[m], framework=False)[1])
    forward += (seconds - compute) / 2
    backward = seconds - forward
    if layers is None or not extra.any():
        return float(forward.max() + backward.max())
    k = np.array([n if m in BELOW else 0 for m, n in layers])
    base = (backward - k * extra) / L  # [R] one layer's backward below the mode
    cuts = sorted({0, L, *k.tolist()})
    # each run's busiest rank, every run's at once: (base + extra * (k > lo)).max() a run
    most = (base + extra * (k > np.array(cuts[:-1])[:, None])).max(axis=1).tolist()
    runs = sum((hi - lo) * m for lo, hi, m in zip(cuts, cuts[1:], most))
    return float(forward.max() + runs)


def rank_tp_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray) -> np.ndarray:
    """[R] a step's tensor-parallel collectives per rank (all layers, forward, backward and
    the reruns of `model.recompute`: `cost.tensor_parallel.tp_layer_seconds`)."""
    if model.tp == 1:
        return np.zeros(plan.num_ranks)
    mode = recompute_mode(model)
    return model.num_layers * np.array([sum(tp_layer_seconds(model, n, link_bw[r], dev.gpu[r], mode))
                                        for r, n in enumerate(plan.linear_token_counts)])


def rank_remap_seconds(plan: Plan, model: ModelSpec, link_bw: np.ndarray) -> np.ndarray:
    """[R] seconds a step's remap all-to-alls take on each rank (all layers): q, k and v
    toward the attention layout and o back, forward and backward. The all-to-all is
    blocking (no compute hides it) and ends on a rank when all of its sends and receives
    are done (`simulation.layer_graph.LayerGraph.remap_all_to_all`, as NCCL runs it): the
    larger of what the rank sends and receives over its link of `link_bw[r]` bytes/s, or
    of what a partner does, whose port its transfer shares (the senders into one busy rank
    all end with its last byte)."""
    out, inn = np.zeros(plan.num_ranks), np.zeros(plan.num_ranks)
    per_token = remap_bytes(model, 1, True) + remap_bytes(model, 1, False)
    src, dst, n = remap_pairs(plan)
    np.add.at(out, src, n * per_token)
    np.add.at(inn, dst, n * per_token)
    own = 2 * model.num_layers * np.maximum(out, inn) / link_bw
    busy = own.copy()
    np.maximum.at(busy, src, own[dst])
    np.maximum.at(busy, dst, own[src])
    return busy



def remap_pairs(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`Plan.remap_pairs` as arrays: each (source, destination) pair's ranks and tokens."""
    src, dst, n = plan.remap_pairs
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(n, dtype=np.int64)
