"""What a "heads" document (DeepSpeed-Ulysses inside one node, `plan.Ring` comm "heads")
leaves exposed on its members, as the simulator runs it (`simulation.ring_patterns.heads`).

In each pass a member posts its rows of q, k and v (in the backward also o, dO and the
log-sum-exp: "dout") to every other member at once, runs its local documents meanwhile,
then its one kernel over the whole document for its heads once every gather is in, and
returns each member's rows of the result ("out"; "dqkv"); its pass ends once every other
member's return of its own rows is in. Nothing hides the returns, and the gathers only
behind the member's other work. Its node's ports also carry the layer's data-parallel
collectives (their intra-node part, `ring_pricing.dp_intra_seconds`), from the layer's
start (in the backward, alone during its linear layers): each port shares its bandwidth
fairly among what it carries (`simulation.timeline`), so a port's messages all posted at
once end after their own seconds plus as much of the collectives as its longest message
(processor sharing serves every flow alike). Under full recomputation the backward first
reruns the forward, its messages too.

`heads_exposed_seconds` prices one group of members; `pcie_rings.pcie_ring_exposed_seconds`
calls it for every "heads" group of a plan (on any node: over NVLink little but the wait
for the slowest member is left). A "heads" document has no trailing dK/dV hop
(`step_terms.final_grad_wait_seconds` leaves it out) and waits for its slowest member in
both passes here (`ring_waits.ring_wait_seconds` leaves it out).
"""

from __future__ import annotations

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import message_bytes
from ballonet.cost.seconds import DP_BACKWARD_SHARE, DP_FORWARD_SHARE, heads_kernel_seconds, p2p_time
from ballonet.specs import ModelSpec

__all__ = ["heads_exposed_seconds", "heads_pass_ends"]


def _drain(arrive: np.ndarray, work: np.ndarray) -> float:
    """When a fairly shared (work-conserving) port is done with messages of `work` seconds
    each posted at `arrive`: the latest post plus all the work posted at or after it."""
    order = np.argsort(arrive, kind="stable")
    a, w = arrive[order], work[order]
    return float(np.max(a + np.cumsum(w[::-1])[::-1]))


def heads_pass_ends(start, ready, gather, compute, back, dp) -> tuple[np.ndarray, np.ndarray]:
    """(ends, data-parallel seconds left) [g] of one gather, kernel and return of the g
    members of a "heads" group: member i posts its gathers at `start[i]` (`gather` [p, g]:
    seconds of its message of each payload p to each other member), its stream can run
    the kernel of `compute[i]` from `ready[i]` once every gather into it is in, then it
    returns each other member j's rows (`back[j]` seconds, to j); `dp` [g]: seconds of the
    layer's collectives left on each member's port at `start`, shared fairly with the
    messages (`_drain`)."""
    start, ready, compute, back, dp = (np.asarray(x, dtype=float) for x in (start, ready, compute, back, dp))
    gather = np.asarray(gather, dtype=float).reshape(-1, len(start))
    g = len(start)
    others = ~np.eye(g, dtype=bool)
    each = gather.sum(axis=0)  # [g] member j's messages to one other member
    longest = gather.max(axis=0)
    out_done = start + (g - 1) * each + np.minimum(dp, longest)
    in_done = np.array([_drain(start[others[i]], each[others[i]]) + min(dp[i], longest[others[i]].max())
                        for i in range(g)])
    gathered = np.array([max(in_done[i], out_done[others[i]].max()) for i in range(g)])
    ends = np.maximum(gathered, ready) + compute
    port = np.maximum(out_done, in_done)
    left = np.maximum(dp - np.minimum(dp, longest) - np.maximum(ends - compute - port, 0.0), 0.0)
    sent = np.array([back[others[j]].sum() for j in range(g)])
    widest = np.array([back[others[j]].max() for j in range(g)])
    out_back = ends + sent + np.minimum(left, widest)
    in_back = np.array([_drain(ends[others[i]], np.full(g - 1, back[i])) + min(left[i], back[i]) for i in range(g)])
    done = np.array([max(in_back[i], out_back[others[i]].max()) for i in range(g)])
    return done, np.maximum(left - np.minimum(left, np.maximum(widest, back)), 0.0)


def heads_exposed_seconds(model: ModelSpec, gpu: hardware.GPUType, lengths, blocks, link_bw: float, dp: float,
                          fill=(0.0, 0.0), linear_backward=0.0, rerun: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds (all layers) each member of a "heads" group leaves
    exposed beyond its kernels and `fill`: documents of `lengths` tokens, `blocks` [g]
    each member's rows of them, messages over `link_bw` bytes/s, `dp` seconds of one
    layer's data-parallel collectives on each port inside the node
    (`ring_pricing.dp_intra_seconds`; the forward runs beside `DP_FORWARD_SHARE` of them,
    the backward beside `DP_BACKWARD_SHARE`, less what ran during its linear layers).
    `fill`: (forward, backward) seconds a layer of each member's other attention work (its
    local documents, its other rings), run while the gathers travel; `linear_backward`: of
    its linear layers' backward (before its attention); `rerun`: full recomputation (the
    backward reruns the forward, kernel and messages, and `fill[1]` holds the local
    documents' rerun too)."""
    rows = np.asarray(blocks, dtype=float)
    g = len(rows)
    if g < 2:
        return np.zeros(g), np.zeros(g)

    def seconds(payload: str, n: np.ndarray) -> np.ndarray:
        return np.array([p2p_time(message_bytes(model, payload, x, g), link_bw, False, gpu) for x in n])

    qkv, out, dout, dqkv = (seconds(p, rows) for p in ("qkv", "out", "dout", "dqkv"))
    c_f = np.full(g, heads_kernel_seconds(model, gpu, lengths, g))
    c_b = np.full(g, heads_kernel_seconds(model, gpu, lengths, g, backward=True))
    fill_f, fill_b = (np.broadcast_to(np.asarray(x, dtype=float), (g,)) for x in fill)
    zero = np.zeros(g)
    done, _ = heads_pass_ends(zero, fill_f, qkv, c_f, out, np.full(g, DP_FORWARD_SHARE * dp))
    forward = done - fill_f - c_f
    start = np.broadcast_to(np.asarray(linear_backward, dtype=float), (g,))
    left = np.maximum(DP_BACKWARD_SHARE * dp - start, 0.0)
    ready, redo = start + fill_b, zero
    if rerun:
        start, left = heads_pass_ends(start, ready, qkv, c_f, out, left)
        ready, redo = start, c_f
    done, _ = heads_pass_ends(start, ready, np.stack([qkv, dout]), c_b, dqkv, left)
    backward = done - np.broadcast_to(np.asarray(linear_backward, dtype=float), (g,)) - fill_b - c_b - redo
    return model.num_layers * forward, model.num_layers * backward
