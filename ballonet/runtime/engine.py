"""The attention engine: one rank's part of a plan's distributed, variable-length attention.

Shapes: T local rows (the concatenation of the rank's `plan.attention[rank]` segments, in
order), H query heads, H_kv key/value heads, D head size. Causal within each document,
nothing across documents.

Queues run in the order inter-node rings, intra-node rings, local documents
(docs/design.md, section 8): every split document is its own ring over its own ranks,
each a task that yields its transfers of every round and computes in between
(`ring.ring_pass`; a "heads" document gathers each member's share of the heads over
the whole document and returns the results, `heads.py`); `comm.drive` posts every
task's transfers of a round as one batch per process group and resumes the tasks in
queue order, and the local documents (one varlen call) run after the first round,
filling the wait. Partial results merge in fp32 with
the log-sum-exp rule; the backward passes K/V again and returns dK/dV to their owners.
Hops the plan routes (`plan.routes`) go over proxy ranks, which forward in relay tasks
queued right after the ring's (`runtime.routing`); results do not depend on routing.
Layers as in ring-flash-attention: metadata (`rank_meta`, built once per step, every
tensor of it moved to the device in one copy by `runtime.step`), `_forward` /
`_backward`, a thin autograd Function, one public function. The layer path makes no
host-device copy and reads nothing back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ballonet.plan import Plan
from ballonet.runtime import kernels
from ballonet.runtime.comm import KV, P2P, ByteCounter, Post, drive
from ballonet.runtime.heads import heads_backward, heads_forward
from ballonet.runtime.kernels import Kernel, Packing
from ballonet.runtime.plan_check import check_heads, check_plan
from ballonet.runtime.ring import RingMeta, ring_meta, ring_pass, ring_queue
from ballonet.runtime.routing import RelayMeta, relay_meta, relay_pass, routes_by_hop
from ballonet.runtime.staging import to_device


@dataclass(frozen=True)
class RankMeta:
    local_rows: torch.Tensor
    """[T_loc] local rows of the documents this rank holds whole."""
    local_packing: Packing
    queue: tuple[RingMeta | RelayMeta, ...]
    """The split documents this rank takes part in (`RingMeta`, with their calls) or
    forwards routed parts of (`RelayMeta`, right after the ring's own entry), in queue
    order."""


def rank_queue(plan: Plan, rank: int, rings: list[RingMeta], routes: dict) -> tuple[RingMeta | RelayMeta, ...]:
    """`rings` (this rank's) and this rank's relays, in queue order (`ring.ring_queue`),
    each relay right after its ring's place."""
    position = {index: i for i, index in enumerate(ring_queue(plan))}
    routed_docs = {r.doc for r in plan.routes}
    routed = sorted(i for i, ring in enumerate(plan.rings) if ring.doc in routed_docs)
    relays = [x for x in (relay_meta(plan, i, rank, routes) for i in routed) if x is not None]
    entries = [(position[m.index], 0, m) for m in rings] + [(position[x.index], 1, x) for x in relays]
    return tuple(x for *_, x in sorted(entries, key=lambda e: e[:2]))


def rank_meta(plan: Plan, rank: int) -> RankMeta:
    """Everything `rank` runs the plan's attention with, on the CPU."""
    rows, lengths, cursor = [], [], 0
    for s in plan.attention[rank]:
        if s.doc not in plan.ring_of_doc:
            rows.append(torch.arange(cursor, cursor + s.num_tokens))
            lengths.append(s.num_tokens)
        cursor += s.num_tokens
    local_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    routes = routes_by_hop(plan)
    return RankMeta(local_rows=local_rows, local_packing=Packing.of(lengths, causal=True).with_cu_seqlens(),
                    queue=rank_queue(plan, rank, ring_meta(plan, rank, routes), routes))


def run_pass(p2p, queue, ring_task, heads_task, local, like: torch.Tensor, backward: bool) -> None:
    """One pass over the queue: ring_task(ring) per ring, heads_task(ring) per "heads"
    document, `relay_pass` per relay entry (`like`: a K/V block [2, 0, H_kv, D] for their
    buffers), and `local()` after the first round, all driven in rounds (`comm.drive`).
    The schedule checker runs this very function with stand-in tensors (`schedule.py`)."""
    tasks = [relay_pass(p2p, x, like, backward) if not isinstance(x, RingMeta)
             else heads_task(x) if x.comm == "heads" else ring_task(x) for x in queue]
    drive(p2p, tasks + [_local_task(local)])


def _local_task(local):
    yield Post(key=(0, KV, 0))
    local()


def merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, index: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a partial result (out [n, H, D], lse [n, H]) into rows `index` of the fp32
    accumulators: lse' = log(e^lse_acc + e^lse), out' = out_acc e^(lse_acc - lse') + out e^(lse - lse')."""
    old_out, old_lse = out_acc[index], lse_acc[index]
    new_lse = torch.logaddexp(old_lse, lse)
    out_acc[index] = (old_out * torch.exp(old_lse - new_lse).unsqueeze(-1)
                      + out.float() * torch.exp(lse - new_lse).unsqueeze(-1))
    lse_acc[index] = new_lse


def _kv(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.stack([k[rows], v[rows]])


def _forward(p2p: P2P, meta: RankMeta, q, k, v, kernel: Kernel, scale: float):
    """out [T, H, D] (dtype of q) and lse [T, H] (fp32) of this rank's rows."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)

    def ring_task(ring: RingMeta):
        rows, calls = ring.calls.rows, ring.calls.calls
        q_ring = q[rows]
        out_acc = q_ring.new_zeros(q_ring.shape, dtype=torch.float32)
        lse_acc = q_ring.new_full(q_ring.shape[:2], float("-inf"), dtype=torch.float32)

        def compute(step: int, kv: torch.Tensor) -> None:
            call = calls[step]
            if call is not None:
                part = kernel.forward(q_ring[call.q_index], kv[0][call.k_index], kv[1][call.k_index], call.packing, scale)
                merge(out_acc, lse_acc, call.q_index, *part)

        yield from ring_pass(p2p, ring, _kv(k, v, rows), compute)
        out[rows], lse[rows] = out_acc.to(out.dtype), lse_acc

    def heads_task(ring: RingMeta):
        rows = ring.calls.rows
        out[rows], lse[rows] = yield from heads_forward(p2p, ring, q, k, v, kernel, scale)

    def local():
        rows = meta.local_rows
        if rows.numel():
            out[rows], lse[rows] = kernel.forward(q[rows], k[rows], v[rows], meta.local_packing, scale)

    run_pass(p2p, meta.queue, ring_task, heads_task, local, _kv(k, v, meta.local_rows[:0]), backward=False)
    return out, lse


def _backward(p2p: P2P, meta: RankMeta, dout, q, k, v, out, lse, kernel: Kernel, scale: float):
    """dq, dk, dv [T, ...] of this rank's rows, given the final out and lse."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def ring_task(ring: RingMeta):
        rows, calls = ring.calls.rows, ring.calls.calls
        q_ring, dout_ring, out_ring, lse_ring = q[rows], dout[rows], out[rows], lse[rows]
        dq_acc = q_ring.new_zeros(q_ring.shape, dtype=torch.float32)

        def compute(step: int, kv: torch.Tensor) -> torch.Tensor:
            dkv = kv.new_zeros(kv.shape, dtype=torch.float32)
            call = calls[step]
            if call is not None:
                qi, ki = call.q_index, call.k_index
                dq_part, dk_part, dv_part = kernel.backward(
                    dout_ring[qi], q_ring[qi], kv[0][ki], kv[1][ki], out_ring[qi], lse_ring[qi], call.packing, scale)
                dq_acc.index_add_(0, qi, dq_part.float())
                dkv[0].index_add_(0, ki, dk_part.float())
                dkv[1].index_add_(0, ki, dv_part.float())
            return dkv

        dkv = yield from ring_pass(p2p, ring, _kv(k, v, rows), compute)
        dq[rows], dk[rows], dv[rows] = dq_acc.to(dq.dtype), dkv[0].to(dk.dtype), dkv[1].to(dv.dtype)

    def heads_task(ring: RingMeta):
        rows = ring.calls.rows
        dq[rows], dk[rows], dv[rows] = yield from heads_backward(p2p, ring, dout, q, k, v, out, lse, kernel, scale)

    def local():
        rows = meta.local_rows
        if rows.numel():
            grads = kernel.backward(dout[rows], q[rows], k[rows], v[rows], out[rows], lse[rows], meta.local_packing, scale)
            for grad, part in zip((dq, dk, dv), grads):
                grad[rows] = part.to(grad.dtype)

    run_pass(p2p, meta.queue, ring_task, heads_task, local, _kv(k, v, meta.local_rows[:0]), backward=True)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p2p: P2P, meta: RankMeta, kernel: Kernel, scale: float):
        out, lse = _forward(p2p, meta, q, k, v, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (p2p.for_phase("backward"), meta, kernel, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        p2p, meta, kernel, scale = ctx.args
        dq, dk, dv = _backward(p2p, meta, dout, *ctx.saved_tensors, kernel, scale)
        return dq, dk, dv, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, rank: int,
              group: dist.ProcessGroup | None = None, *, kernel: str | None = None,
              counter: ByteCounter | None = None, scale: float | None = None,
              verify_plan: bool = True, outer_group: dist.ProcessGroup | None = None,
              meta: RankMeta | None = None) -> torch.Tensor:
    """This rank's share of the plan's attention: q [T_local, H, D], k and v
    [T_local, H_kv, D] in the attention layout (`token_index(plan, rank)`), out like q.

    `rank` is this process's rank in `group` (None: the default group); every rank of the
    group must call with the same plan (checked: a mismatch raises RuntimeError on all).
    `kernel` names a `kernels.KERNELS` backend (default: `kernels.select`); `counter`
    records the bytes this rank sends; `scale` defaults to 1/sqrt(D); `verify_plan=False`
    skips the plan check (for callers that ran `check_plan` once for many layers);
    `outer_group`, a second group over the ranks of `group` in the same order
    (`dist.new_group`, warmed up by a collective of all its ranks), carries "double"
    rings' transfers across nodes, so that on NCCL they run on their own stream beside
    the rings inside nodes; `meta`: `rank_meta(plan, rank)` already on q's device (as
    `runtime.step_meta` builds it once per step), else built and moved here."""
    num_rows = plan.attention_tokens(rank)
    if q.ndim != 3 or k.shape != v.shape or q.shape[0] != num_rows or k.shape[0] != num_rows:
        raise ValueError(f"rank {rank} holds {num_rows} tokens: q, k, v must be [{num_rows}, H, D], "
                         f"[{num_rows}, H_kv, D] twice; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}, same head size")
    check_heads(plan, k.shape[1])
    if verify_plan:  # one all_gather; a caller running many layers on one plan may check once
        check_plan(plan, rank, group, q.device, outer_group=outer_group)
    if meta is None:
        meta = to_device(rank_meta(plan, rank), q.device)
    p2p = P2P(group, rank, "forward", counter=counter, outer=outer_group, device=q.device)
    scale = kernels.default_scale(q.shape[2]) if scale is None else scale
    return _Attention.apply(q, k, v, p2p, meta, kernels.select(kernel, q.device), scale)
