"""Every transfer the runtime posts for a plan, on every rank, recorded in one process and
replayed under NCCL's rules (`replay.py`): `check_schedule`, `ballonet plan --check-schedule`.

Each rank runs its part of one training step (`record`): the plan check, the token ids'
remap, then per layer the remap of q, k, v to the attention layout, the attention
forward and the remap of its output back (as `training.parallelism.model.Block` and
`integrations.hf` run a layer), and the backward in reverse, by default with full
recomputation (the layer's forward, exchanges included, rerun before its backward).
The attention passes run the engine's own code (`engine.run_pass`, `ring.ring_pass`,
`heads.heads_pass`, `routing.relay_pass`, `comm.drive`) against `Recorder`, a stand-in
for `comm.P2P` that records each round's batches (`comm.round_batches`, as `P2P.post`
forms them) instead of sending them, with `Rows` standing in for K/V blocks (and a
"heads" document's buffers): nothing is computed or sent, so a 1024-rank plan is
recorded in seconds.
"""

from __future__ import annotations

import gc

import torch

from ballonet.plan import Plan
from ballonet.runtime.comm import Pending, Post, Sent, round_batches
from ballonet.runtime.engine import run_pass
from ballonet.runtime.heads import heads_pass
from ballonet.runtime.replay import ScheduleBuilder, ScheduleCheck, replay
from ballonet.runtime.ring import all_ring_metas, ring_pass, ring_queue
from ballonet.runtime.routing import relay_meta, routes_by_hop

__all__ = ["Recorder", "Rows", "check_schedule", "record"]


class Rows:
    """A stand-in for a stack of row blocks [lead, rows, ...] (a K/V block: lead 2; a
    "heads" document's buffers: one per member) or for one of them [rows, ...] (lead 0)
    in a recording: only its rows and element type matter. It has the few tensor methods
    the ring and heads loops use on blocks."""

    __slots__ = ("rows", "dtype", "lead")

    def __init__(self, rows: int, dtype: torch.dtype, lead: int = 2):
        self.rows, self.dtype, self.lead = rows, dtype, lead

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.lead, self.rows) if self.lead else (self.rows,)

    def numel(self) -> int:
        return self.rows * max(self.lead, 1)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def new_empty(self, shape, dtype: torch.dtype | None = None) -> Rows:
        return Rows(shape[1], dtype or self.dtype, shape[0])

    new_zeros = new_empty

    def __getitem__(self, index) -> Rows:
        """x[j] (one block), x[j, a:b] (its rows a:b) or x[:, a:b] (rows a:b of each)."""
        if isinstance(index, int):
            return Rows(self.rows, self.dtype, 0)
        first, rows = index
        return Rows(len(range(*rows.indices(self.rows))), self.dtype, 0 if isinstance(first, int) else self.lead)

    def __setitem__(self, index, value) -> None:
        pass

    def unbind(self, dim: int = 0) -> tuple[Rows, ...]:
        return tuple(Rows(self.rows, self.dtype, 0) for _ in range(self.lead))

    def __iadd__(self, other) -> Rows:
        return self

    def __add__(self, other) -> Rows:
        return self

    __radd__ = __add__


class Recorder:
    """`comm.P2P`'s interface, recording one rank's pass into a `ScheduleBuilder`."""

    def __init__(self, builder: ScheduleBuilder, rank: int, phase: str, order: int, *, has_outer: bool,
                 row_elems: int = 1):
        self.builder, self.rank, self.phase, self.order = builder, rank, phase, order
        self.has_outer, self.row_elems = has_outer, row_elems
        self._inflight: list[int] = []

    def empty(self, like, rows: int, dtype: torch.dtype | None = None) -> Rows:
        return Rows(rows, dtype or like.dtype, like.lead)

    def ready(self) -> int:
        return self.builder.mark(self.rank)

    def wait(self, pending: Pending) -> None:
        self.builder.wait(self.rank, pending.works)

    def finish(self) -> None:
        self.builder.wait(self.rank, self._inflight)
        self._inflight = []

    def post(self, posts: list[Post]) -> list[Sent]:
        """One batch per group of the round's messages (`comm.round_batches`, as
        `P2P.post` forms them), posted after the compute marks and batches their sends
        wait for."""
        label = ((self.order, *posts[0].key), self.phase)
        ids: dict[str, dict[int, int]] = {}
        for role, items in round_batches(posts, self.has_outer):
            sends, recvs, marks, after, owners, senders = [], [], [], [], set(), set()
            for receive, peer, tag, i, t in items:
                owners.add(i)
                (recvs if receive else sends).append((peer, t.numel() * t.element_size() * self.row_elems, tag))
                if not receive and i not in senders:
                    senders.add(i)
                    if posts[i].ready is not None:
                        marks.append(posts[i].ready)
                    for before in posts[i].after:
                        after.extend(before.works)
            b = self.builder.batch(self.rank, role, sends, recvs, marks=marks, after=after, label=label)
            self._inflight.append(b)
            ids[role] = dict.fromkeys(owners, b)
        inner, across = ids.get("inner", {}), ids.get("across", {}) if self.has_outer else ids.get("inner", {})
        return [Sent(inner=Pending(works=[inner[i]]) if i in inner else _NONE,
                     across=Pending(works=[across[i]]) if i in across else _NONE) for i in range(len(posts))]


_NONE = Pending()
"""What a task waits for after a round in which it posted nothing on a group (read only)."""


def _queues(plan: Plan, routes: dict) -> list[tuple]:
    """Every rank's queue, as `engine.rank_queue` orders it, in one pass over the plan."""
    position = {index: i for i, index in enumerate(ring_queue(plan))}
    entries = [[(position[m.index], 0, m) for m in metas] for metas in all_ring_metas(plan, routes)]
    routed_docs = {r.doc for r in plan.routes}
    for index, ring in enumerate(plan.rings):
        if ring.doc not in routed_docs:
            continue
        for rank in sorted({r for route in plan.routes if route.doc == ring.doc for pair in route.proxies for r in pair}):
            relay = relay_meta(plan, index, rank, routes)
            if relay is not None:
                entries[rank].append((position[index], 1, relay))
    return [tuple(x for *_, x in sorted(e, key=lambda e: e[:2])) for e in entries]


def record(plan: Plan, *, layers: int = 1, recompute: bool = True, outer_group: bool = True,
           kv_dtype: torch.dtype = torch.bfloat16, row_elems: int = 1) -> ScheduleBuilder:
    """Every rank's transfers of one training step on `plan` (module docstring), with
    `layers` layers, full recomputation or none, and double rings' transfers across nodes
    on their own group (`outer_group`, as the trainer runs them) or on the one group.
    Bytes are rows x `row_elems` (K/V heads x head size) x the element size ("heads"
    documents' messages too, not their true widths: the replay needs only that both
    ends agree)."""
    builder = ScheduleBuilder(plan.num_ranks)
    queues = _queues(plan, routes_by_hop(plan))
    has_outer = outer_group and any(r.comm == "double" for r in plan.rings)
    for rank, queue in enumerate(queues):
        _record_rank(builder, plan, rank, queue, layers, recompute, has_outer, kv_dtype, row_elems)
    return builder


def _record_rank(builder, plan, rank, queue, layers, recompute, has_outer, kv_dtype, row_elems) -> None:
    order = iter(range(1 << 30))

    def collective(name: str) -> None:
        o = next(order)
        builder.collective(rank, "inner", name, label=((o, -1, 0, 0), f"{name} (collective {o})"))

    def attention(backward: bool, name: str) -> None:
        p2p = Recorder(builder, rank, name, next(order), has_outer=has_outer, row_elems=row_elems)

        def ring_task(ring):
            kv = Rows(ring.block_rows[ring.position], kv_dtype)
            grad = (lambda step, held: held.new_zeros(held.shape, dtype=torch.float32)) if backward else \
                (lambda step, held: None)
            return (yield from ring_pass(p2p, ring, kv, grad))

        def heads_task(ring):
            # What `heads.heads_forward` and `heads_backward` send: q, k, v (and o, dO; the
            # LSE) per member, and o and the LSE (dq, dk, dv) back.
            g, n_max = len(ring.ranks), max(ring.block_rows)
            sent = (kv_dtype, kv_dtype, torch.float32) if backward else (kv_dtype,)
            back = (kv_dtype,) if backward else (kv_dtype, torch.float32)
            parts = [Rows(ring.block_rows[ring.position], dtype, g) for dtype in sent]
            return (yield from heads_pass(p2p, ring, parts, lambda got: [Rows(n_max, dtype, g) for dtype in back]))

        run_pass(p2p, queue, ring_task, heads_task, lambda: None, Rows(0, kv_dtype), backward)

    def remap(name: str) -> None:
        if plan.remap:
            collective(name)

    def layer_forward(what: str) -> None:
        remap(f"{what} remap of q, k, v")
        attention(False, what)
        remap(f"{what} remap of the output")

    if plan.num_ranks > 1:
        collective("plan check")
        builder.host_sync(rank)
    remap("token ids' remap")
    for _ in range(layers):
        layer_forward("forward")
    for _ in range(layers):
        if recompute:
            layer_forward("recomputed forward")
        remap("backward remap of the output")
        attention(True, "backward")
        remap("backward remap of q, k, v")


def check_schedule(plan: Plan, **options) -> ScheduleCheck:
    """Record every rank's transfers of one step on `plan` (`record(plan, **options)`)
    and replay them under NCCL's rules."""
    # Hundreds of thousands of small, acyclic objects: the cyclic collector would only
    # rescan them (it doubles the time at 1024 ranks).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return replay(record(plan, **options))
    finally:
        if enabled:
            gc.enable()
