"""A ring's exposed transfers, as the simulator runs its steps (docs/design.md, sections
4, 6 and 7): a zig-zag step computes half of two full blocks; a step waits for the
larger of its compute and its block's transfer; a routed hop across nodes passes its
blocks through dispatch, NIC legs and combine one after another (`crossing_pipeline`);
the layer's FSDP collectives share a ring's ports fairly while they last
(`dp_shared_seconds`), as the simulator's links share their bandwidth. A candidate's
single ring whose crossing hops routing cuts over several rails is run port by port
instead (`routed_ring.routed_exposed_seconds`; in the search's candidates
that can still win only, `crossing_rings.PortRuns`): the blocks its members relay
reach a crossing hop in bursts that share its ports, every block of a burst late.
`pricing` and `crossing_rings` add these to the partitioner's estimates
(`inter_node_span`, `rank_step_seconds`, `crossing_exposed_seconds`)."""

from __future__ import annotations

import functools
import heapq
import itertools

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import block_flops, grad_bytes, kv_bytes, kv_grad_bytes
from ballonet.cost.memory import recompute_mode
from ballonet.cost.recompute import recompute_attention
from ballonet.planning.routed_ring import routed_exposed_seconds, routed_ring_width
from ballonet.cost.seconds import DP_BACKWARD_SHARE, DP_FORWARD_SHARE, DP_PIECES, attention_seconds, collective_time, p2p_time, p2p_times
from ballonet.specs import ModelSpec

__all__ = ["crossing_pipeline", "crossing_seconds", "crossing_seconds_each", "double_exposed_seconds", "double_pass", "double_wait_seconds", "dp_intra_seconds", "dp_shared_seconds",
           "ring_exposed_seconds"]


def crossing_seconds(nbytes: float, nic_bw: float, intra_bw: float, rails: int, gpu: hardware.GPUType) -> float:
    """One node-crossing ring hop of `nbytes`, routed as `planning.routing` routes it: over
    the k of `rails` idle rail-aligned proxy pairs that cost least, or direct (k = 1). Its
    k - 1 dispatch messages of m/k leave the source one after another over `intra_bw`, as
    the k - 1 combine messages reach the destination, each paying a message's latency
    (as the simulator sends them); the NIC legs of m/k run in parallel at `nic_bw`."""
    return min(_routed_seconds(nbytes, nic_bw, intra_bw, rails, gpu))


def crossing_seconds_each(nbytes: np.ndarray, nic_bw: np.ndarray, intra_bw: np.ndarray, rails: np.ndarray,
                          gpu: hardware.GPUType) -> np.ndarray:
    """`crossing_seconds` of each hop of `nbytes` (arrays of hops on one GPU type)."""
    best = p2p_times(nbytes, nic_bw, True, gpu)
    for k in range(2, int(rails.max(initial=1)) + 1):
        routed = 2 * (k - 1) * p2p_times(nbytes / k, intra_bw, False, gpu) + p2p_times(nbytes / k, nic_bw, True, gpu)
        best = np.where(rails >= k, np.minimum(best, routed), best)
    return best


def _routed_seconds(nbytes: float, nic_bw: float, intra_bw: float, rails: int, gpu: hardware.GPUType) -> list[float]:
    """A crossing hop's seconds routed over k = 1, 2, ... `rails` proxy pairs (`crossing_seconds`)."""
    return [p2p_time(nbytes, nic_bw, True, gpu)] + [
        2 * (k - 1) * p2p_time(nbytes / k, intra_bw, False, gpu) + p2p_time(nbytes / k, nic_bw, True, gpu)
        for k in range(2, rails + 1)]


def ring_exposed_seconds(model: ModelSpec, gpu: hardware.GPUType, length: int, members: int, bandwidth: float,
                         nic: bool = True, routed: tuple[float, int] | None = None,
                         dp_piece: tuple[float, float] = (0.0, 0.0), dp_intra: float = 0.0, nodes: int = 0) -> float:
    """`_ring_exposed_seconds`; under a built-in profile (`hardware.calibrated`) once per
    ring shape: the partitioner prices the rings of a document alike in many candidates.
    With `nodes` (the ring's, its members spread evenly over them) and crossing hops that
    routing cuts over several rails, the ring run as the simulator runs it
    (`routed_exposed_seconds`)."""
    bandwidth, routed, dp_piece, dp_intra = _floats(bandwidth, routed, dp_piece, dp_intra)
    args = (model, gpu, length, members, bandwidth, nic, routed, dp_piece, dp_intra)
    width = routed_ring_width(model, length, members, nodes, bandwidth, routed) if nic else 0
    if width and routed is not None:
        return routed_exposed_seconds(model, gpu, length, members, nodes, bandwidth, routed[0], width, dp_piece[0],
                                      dp_intra)
    return _ring_exposed_seconds(*args) if hardware.calibrated(gpu) else _ring_exposed_builtin(*args)


def _floats(bandwidth, routed, dp_piece, dp_intra) -> tuple[float, tuple[float, int] | None, tuple[float, float],
                                                            float]:
    """The seconds and bandwidths of a ring's pricing as Python floats: callers index them
    out of numpy arrays, and a float's arithmetic gives numpy's scalars' values at a
    fraction of their cost (the same IEEE double operations)."""
    return (float(bandwidth), None if routed is None else (float(routed[0]), routed[1]),
            (float(dp_piece[0]), float(dp_piece[1])), float(dp_intra))


def _ring_exposed_seconds(model: ModelSpec, gpu: hardware.GPUType, length: int, members: int, bandwidth: float,
                          nic: bool, routed: tuple[float, int] | None, dp_piece: tuple[float, float],
                          dp_intra: float) -> float:
    """Seconds a ring of `members` ranks over a document of `length` tokens leaves its
    transfers exposed in a step (all layers), when each hop runs at `bandwidth` (the
    slowest hop: a NIC with `nic`, else NVLink or PCIe; with `routed` = (intra-node
    bandwidth, rails), a NIC hop routed over idle rails, `crossing_seconds`) and nothing
    else fills the wait: per ring step, the forward's K/V transfer and the backward's K/V
    plus dK/dV (fp32) beyond that step's compute; a NIC hop of a pass's first `DP_PIECES`
    steps also waits behind a piece of the layer's data-parallel collectives, queued at
    its start (`dp_piece`: forward, backward seconds, `cost.seconds.dp_piece_seconds`).
    A routed hop's blocks pass its dispatch, NIC legs and combine one after another
    (`crossing_pipeline`); in the forward its dispatching port also carries the layer's
    collectives inside the node (`dp_intra` seconds alone, `dp_intra_seconds`) beside its
    k parts (`dp_shared_seconds`)."""
    block = max(length // members, 1)
    flops = block_flops(model, block, block) / 2  # a zig-zag step: two of its two blocks' four chunk pairs

    def hop(nbytes: float) -> tuple[float, float, int]:
        """(the first block's seconds over the hop, then a block's each step, its parts)."""
        if nic and routed is not None:
            return crossing_pipeline(nbytes, bandwidth, routed[0], routed[1], gpu)
        t = p2p_time(nbytes, bandwidth, nic, gpu)
        return t, t, 1

    def exposed(transfer: tuple[float, float, int], compute: float, piece: float) -> float:
        first, each, _ = transfer
        queued = min(DP_PIECES, members - 1) if nic else 0
        return (queued * max(each + piece - compute, 0.0) + (members - 1 - queued) * max(each - compute, 0.0)
                + max(first - compute, 0.0) - max(each - compute, 0.0))
    kv_hop, fwd_c = hop(kv_bytes(model, block)), attention_seconds(model, gpu, flops, block, launch_floor=True)
    fwd = exposed(kv_hop, fwd_c, dp_piece[0])
    if kv_hop[2] > 1:
        fwd += dp_shared_seconds(kv_hop[1], fwd_c, members - 1, dp_intra, kv_hop[2])
    bwd = exposed(hop(kv_bytes(model, block) + kv_grad_bytes(model, block)),
                  attention_seconds(model, gpu, flops, block, backward=True, launch_floor=True), dp_piece[1])
    redo = 2 if recompute_attention(recompute_mode(model)) else 1
    return model.num_layers * (redo * fwd + bwd)


_ring_exposed_builtin = functools.lru_cache(maxsize=4096)(_ring_exposed_seconds)


def crossing_pipeline(nbytes: float, nic_bw: float, intra_bw: float, rails: int,
                      gpu: hardware.GPUType) -> tuple[float, float, int]:
    """A ring's node-crossing hop of `nbytes` a step, routed over the k of `rails` proxy
    pairs `crossing_seconds` picks: (the first block's seconds, its dispatch, NIC legs
    and combine one after another; then one block's a step, the slowest of the three
    stages, as blocks follow each other through them; k). The source's port carries k parts
    a step, its k - 1 dispatches and the combine of the hop into its node (every node a
    ring crosses is left and entered), as the destination's does."""
    seconds = _routed_seconds(nbytes, nic_bw, intra_bw, max(rails, 1), gpu)
    best = min(seconds)
    k = seconds.index(best) + 1  # the fewest pairs that cost least
    if k == 1:
        return best, best, 1
    return best, max(k * p2p_time(nbytes / k, intra_bw, False, gpu), p2p_time(nbytes / k, nic_bw, True, gpu)), k


def double_exposed_seconds(model: ModelSpec, gpu: hardware.GPUType, length: int, groups: int, group_size: int,
                           intra_bw: float, nic_bw: float, dp_piece: tuple[float, float] = (0.0, 0.0)) -> float:
    """`_double_exposed_seconds`, cached as `ring_exposed_seconds` is (its bandwidths and
    seconds as floats, `_floats`)."""
    args = (model, gpu, length, groups, group_size, float(intra_bw), float(nic_bw),
            (float(dp_piece[0]), float(dp_piece[1])))
    return _double_exposed_seconds(*args) if hardware.calibrated(gpu) else _double_exposed_builtin(*args)


def _double_exposed_seconds(model: ModelSpec, gpu: hardware.GPUType, length: int, groups: int, group_size: int,
                            intra_bw: float, nic_bw: float, dp_piece: tuple[float, float]) -> float:
    """Seconds a "double" ring (`ring_traffic.double_schedule`: `groups` nodes of
    `group_size` ranks) over a document of `length` tokens leaves its transfers exposed in
    a step (all layers), nothing else filling the wait: per inner step the K/V (backward:
    plus dK/dV) over NVLink beyond that step's compute, as `ring_exposed_seconds`, the
    forward's first inner steps sharing their ports with the layer's FSDP collectives
    inside the node and the backward's first round's partial dK/dV with the K/V blocks
    that round relays (`dp_shared_seconds`); per round one block over a NIC beyond the
    round's compute (the first `DP_PIECES` behind a `dp_piece`, as there); in the
    backward the last inner partial's hop, and each node's sum of a round's block home
    over a NIC, hidden by the next round's compute but the last."""
    k, n = groups, group_size
    block = max(length // (k * n), 1)
    flops = block_flops(model, block, block) / 2  # a zig-zag step (`ring_exposed_seconds`)
    fwd_c = attention_seconds(model, gpu, flops, block, launch_floor=True)
    bwd_c = attention_seconds(model, gpu, flops, block, backward=True, launch_floor=True)
    kv, grad = kv_bytes(model, block), kv_grad_bytes(model, block)
    x_kv, x_grad = p2p_time(kv, intra_bw, False, gpu), p2p_time(grad, intra_bw, False, gpu)
    steps = k * (n - 1)  # inner steps a pass
    inner_f = inner_b = 0.0
    if n > 1:
        inner_f = steps * max(x_kv - fwd_c, 0.0) + dp_shared_seconds(
            x_kv, fwd_c, steps, DP_FORWARD_SHARE * dp_intra_seconds(model, gpu, n, intra_bw))
        inner_b = (steps * max(x_kv + x_grad - bwd_c, 0.0) + dp_shared_seconds(x_grad, bwd_c, n - 1, (n - 1) * x_kv)
                   + x_grad)
    queued = min(DP_PIECES, k - 1)

    def rounds(compute: float, piece: float) -> float:
        out = p2p_time(kv, nic_bw, True, gpu)
        return queued * max(out + piece - n * compute, 0.0) + (k - 1 - queued) * max(out - n * compute, 0.0)
    home = p2p_time(grad, nic_bw, True, gpu)
    redo = 2 if recompute_attention(recompute_mode(model)) else 1
    forward = inner_f + rounds(fwd_c, dp_piece[0])
    backward = inner_b + rounds(bwd_c, dp_piece[1]) + (k - 2) * max(home - n * bwd_c, 0.0) + home
    return model.num_layers * (redo * forward + backward)


_double_exposed_builtin = functools.lru_cache(maxsize=4096)(_double_exposed_seconds)


def double_wait_seconds(model: ModelSpec, gpu: hardware.GPUType, length: int, groups: int, group_size: int,
                        intra_bw: float, nic_bw: float, node_ranks: int, lead: float = 0.0,
                        local: tuple[float, float] = (0.0, 0.0)) -> float:
    """`_double_wait_seconds`, cached as `ring_exposed_seconds` is. What the simulator
    runs (`tests/test_double_ring_pricing.py`); the partitioner still prices double rings
    by `double_exposed_seconds` (docs/design.md, section 4: why)."""
    args = (model, gpu, length, groups, group_size, float(intra_bw), float(nic_bw), node_ranks, float(lead),
            (float(local[0]), float(local[1])))
    return _double_wait_seconds(*args) if hardware.calibrated(gpu) else _double_wait_builtin(*args)


def _double_wait_seconds(model: ModelSpec, gpu: hardware.GPUType, length: int, groups: int, group_size: int,
                         intra_bw: float, nic_bw: float, node_ranks: int, lead: float,
                         local: tuple[float, float]) -> float:
    """Seconds a member of a "double" ring (`ring_traffic.double_schedule`: `groups` nodes
    of `group_size` ranks, equal blocks) over a document of `length` tokens waits in a
    step (all layers) beyond its compute, each pass as `double_pass` runs it: its port
    (`intra_bw`) shared with the layer's FSDP collectives inside its node of `node_ranks`
    ranks, its rounds' blocks and sums over a NIC share of `nic_bw`; `lead`: seconds of
    a layer's backward linear layers, which run before its attention (the collectives
    start with the layer), `local`: its local documents' attention a layer, forward and
    backward (under full recomputation the backward reruns the forward's kernels)."""
    k, n = groups, group_size
    block = max(length // (k * n), 1)
    flops = block_flops(model, block, block) / 2  # a zig-zag step (`ring_exposed_seconds`)
    fwd_c = attention_seconds(model, gpu, flops, block, launch_floor=True)
    bwd_c = attention_seconds(model, gpu, flops, block, backward=True, launch_floor=True)
    if recompute_attention(recompute_mode(model)):
        bwd_c += fwd_c
    kv, grad = kv_bytes(model, block), kv_grad_bytes(model, block)
    x_kv, x_grad = p2p_time(kv, intra_bw, False, gpu), p2p_time(grad, intra_bw, False, gpu)
    nic_kv, nic_grad = p2p_time(kv, nic_bw, True, gpu), p2p_time(grad, nic_bw, True, gpu)
    dp = dp_intra_seconds(model, gpu, node_ranks, intra_bw)
    forward = double_pass(k, n, fwd_c, x_kv, nic_kv, DP_FORWARD_SHARE * dp, local=local[0])
    backward = double_pass(k, n, bwd_c, x_kv, nic_kv, DP_BACKWARD_SHARE * dp, local=local[1], lead=lead,
                           grad=(x_grad, nic_grad))
    return model.num_layers * (forward + backward)


def double_pass(k: int, n: int, compute: float, x_kv: float, nic_kv: float, dp: float, local: float = 0.0,
                lead: float = 0.0, grad: tuple[float, float] | None = None) -> float:
    """What a member of a double ring of `k` node groups of `n` ranks waits in one layer's
    forward (or, with `grad`, backward) beyond its compute, every member alike, as
    `simulation.ring_patterns.double` runs it: round j's block reaches the member's node
    j NIC hops (`nic_kv` each) after the pass's attention starts and goes round the node's
    inner ring as soon as it is there, so the rounds' inner chains run at once, each hop
    (`x_kv` alone) sharing the member's port fairly (the simulator's processor sharing)
    with the other rounds' hops, the layer's FSDP collectives inside the node (`dp`
    alone, `lead` of them done before the attention starts) and in the backward the
    partial dK/dV it passes on after each step but a round's first (`grad`: its seconds
    over the port and over a NIC), for which the next step waits; a round's last partial
    closes its node's sum of the round's first block, which goes home over a NIC after
    the next round's first step (or the last step), the owner waiting for it. The member
    computes its steps in order, `compute` each, its local documents (`local`) after the
    first."""
    active: list[list] = []  # [seconds left alone, what its end starts]: transfers on the port
    pending: list[tuple] = []  # (start, order, seconds alone, what its end starts)
    order = itertools.count()
    block: dict = {}  # (round, step) -> when its block is at the member
    partial: dict = {}  # (round, step) -> when the predecessor's partial sent after that step is there
    stream = {"free": 0.0, "home": 0.0}
    step = [0]  # the member's next step

    def later(at: float, seconds: float, then) -> None:
        heapq.heappush(pending, (at, next(order), seconds, then))

    def hop(j: int, t: int):
        def there(at: float) -> None:
            block[j, t] = at
            if t < n - 1:
                later(at, x_kv, hop(j, t + 1))
        return there

    def arrived(j: int, t: int):
        return lambda at: partial.__setitem__((j, t), at)

    def run() -> None:  # the member's steps whose inputs are there, in order
        while step[0] < k * n:
            j, t = divmod(step[0], n)
            if (j, t) not in block:
                return
            done = max(stream["free"], block[j, t]) + compute
            if grad is not None:
                needs = (j, t - 1) if t >= 2 else (j - 1, n - 1) if t == 0 and j >= 1 and n > 1 else None
                if needs is not None:
                    if needs not in partial:
                        return
                    done = max(done, partial[needs])
                if t == 0 and j >= 1:  # the last round's node sum (n = 1: this step's block) goes home
                    stream["home"] = max(stream["home"], done + grad[1])
                if t >= 1:
                    later(done, grad[0], arrived(j, t))
            stream["free"] = done + (local if step[0] == 0 else 0.0)
            step[0] += 1

    for j in range(k):
        later(j * nic_kv, 0.0, hop(j, 0))
    if dp > lead:
        active.append([dp - lead, None])
    now = 0.0
    while True:
        run()
        if not active and not pending:
            break
        ends = now + min(a[0] for a in active) * len(active) if active else np.inf
        at = min(ends, pending[0][0]) if pending else ends
        for a in active:
            a[0] -= (at - now) / len(active)
        now = at
        if at < ends:
            _, _, seconds, then = heapq.heappop(pending)
            if seconds > 0:
                active.append([seconds, then])
            else:
                then(now)
            continue
        last = min(active, key=lambda a: a[0])
        active.remove(last)
        if last[1] is not None:
            last[1](now)
    end = stream["free"]
    if grad is not None:
        if n > 1:  # the last round's node sum, after the last step
            end = max(end, partial[k - 1, n - 1])
            stream["home"] = max(stream["home"], end + grad[1])
        end = max(end, stream["home"])
    return max(end - k * n * compute - local, 0.0)


_double_wait_builtin = functools.lru_cache(maxsize=4096)(_double_wait_seconds)


def dp_intra_seconds(model: ModelSpec, gpu: hardware.GPUType, ranks_per_node: int, intra_bw: float) -> float:
    """Seconds one layer's share of the gradient all-reduce holds each GPU's intra-node
    port alone (`cost.seconds.grad_allreduce_parts`' reduce-scatter and all-gather inside
    a node of `ranks_per_node` plan ranks); a layer's forward runs beside
    `DP_FORWARD_SHARE` of it, its backward beside `DP_BACKWARD_SHARE`. Cached as
    `ring_exposed_seconds` is: every ring of a candidate across nodes asks it."""
    args = (model, gpu, ranks_per_node, intra_bw)
    return _dp_intra_seconds(*args) if hardware.calibrated(gpu) else _dp_intra_builtin(*args)


def _dp_intra_seconds(model: ModelSpec, gpu: hardware.GPUType, ranks_per_node: int, intra_bw: float) -> float:
    n = ranks_per_node * model.tp
    return sum(collective_time(op, grad_bytes(model), n, intra_bw, gpu)
               for op in ("reduce_scatter", "all_gather")) / model.num_layers


_dp_intra_builtin = functools.lru_cache(maxsize=4096)(_dp_intra_seconds)


def dp_shared_seconds(transfer: float, compute: float, steps: int, work: float, parts: int = 1) -> float:
    """What a chain of `steps` ring steps (each a `transfer` of so many seconds alone, cut
    into `parts` flows, then a step of `compute`) leaves exposed when their port also
    carries `work` seconds of data-parallel collectives from the start, shared fairly
    (the simulator's processor sharing): while they last a transfer runs at
    parts / (parts + 1) of its speed, and the collectives progress by 1 / parts of its
    seconds, and alone for what the compute leaves; beyond what the steps expose without them."""
    if work <= 0 or steps <= 0 or transfer <= 0:
        return 0.0
    slowed = transfer * (parts + 1) / parts
    shared = min(work / (transfer / parts + max(compute - slowed, 0.0)), steps)
    return shared * (max(slowed - compute, 0.0) - max(transfer - compute, 0.0))
