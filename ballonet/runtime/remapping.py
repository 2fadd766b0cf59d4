"""Remap: move tokens between the attention layout and the linear (token-balanced) layout.

A remap is one `all_to_all_single` with per-peer split sizes (gloo and NCCL both take
uneven splits); its backward is the reverse move. The layouts are the Plan's: a rank keeps
the tokens it does not send, in order, and appends what it receives, ordered by
(src, start) (`Plan.linear_pieces`).

Token metadata (position within document, document id, loss mask) is a tensor like any
other: `remap` moves it too, and it agrees with what `runtime.layout` computes locally for
the destination layout, so callers may use either.

Legend: T_in / T_out tokens of this rank in the source / destination layout; K kept
tokens; S sent; R received.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ballonet.plan import Plan
from ballonet.runtime.comm import ByteCounter, link_bytes  # noqa: F401 - link_bytes: re-exported
from ballonet.runtime.layout import LAYOUTS
from ballonet.runtime.plan_check import check_plan
from ballonet.runtime.staging import to_device


@dataclass(frozen=True, kw_only=True)
class Move:
    """One rank's part of a remap, as index maps over its local token orders:
    out[keep_dst] = x[keep_src]; x[send_src] leaves in peer order, send_splits[p] rows to
    peer p; what arrives (recv_splits[p] rows from peer p, in peer order) lands at
    out[recv_dst]."""
    rank: int
    num_in: int
    num_out: int
    keep_src: torch.Tensor  # [K]
    keep_dst: torch.Tensor  # [K]
    send_src: torch.Tensor  # [S]
    recv_dst: torch.Tensor  # [R]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]

    def reverse(self) -> Move:
        """The move that undoes this one (and carries its gradients back)."""
        return Move(rank=self.rank, num_in=self.num_out, num_out=self.num_in,
                    keep_src=self.keep_dst, keep_dst=self.keep_src,
                    send_src=self.recv_dst, recv_dst=self.send_src,
                    send_splits=self.recv_splits, recv_splits=self.send_splits)


def _check_layouts(src: str, dst: str) -> None:
    if src not in LAYOUTS or dst not in LAYOUTS or src == dst:
        raise ValueError(f"src and dst must be the two layouts {LAYOUTS}, got {src!r} -> {dst!r}")


def _ranges(spans) -> torch.Tensor:
    parts = [torch.arange(start, end) for start, end in spans]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def plan_move(plan: Plan, rank: int, src: str = "attention", dst: str = "linear") -> Move:
    """`rank`'s index maps and split sizes for moving tokens from layout `src` to `dst`."""
    _check_layouts(src, dst)
    if src == "linear":
        return plan_move(plan, rank, "attention", "linear").reverse()
    # Attention -> linear: sent rows leave sorted by (dst, start), so each peer receives its
    # transfers by start; peers arrive in src order, which is the linear layout's order.
    outgoing = sorted((t.dst, t.start, t.end) for t in plan.remap if t.src == rank)
    incoming = sorted((t.src, t.start, t.end) for t in plan.remap if t.dst == rank)
    kept = [(start, end) for r, start, end in plan.linear_pieces(rank) if r == rank]
    send_splits, recv_splits = [0] * plan.num_ranks, [0] * plan.num_ranks
    for peer, start, end in outgoing:
        send_splits[peer] += end - start
    for peer, start, end in incoming:
        recv_splits[peer] += end - start
    num_kept = sum(end - start for start, end in kept)
    num_out = plan.linear_tokens(rank)
    return Move(rank=rank, num_in=plan.attention_tokens(rank), num_out=num_out,
                keep_src=_ranges(kept), keep_dst=torch.arange(num_kept),
                send_src=_ranges((s, e) for _, s, e in outgoing), recv_dst=torch.arange(num_kept, num_out),
                send_splits=tuple(send_splits), recv_splits=tuple(recv_splits))


def _forward(group, x: torch.Tensor, move: Move, counter: ByteCounter | None, phase: str = "forward") -> torch.Tensor:
    """[T_in, ...] -> [T_out, ...] (the move's index maps on x's device); records the bytes
    this rank sends under `phase`."""
    rest = x.shape[1:]
    out = x.new_empty((move.num_out, *rest))
    out[move.keep_dst] = x[move.keep_src]
    send = x[move.send_src].contiguous()
    recv = x.new_empty((sum(move.recv_splits), *rest))
    dist.all_to_all_single(recv, send, output_split_sizes=list(move.recv_splits),
                           input_split_sizes=list(move.send_splits), group=group)
    out[move.recv_dst] = recv
    if counter is not None:
        row_bytes = rest.numel() * x.element_size()
        for peer, rows in enumerate(move.send_splits):
            if rows:
                counter.add(phase, move.rank, peer, rows * row_bytes)
    return out


def _backward(group, grad_out: torch.Tensor, move: Move, counter: ByteCounter | None) -> torch.Tensor:
    return _forward(group, grad_out.contiguous(), move.reverse(), counter, "backward")


class _Remap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, move, group, counter):
        ctx.move, ctx.group, ctx.counter = move, group, counter
        return _forward(group, x, move, counter)

    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx.group, grad_out, ctx.move, ctx.counter), None, None, None


def remap(x: torch.Tensor, plan: Plan, rank: int, src: str = "attention", dst: str = "linear",
          group=None, counter: ByteCounter | None = None, verify_plan: bool = True,
          move: Move | None = None) -> torch.Tensor:
    """Move this rank's [T_src, ...] rows from layout `src` to `dst`: [T_dst, ...].

    Collective: every rank of `group` (plan rank i = group rank i) must call it. Moves
    integer tensors (metadata) too. `counter`, if given, records the bytes this rank sends
    per (rank, peer), forward and backward (`predicted_bytes` gives the plan's figures).
    A plan with one rank or no remap transfers needs no process group: `x` comes back as is.
    Every rank must call with the same plan: checked first when a process group exists
    (one all_gather, a mismatch raises RuntimeError on all), unless `verify_plan=False`
    (a caller that checked once). `move`: `plan_move(plan, rank, src, dst)` with its index
    maps already on x's device (`runtime.step_meta` builds it once per step); else built
    and moved here.
    """
    _check_layouts(src, dst)
    expected = plan.attention_tokens(rank) if src == "attention" else plan.linear_tokens(rank)
    if x.shape[0] != expected:
        raise ValueError(f"rank {rank} holds {expected} tokens in the {src} layout, got a tensor of {x.shape[0]}")
    # Before the early return: a rank without transfers must not skip the check its peers run.
    if verify_plan and plan.num_ranks > 1 and dist.is_initialized():
        check_plan(plan, rank, group, x.device)
    if plan.num_ranks == 1 or not plan.remap:
        return x
    if move is None:
        move = to_device(plan_move(plan, rank, src, dst), x.device)
    return _Remap.apply(x, move, group, counter)


def predicted_bytes(plan: Plan, bytes_per_token: int, src: str = "attention") -> ByteCounter:
    """Bytes a remap from layout `src` sends per (src, dst) pair, from the plan alone: each
    transfer's tokens one way in the forward and the other way in the backward."""
    _check_layouts(src, "linear" if src == "attention" else "attention")
    there = Counter({pair: n * bytes_per_token for pair, n in plan.remap_tokens().items()})
    back = Counter({(b, a): n for (a, b), n in there.items()})
    forward, backward = (there, back) if src == "attention" else (back, there)
    return ByteCounter(forward=forward, backward=backward)

