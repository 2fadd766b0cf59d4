"""What a step costs beyond its ranks' kernels and the transfers `pricing` already
charges, as the simulator runs it (docs/design.md, sections 4 and 7): what the step adds
after its layers, each single ring member's last dK/dV hop home, and the compute that
sends running beside it slow. The partitioner adds them to each candidate's estimate.
A "heads" document has no trailing hop: its returns are priced with its gathers
(`heads_exposure`)."""

from __future__ import annotations

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import kv_bytes, kv_grad_bytes, message_bytes, remap_bytes
from ballonet.cost.memory import recompute_mode
from ballonet.cost.recompute import recompute_attention
from ballonet.cost.seconds import (
    DP_BACKWARD_SHARE,
    DP_FORWARD_SHARE,
    DP_PIECES,
    collective_time,
    dp_layer_parts,
    grad_allreduce_time,
    head_seconds,
    optimizer_time,
    p2p_time,
)
from ballonet.cost.tensor_parallel import tp_step_collectives
from ballonet.plan import Plan, Ring
from ballonet.planning.devices import Devices
from ballonet.planning.pricing import remap_pairs
from ballonet.planning.ring_pricing import crossing_seconds_each
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["dp_send_seconds", "final_grad_wait_seconds", "fixed_tail_seconds", "overlap_slowdown_seconds",
           "step_tail_seconds"]


def fixed_tail_seconds(cluster: ClusterSpec, dev: Devices, model: ModelSpec) -> float:
    """What a step adds after its layers whatever the plan: the last layer's gradient
    bucket, reduced after the backward (`cost.seconds.grad_allreduce_time` over the
    layers), and the slowest rank's optimizer step."""
    opt = max(optimizer_time(model, g, dev.num_ranks) for g in _types(dev))
    return grad_allreduce_time(model, cluster) / model.num_layers + opt


def step_tail_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray, fixed: float) -> float:
    """What a step of `plan` adds after its layers: the slowest rank's LM head and loss
    over its linear tokens with their tensor-parallel collectives over its TP group's
    links (`link_bw`, [R]), plus `fixed` (`fixed_tail_seconds`)."""
    tokens = np.asarray(plan.linear_token_counts)
    names = dev.gpu_names
    out = 0.0
    for gpu in _types(dev):  # its most tokens take longest
        on = np.nonzero(names == gpu.name)[0]
        r = int(on[np.argmax(tokens[on])])
        n = int(tokens[r])
        out = max(out, head_seconds(model, gpu, n) + sum(collective_time(op, nbytes, model.tp, link_bw[r], gpu)
                                                         for _, op, nbytes in tp_step_collectives(model, n)))
    return out + fixed


def _block_tokens(ring: Ring) -> list[int]:
    """`ring.block_tokens(i)` of every position i, from the bounds without building its chunks."""
    b, g = ring.bounds, len(ring.ranks)
    return [max(b[i + 1] - b[i], 0) + max(b[2 * g - i] - b[2 * g - 1 - i], 0) for i in range(g)]


def final_grad_wait_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray, nic_bw: np.ndarray,
                            rails: np.ndarray) -> np.ndarray:
    """[R] what each member of a single ring waits, after its last backward step of each
    layer, for its own block's summed dK/dV (fp32), which its predecessor sends only
    after its own last step (`runtime.ring.ring_pass`; the simulator's `ring_backward`):
    the hop into it, across nodes at `nic_bw` routed over `rails` (1: direct), inside a
    node over `link_bw`; nothing hides it. Not "allgather", "double" or "heads" documents
    (a "heads" member's last messages, the returns of its rows, `heads_exposure` prices)."""
    out = np.zeros(plan.num_ranks)
    member: list[int] = []  # every single ring's members, their blocks and predecessors, ring by ring
    block: list[int] = []
    before: list[int] = []
    for ring in plan.rings:
        if ring.comm == "ring":
            member += ring.ranks
            block += _block_tokens(ring)
            before += ring.ranks[-1:] + ring.ranks[:-1]
    if not member:
        return out
    r, nbytes = np.array(member), kv_grad_bytes(model, np.array(block))
    lat, eff = _p2p_terms(dev, nic=False)
    node = np.asarray(dev.node)
    seconds = lat[r] + nbytes / (link_bw[r] * eff[r])  # `p2p_time` over the node's link
    crossing = np.nonzero(node[np.array(before)] != node[r])[0]
    for t, gpu in enumerate(dev.gpu_types):
        on = crossing[dev.type_index[r[crossing]] == t]
        if on.size:
            rs = r[on]
            seconds[on] = crossing_seconds_each(nbytes[on], nic_bw[rs], link_bw[rs], rails[rs], gpu)
    sent = nbytes > 0
    np.add.at(out, r[sent], seconds[sent])  # in ring order, as the members' hops add up
    return model.num_layers * out


def overlap_slowdown_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray, nic_bw: np.ndarray,
                             dp_send_s: float, compute: np.ndarray) -> np.ndarray:
    """[R] compute seconds a step loses to transfers running beside it, as the simulator
    charges them: the GPU profile's `overlap_slowdown` times the seconds of what the rank
    sends (at most its `compute`, [R]): its rings' K/V (forward, and again under full
    recomputation) and in the backward K/V and partial dK/dV, each hop at its link's
    bandwidth (`link_bw` inside a node, `nic_bw` across; a "double" ring's inner steps
    inside, its rounds across), its "heads" documents' messages (`_heads_send_seconds`),
    its remap, and `dp_send_s`, the layers' data-parallel collectives every rank sends."""
    factor = dev.per_type([hardware.profile(g).overlap_slowdown for g in dev.gpu_types])
    if not factor.any():
        return np.zeros(plan.num_ranks)
    passes = (2 if recompute_attention(recompute_mode(model)) else 1) + 1  # K/V: forward(s) and backward
    kv_row, grad_row = kv_bytes(model, 1), kv_grad_bytes(model, 1)
    # Each ring member's sends, one entry a list: rank, rows of K/V, rows of dK/dV, messages, across nodes
    senders: list[int] = []
    kv_rows: list[int] = []
    grad_rows: list[int] = []
    messages: list[int] = []
    crosses: list[bool] = []
    node = dev.node
    for ring in plan.rings:
        ranks, total = ring.ranks, ring.bounds[-1] - ring.bounds[0]
        if ring.comm == "double":  # per member k(n-1) inner steps inside the node, k-1 rounds across
            k, n = ring.groups, ring.group_size
            block = max(total // (k * n), 1)
            inner, rounds = k * (n - 1), k - 1
            for r in ranks:
                senders += (r, r)
                kv_rows += (inner * block, rounds * block)
                grad_rows += (inner * block, rounds * block)
                messages += (inner, rounds)
                crosses += (False, True)
        elif ring.comm == "ring":
            g = len(ranks)
            blocks = _block_tokens(ring)
            after = ranks[1:] + ranks[:1]
            # every block but its successor's goes out; partials of every block but its own
            senders += ranks
            kv_rows += [total - x for x in blocks[1:] + blocks[:1]]
            grad_rows += [total - x for x in blocks]
            messages += [g - 1] * g
            crosses += [node[s] != node[r] for r, s in zip(ranks, after)]
    sent = np.full(plan.num_ranks, dp_send_s)
    if senders:
        ra = np.array(senders)
        kv, grad, m = (np.array(x, dtype=float) for x in (kv_rows, grad_rows, messages))
        across = np.array(crosses)
        lat_link, eff_link = _p2p_terms(dev, nic=False)
        lat_nic, eff_nic = _p2p_terms(dev, nic=True)
        lat = np.where(across, lat_nic[ra], lat_link[ra])
        per_byte = 1 / np.where(across, nic_bw[ra] * eff_nic[ra], link_bw[ra] * eff_link[ra])
        seconds = passes * (m * lat + kv_row * kv * per_byte) + m * lat + grad_row * grad * per_byte
        sent += model.num_layers * np.bincount(ra, weights=np.where(m > 0, seconds, 0.0), minlength=plan.num_ranks)
    if any(ring.comm == "heads" for ring in plan.rings):
        sent += model.num_layers * _heads_send_seconds(plan, dev, model, link_bw, passes - 1)
    per_token = remap_bytes(model, 1, True) + remap_bytes(model, 1, False)
    src, _, tokens = remap_pairs(plan)
    np.add.at(sent, src, 2 * model.num_layers * tokens * per_token / link_bw[src])
    return factor * np.minimum(sent, compute)


def _heads_send_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray, forwards: int) -> np.ndarray:
    """[R] seconds of what a layer's "heads" documents send from each member (one message
    a payload and pair for the documents over the same ranks, as the simulator sends
    them): its rows of q, k, v to every other member and each other member's rows of the
    result back, in `forwards` forward passes (2 under full recomputation) and the
    backward (also "dout" out, "dqkv" back)."""
    groups: dict[tuple[int, ...], np.ndarray] = {}
    for ring in plan.rings:
        if ring.comm == "heads":
            rows = np.asarray(_block_tokens(ring), dtype=float)
            groups[ring.ranks] = groups[ring.ranks] + rows if ring.ranks in groups else rows
    lat, eff = _p2p_terms(dev, nic=False)
    out = np.zeros(plan.num_ranks)
    for ranks, rows in groups.items():
        r, g = np.array(ranks), len(ranks)
        theirs = rows.sum() - rows  # every other member's rows, returned to them

        def seconds(payload: str, n: np.ndarray) -> np.ndarray:
            return (g - 1) * lat[r] + message_bytes(model, payload, n, g) / (link_bw[r] * eff[r])
        forward = seconds("qkv", rows) + seconds("out", theirs)
        backward = seconds("qkv", rows) + seconds("dout", rows) + seconds("dqkv", theirs)
        np.add.at(out, r, forwards * forward + backward)
    return out


def dp_send_seconds(cluster: ClusterSpec, model: ModelSpec) -> float:
    """Seconds of sends a rank's layers' data-parallel collectives take in a step (the
    simulator's `LayerGraph.data_parallel`: their intra-node part, then their part across
    nodes in `DP_PIECES` pieces over the rank's NICs; forward `DP_FORWARD_SHARE` of a
    layer's all-reduce, backward `DP_BACKWARD_SHARE`), for the slowest node group."""
    intra_s, nic_bytes = dp_layer_parts(model, cluster)
    out = 0.0
    for g in cluster.groups:
        bw = g.nic_bw * max(1, model.tp // g.gpus_per_nic) / model.tp
        per_layer = 0.0
        for share in (DP_FORWARD_SHARE, DP_BACKWARD_SHARE):
            per_layer += share * intra_s
            if nic_bytes > 0 and cluster.num_nodes > 1:
                per_layer += DP_PIECES * p2p_time(share * nic_bytes / DP_PIECES, bw, True, g.gpu_type)
        out = max(out, per_layer)
    return model.num_layers * out


def _types(dev: Devices) -> list:
    return list(dev.gpu_types)


def _p2p_terms(dev: Devices, nic: bool) -> tuple[np.ndarray, np.ndarray]:
    """[R] latency and efficiency of `cost.seconds.p2p_time` on each rank's GPU profile."""
    prof = [hardware.profile(g) for g in dev.gpu_types]
    if nic:
        return dev.per_type([p.nic_latency_s for p in prof]), dev.per_type([p.nic_efficiency for p in prof])
    return dev.per_type([p.p2p_latency_s for p in prof]), dev.per_type([p.p2p_efficiency for p in prof])
