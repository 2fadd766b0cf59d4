"""What a ring inside a PCIe-only node leaves exposed, as the simulator runs it
(docs/design.md, sections 5 and 7).

Over NVLink a ring's K/V hop takes a small part of its step's compute; over PCIe
(`GPUType.intra_link` "pcie", 25 GB/s a GPU) it can take several times more, and the
node's ports also carry the layer's data-parallel collectives (their intra-node part,
`ring_pricing.dp_intra_seconds`). The simulator runs every ring step as the runtime does:
a member's step waits for its block, K/V blocks are forwarded as they arrive, and in the
backward a step's partial dK/dV (fp32) leaves once the step is computed. So a member's
pass is bounded below by its compute (its ring steps, and its local documents queued
after the ring's first step) and by what its port must carry: the ring's transfers and
whatever part of the layer's collectives runs beside them, shared fairly. Where the
port takes longer, the difference is exposed on every member of the ring.

`pcie_ring_exposed_seconds` prices that per rank, by pass, for the estimate the
partitioner compares its candidates by (`zeppelin.candidates`); `pcie_ring_seconds` one
ring's members. The last dK/dV hop home, after the ring's last step, is
`step_terms.final_grad_wait_seconds`' and not counted here. Level 1 prices these rings
with `ring_pricing.ring_exposed_seconds` (docs/design.md, section 5: within about 10% of
this here; priced so there instead, no plan of bench/hetero.py's changed).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import attention_flops, kv_bytes, kv_grad_bytes
from ballonet.cost.memory import recompute_mode
from ballonet.cost.recompute import recompute_attention
from ballonet.cost.seconds import (
    DP_BACKWARD_SHARE,
    DP_FORWARD_SHARE,
    attention_seconds,
    heads_kernel_seconds,
    linear_layer_seconds,
    p2p_time,
)
from ballonet.plan import Plan
from ballonet.planning.devices import Devices
from ballonet.planning.heads_exposure import heads_exposed_seconds
from ballonet.planning.ring_pricing import dp_intra_seconds
from ballonet.specs import ModelSpec

__all__ = ["PcieExposure", "backward_exposed_seconds", "forward_exposed_seconds", "pcie_ring_exposed_seconds",
           "pcie_ring_seconds", "ring_step_seconds"]


def forward_exposed_seconds(members: int, compute, kv: float, fill, dp_work: float):
    """Seconds one layer's forward of a ring of `members` leaves exposed on a member
    beyond its compute: K/V blocks go round as they arrive, `kv` seconds a hop alone, while
    its port also carries `dp_work` seconds of collectives from the pass's start, shared
    fairly (while both last each runs at half speed: the blocks are held back by as much
    as the collectives get, at most by their own seconds); its stream computes `members`
    ring steps of `compute` and, after the first, `fill` seconds of other work (its local
    documents, its other rings' steps). The last block's step follows its arrival:
    exposed is the blocks' chain beyond the compute's other steps and fill. `compute` and
    `fill` may be arrays (one value per member)."""
    chain = (members - 1) * kv
    return np.maximum(chain + min(max(dp_work, 0.0), chain) - (members - 1) * np.asarray(compute) - fill, 0.0)


def backward_exposed_seconds(members: int, compute, kv: float, grad: float, fill, dp_work):
    """`forward_exposed_seconds` for one layer's backward, its last partial dK/dV hop home
    (`grad` seconds) left out (`step_terms.final_grad_wait_seconds` prices it): a member's
    port carries K/V and a partial dK/dV a step, beside `dp_work` seconds of collectives
    (the pass's share less what ran alone during its linear layers, which the backward
    computes first), so the pass lasts at least those transfers; and from the third step
    on each member waits for its predecessor's partial, sent once that member's step is
    computed, so it lasts at least its steps or those partials' hops, step after step
    (other work does not hide these)."""
    compute = np.asarray(compute)
    chain = (members - 1) * (kv + grad)
    port = chain + np.minimum(np.maximum(dp_work, 0.0), chain) - grad - members * compute - fill
    return np.maximum(np.maximum(port, (members - 2) * np.maximum(grad - compute, 0.0)), 0.0)


def ring_step_seconds(model: ModelSpec, gpu: hardware.GPUType, blocks) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of one ring step of each member, `blocks` [docs, g]
    its rows of each document the ring runs (one kernel a step for all of them, at least
    a launch; a zig-zag step computes half of two such blocks); under full recomputation
    the backward's kernel reruns its forward."""
    rows = np.asarray(blocks, dtype=float)
    flops = 4.0 * model.num_heads * model.head_dim * rows * rows / 2  # `block_flops` of two full blocks, halved
    floor = hardware.profile(gpu).attention_launch_s
    on = rows.sum(axis=0) > 0
    length = np.maximum(rows, 1.0)  # (an empty block's efficiency: no FLOPs, no seconds)
    fwd = np.where(on, np.maximum(attention_seconds(model, gpu, flops, length).sum(axis=0), floor), 0.0)
    bwd = np.where(on, np.maximum(attention_seconds(model, gpu, flops, length, backward=True).sum(axis=0), floor), 0.0)
    return fwd, bwd + (fwd if recompute_attention(recompute_mode(model)) else 0.0)


def pcie_ring_seconds(model: ModelSpec, gpu: hardware.GPUType, blocks, members: int, link_bw: float,
                      ranks_per_node: int, fill=(0.0, 0.0), linear_backward=0.0,
                      steps: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds (all layers) each member of a ring of `members` ranks
    inside a PCIe-only node of `ranks_per_node` leaves exposed, each hop over `link_bw`
    bytes/s, the port shared with the layer's data-parallel collectives inside the node
    (`forward_exposed_seconds`, `backward_exposed_seconds`). `blocks` [docs, members]: each
    member's rows of each document the ring runs (`ring_step_seconds`); a hop carries the
    widest member's (every block goes round, so the widest paces the chain). Under full
    recomputation the rerun's K/V are taken as shared with the backward's, as the
    simulator takes them. `fill`: (forward, backward) seconds a layer of each member's
    other work between the ring's steps (its local documents, its other rings' steps);
    `linear_backward`: of its linear layers' backward; `steps`: the members'
    `ring_step_seconds`, when known."""
    rows = np.asarray(blocks, dtype=float).reshape(-1, members)
    if members < 2:
        return np.zeros(members), np.zeros(members)
    fwd, bwd = steps or ring_step_seconds(model, gpu, rows)
    widest = int(rows.max(axis=1).sum())  # the widest member's rows, summed over the documents
    kv = p2p_time(kv_bytes(model, widest), link_bw, False, gpu)
    grad = p2p_time(kv_grad_bytes(model, widest), link_bw, False, gpu)
    dp = dp_intra_seconds(model, gpu, ranks_per_node, link_bw)
    forward = forward_exposed_seconds(members, fwd, kv, fill[0], DP_FORWARD_SHARE * dp)
    backward = backward_exposed_seconds(members, bwd, kv, grad, fill[1],
                                        DP_BACKWARD_SHARE * dp - np.asarray(linear_backward))
    return model.num_layers * forward, model.num_layers * backward


@dataclass(frozen=True)
class PcieExposure:
    """[R] what rings inside PCIe-only nodes leave exposed on each rank in a step, by pass."""
    forward: np.ndarray
    backward: np.ndarray
    members: np.ndarray
    """[R] whether the rank is in such a ring."""

    def backward_skew(self, final: np.ndarray) -> np.ndarray:
        """[R] how much more of a rank's exposed seconds its backward holds than its
        forward, for `pricing.synchronous_step_seconds`, which splits what an estimate adds
        to compute evenly between the passes: these rings' own, and the members' last
        dK/dV hop home (`final`, [R]: `step_terms.final_grad_wait_seconds`), a backward's.
        Zeros where no rank is in such a ring."""
        return self.backward - self.forward + np.where(self.members, final, 0.0)


def pcie_ring_exposed_seconds(plan: Plan, dev: Devices, model: ModelSpec, link_bw: np.ndarray) -> PcieExposure:
    """What each member of a ring inside a PCIe-only node leaves exposed in a step, by
    pass (`pcie_ring_seconds`; rings over the same ranks run as one, as the simulator runs
    them; a member's local documents and its other rings' steps fill its waits), over
    its node's links of `link_bw[r]` bytes/s; zeros where no ring is inside such a node
    (NVLink nodes: the estimate is unchanged). A "heads" document's members, on any node,
    `heads_exposure.heads_exposed_seconds` (documents over the same ranks as one kernel)."""
    R = plan.num_ranks
    forward, backward, members = np.zeros(R), np.zeros(R), np.zeros(R, dtype=bool)
    groups: dict[tuple[int, ...], list] = defaultdict(list)
    heads: dict[tuple[int, ...], list] = defaultdict(list)
    for ring in plan.rings:
        r = ring.ranks[0]
        if ring.comm == "heads":
            heads[tuple(ring.ranks)].append(ring)
        elif (ring.comm == "ring" and dev.gpu[r].intra_link == "pcie"
                and all(dev.node[x] == dev.node[r] for x in ring.ranks)):
            groups[tuple(ring.ranks)].append(_block_tokens(ring.bounds, len(ring.ranks)))
    if not groups and not heads:
        return PcieExposure(forward=forward, backward=backward, members=members)
    mode = recompute_mode(model)
    redo = recompute_attention(mode)
    steps = {ranks: ring_step_seconds(model, dev.gpu[ranks[0]], rows) for ranks, rows in groups.items()}
    busy = np.zeros((2, R))  # (forward, backward) seconds a layer of each member's attention
    for ranks, (f, b) in steps.items():
        busy[:, list(ranks)] += len(ranks) * np.stack([f, b])
    kernels: dict[tuple[int, ...], np.ndarray] = {}  # a "heads" group's (forward, backward) kernel a member
    for ranks, rings in heads.items():
        lengths, gpu = [plan.lengths[ring.doc] for ring in rings], dev.gpu[ranks[0]]
        fk, bk = (heads_kernel_seconds(model, gpu, lengths, len(ranks), backward) for backward in (False, True))
        kernels[ranks] = np.array([[fk], [bk + (fk if redo else 0.0)]])
        busy[:, list(ranks)] += kernels[ranks]
    in_ring = plan.ring_of_doc
    on = sorted({r for ranks in groups for r in ranks} | {r for ranks in heads for r in ranks})
    local = [(r, s.num_tokens) for r in on for s in plan.attention[r] if s.doc not in in_ring]
    rank = np.array([r for r, _ in local], dtype=np.int64)
    tokens = np.array([n for _, n in local], dtype=float)
    linear, counts = np.zeros(R), np.asarray(plan.linear_token_counts, dtype=float)
    names = np.array([g.name for g in dev.gpu])
    for gpu in {dev.gpu[r].name: dev.gpu[r] for r in on}.values():
        mine = names[rank] == gpu.name
        if mine.any():
            flops = attention_flops(model, tokens[mine])
            f = attention_seconds(model, gpu, flops, tokens[mine])
            b = attention_seconds(model, gpu, flops, tokens[mine], backward=True)
            busy += np.stack([np.bincount(rank[mine], weights=f, minlength=R),
                              np.bincount(rank[mine], weights=b + (f if redo else 0.0), minlength=R)])
        sel = (names == gpu.name) & np.isin(np.arange(R), on)
        linear[sel] = linear_layer_seconds(model, gpu, counts[sel], mode, framework=False)[1]
    node_size = np.bincount(np.asarray(dev.node))
    for ranks, rows in groups.items():
        idx, g = list(ranks), len(ranks)
        other = busy[:, idx] - g * np.stack(steps[ranks])
        f, b = pcie_ring_seconds(model, dev.gpu[ranks[0]], rows, g, float(link_bw[ranks[0]]),
                                 int(node_size[dev.node[ranks[0]]]), (other[0], other[1]), linear[idx], steps[ranks])
        forward[idx] += f
        backward[idx] += b
        members[idx] = True
    for ranks, rings in heads.items():
        idx, r, gpu = list(ranks), ranks[0], dev.gpu[ranks[0]]
        other = busy[:, idx] - kernels[ranks]
        blocks = np.sum([_block_tokens(ring.bounds, len(ranks)) for ring in rings], axis=0)
        dp = dp_intra_seconds(model, gpu, int(node_size[dev.node[r]]), float(link_bw[r]))
        f, b = heads_exposed_seconds(model, gpu, [plan.lengths[ring.doc] for ring in rings], blocks,
                                     float(link_bw[r]), dp, (other[0], other[1]), linear[idx], rerun=redo)
        forward[idx] += f
        backward[idx] += b
        members[idx] = True
    return PcieExposure(forward=forward, backward=backward, members=members)


def _block_tokens(bounds, g: int) -> list[int]:
    """`Ring.block_tokens` of every position from the ring's bounds (its chunks i and 2g-1-i)."""
    return [max(bounds[i + 1] - bounds[i], 0) + max(bounds[2 * g - i] - bounds[2 * g - 1 - i], 0) for i in range(g)]
