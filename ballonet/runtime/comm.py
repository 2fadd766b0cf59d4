"""Peer-to-peer transfers between plan ranks and the bytes they move.

Plan ranks are ranks of the process group the engine runs on (`group=None`: the default
world group); `P2P` turns them into global ranks for torch.distributed. Every message is
counted by its sender, per (src, dst) plan-rank pair and per phase (forward, backward);
`link_bytes` and `nic_bytes` turn such pair counts into bytes per link class and per NIC.
What the plan predicts (`Plan.ring_messages`), routes included, is
`runtime.routing.predicted_bytes`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ballonet.plan import Plan

__all__ = ["GRAD_DTYPE", "P2P", "ByteCounter", "Message", "check_plan", "link_bytes", "nic_bytes", "wait"]

Message = tuple[int, torch.Tensor, int]
"""(peer plan rank, contiguous tensor, tag)."""

GRAD_DTYPE = torch.float32
"""dK/dV travel back to their owners as fp32 partial sums (exact accumulation, as in
ring-flash-attention), whatever the dtype of K and V."""


@dataclass
class ByteCounter:
    """Bytes sent per (src, dst) plan-rank pair, by phase. Each rank records its own sends."""

    forward: Counter = field(default_factory=Counter)
    backward: Counter = field(default_factory=Counter)
    collectives: Counter = field(default_factory=Counter)
    """Bytes this rank sends in tensor-parallel collectives, per (phase, op) (ring
    algorithm: an all-gather's or reduce-scatter's (n-1)/n of the whole buffer)."""

    def add(self, phase: str, src: int, dst: int, num_bytes: int) -> None:
        getattr(self, phase)[src, dst] += num_bytes

    def add_collective(self, phase: str, op: str, num_bytes: int) -> None:
        self.collectives[phase, op] += num_bytes

    def merge(self, other: ByteCounter) -> ByteCounter:
        return ByteCounter(forward=self.forward + other.forward, backward=self.backward + other.backward,
                           collectives=self.collectives + other.collectives)

    def total(self) -> Counter:
        return self.forward + self.backward


@dataclass(frozen=True)
class P2P:
    """Asynchronous point-to-point messages of one rank in one phase."""

    group: dist.ProcessGroup | None
    rank: int
    """This process, as a plan rank (its rank in `group`)."""
    phase: str
    counter: ByteCounter | None = None
    outer: dist.ProcessGroup | None = None
    """A second group over the ranks of `group`, in the same order, for a "double" ring's
    transfers across nodes (`across`); None: `group`."""

    def across(self) -> P2P:
        """These messages over `outer`: on NCCL a group's batched P2P run on one CUDA
        stream, so a double ring's NIC transfer, which has a whole round to arrive, would
        queue the inner ring's next steps behind it; another group's run on its own."""
        return self if self.outer is None else dataclasses.replace(self, group=self.outer, outer=None)

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def post(self, sends: list[Message], recvs: list[Message]) -> list:
        """Start sending each (dst, tensor, tag) and receiving into each (src, tensor, tag);
        return the work handles to wait on. Empty tensors are skipped on both sides.
        Messages between two ranks with one tag are matched in the order they are posted."""
        ops = [dist.P2POp(dist.isend, t, self._peer(dst), self.group, tag) for dst, t, tag in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, self._peer(src), self.group, tag) for src, t, tag in recvs if t.numel()]
        if self.counter is not None:
            for dst, t, _ in sends:
                if t.numel():
                    self.counter.add(self.phase, self.rank, dst, t.numel() * t.element_size())
        return dist.batch_isend_irecv(ops) if ops else []


def wait(works: list) -> None:
    for work in works:
        work.wait()


def check_plan(plan: Plan, rank: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise RuntimeError on every rank unless all ranks of `group` run the same plan, each
    as the plan rank it really is (compares plan digests with one all_gather)."""
    if not dist.is_available() or not dist.is_initialized():
        if plan.num_ranks != 1 or rank != 0:
            raise RuntimeError(f"a plan for {plan.num_ranks} ranks needs torch.distributed initialised")
        return
    world = dist.get_world_size(group)
    if world != plan.num_ranks:
        raise RuntimeError(f"the plan is for {plan.num_ranks} ranks but the process group has {world}")
    mine = torch.tensor(list(bytes.fromhex(plan.digest)) + [rank], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    wrong_rank = [r for r, t in enumerate(everyone) if int(t[-1]) != r]
    if wrong_rank:
        raise RuntimeError(f"ranks {wrong_rank} of the group were called as another plan rank")
    holders: dict[tuple, list[int]] = {}
    for r, t in enumerate(everyone):
        holders.setdefault(tuple(t[:-1].tolist()), []).append(r)
    if len(holders) > 1:
        raise RuntimeError(f"ranks disagree on the plan: rank sets {sorted(holders.values())} hold different plans")


# ---- accounting -------------------------------------------------------------------------


def link_bytes(pair_bytes: Counter, node_of_rank: tuple[int, ...]) -> Counter:
    """Bytes per link class ("intra" or "inter" node) from bytes per (src, dst) pair."""
    out: Counter = Counter()
    for (src, dst), num_bytes in pair_bytes.items():
        out["intra" if node_of_rank[src] == node_of_rank[dst] else "inter"] += num_bytes
    return out


def nic_bytes(pair_bytes: Counter, plan: Plan) -> Counter:
    """Inter-node bytes per NIC direction, ("out", nic) and ("in", nic), from bytes per
    (src, dst) pair: a transfer across nodes leaves by the sender's NIC and enters by the
    receiver's. Every NIC of the plan has both keys (zero where idle)."""
    out = Counter({(way, nic): 0 for nic in sorted(set(plan.nic_of_rank)) for way in ("out", "in")})
    for (src, dst), num_bytes in pair_bytes.items():
        if plan.node_of_rank[src] != plan.node_of_rank[dst]:
            out["out", plan.nic_of_rank[src]] += num_bytes
            out["in", plan.nic_of_rank[dst]] += num_bytes
    return out
