"""Split documents: per-rank ring metadata from the plan, and the one ring loop that both
the forward and the backward run.

A rank at ring position p holds the block of p: its zig-zag chunks p and 2g-1-p
(`Ring.chunks_of`), K and V stacked as kv [2, rows, H_kv, D]. At step s it holds the
block of position `Ring.schedule()`[p, s] ((p - s) mod g for "ring"). Which of its query
chunks see which key chunks follows from document offsets: a key chunk that ends before a
query chunk starts is seen whole, the rank's own block (step 0) is causal, a later chunk
is not seen. The own block is causal as one square sequence because a rank's chunks are
in document order.

The loops are tasks for `comm.drive`: at each step a ring yields its transfers of round
(step, KV, stage), computes on the block it holds, and in the backward yields its dK/dV
of round (step, GRAD, stage) (`comm.py`: every task's messages of a round are posted as
one batch per group). A hop between ring positions may be routed over proxies
(`routing.Hop`): the ring posts its first leg at stage 0 and receives the last leg at the
stage that leg is (0 to 2); the proxies forward the rest in `routing.relay_pass`.

A "heads" document is a `RingMeta` too (its calls a `heads.HeadsCalls`), run by its own
task (`heads.heads_pass`) rather than this loop.

A "double" ring (k node groups of n ranks, node-major) runs k rounds of n steps: in each
round an inner ring over n ranks inside each node, as "ring" does; at a round's first step
each rank also sends the block it holds to the same position of the next group, which
computes with it at the next round's first step, so it has the whole round to arrive. In
the backward the inner ring sums each round's first block over the node, and that sum
goes straight to the block's owner (in the next round's first GRAD round). Its hops are
direct (only "ring" hops are routed); those across nodes go over `P2P.outer` when the
caller gives that second group.

Overlap: a step's transfers are posted before its compute; they carry the block held,
received in the step before, so on CUDA they run as soon as it has arrived, beside the
compute (comm.py). On gloo (CPU) a wait blocks the host; results are the same either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch

from ballonet.plan import Plan, Ring
from ballonet.runtime.comm import GRAD, KV, NUM_STAGES, P2P, Message, Pending, Post, Sent
from ballonet.runtime.heads import HeadsCalls, heads_calls
from ballonet.runtime.kernels import Packing
from ballonet.runtime.routing import Hop, message_tag, ring_hop


@dataclass(frozen=True)
class BlockCall:
    """The kernel call of one step: query rows of the rank's block against key rows of
    the block held, packed into sequences."""

    q_index: torch.Tensor
    """[T_q] rows of this rank's block (each at most once)."""
    k_index: torch.Tensor
    """[T_k] rows of the block held at that step."""
    packing: Packing


@dataclass(frozen=True)
class RingCalls:
    """The tensors a rank computes one ring with (`ring_calls`)."""

    rows: torch.Tensor
    """[n] local rows (attention layout) of this rank's block, chunk p then 2g-1-p."""
    calls: tuple[BlockCall | None, ...]
    """The kernel call of each step; None where no query row sees the block held."""


@dataclass(frozen=True)
class RingMeta:
    """One rank's schedule of one ring: pure Python, no tensors."""

    doc: int
    comm: str
    ranks: tuple[int, ...]
    position: int
    held: tuple[int, ...]
    """The ring position whose block this rank holds at each step (`Ring.schedule`)."""
    block_rows: tuple[int, ...]
    """Rows of the block of each ring position."""
    tag: int
    """Message tag base of this ring's K/V: 2 * its index in plan.rings; tag + 1: dK/dV."""
    out_hop: Hop | None = None
    """"ring" comm: the hop to the next position, and from the previous one (g > 1)."""
    in_hop: Hop | None = None
    groups: int = 1
    """"double" comm: the number of node groups (`Ring.groups`)."""
    index: int = 0
    """Its index in plan.rings."""
    calls: RingCalls | HeadsCalls | None = field(default=None, compare=False)
    """What it computes with (`with_calls`; `heads.HeadsCalls` for "heads" comm); None in
    a schedule alone."""


def _chunk_offsets(chunks) -> list[int]:
    out = [0]
    for c in chunks:
        out.append(out[-1] + c.num_tokens)
    return out


def _rows(offsets: list[int], which) -> torch.Tensor:
    parts = [torch.arange(offsets[i], offsets[i + 1]) for i in which]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _step_call(ring: Ring, p: int, j: int) -> BlockCall | None:
    """The call of the rank at position p while it holds the block of position j."""
    mine, held = ring.chunks_of(p), ring.chunks_of(j)
    if p == j:
        n = ring.block_tokens(p)
        return BlockCall(q_index=torch.arange(n), k_index=torch.arange(n),
                         packing=Packing.of([n], causal=True).with_cu_seqlens()) if n else None
    # Consecutive query chunks that see the same key chunks share one sequence.
    groups: list[tuple[list[int], tuple[int, ...]]] = []
    for ci, c in enumerate(mine):
        seen = tuple(ki for ki, kc in enumerate(held) if kc.end <= c.start)
        assert all(kc.end <= c.start or kc.start >= c.end for kc in held), "overlapping chunks"
        if not seen:
            continue
        if groups and groups[-1][1] == seen and groups[-1][0][-1] == ci - 1:
            groups[-1][0].append(ci)
        else:
            groups.append(([ci], seen))
    if not groups:
        return None
    q_off, k_off = _chunk_offsets(mine), _chunk_offsets(held)
    return BlockCall(
        q_index=_rows(q_off, [ci for cis, _ in groups for ci in cis]),
        k_index=_rows(k_off, [ki for _, kis in groups for ki in kis]),
        packing=Packing.of([sum(mine[ci].num_tokens for ci in cis) for cis, _ in groups],
                           [sum(held[ki].num_tokens for ki in kis) for _, kis in groups],
                           causal=False).with_cu_seqlens())


def ring_queue(plan: Plan) -> list[int]:
    """Indices of plan.rings in queue order: inter-node first, then intra-node, by document."""
    return sorted(range(len(plan.rings)), key=lambda i: (plan.rings[i].kind != "inter", plan.rings[i].doc))


def ring_meta(plan: Plan, rank: int, routes: dict | None = None, *, with_calls: bool = True) -> list[RingMeta]:
    """The rings `rank` is part of, in queue order; `routes` (`routing.routes_by_hop`)
    routes their hops (None: every hop direct); `with_calls`: with the CPU tensors it
    computes with (`RingMeta.calls`)."""
    out = []
    for index in ring_queue(plan):
        ring = plan.rings[index]
        if rank in ring.ranks:
            out.append(_one_ring(plan, index, ring.ranks.index(rank), routes or {}))
    if with_calls:
        offsets, cursor = {}, 0
        for s in plan.attention[rank]:
            offsets[s] = cursor
            cursor += s.num_tokens
        out = [_with_calls(plan.rings[m.index], m, offsets) for m in out]
    return out


def _one_ring(plan: Plan, index: int, p: int, routes: dict) -> RingMeta:
    ring = plan.rings[index]
    g = len(ring.ranks)
    hops = (ring_hop(ring, p, routes), ring_hop(ring, (p - 1) % g, routes)) \
        if ring.comm == "ring" and g > 1 else (None, None)
    return RingMeta(doc=ring.doc, comm=ring.comm, ranks=ring.ranks, position=p,
                    held=tuple(int(j) for j in ring.schedule()[p]),
                    block_rows=tuple(ring.block_tokens(i) for i in range(g)), tag=2 * index,
                    out_hop=hops[0], in_hop=hops[1], groups=ring.groups, index=index)


def _with_calls(ring: Ring, meta: RingMeta, offsets: dict) -> RingMeta:
    if ring.comm == "heads":
        return dataclasses.replace(meta, calls=heads_calls(ring, meta.position, offsets))
    parts = [torch.arange(offsets[c], offsets[c] + c.num_tokens) for c in ring.chunks_of(meta.position)]
    rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    calls = tuple(_step_call(ring, meta.position, j) for j in meta.held)
    return dataclasses.replace(meta, calls=RingCalls(rows=rows, calls=calls))


def all_ring_metas(plan: Plan, routes: dict) -> list[list[RingMeta]]:
    """`ring_meta(plan, rank, routes, with_calls=False)` of every rank, in one pass."""
    out: list[list[RingMeta]] = [[] for _ in range(plan.num_ranks)]
    for index in ring_queue(plan):
        for p, rank in enumerate(plan.rings[index].ranks):
            out[rank].append(_one_ring(plan, index, p, routes))
    return out


# ---- the loop ------------------------------------------------------------------------

Compute = Callable[[int, torch.Tensor], "torch.Tensor | None"]
Task = Generator[Post, Sent, "torch.Tensor | None"]


def _merged(pending: list[Pending]) -> Pending:
    return Pending(works=[w for p in pending for w in p.works], tensors=[t for p in pending for t in p.tensors])


def hop_rounds(step: int, payload: int, sends: list[Message], recvs: list[tuple[int, Message]],
               after: tuple[Pending, ...] = (), ready=None) -> Generator[Post, Sent, Pending]:
    """One step's transfer over a hop, as the ring's ends post it: the first legs
    (`Hop.sends`) at stage 0, each last leg (`Hop.recvs`: (stage, message)) at its stage.
    Returns what the receives wait for."""
    sent = yield Post(key=(step, payload, 0), sends=sends, recvs=[m for st, m in recvs if st == 0],
                      after=after, ready=ready)
    pending = [sent.inner]
    for stage in range(1, NUM_STAGES):
        later = [m for st, m in recvs if st == stage]
        if later:
            pending.append((yield Post(key=(step, payload, stage), recvs=later)).inner)
    return _merged(pending)


def ring_pass(p2p: P2P, meta: RingMeta, kv: torch.Tensor, compute: Compute) -> Task:
    """Call compute(step, kv_held) on the block held at each step, passing `kv` (this
    rank's block) around the ring, all-gathering it or passing it around a "double" ring;
    a task for `comm.drive`.

    When compute returns the fp32 dK/dV of the block held (the backward), those return to
    the block's owner; then the task returns this rank's own block gradient."""
    if meta.comm == "allgather":
        return (yield from _gathered(p2p, meta, kv, compute))
    if meta.comm == "double":
        return (yield from _double(p2p, meta, kv, compute))
    g, out_hop, in_hop = len(meta.ranks), meta.out_hop, meta.in_hop
    own, incoming, got, ready = None, None, (), p2p.ready()
    for step in range(g):
        sends, recvs, kv_next = [], [], None
        if step < g - 1:
            kv_next = p2p.empty(kv, meta.block_rows[meta.held[step + 1]])
            sends, recvs = out_hop.sends(kv, meta.tag), in_hop.recvs(kv_next, meta.tag)
        arriving = yield from hop_rounds(step, KV, sends, recvs, after=got, ready=ready)
        ready = None
        for pending in got:  # the block of this step, received in the step before
            p2p.wait(pending)
        grad = compute(step, kv)
        if grad is not None and step == 0:
            own = grad
        elif grad is not None:
            # Add the predecessor's partial sum for this block, pass it on; take the next one.
            if incoming is not None:
                p2p.wait(incoming[1])
                grad += incoming[0]
            buf = p2p.empty(grad, meta.block_rows[meta.held[(step + 1) % g]])
            incoming = (buf, (yield from hop_rounds(step, GRAD, out_hop.sends(grad, meta.tag + 1),
                                                    in_hop.recvs(buf, meta.tag + 1), ready=p2p.ready())))
        kv, got = kv_next, (arriving,)
    if incoming is not None:  # the sum over the other ranks for this rank's own block
        p2p.wait(incoming[1])
        own += incoming[0]
    return own


def _gathered(p2p: P2P, meta: RingMeta, kv: torch.Tensor, compute: Compute) -> Task:
    """ring_pass for comm="allgather": every block goes straight to every other member
    at step 0, and in the backward every block gradient straight back to its owner after
    the last step. Step s computes on the block of position p - s (one round each)."""
    g, p = len(meta.ranks), meta.position
    peers = [(meta.ranks[(p - s) % g], (p - s) % g) for s in range(1, g)]
    held = [p2p.empty(kv, meta.block_rows[j]) for _, j in peers]
    tag = message_tag(meta.tag, 0)
    sent = yield Post(key=(0, KV, 0), sends=[(r, kv, tag) for r, _ in peers],
                      recvs=[(r, buf, tag) for (r, _), buf in zip(peers, held)], ready=p2p.ready())
    own, grads = compute(0, kv), []
    for step, buf in enumerate(held, start=1):
        yield Post(key=(step, KV, 0))
        if step == 1:
            p2p.wait(sent.inner)
        grads.append(compute(step, buf))
    if own is None:
        return None
    incoming = [p2p.empty(own, own.shape[1]) for _ in peers]
    tag = message_tag(meta.tag + 1, 0)
    back = yield Post(key=(g - 1, GRAD, 0), sends=[(r, grad, tag) for (r, _), grad in zip(peers, grads)],
                      recvs=[(r, buf, tag) for (r, _), buf in zip(peers, incoming)], ready=p2p.ready())
    p2p.wait(back.inner)
    return own + sum(incoming) if incoming else own


def _double(p2p: P2P, meta: RingMeta, kv: torch.Tensor, compute: Compute) -> Task:
    """ring_pass for comm="double": k rounds of n steps, each an inner ring inside every
    node group; a round's first block also goes to the same position of the next group.
    In the backward the inner ring sums each round's first block over the node, and the
    sum goes straight to the block's owner (the rank keeps its own, from round 0)."""
    k, g = meta.groups, len(meta.ranks)
    n = g // k
    a, p = divmod(meta.position, n)

    def peer(group: int, position: int) -> int:
        return meta.ranks[group % k * n + position % n]

    kv_tag, grad_tag = message_tag(meta.tag, 0), message_tag(meta.tag + 1, 0)
    own, first, incoming, returns = None, None, None, []
    got, ready, round_kv = (), p2p.ready(), None

    def finish(j: int, total: torch.Tensor, post: Post) -> None:
        """Round j's node sum for its first block, the block of group a - j: kept (j = 0)
        or sent to its owner in `post`, receiving the sum for this rank's own block."""
        nonlocal own
        if j == 0:
            own = total
            return
        buf = p2p.empty(own, own.shape[1])
        post.sends_across.append((peer(a - j, p), total, grad_tag))
        post.recvs_across.append((peer(a + j, p), buf, grad_tag))
        returns.append(buf)

    for step in range(g):
        j, t = divmod(step, n)
        sends, recvs, across_sends, across_recvs = [], [], [], []
        if t < n - 1:
            kv_next = p2p.empty(kv, meta.block_rows[meta.held[step + 1]])
            sends.append((peer(a, p + 1), kv, kv_tag))
            recvs.append((peer(a, p - 1), kv_next, kv_tag))
        if t == 0 and j < k - 1:
            kv_round = p2p.empty(kv, meta.block_rows[meta.held[step + n]])
            across_sends.append((peer(a + 1, p), kv, kv_tag))
            across_recvs.append((peer(a - 1, p), kv_round, kv_tag))
        sent = yield Post(key=(step, KV, 0), sends=sends, recvs=recvs, sends_across=across_sends,
                          recvs_across=across_recvs, after=got, ready=ready)
        ready = None
        if t == 0 and j < k - 1:
            round_kv = (kv_round, sent.across)
        for pending in got:
            p2p.wait(pending)
        grad = compute(step, kv)
        back = Post(key=(step, GRAD, 0), sends=[], recvs=[], sends_across=[], recvs_across=[])
        if grad is not None and t == 0:
            if incoming is not None:  # the predecessor's partial sum of the previous round's first block
                p2p.wait(incoming[1])
                first += incoming[0]
                incoming = None
                finish(j - 1, first, back)
            first = grad
            if n == 1:
                finish(j, first, back)
        elif grad is not None:
            if incoming is not None:
                p2p.wait(incoming[1])
                grad += incoming[0]
            buf = p2p.empty(grad, meta.block_rows[meta.held[j * n + (t + 1) % n]])
            back.sends.append((peer(a, p + 1), grad, grad_tag))
            back.recvs.append((peer(a, p - 1), buf, grad_tag))
            incoming = (buf, None)
        if back.sends or back.sends_across:
            back.ready = p2p.ready()
            done = yield back
            if incoming is not None and incoming[1] is None:
                incoming = (incoming[0], done.inner)
            if back.recvs_across:
                returns[-1] = (returns[-1], done.across)
        if t < n - 1:
            kv, got = kv_next, (sent.inner,)
        elif j < k - 1:
            kv, got = round_kv[0], (round_kv[1],)
    if first is None:
        return None
    if incoming is not None:
        p2p.wait(incoming[1])
        first += incoming[0]
        back = Post(key=(g, GRAD, 0), sends_across=[], recvs_across=[])
        finish(k - 1, first, back)
        if back.sends_across:
            back.ready = p2p.ready()
            returns[-1] = (returns[-1], (yield back).across)
    for buf, pending in returns:
        p2p.wait(pending)
        own += buf
    return own
