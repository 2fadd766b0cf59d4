"""Split documents: per-rank ring metadata from the plan, and the one ring loop that both
the forward and the backward run.

A rank at ring position p holds the block of p: its zig-zag chunks p and 2g-1-p
(`Ring.chunks_of`), K and V stacked as kv [2, rows, H_kv, D]. At step s it holds the
block of position `Ring.schedule()`[p, s] ((p - s) mod g for "ring"). Which of its query
chunks see which key chunks follows from document offsets: a key chunk that ends before a
query chunk starts is seen whole, the rank's own block (step 0) is causal, a later chunk
is not seen. The own block is causal as one square sequence because a rank's chunks are
in document order.

A hop between ring positions may be routed over proxies (`routing.Hop`): the ring loop
posts its first and last legs; the proxies forward the rest in `routing.relay_pass`.

A "double" ring (k node groups of n ranks, node-major) runs k rounds of n steps: in each
round an inner ring over n ranks inside each node, as "ring" does; at a round's first step
each rank also sends the block it holds to the same position of the next group, which
computes with it at the next round's first step, so it has the whole round to arrive. In
the backward the inner ring sums each round's first block over the node, and that sum
goes straight to the block's owner. Its hops are direct (only "ring" hops are routed);
those across nodes go over `P2P.outer` when the caller gives that second group.

Overlap: each step posts the next block's transfer before computing on the current one.
On NCCL the transfers run on the process group's own CUDA streams: `post` returns at
once, and `wait` only makes the compute stream wait for them (the host runs on), so a
transfer overlaps the kernels queued while it is in flight, and buffers are kept alive
by the group until their transfer ends. A transfer also starts only after the kernels
queued before its `post` (the group's stream waits for the current one), which the
simulator's engine does not charge (docs/design.md, section 8). On gloo (CPU) `wait`
blocks the host; results are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator

import torch

from ballonet.plan import Plan, Ring
from ballonet.runtime.comm import P2P, wait
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
class RingMeta:
    doc: int
    comm: str
    ranks: tuple[int, ...]
    position: int
    held: tuple[int, ...]
    """The ring position whose block this rank holds at each step (`Ring.schedule`)."""
    rows: torch.Tensor
    """[n] local rows (attention layout) of this rank's block, chunk p then 2g-1-p."""
    block_rows: tuple[int, ...]
    """Rows of the block of each ring position."""
    calls: tuple[BlockCall | None, ...]
    """The kernel call of each step; None where no query row sees the block held."""
    tag: int
    """Message tag base of this ring's K/V: 2 * its index in plan.rings; tag + 1: dK/dV."""
    out_hop: Hop | None = None
    """"ring" comm: the hop to the next position, and from the previous one (g > 1)."""
    in_hop: Hop | None = None
    groups: int = 1
    """"double" comm: the number of node groups (`Ring.groups`)."""


def _chunk_offsets(chunks) -> list[int]:
    out = [0]
    for c in chunks:
        out.append(out[-1] + c.num_tokens)
    return out


def _rows(offsets: list[int], which, device) -> torch.Tensor:
    parts = [torch.arange(offsets[i], offsets[i + 1], device=device) for i in which]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _step_call(ring: Ring, p: int, j: int, device) -> BlockCall | None:
    """The call of the rank at position p while it holds the block of position j."""
    mine, held = ring.chunks_of(p), ring.chunks_of(j)
    if p == j:
        n = ring.block_tokens(p)
        return BlockCall(q_index=torch.arange(n, device=device), k_index=torch.arange(n, device=device),
                         packing=Packing.of([n], causal=True)) if n else None
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
        q_index=_rows(q_off, [ci for cis, _ in groups for ci in cis], device),
        k_index=_rows(k_off, [ki for _, kis in groups for ki in kis], device),
        packing=Packing.of([sum(mine[ci].num_tokens for ci in cis) for cis, _ in groups],
                           [sum(held[ki].num_tokens for ki in kis) for _, kis in groups], causal=False))


def ring_queue(plan: Plan) -> list[int]:
    """Indices of plan.rings in queue order: inter-node first, then intra-node, by document."""
    return sorted(range(len(plan.rings)), key=lambda i: (plan.rings[i].kind != "inter", plan.rings[i].doc))


def ring_meta(plan: Plan, rank: int, device, routes: dict | None = None) -> list[RingMeta]:
    """The rings `rank` is part of, in queue order; `routes` (`routing.routes_by_hop`)
    routes their hops (None: every hop direct)."""
    local_offset, cursor = {}, 0
    for s in plan.attention[rank]:
        local_offset[s] = cursor
        cursor += s.num_tokens
    out = []
    for index in ring_queue(plan):
        ring = plan.rings[index]
        if rank not in ring.ranks:
            continue
        g, p = len(ring.ranks), ring.ranks.index(rank)
        parts = [torch.arange(local_offset[c], local_offset[c] + c.num_tokens) for c in ring.chunks_of(p)]
        rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        hops = (ring_hop(ring, p, routes or {}), ring_hop(ring, (p - 1) % g, routes or {})) \
            if ring.comm == "ring" and g > 1 else (None, None)
        held = tuple(int(j) for j in ring.schedule()[p])
        out.append(RingMeta(doc=ring.doc, comm=ring.comm, ranks=ring.ranks, position=p, held=held,
                            rows=rows.to(device), block_rows=tuple(ring.block_tokens(i) for i in range(g)),
                            calls=tuple(_step_call(ring, p, j, device) for j in held),
                            tag=2 * index, out_hop=hops[0], in_hop=hops[1], groups=ring.groups))
    return out


# ---- the loop ------------------------------------------------------------------------

Compute = Callable[[int, torch.Tensor], "torch.Tensor | None"]


def _like(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], rows) + tuple(x.shape[2:]))


def ring_pass(p2p: P2P, meta: RingMeta, kv: torch.Tensor, compute: Compute) -> Generator[None, None, torch.Tensor | None]:
    """Call compute(step, kv_held) on the block held at each step, passing `kv` (this
    rank's block) around the ring, all-gathering it or passing it around a "double" ring;
    yield while transfers are in flight.

    When compute returns the fp32 dK/dV of the block held (the backward), those return to
    the block's owner; then the generator returns this rank's own block gradient."""
    if meta.comm == "allgather":
        return (yield from _gathered(p2p, meta, kv, compute))
    if meta.comm == "double":
        return (yield from _double(p2p, meta, kv, compute))
    g, out_hop, in_hop = len(meta.ranks), meta.out_hop, meta.in_hop
    own, incoming = None, None
    for step in range(g):
        if step < g - 1:
            kv_next = _like(kv, meta.block_rows[meta.held[step + 1]])
            kv_works = p2p.post(out_hop.sends(kv, meta.tag), in_hop.recvs(kv_next, meta.tag))
        grad = compute(step, kv)
        if grad is not None and step == 0:
            own = grad
        elif grad is not None:
            # Add the predecessor's partial sum for this block, pass it on; take the next one.
            if incoming is not None:
                wait(incoming[1])
                grad += incoming[0]
            buf = _like(grad, meta.block_rows[meta.held[(step + 1) % g]])
            incoming = (buf, p2p.post(out_hop.sends(grad, meta.tag + 1), in_hop.recvs(buf, meta.tag + 1)))
        yield
        if step < g - 1:
            wait(kv_works)
            kv = kv_next
    if incoming is not None:  # the sum over the other ranks for this rank's own block
        wait(incoming[1])
        own += incoming[0]
    return own


def _gathered(p2p: P2P, meta: RingMeta, kv: torch.Tensor, compute: Compute):
    """ring_pass for comm="allgather": every block goes straight to every other member,
    and in the backward every block gradient straight back to its owner."""
    g, p = len(meta.ranks), meta.position
    peers = [(meta.ranks[(p - s) % g], (p - s) % g) for s in range(1, g)]
    held = [_like(kv, meta.block_rows[j]) for _, j in peers]
    tag = message_tag(meta.tag, 0)
    works = p2p.post([(r, kv, tag) for r, _ in peers], [(r, buf, tag) for (r, _), buf in zip(peers, held)])
    own = compute(0, kv)
    yield
    wait(works)
    grads = [compute(step, buf) for step, buf in enumerate(held, start=1)]
    if own is None:
        return None
    incoming = [torch.empty_like(own) for _ in peers]
    tag = message_tag(meta.tag + 1, 0)
    works = p2p.post([(r, grad, tag) for (r, _), grad in zip(peers, grads)],
                     [(r, buf, tag) for (r, _), buf in zip(peers, incoming)])
    yield
    wait(works)
    return own + sum(incoming) if incoming else own


def _double(p2p: P2P, meta: RingMeta, kv: torch.Tensor, compute: Compute):
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
    across = p2p.across()  # rail peers in other nodes

    def finish(j: int, total: torch.Tensor) -> None:
        """Round j's node sum for its first block, the block of group a - j."""
        nonlocal own
        if j == 0:
            own = total
            return
        buf = torch.empty_like(own)
        returns.append((buf, across.post([(peer(a - j, p), total, grad_tag)], [(peer(a + j, p), buf, grad_tag)])))

    for step in range(g):
        j, t = divmod(step, n)
        if t < n - 1:
            kv_next = _like(kv, meta.block_rows[meta.held[step + 1]])
            inner = p2p.post([(peer(a, p + 1), kv, kv_tag)], [(peer(a, p - 1), kv_next, kv_tag)])
        if t == 0 and j < k - 1:  # after the inner post: it shares the inner ring's stream without `P2P.outer`
            kv_round = _like(kv, meta.block_rows[meta.held[step + n]])
            outer = across.post([(peer(a + 1, p), kv, kv_tag)], [(peer(a - 1, p), kv_round, kv_tag)])
        grad = compute(step, kv)
        if grad is not None and t == 0:
            if incoming is not None:  # the predecessor's partial sum of the previous round's first block
                wait(incoming[1])
                first += incoming[0]
                incoming = None
                finish(j - 1, first)
            first = grad
            if n == 1:
                finish(j, first)
        elif grad is not None:
            if incoming is not None:
                wait(incoming[1])
                grad += incoming[0]
            buf = _like(grad, meta.block_rows[meta.held[j * n + (t + 1) % n]])
            incoming = (buf, p2p.post([(peer(a, p + 1), grad, grad_tag)], [(peer(a, p - 1), buf, grad_tag)]))
        yield
        if t < n - 1:
            wait(inner)
            kv = kv_next
        elif j < k - 1:
            wait(outer)
            kv = kv_round
    if first is None:
        return None
    if incoming is not None:
        wait(incoming[1])
        first += incoming[0]
        finish(k - 1, first)
        yield
    for buf, works in returns:
        wait(works)
        own += buf
    return own
