"""A split document's ring (`Ring`), the routes of its hops across nodes (`Route`), and its
traffic: every K/V and dK/dV message, step by step.

The one walk of ring traffic (`Plan.ring_messages`, `Ring.messages` call it): the metrics,
the routing planner, the runtime's byte prediction and the simulator all use it, or its
O(g) forms below (`forward_link_rows`, `ring_schedule`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ballonet.plan.layout import Segment, chunk_bounds

__all__ = ["PAYLOADS", "PHASES", "RING_COMMS", "SPLIT_KINDS", "Ring", "RingMessage", "Route", "double_schedule",
           "forward_link_rows", "ring_messages", "ring_schedule"]

SPLIT_KINDS = ("intra", "inter")
RING_COMMS = ("ring", "allgather", "double", "heads")
PHASES = ("forward", "backward")
PAYLOADS = ("kv", "grad", "qkv", "out", "dout", "dqkv")
"""What a message carries per row (`cost.flops.message_bytes` prices each): "kv" K and V
(dtype of K/V); "grad" their fp32 partial dK/dV; a "heads" document's "qkv" (q, k and v
of the receiver's 1/g of the heads), "out" (o and the fp32 log-sum-exp of the receiver's
rows for the sender's heads), "dout" (o, dO and the fp32 log-sum-exp of the sender's rows for the receiver's
heads) and "dqkv" (dq, dk and dv of the receiver's rows for the sender's heads)."""


@dataclass(frozen=True)
class Ring:
    """A split document: its ranks in ring order and its zig-zag chunks."""

    doc: int
    kind: str
    """"intra" (one node) or "inter" (several nodes)."""
    ranks: tuple[int, ...]
    """Ring order: ranks[i] sends K/V to ranks[i + 1] (mod g)."""
    bounds: tuple[int, ...]
    """2g + 1 increasing chunk boundaries over the document, from 0 to its length."""
    comm: str = "ring"
    """"ring" (P2P K/V passing), "allgather" (Llama-3 style: K/V all-gathered), "double"
    (a ring inside each node and one across nodes between rail peers, `ring_traffic`) or
    "heads" (DeepSpeed-Ulysses, one node: each member gathers the whole document's q, k
    and v for its 1/g of the heads, computes them, and sends each row's o back to the
    row's owner; g must divide the model's K/V heads per GPU)."""
    groups: int = 1
    """"double": the number of node groups k; ranks are node-major, group a is ranks
    [a*n, (a+1)*n) (n = g // k), all on one node, each group on its own node. 1 otherwise."""

    @property
    def group_size(self) -> int:
        """Ranks per node group (g for a ring of one group)."""
        return len(self.ranks) // self.groups

    def schedule(self) -> np.ndarray:
        """[g, g]: the ring position whose block position i holds at step s
        (`ring_traffic.ring_schedule`, `double_schedule` for "double")."""
        return double_schedule(self.groups, self.group_size) if self.comm == "double" else ring_schedule(len(self.ranks))

    def chunks_of(self, position: int) -> tuple[Segment, ...]:
        """The non-empty chunks held by ring position `position`: i and 2g-1-i."""
        g, b = len(self.ranks), self.bounds
        pair = (Segment(self.doc, b[position], b[position + 1]),
                Segment(self.doc, b[2 * g - 1 - position], b[2 * g - position]))
        return tuple(s for s in pair if s.num_tokens > 0)

    def block_tokens(self, position: int) -> int:
        """Tokens (K/V rows) held by ring position `position`."""
        return sum(s.num_tokens for s in self.chunks_of(position))

    def messages(self) -> Iterator[RingMessage]:
        """Every message of this document's attention (`ring_traffic.ring_messages`)."""
        return ring_messages(self)

    def forward_link_rows(self) -> list[tuple[int, int, int]]:
        """(src, dst, rows): the forward K/V rows of `messages()` summed per link, in O(g)
        (`ring_traffic.forward_link_rows`)."""
        return forward_link_rows(self)


@dataclass(frozen=True)
class Route:
    doc: int
    src: int
    dst: int
    proxies: tuple[tuple[int, int], ...]
    """(proxy on the source node, proxy on the destination node) per part."""

    def part_bounds(self, rows: int) -> tuple[int, ...]:
        """Row bounds of the parts of a message of `rows` rows: part j is rows
        [b[j], b[j + 1]) and travels by proxies[j]."""
        return chunk_bounds(rows, len(self.proxies))


@dataclass(frozen=True)
class RingMessage:
    """One message of a split document's attention (`Ring.messages`)."""
    phase: str
    """"forward" or "backward" (the pass that sends it)."""
    payload: str
    """"kv": K and V rows (in the dtype of K/V); "grad": dK and dV rows (fp32)."""
    doc: int
    step: int
    """Ring step (0 for an "allgather" document)."""
    src: int
    dst: int
    rows: int
    """Rows of K (and as many of V); a routed hop cuts them by `Route.part_bounds`."""


def _message(phase: str, payload: str, doc: int, step: int, src: int, dst: int, rows: int) -> Iterator[RingMessage]:
    if rows:
        yield RingMessage(phase=phase, payload=payload, doc=doc, step=step, src=src, dst=dst, rows=rows)


def ring_schedule(g: int) -> np.ndarray:
    """[g, g]: the ring position whose block position i holds at step s, (i - s) mod g."""
    a = np.arange(g)
    return (a[:, None] - a[None, :]) % g


def double_schedule(k: int, n: int) -> np.ndarray:
    """[g, g] (g = k n) for a "double" ring of k node groups of n ranks: at step s = j n + t
    (round j, inner step t) position i = a n + p holds the block of position
    ((a - j) mod k) n + (p - t) mod n: each round runs an inner ring over one node's
    blocks, and round j + 1 starts on the blocks of the previous node group."""
    i, s = np.arange(k * n)[:, None], np.arange(k * n)[None, :]
    a, p, j, t = i // n, i % n, s // n, s % n
    return ((a - j) % k) * n + (p - t) % n


def _double_messages(ring: Ring, phase: str, blocks: list[int]) -> Iterator[RingMessage]:
    """A "double" ring's messages of one pass (`ring_messages`)."""
    k, n, ranks, doc = ring.groups, ring.group_size, ring.ranks, ring.doc
    held = double_schedule(k, n).tolist()
    for step in range(k * n):
        j, t = divmod(step, n)
        for i in range(k * n):
            a, p = divmod(i, n)
            rows, inner = blocks[held[i][step]], ranks[a * n + (p + 1) % n]
            if t < n - 1:
                yield from _message(phase, "kv", doc, step, ranks[i], inner, rows)
            if t == 0 and j < k - 1:  # the round's first block, to the same position of the next node
                yield from _message(phase, "kv", doc, step, ranks[i], ranks[(a + 1) % k * n + p], rows)
            if phase == "backward" and t >= 1:
                yield from _message(phase, "grad", doc, step, ranks[i], inner, rows)
            if phase == "backward" and t == n - 1 and j >= 1:  # the node's sum for a block, to its owner
                owner = (a - j) % k * n + p
                sent = step + 1 if n > 1 and j < k - 1 else step  # (the runtime's: after the next round's first compute)
                yield from _message(phase, "grad", doc, sent, ranks[i], ranks[owner], blocks[owner])


def _heads_messages(ring: Ring, phase: str, blocks: list[int]) -> Iterator[RingMessage]:
    """A "heads" document's messages of one pass (`ring_messages`): at step 0 every member
    i sends every other member j its block's rows for j's heads ("qkv"; in the backward
    also "dout", what the backward kernel needs beside q, k and v: nothing of the forward
    is kept across the pass), at step 1 each j returns i's rows of its heads' result ("out";
    in the backward "dqkv")."""
    ranks, doc = ring.ranks, ring.doc
    pairs = [(i, j) for i in range(len(ranks)) for j in range(len(ranks)) if i != j]
    gathered = ("qkv", "dout") if phase == "backward" else ("qkv",)
    for payload in gathered:
        for i, j in pairs:
            yield from _message(phase, payload, doc, 0, ranks[i], ranks[j], blocks[i])
    back = "dqkv" if phase == "backward" else "out"
    for i, j in pairs:
        yield from _message(phase, back, doc, 1, ranks[j], ranks[i], blocks[i])


def ring_messages(ring: Ring) -> Iterator[RingMessage]:
    """Every message of a split document's attention, forward then backward, per step;
    empty ones left out. "ring": at step s position i holds the block of position
    (i - s) mod g; it passes it to position i + 1 at steps s < g - 1 (forward, and
    again in the backward, which recomputes with it), and in the backward passes the
    partial dK/dV of the block it held at steps s >= 1 on the same hop, so each block's
    gradient reaches its owner after the last step. "allgather": each block to every
    other member (forward, and again in the backward), then the dK/dV of every other
    member's block straight to that member. "double" (`double_schedule`): in each round a
    ring inside each node group, as "ring" with n for g (K/V at inner steps t < n - 1,
    dK/dV at t >= 1, so after the round each position holds its node's sum for the
    round's first block); at the round's first step each position also sends that block
    to the same position of the next group (rail peers, once per round, with the round's
    n steps to hide it), and in the backward, after each round j >= 1, the node's sum for
    that block straight to its owner j groups back (at the next round's first step, where
    the runtime posts it, or at the last step). "heads": `_heads_messages`."""
    g, ranks = len(ring.ranks), ring.ranks
    blocks = [ring.block_tokens(i) for i in range(g)]
    for phase in PHASES:
        if ring.comm == "heads":
            yield from _heads_messages(ring, phase, blocks)
            continue
        if ring.comm == "double":
            yield from _double_messages(ring, phase, blocks)
            continue
        if ring.comm == "allgather":
            for i in range(g):
                for j in range(g):
                    if j != i:
                        yield from _message(phase, "kv", ring.doc, 0, ranks[i], ranks[j], blocks[i])
                        if phase == "backward":
                            yield from _message(phase, "grad", ring.doc, 0, ranks[i], ranks[j], blocks[j])
            continue
        held = ring_schedule(g).tolist()
        for step in range(g):
            for i in range(g):
                rows, dst = blocks[held[i][step]], ranks[(i + 1) % g]
                if step < g - 1:
                    yield from _message(phase, "kv", ring.doc, step, ranks[i], dst, rows)
                if phase == "backward" and step >= 1:
                    yield from _message(phase, "grad", ring.doc, step, ranks[i], dst, rows)


def forward_link_rows(ring: Ring) -> list[tuple[int, int, int]]:
    """(src, dst, rows): the forward K/V rows of `ring_messages` summed per link, in O(g)
    for a "ring" (over its g - 1 steps the hop out of position i carries every block
    but its successor's); an "allgather" sends each block to every other member; a
    "double" sums its forward messages (O(g^2), as few rings are); a "heads" document has
    none (ValueError)."""
    g, L = len(ring.ranks), ring.bounds[-1]
    blocks = [ring.block_tokens(i) for i in range(g)]
    if ring.comm == "heads":
        raise ValueError(f"document {ring.doc} is split by heads: it sends no K/V rows (its messages: `messages`)")
    if ring.comm == "double":
        links: dict[tuple[int, int], int] = {}
        for m in _double_messages(ring, "forward", blocks):
            links[m.src, m.dst] = links.get((m.src, m.dst), 0) + m.rows
        return [(src, dst, rows) for (src, dst), rows in links.items()]
    if ring.comm == "allgather":
        return [(ring.ranks[i], ring.ranks[j], blocks[i]) for i in range(g) for j in range(g)
                if i != j and blocks[i]]
    return [(ring.ranks[i], ring.ranks[(i + 1) % g], L - blocks[(i + 1) % g]) for i in range(g)
            if L - blocks[(i + 1) % g] > 0]
