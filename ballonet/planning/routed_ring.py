"""A single ring across nodes whose crossing hops are routed over the nodes' rails, run
as the simulator runs it (docs/design.md, sections 4, 6 and 7): every member forwards a
block as soon as it is there, so blocks reach a crossing hop's dispatching port faster
than the members compute them and queue there, and every link shares its bandwidth
fairly among the transfers on it (processor sharing: the blocks of such a burst all
arrive late, not one after another); in the backward each member waits for its
predecessor's partial dK/dV after its step's compute, and those partials cross the same
routed hops behind the relayed K/V. `pass_wait` gives what a member waits beyond its
compute in one layer's pass; `ring_pricing` prices large routed rings by it."""

from __future__ import annotations

import heapq
import itertools

from ballonet.cost.seconds import DP_PIECES

__all__ = ["pass_wait"]


class _Links:
    """Links that share their bandwidth equally among the transfers on them, each link its
    own share (the simulator's `timeline.Timeline`): a transfer of d seconds alone that
    joins a link at virtual time v leaves it at v + d; it is done when every link it
    crosses has carried it. Links are numbered; `run` advances them and the transfers
    `later` queues to start, calling what each finished transfer starts."""

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
