"""Routing (docs/design.md, "Routing"): inter-node ring hops cut over proxy GPUs.

A routed hop (`plan.Route`) cuts the buffer of each ring step, [2, rows, H_kv, D] (K and
V, or fp32 dK and dV), into len(proxies) row ranges (`plan.chunk_bounds`); part j travels
src -> proxies[j][0] (dispatch, inside the source node) -> proxies[j][1] (transfer, across
nodes on that rail's NICs) -> dst (combine), legs between equal ranks left out. A direct
hop is one part on the path (src, dst). A part travels as two messages, its K rows and its
V rows: each is a contiguous view, so nothing is copied to send or receive it.

Per ring step, the ring members post the first leg of their outgoing hop's parts at stage
0 and receive the last leg of their incoming hop's at the stage that leg is (`Hop.sends`,
`Hop.recvs`, used by `ring.ring_pass`); the ranks in between forward in a task of their
own, `relay_pass`: a part received at stage k is forwarded at stage k + 1 of the same
step (rounds (step, payload, stage), `comm.py`), on CUDA as soon as it has arrived.
Every leg of every part of every hop has its own tag: gloo matches messages by (peer,
tag); NCCL ignores tags, and `comm.P2P.post` orders a round's messages to each peer by
tag on both ends, so both match them alike. docs/design.md, section 8, gives the
argument that this cannot deadlock.

`predicted_bytes` is what the engine sends per (src, dst) pair for a plan, routes
followed ("heads" documents' messages too, `heads_row_bytes`); `comm.link_bytes` and `comm.nic_bytes` turn it into link-class and NIC figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass

import torch

from ballonet.plan import Plan, Ring, Route, chunk_bounds
from ballonet.runtime.comm import GRAD, GRAD_DTYPE, KV, NUM_STAGES, P2P, ByteCounter, Message, Post, Sent

__all__ = ["MAX_PARTS", "MAX_RANKS", "MAX_RINGS", "Hop", "Relay", "RelayMeta", "hop_paths", "message_tag",
           "heads_row_bytes", "predicted_bytes", "relay_meta", "relay_pass", "ring_hop", "routes_by_hop"]

MAX_RANKS, MAX_PARTS, MAX_RINGS = 1024, 16, 2**14
"""Bounds of the tag encoding (tags are nonnegative int32)."""


def message_tag(base: int, position: int, part: int = 0, leg: int = 0) -> int:
    """The tag of leg `leg` of part `part` of the hop out of ring position `position`.
    base: 2 * (the ring's index in plan.rings), + 1 for dK/dV."""
    return ((base * MAX_RANKS + position) * MAX_PARTS + part) * 4 + leg


def routes_by_hop(plan: Plan) -> dict[tuple[int, int, int], Route]:
    """plan.routes by (doc, src, dst); ValueError for a plan the engine cannot route."""
    if plan.num_ranks > MAX_RANKS or len(plan.rings) >= MAX_RINGS:
        raise ValueError(f"the engine runs at most {MAX_RANKS} ranks and {MAX_RINGS - 1} rings, "
                         f"got {plan.num_ranks} and {len(plan.rings)}")
    out = {}
    for route in plan.routes:
        if plan.ring_of_doc[route.doc].comm != "ring" or len(route.proxies) > MAX_PARTS:
            raise ValueError(f"route {route.src}->{route.dst} of document {route.doc}: only P2P rings are "
                             f"routed, over at most {MAX_PARTS} proxy pairs")
        out[route.doc, route.src, route.dst] = route
    return out


def hop_paths(src: int, dst: int, route: Route | None) -> tuple[tuple[int, ...], ...]:
    """Per part of the hop src -> dst, the ranks it passes: src first, dst last."""
    paths = []
    for a, b in route.proxies if route else ((src, dst),):
        path = [src]
        for r in (a, b, dst):
            if r != path[-1]:
                path.append(r)
        paths.append(tuple(path))
    return tuple(paths)


def _pieces(buf: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, ...]:
    """Rows [start, end) of buf [2, rows, ...] as two contiguous views."""
    return buf[:, start:end].unbind(0)


@dataclass(frozen=True)
class Hop:
    """The hop out of ring position `position`, to the next position."""

    position: int
    paths: tuple[tuple[int, ...], ...]
    """Per part, the ranks it passes (`hop_paths`)."""

    def bounds(self, rows: int) -> tuple[int, ...]:
        return chunk_bounds(rows, len(self.paths))

    def sends(self, buf: torch.Tensor, base: int) -> list[Message]:
        """The first leg of every part of buf [2, rows, ...], as the hop's source."""
        b = self.bounds(buf.shape[1])
        return [(path[1], piece, message_tag(base, self.position, j, 0))
                for j, path in enumerate(self.paths) for piece in _pieces(buf, b[j], b[j + 1])]

    def recvs(self, buf: torch.Tensor, base: int) -> list[tuple[int, Message]]:
        """The last leg of every part, into buf [2, rows, ...], as the hop's destination:
        (stage, message), the stage being the leg's index on its path."""
        b = self.bounds(buf.shape[1])
        return [(len(path) - 2, (path[-2], piece, message_tag(base, self.position, j, len(path) - 2)))
                for j, path in enumerate(self.paths) for piece in _pieces(buf, b[j], b[j + 1])]


def ring_hop(ring: Ring, position: int, routes: dict) -> Hop:
    g = len(ring.ranks)
    src, dst = ring.ranks[position], ring.ranks[(position + 1) % g]
    return Hop(position=position, paths=hop_paths(src, dst, routes.get((ring.doc, src, dst))))


# ---- relays ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Relay:
    """This rank forwards part `part` of `hop`: it is hop.paths[part][stage]."""

    hop: Hop
    part: int
    stage: int

    def _leg(self, buf: torch.Tensor, base: int, peer: int, leg: int) -> list[Message]:
        tag = message_tag(base, self.hop.position, self.part, leg)
        return [(peer, piece, tag) for piece in buf.unbind(0)]

    def incoming(self, buf: torch.Tensor, base: int) -> list[Message]:
        return self._leg(buf, base, self.hop.paths[self.part][self.stage - 1], self.stage - 1)

    def outgoing(self, buf: torch.Tensor, base: int) -> list[Message]:
        return self._leg(buf, base, self.hop.paths[self.part][self.stage + 1], self.stage)


@dataclass(frozen=True)
class RelayMeta:
    """What this rank forwards for one ring whose routed hops pass through it."""

    doc: int
    index: int
    """The ring's index in plan.rings."""
    tag: int
    """The ring's message tag base (as `RingMeta.tag`)."""
    block_rows: tuple[int, ...]
    """K/V rows of each ring position's block."""
    relays: tuple[Relay, ...]
    """By (stage, hop position, part)."""


def relay_meta(plan: Plan, index: int, rank: int, routes: dict) -> RelayMeta | None:
    """`rank`'s forwarding for ring plan.rings[index]; None if it forwards nothing."""
    ring = plan.rings[index]
    g, relays = len(ring.ranks), []
    for (doc, src, dst), route in routes.items():
        if doc != ring.doc:
            continue
        hop = ring_hop(ring, ring.ranks.index(src), routes)
        for j, path in enumerate(hop.paths):
            relays += [Relay(hop=hop, part=j, stage=k) for k in range(1, len(path) - 1) if path[k] == rank]
    if not relays:
        return None
    relays.sort(key=lambda r: (r.stage, r.hop.position, r.part))
    return RelayMeta(doc=ring.doc, index=index, tag=2 * index, relays=tuple(relays),
                     block_rows=tuple(ring.block_tokens(i) for i in range(g)))


def relay_pass(p2p: P2P, meta: RelayMeta, like: torch.Tensor, backward: bool) -> Generator[Post, Sent, None]:
    """Forward this rank's parts of one ring's hops, in step with the ring's members: K/V
    (dtype and trailing shape of `like`, [2, 0, H_kv, D]) at steps 0..g-2, and in the
    backward also fp32 dK/dV at steps 1..g-1; a part received at stage k - 1 of a round
    goes on at stage k (a task for `comm.drive`)."""
    g = len(meta.block_rows)
    for step in range(g):
        passes = [(KV, meta.tag, like.dtype)] if step < g - 1 else []
        if backward and step >= 1:
            passes.append((GRAD, meta.tag + 1, GRAD_DTYPE))
        for payload, base, dtype in passes:
            bufs = []
            for relay in meta.relays:
                b = relay.hop.bounds(meta.block_rows[(relay.hop.position - step) % g])
                bufs.append(p2p.empty(like, b[relay.part + 1] - b[relay.part], dtype))
            got = {}
            for stage in range(NUM_STAGES):
                out = [i for i, r in enumerate(meta.relays) if r.stage == stage]
                into = [i for i, r in enumerate(meta.relays) if r.stage == stage + 1]
                if not out and not into:
                    continue
                sent = yield Post(key=(step, payload, stage),
                                  sends=[m for i in out for m in meta.relays[i].outgoing(bufs[i], base)],
                                  recvs=[m for i in into for m in meta.relays[i].incoming(bufs[i], base)],
                                  after=tuple(got[i] for i in out))
                got.update({i: sent.inner for i in into})


# ---- predictions, from the plan alone --------------------------------------------------


def heads_row_bytes(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    members: int) -> dict[str, int]:
    """Bytes per row of a "heads" document's messages (`heads.py`) with `members` members,
    by payload: q, k, v of a member's share of the heads ("qkv", and "dqkv" back), o and
    the fp32 LSE ("out"), o, dO and the LSE ("dout")."""
    h, h_kv, e = num_heads // members, num_kv_heads // members, dtype.itemsize
    lse = h * GRAD_DTYPE.itemsize
    return {"qkv": (h + 2 * h_kv) * head_dim * e, "dqkv": (h + 2 * h_kv) * head_dim * e,
            "out": h * head_dim * e + lse, "dout": 2 * h * head_dim * e + lse}


def predicted_bytes(plan: Plan, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    num_heads: int | None = None) -> ByteCounter:
    """Bytes per (src, dst) the engine sends for `plan` (`Plan.ring_messages`), routes
    followed, with K/V of `dtype` and dK/dV in fp32 (`GRAD_DTYPE`); "heads" documents'
    messages by `heads_row_bytes` (`num_heads` query heads: needed only if there are any).
    A routed hop's message is cut by `Route.part_bounds`, each part counted once on each
    leg of its path."""
    row_bytes = {payload: 2 * num_kv_heads * head_dim * t.itemsize for payload, t in (("kv", dtype), ("grad", GRAD_DTYPE))}
    routes = routes_by_hop(plan)
    out = ByteCounter()
    for msg in plan.ring_messages():
        if msg.payload not in row_bytes:
            if num_heads is None:
                raise ValueError(f"document {msg.doc} splits its heads: predicted_bytes needs num_heads")
            members = len(plan.ring_of_doc[msg.doc].ranks)
            out.add(msg.phase, msg.src, msg.dst,
                    msg.rows * heads_row_bytes(num_heads, num_kv_heads, head_dim, dtype, members)[msg.payload])
            continue
        route = routes.get((msg.doc, msg.src, msg.dst))
        bounds = route.part_bounds(msg.rows) if route else (0, msg.rows)
        for j, path in enumerate(hop_paths(msg.src, msg.dst, route)):
            for a, c in itertools.pairwise(path):
                if bounds[j + 1] > bounds[j]:
                    out.add(msg.phase, a, c, (bounds[j + 1] - bounds[j]) * row_bytes[msg.payload])
    return out
