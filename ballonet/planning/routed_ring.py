"""A single ring across nodes whose crossing hops are routed over the nodes' rails, run
as the simulator runs it (docs/design.md, sections 4, 6 and 7): every member forwards a
block as soon as it is there, so blocks reach a crossing hop's dispatching port faster
than the members compute them and queue there, and every link shares its bandwidth
fairly among the transfers on it (processor sharing: the blocks of such a burst all
arrive late, not one after another); in the backward each member waits for its
predecessor's partial dK/dV after its step's compute, and those partials cross the same
routed hops behind the relayed K/V. `pass_wait` gives what a member waits beyond its
compute in one layer's pass, `routed_waits` and `routed_exposed_seconds` what a ring's
members wait in a layer and a step, as `ring_pricing` and `crossing_rings` price large
routed rings; `routed_width` how many rails routing cuts a crossing hop over."""

from __future__ import annotations

import functools
import heapq
import itertools

from ballonet.cost import hardware
from ballonet.cost.flops import block_flops, kv_bytes, kv_grad_bytes
from ballonet.cost.memory import recompute_mode
from ballonet.cost.recompute import recompute_attention
from ballonet.cost.seconds import DP_PIECES, attention_seconds, p2p_time
from ballonet.planning.routing import best_width
from ballonet.specs import ModelSpec

__all__ = ["pass_wait", "routed_exposed_seconds", "routed_ring_width", "routed_waits", "routed_width"]


class _Links:
    """Links that share their bandwidth equally among the transfers on them, each link its
    own share (the simulator's `timeline.Timeline`): a transfer of d seconds alone that
    joins a link at virtual time v leaves it at v + d; it is done when every link it
    crosses has carried it. Links are numbered; `run` advances them and the transfers
    `later` queues to start, calling what each finished transfer starts. The model is
    written out here and in the timeline's loop alike: one implementation of it in
    `ballonet.cost` for both gave the same results at a call per join, end and
    rescheduling, 10-15% more instructions in `pass_wait` and 7-10% in `Timeline.run`
    (callgrind, 2026-12-07)."""

    def __init__(self, count: int) -> None:
        self.on = [0] * count  # transfers on each link
        self.virtual = [0.0] * count  # each link's virtual time at `real`
        self.real = [0.0] * count
        self.tags: list[list] = [[] for _ in range(count)]  # (virtual end, transfer) heaps
        self.version = [0] * count
        self.events: list = []  # (time, order, link, version)
        self.starts: list = []  # (time, order, seconds, links, what its end starts)
        self.left: dict = {}  # transfer -> [links still carrying it, what its end starts]
        self.order = itertools.count()

    def later(self, at: float, seconds: float, links: tuple, then) -> None:
        heapq.heappush(self.starts, (at, next(self.order), seconds, links, then))

    def run(self, settle) -> None:
        """Until no transfer is left: `settle()` after every instant's ends and starts."""
        on, virtual, real, tags, version = self.on, self.virtual, self.real, self.tags, self.version
        events, starts, left, order = self.events, self.starts, self.left, self.order
        push, pop, inf = heapq.heappush, heapq.heappop, float("inf")
        dirty: set = set()  # links whose next end changed
        while True:
            settle()
            for link in dirty:
                version[link] += 1
                if on[link]:
                    push(events, (real[link] + (tags[link][0][0] - virtual[link]) * on[link], next(order), link,
                                  version[link]))
            dirty.clear()
            while events and events[0][3] != version[events[0][2]]:  # ends a later change replaced
                pop(events)
            first_start = starts[0][0] if starts else inf
            first_end = events[0][0] if events else inf
            if first_start == first_end == inf:
                return
            if first_start <= first_end:  # every transfer starting now, then the links' ends
                while starts and starts[0][0] == first_start:
                    at, _, seconds, links, then = pop(starts)
                    if seconds <= 0:
                        then(at)
                        continue
                    tid = next(order)
                    left[tid] = [len(links), then]
                    for link in links:
                        n = on[link]
                        if n:
                            virtual[link] += (at - real[link]) / n
                        real[link] = at
                        on[link] = n + 1
                        push(tags[link], (virtual[link] + seconds, tid))
                        dirty.add(link)
                continue
            at, _, link, _ = pop(events)
            heap = tags[link]
            tag, tid = pop(heap)
            finished = [tid]
            while heap and heap[0][0] <= tag:
                finished.append(pop(heap)[1])
            on[link] -= len(finished)
            virtual[link], real[link] = tag, at
            dirty.add(link)
            for tid in finished:
                entry = left[tid]
                entry[0] -= 1
                if entry[0] == 0:
                    del left[tid]
                    entry[1](at)


def pass_wait(per_node: int, members: int, rails: int, compute: float, kv: tuple[float, float, float],
              grad: tuple[float, float, float] | None = None, dp: tuple[float, float] = (0.0, 0.0),
              nodes: int = 1) -> tuple[float, float]:
    """(Seconds the member of a ring of `members` that waits most waits beyond its compute in
    one layer's forward (or, with `grad`, backward), and of those the wait before its
    second step, which its local documents fill: the runtime queues them there): `per_node` members on each node in
    ring order (a node's last member sends to the next node's first), each step `compute`;
    `kv`: seconds alone of a block over NVLink, and of one of its `rails` parts over
    NVLink and over a NIC: a crossing hop's parts are dispatched from the source to the
    node's rank of each local index, sent over that rail's NIC and combined on the far node
    by its rank of that index, as `simulation.fabric.send_routed` sends them; `grad`: the
    same of a partial dK/dV (the wait for the member's own block's sum after its last step
    is not counted: `step_terms.final_grad_wait_seconds` prices it). `dp`: (seconds of the layer's FSDP collectives inside a node
    alone on each rank's ports, of one NIC piece of them): `DP_PIECES` pieces on the ports
    from the start, then on the NICs to the next node, as `layer_graph.data_parallel` runs
    them. Every node runs alike, so `nodes` = 1 (the default) runs one node whose crossing
    hop arrives back at it, standing for its predecessor's; more run that many nodes of the
    ring (`members` a multiple of them), which gives the same."""
    g, n = nodes * per_node, per_node  # members run, each one's steps: `members`
    width = max(n, rails)
    links = _Links(3 * nodes * width)
    later = links.later

    def port(j: int, x: int, y: int, z: int) -> tuple:  # node j's rank x -> node y's rank z, over NVLink
        return (j * width + x, (nodes + y) * width + z)

    def nic_link(j: int, r: int) -> tuple:  # node j's NIC of rail r -> the next node's: the one
        return ((2 * nodes + j) * width + r,)  # link stands for both NICs, which carry the same transfers

    def send(i: int, at: float, what: tuple[float, float, float], then) -> None:
        """Member i's block (or partial) to its successor, arriving: then(time)."""
        (j, x), (y, z) = divmod(i, n), divmod((i + 1) % g, n)
        if x < n - 1:
            later(at, what[0], port(j, x, y, z), then)
            return
        count = [rails]

        def part_done(t: float) -> None:
            count[0] -= 1
            if count[0] == 0:
                then(t)
        for r in range(rails):
            def combine(t: float, r=r) -> None:
                if r == z:
                    part_done(t)
                else:
                    later(t, what[1], port(y, r, y, z), part_done)

            def nic(t: float, r=r, combine=combine) -> None:
                later(t, what[2], nic_link(j, r), combine)
            if r == x:
                nic(at)
            else:
                later(at, what[1], port(j, x, j, r), nic)

    kv_at: dict = {}  # (member, step) -> when its block is there
    dkv_at: dict = {}  # (member, step) -> when its predecessor's partial for that step is there
    free = [0.0] * g
    step = [0] * g
    end = [0.0] * g
    first = [0.0] * g  # what each member waits before its second step
    dirty: set = set()

    def arrived(table: dict, i: int, s: int):
        def there(t: float) -> None:
            table[i, s] = t
            dirty.add(i)
            if table is kv_at and s < members - 1:
                send(i, t, kv, arrived(kv_at, (i + 1) % g, s + 1))
        return there

    def run(i: int) -> None:  # member i's steps whose inputs are there, in order
        while step[i] < members:
            s = step[i]
            if (i, s) not in kv_at:
                return
            if s == 1:
                first[i] = max(kv_at[i, s] - free[i], 0.0)
            done = max(free[i], kv_at[i, s]) + compute
            if grad is not None and s >= 1:  # the partial of the block held at step s (from step 2 on)
                if s >= 2:
                    if (i, s) not in dkv_at:
                        return
                    done = max(done, dkv_at[i, s])
                send(i, done, grad, arrived(dkv_at, (i + 1) % g, s + 1))
            free[i] = done
            step[i] += 1
        end[i] = free[i]

    for i in range(g):
        arrived(kv_at, i, 0)(0.0)
    for j in range(nodes if dp[0] > 0 or dp[1] > 0 else 0):
        for x in range(width):
            chain = [(dp[0] / DP_PIECES, port(j, x, j, x))] * (DP_PIECES if dp[0] > 0 else 0) + \
                [(dp[1], nic_link(j, x))] * (DP_PIECES if dp[1] > 0 else 0)

            def piece(t: float, rest=tuple(chain)) -> None:
                if rest:
                    later(t, rest[0][0], rest[0][1], lambda t2, more=rest[1:]: piece(t2, more))
            piece(0.0)

    def settle() -> None:
        while dirty:
            run(dirty.pop())
    links.run(settle)
    most = max(range(g), key=lambda i: end[i])
    return max(end[most] - members * compute, 0.0), first[most]


def routed_exposed_seconds(model: ModelSpec, gpu: hardware.GPUType, length: int, members: int, nodes: int,
                           nic_bw: float, intra_bw: float, width: int, dp_piece: float, dp_intra: float,
                           local: tuple[float, float] = (0.0, 0.0)) -> float:
    """Seconds the member of a single ring across `nodes` nodes that waits most waits
    beyond its compute in a step (all layers), its local documents (`local`: one layer's,
    forward and backward) filling the wait before its second step (`routed_waits`)."""
    (fwd, fwd_first), (bwd, bwd_first) = routed_waits(model, gpu, length, members, nodes, nic_bw, intra_bw, width,
                                                      dp_piece, dp_intra)
    return model.num_layers * (fwd - min(fwd_first, local[0]) + bwd - min(bwd_first, local[1]))


def routed_waits(model: ModelSpec, gpu: hardware.GPUType, length: int, members: int, nodes: int,
                 nic_bw: float, intra_bw: float, width: int, dp_piece: float, dp_intra: float) \
        -> tuple[tuple[float, float], tuple[float, float]]:
    """(forward, backward) of one layer: (seconds the member of a single ring across
    `nodes` nodes that waits most waits beyond its compute, of which before its second
    step), its crossing hops cut over `width` rails as
    `planning.routing` cuts them, run as the simulator runs them
    (`routed_ring.pass_wait`): blocks relayed as soon as they are there reach a crossing
    hop in bursts that share its ports, and in the backward the partial dK/dV queue behind
    the relayed K/V; the forward's ports and NICs also carry the layer's FSDP collectives
    (`dp_intra` seconds alone on a port, pieces of `dp_piece` on a NIC). The backward's
    collectives run beside its linear layers, before its attention. Under full
    recomputation the backward's steps rerun the forward's kernels."""
    nic_bw, intra_bw, dp_piece, dp_intra = float(nic_bw), float(intra_bw), float(dp_piece), float(dp_intra)
    block = max(length // members, 1)
    flops = block_flops(model, block, block) / 2  # a zig-zag step (`ring_exposed_seconds`)
    fwd_c = attention_seconds(model, gpu, flops, block, launch_floor=True)
    bwd_c = attention_seconds(model, gpu, flops, block, backward=True, launch_floor=True)
    if recompute_attention(recompute_mode(model)):
        bwd_c += fwd_c
    per_node = -(-members // nodes)  # a node of the most members stands for each (`pass_wait`)

    def seconds(nbytes: float) -> tuple[float, float, float]:
        return (p2p_time(nbytes, intra_bw, False, gpu), p2p_time(nbytes / width, intra_bw, False, gpu),
                p2p_time(nbytes / width, nic_bw, True, gpu))
    kv = seconds(kv_bytes(model, block))
    forward = _pass_wait(per_node, members, width, fwd_c, kv, None, (dp_intra, dp_piece))
    backward = _pass_wait(per_node, members, width, bwd_c, kv, seconds(kv_grad_bytes(model, block)), (0.0, 0.0))
    return forward, backward


_pass_wait = functools.lru_cache(maxsize=4096)(pass_wait)
"""`routed_ring.pass_wait`, once per pass shape: its arguments are seconds, so recomputation
modes that run the same steps (and profiles that give the same seconds) share it."""


def routed_ring_width(model: ModelSpec, length: int, members: int, nodes: int, nic_bw: float,
                      routed: tuple[float, int] | None) -> int:
    """The rails a single ring of `members` over `nodes` nodes (0: unknown) has its crossing
    hops cut over (`routed_width`) where that is 2 or more, else 0 (priced hop by hop)."""
    if routed is None or nodes < 2 or members <= nodes:
        return 0
    width = routed_width(kv_bytes(model, max(length // members, 1)), nic_bw, routed[0], routed[1])
    return width if width > 1 else 0


def routed_width(nbytes: float, nic_bw: float, intra_bw: float, rails: int) -> int:
    """How many rails `planning.routing` cuts a crossing hop of `nbytes` a step over, no
    other hop loading them (`routing.best_width`); under the built-in reference profile,
    which prices it, once per hop shape: the search's candidates hold rings of the same
    documents over the same nodes again and again."""
    args = (nbytes, nic_bw, intra_bw, rails)
    return _routed_width(*args) if hardware.calibrated(None) else _routed_width_builtin(*args)


def _routed_width(nbytes: float, nic_bw: float, intra_bw: float, rails: int) -> int:
    return best_width(nbytes, 0.0, [0.0] * max(rails, 1), (intra_bw, intra_bw), nic_bw)


_routed_width_builtin = functools.lru_cache(maxsize=4096)(_routed_width)
