"""A "heads" document (DeepSpeed-Ulysses inside one node): each member computes a share
of the heads over the whole document.

Member p of g holds its zig-zag block (`Ring.chunks_of(p)`, n_p rows, as in any ring).
In attention member j computes query heads [j H/g, (j+1) H/g) and K/V heads
[j H_kv/g, (j+1) H_kv/g) over the whole document, one causal sequence of L rows in
document order. At round (0, KV, 0) every member sends every other member its rows of
q, k, v for the receiver's heads ("qkv"; in the backward also o, dO and the fp32 LSE,
"dout"); the receiver computes (after round (0, KV, 1): behind the compute the other
tasks queue at round (0, KV, 0)), and at round (0, GRAD, 0) returns each member its rows
of the result: o and the LSE in the forward ("out"), dq, dk, dv in the backward
("dqkv": complete sums, in the dtype of q). Nothing is kept across the passes: the
forward returns each row's LSE to its owner, which sends it back with o and dO.

Buffers are member-major: what a rank sends is [g, n_p, ...] (member j's heads at [j]),
what a member gathers is [g, n_max, ...] (member i's rows at [i, :n_i], n_max the
largest block), and `HeadsCalls.order` picks the document's rows out of its first two
dimensions flattened, in document order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator

import torch

from ballonet.plan import Ring
from ballonet.runtime.comm import GRAD, KV, P2P, Pending, Post, Sent
from ballonet.runtime.kernels import Kernel, Packing
from ballonet.runtime.routing import message_tag

if TYPE_CHECKING:
    from ballonet.runtime.ring import RingMeta

__all__ = ["HeadsCalls", "heads_backward", "heads_calls", "heads_forward", "heads_pass"]


@dataclass(frozen=True)
class HeadsCalls:
    """The tensors a rank computes one "heads" document with (`heads_calls`)."""

    rows: torch.Tensor
    """[n_p] local rows (attention layout) of this rank's block, chunk p then 2g-1-p."""
    order: torch.Tensor
    """[L] the document's rows in document order, as indices into a gathered buffer
    [g, n_max, ...] flattened to [g * n_max, ...]."""
    packing: Packing
    """One causal sequence of L rows."""


def heads_calls(ring: Ring, position: int, offsets: dict) -> HeadsCalls:
    """`HeadsCalls` of ring position `position`; `offsets`: each segment of the rank's
    attention layout -> its first local row."""
    g = len(ring.ranks)
    n_max = max(ring.block_tokens(i) for i in range(g))
    order = torch.empty(ring.bounds[-1], dtype=torch.long)
    for i in range(g):
        slot = i * n_max
        for c in ring.chunks_of(i):
            order[c.start:c.end] = torch.arange(slot, slot + c.num_tokens)
            slot += c.num_tokens
    parts = [torch.arange(offsets[c], offsets[c] + c.num_tokens) for c in ring.chunks_of(position)]
    return HeadsCalls(rows=torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long), order=order,
                      packing=Packing.of([ring.bounds[-1]], causal=True).with_cu_seqlens())


Compute = Callable[[list], list]
Task = Generator[Post, Sent, list]


def _with(pending: Pending, tensors: list) -> Pending:
    """`pending`, also marking `tensors` (buffers of the post stream) as used by the waiter."""
    return Pending(works=list(pending.works), tensors=list(pending.tensors) + tensors)


def heads_pass(p2p: P2P, meta: RingMeta, parts: list, compute: Compute) -> Task:
    """One pass of a "heads" document, a task for `comm.drive`: `parts` is what this rank
    sends, per payload [g, n_p, ...]; every member's rows of each are gathered into
    [g, n_max, ...], compute(gathered) returns the results of this rank's heads, per
    payload [g, n_max, ...] (member i's rows at [i, :n_i]), and each member's rows go back
    to it. Returns this rank's rows of every member's results, per payload [g, n_p, ...]."""
    p, rows = meta.position, meta.block_rows
    n_max, peers = max(rows), [i for i in range(len(rows)) if i != p]
    gathered = [p2p.empty(part, n_max) for part in parts]
    sent = yield Post(
        key=(0, KV, 0),
        sends=[(meta.ranks[j], part[j], message_tag(meta.tag, p, k)) for k, part in enumerate(parts) for j in peers],
        recvs=[(meta.ranks[i], buf[i, :rows[i]], message_tag(meta.tag, i, k))
               for k, buf in enumerate(gathered) for i in peers],
        ready=p2p.ready())
    for part, buf in zip(parts, gathered):
        buf[p, :rows[p]] = part[p]
    # Compute after the round's other tasks have queued theirs (local documents, rings'
    # own blocks), which hides the gather.
    yield Post(key=(0, KV, 1))
    p2p.wait(_with(sent.inner, gathered))
    results = compute(gathered)
    back = [p2p.empty(result, rows[p]) for result in results]
    sent = yield Post(
        key=(0, GRAD, 0),
        sends=[(meta.ranks[i], result[i, :rows[i]], message_tag(meta.tag + 1, p, k))
               for k, result in enumerate(results) for i in peers],
        recvs=[(meta.ranks[j], buf[j], message_tag(meta.tag + 1, j, k)) for k, buf in enumerate(back) for j in peers],
        ready=p2p.ready())
    for result, buf in zip(results, back):
        buf[p] = result[p, :rows[p]]
    p2p.wait(_with(sent.inner, back))
    return back


def _by_member(g: int, *xs: torch.Tensor) -> torch.Tensor:
    """[n, g*h_x, ...] tensors -> [g, n, sum of h_x, ...]: member j's heads of each at [j]."""
    return torch.cat([x.unflatten(1, (g, -1)).transpose(0, 1) for x in xs], dim=2)


def _all_heads(back: torch.Tensor) -> torch.Tensor:
    """[g, n, h, ...] (member j's heads at [j]) -> [n, g*h, ...]."""
    return back.transpose(0, 1).flatten(1, 2)


def _doc(buf: torch.Tensor, order: torch.Tensor, *widths: int) -> list[torch.Tensor]:
    """A gathered [g, n_max, w, ...] -> the document's rows [L, w_i, ...] in document
    order, per consecutive width w_i of the third dimension (each contiguous)."""
    flat, out, start = buf.flatten(0, 1), [], 0
    for w in widths:
        out.append(flat[order, start:start + w])
        start += w
    return out


def _scatter(x: torch.Tensor, order: torch.Tensor, g: int, n_max: int) -> torch.Tensor:
    """The inverse of `_doc`: [L, ...] -> [g, n_max, ...] (rows past a member's n_i unset)."""
    out = x.new_empty((g * n_max,) + tuple(x.shape[1:]))
    out[order] = x
    return out.unflatten(0, (g, n_max))


def heads_forward(p2p: P2P, meta: RingMeta, q, k, v, kernel: Kernel, scale: float) -> Generator[Post, Sent, tuple]:
    """The forward of a "heads" document: out [n_p, H, D] (dtype of q) and lse [n_p, H]
    (fp32) of this rank's rows, from q [T, H, D], k and v [T, H_kv, D] (all its rows)."""
    calls, g, n_max = meta.calls, len(meta.ranks), max(meta.block_rows)
    assert isinstance(calls, HeadsCalls)
    h, h_kv, rows = q.shape[1] // g, k.shape[1] // g, calls.rows

    def compute(gathered: list) -> list:
        out, lse = kernel.forward(*_doc(gathered[0], calls.order, h, h_kv, h_kv), calls.packing, scale)
        return [_scatter(out.to(q.dtype), calls.order, g, n_max), _scatter(lse, calls.order, g, n_max)]

    out, lse = yield from heads_pass(p2p, meta, [_by_member(g, q[rows], k[rows], v[rows])], compute)
    return _all_heads(out), _all_heads(lse)


def heads_backward(p2p: P2P, meta: RingMeta, dout, q, k, v, out, lse, kernel: Kernel,
                   scale: float) -> Generator[Post, Sent, tuple]:
    """The backward of a "heads" document: dq [n_p, H, D], dk and dv [n_p, H_kv, D] of
    this rank's rows (dtype of q), given its rows' final out and lse."""
    calls, g, n_max = meta.calls, len(meta.ranks), max(meta.block_rows)
    assert isinstance(calls, HeadsCalls)
    h, h_kv, rows = q.shape[1] // g, k.shape[1] // g, calls.rows

    def compute(gathered: list) -> list:
        q_doc, k_doc, v_doc = _doc(gathered[0], calls.order, h, h_kv, h_kv)
        o_doc, do_doc = _doc(gathered[1], calls.order, h, h)
        (lse_doc,) = _doc(gathered[2], calls.order, h)
        grads = kernel.backward(do_doc, q_doc, k_doc, v_doc, o_doc, lse_doc, calls.packing, scale)
        return [_scatter(torch.cat([x.to(q.dtype) for x in grads], dim=1), calls.order, g, n_max)]

    parts = [_by_member(g, q[rows], k[rows], v[rows]), _by_member(g, out[rows], dout[rows]), _by_member(g, lse[rows])]
    (back,) = yield from heads_pass(p2p, meta, parts, compute)
    return _all_heads(back[:, :, :h]), _all_heads(back[:, :, h:h + h_kv]), _all_heads(back[:, :, h + h_kv:])
