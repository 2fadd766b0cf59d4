"""Peer-to-peer transfers between plan ranks, posted in rounds, and the bytes they move.

The engine's tasks (one per ring and per relay, `engine.py`) do not post messages
themselves: each yields a `Post` (its messages of one round) and `drive` posts every
task's messages of a round together, as ONE batch per process group (NCCL: one
`ncclGroup`), rounds in the same order on every rank. A round is a `Key`,
(step, payload, stage): ring step, K/V before dK/dV, and the leg of a routed hop
(`routing.py`: a part that is received at stage k is forwarded at stage k + 1). Both
ends of every message put it in the same round, and inside a batch the messages to (and
from) each peer are ordered by tag, so NCCL's matching (tags ignored, first in first out
per (group, src, dst)) pairs the right messages. docs/design.md, section 8, gives the
argument that this cannot deadlock under NCCL's rules; `schedule.py` replays it.

On CUDA a batch is posted from a stream of its own per group ("post stream", one per
device and group role for the process), which
waits only for what its sends carry: the CUDA event recorded after the compute that made
them (`P2P.ready`), or the batches that received them (`Post.after`). NCCL runs a
group's batches on the group's stream after the stream they were posted from
(`ProcessGroupNCCL`'s syncStream), so a transfer starts as soon as its data is there,
not behind every kernel queued before it. The compute stream waits for a batch only
where it reads what arrived (`P2P.wait`); the host never blocks. On gloo (CPU) the same
code runs without streams: a post waits on the host for what it forwards.

Plan ranks are ranks of the process group the engine runs on (`group=None`: the default
world group); every message is counted by its sender per (src, dst) plan-rank pair and
phase. `link_bytes` and `nic_bytes` turn pair counts into bytes per link class and NIC.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ballonet.plan import Plan

__all__ = ["GRAD", "GRAD_DTYPE", "KV", "NUM_STAGES", "P2P", "ByteCounter", "Key", "Message", "Pending", "Post",
           "Sent", "drive", "link_bytes", "nic_bytes", "round_batches", "sent_back"]

Message = tuple[int, torch.Tensor, int]
"""(peer plan rank, contiguous tensor, tag)."""

Key = tuple[int, int, int]
"""A round: (ring step, payload KV or GRAD, stage = leg of a routed hop)."""

KV, GRAD = 0, 1
NUM_STAGES = 3
"""Legs of a routed hop: src -> proxy, proxy -> proxy (across nodes), proxy -> dst."""

GRAD_DTYPE = torch.float32
"""dK/dV travel back to their owners as fp32 partial sums (exact accumulation, as in
ring-flash-attention), whatever the dtype of K and V."""

ROLES = ("inner", "across")
"""The groups a task's messages go over: the engine's group, and `P2P.outer` for a
"double" ring's transfers across nodes."""


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


@dataclass
class Pending:
    """Batches posted on one group: what a task waits for before reading what it received."""

    works: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    """The buffers they fill (on CUDA marked as used by the stream that waits)."""


@dataclass
class Sent:
    """What `drive` hands back to a task for its `Post`: one `Pending` per group."""

    inner: Pending
    across: Pending


@dataclass(slots=True)
class Post:
    """One task's messages of one round."""

    key: Key
    sends: list[Message] | tuple = ()
    recvs: list[Message] | tuple = ()
    sends_across: list[Message] | tuple = ()
    """Over `P2P.outer` (a "double" ring's transfers across nodes)."""
    recvs_across: list[Message] | tuple = ()
    after: tuple[Pending, ...] = ()
    """Batches that received what the sends forward: posted only after them."""
    ready: object = None
    """`P2P.ready()` taken after the compute that made what the sends carry."""

    def messages(self, role: str) -> tuple[list[Message], list[Message]]:
        return (self.sends, self.recvs) if role == "inner" else (self.sends_across, self.recvs_across)


class P2P:
    """One rank's messages of one pass (forward or backward) over its process groups.

    `group`: the plan's ranks, in plan-rank order (None: the default group); `outer`: a
    second group over the same ranks in the same order, for "double" rings' transfers
    across nodes (None: `group`); `device`: where the tensors live (CUDA: post streams)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, phase: str, *,
                 counter: ByteCounter | None = None, outer: dist.ProcessGroup | None = None,
                 device: torch.device | None = None):
        self.group, self.rank, self.phase, self.counter, self.outer = group, rank, phase, counter, outer
        self.device = device
        cuda = device is not None and device.type == "cuda"
        self._streams = _post_streams(torch.cuda.current_device() if device.index is None else device.index) \
            if cuda else None
        self._inflight: list[Pending] = []
        self._waited: set = set()
        """(work id, stream) already waited for: gloo's works must be waited once only (a
        second wait blocks for a message that never comes); CUDA waits per stream."""

    def for_phase(self, phase: str) -> P2P:
        return P2P(self.group, self.rank, phase, counter=self.counter, outer=self.outer, device=self.device)

    def _group(self, role: str) -> dist.ProcessGroup | None:
        return self.outer if role == "across" and self.outer is not None else self.group

    def _peer(self, role: str, rank: int) -> int:
        group = self._group(role)
        return rank if group is None else dist.get_global_rank(group, rank)

    def _on(self, role: str):
        return torch.cuda.stream(self._streams[role]) if self._streams else contextlib.nullcontext()

    def empty(self, like: torch.Tensor, rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A receive buffer like `like` ([2, rows, ...] K and V), with `rows` rows. On CUDA
        allocated from the post stream, so its memory is reused only after every stream
        that used it is done (`wait` marks the compute stream's use)."""
        with self._on("inner"):
            return like.new_empty((like.shape[0], rows) + tuple(like.shape[2:]), dtype=dtype or like.dtype)

    def ready(self):
        """A mark after the compute queued so far (CUDA: an event on the current stream)."""
        if self._streams is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _wait_work(self, work) -> None:
        key = (id(work), torch.cuda.current_stream(self.device) if self._streams else None)
        if key not in self._waited:
            self._waited.add(key)
            work.wait()

    def wait(self, pending: Pending) -> None:
        """The compute stream (gloo: the host) waits for these batches."""
        for work in pending.works:
            self._wait_work(work)
        if self._streams:
            stream = torch.cuda.current_stream(self.device)
            for t in pending.tensors:
                t.record_stream(stream)

    def finish(self) -> None:
        """Wait for every batch of this pass (at its end, so their buffers outlive them)."""
        for pending in self._inflight:
            self.wait(pending)
        self._inflight, self._waited = [], set()

    def post(self, posts: list[Post]) -> list[Sent]:
        """Post the messages of one round (every post has the same key): one batch per
        group (`round_batches`)."""
        pending = {role: [Pending() for _ in posts] for role in ROLES}
        for role, items in round_batches(posts, self.outer is not None):
            group = self._group(role)
            with self._on(role):
                for i in sorted({i for receive, _, _, i, _ in items if not receive}):
                    self._await(posts[i], role)
                ops = [dist.P2POp(dist.irecv if receive else dist.isend, t, self._peer(role, peer), group, tag)
                       for receive, peer, tag, _, t in items]
                works = dist.batch_isend_irecv(ops)
            if self.counter is not None:
                for receive, peer, _, _, t in items:
                    if not receive:
                        self.counter.add(self.phase, self.rank, peer, t.numel() * t.element_size())
            per_op = len(works) == len(ops)  # gloo: a work per message; NCCL: one for the batch
            for k, (_, _, _, i, t) in enumerate(items):
                mine = pending[role][i]
                mine.tensors.append(t)
                if per_op:
                    mine.works.append(works[k])
                elif not mine.works:
                    mine.works = list(works)
            self._inflight.append(Pending(works=list(works), tensors=[t for *_, t in items]))
        return sent_back(pending, self.outer is not None)

    def _await(self, post: Post, role: str) -> None:
        """Before posting `post`'s sends: CUDA: the post stream waits for their compute and
        for the batches that received them; gloo: the host waits for those batches."""
        if self._streams and post.ready is not None:
            self._streams[role].wait_event(post.ready)
        for before in post.after:
            for work in before.works:
                self._wait_work(work)


@functools.cache
def _post_streams(device_index: int) -> dict[str, torch.cuda.Stream]:
    """A device's post streams, one per group role, made once per process. One per group:
    a group's batches run in posting order on its NCCL stream anyway, so its post stream
    adds no order of its own. Made once: receive buffers are allocated from them, and the
    caching allocator reuses a freed block only for the stream it came from, so a new
    stream per call would strand freed buffers across PyTorch's pool of streams."""
    return {role: torch.cuda.Stream(torch.device("cuda", device_index)) for role in ROLES}


def round_batches(posts: list[Post], has_outer: bool) -> list[tuple[str, list[tuple]]]:
    """The batches of one round: per group role, (receive?, peer, tag, post index, tensor)
    of every non-empty message, sends first, each ordered by (peer, tag). Without an
    outer group the "across" messages join the inner batch (one batch per group)."""
    out = []
    for role in (ROLES if has_outer else ("inner",)):
        items = []
        for i, p in enumerate(posts):
            for r in ((role,) if has_outer else ROLES):
                sends, recvs = p.messages(r)
                items += [(0, peer, tag, i, t) for peer, t, tag in sends if t.numel()]
                items += [(1, peer, tag, i, t) for peer, t, tag in recvs if t.numel()]
        if items:
            items.sort(key=lambda x: x[:3])
            out.append((role, items))
    return out


def sent_back(pending: dict[str, list[Pending]], has_outer: bool) -> list[Sent]:
    if not has_outer:
        return [Sent(inner=p, across=p) for p in pending["inner"]]
    return [Sent(inner=a, across=b) for a, b in zip(pending["inner"], pending["across"])]


def drive(p2p, tasks: list[Generator[Post, Sent, object]]) -> None:
    """Run tasks in rounds: each yields a `Post` for a round and gets back what was posted;
    the round with the smallest key among the tasks is posted next (`p2p.post`), then
    the tasks in it resume in task order (their compute is queued in that order)."""
    current: list[Post | None] = [next(t, None) for t in tasks]
    while any(p is not None for p in current):
        key = min(p.key for p in current if p is not None)
        now = [i for i, p in enumerate(current) if p is not None and p.key == key]
        sent = p2p.post([current[i] for i in now])
        for i, s in zip(now, sent):
            try:
                current[i] = tasks[i].send(s)
            except StopIteration:
                current[i] = None
                continue
            if current[i].key <= key:
                raise AssertionError(f"a task posted round {current[i].key} after {key}")
    p2p.finish()


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
