"""The task graph of one transformer layer's forward or backward pass, built from a Plan.

Attention: split documents sharing a ring of ranks run as one ring (per step one kernel
and one K/V transfer per rank, as TransformerEngine does for packed sequences); a rank's
local documents are one varlen kernel call (as `runtime.engine` runs them). Then the
remap all-to-all, the linear layers and the TP collectives, and the remap back
(backward: the reverse order). A "heads" document's members gather q, k and v for their
heads, each computes its heads over the whole document, and returns each member's rows
(`ring_patterns.heads`). Every transfer moves what the runtime sends: K/V rows of
`dtype_bytes`, dK/dV as fp32, a "heads" document's messages (`cost.flops.message_bytes`),
q/k/v out to the attention layout and o back (`cost.flops.remap_bytes`);
`LayerGraph.sent` records the bytes per (class, src, dst).
In the backward, one layer's gradient all-reduce bucket shares the links with it. See
`simulator.py` for the model as a whole and `timeline.py` for how tasks are scheduled.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, message_bytes, remap_bytes
from ballonet.cost.seconds import DP_PIECES, attention_seconds, heads_kernel_seconds
from ballonet.plan import Plan, chunk_bounds
from ballonet.simulation import ring_patterns
from ballonet.simulation.fabric import Fabric
from ballonet.simulation.timeline import Timeline
from ballonet.specs import ModelSpec

PRIORITY = {"inter": 0, "intra": 1, "local": 2, "linear": 3, "tp": 4}
"""Queue order of a GPU's stream with the attention engine: inter-node, intra-node, local."""


def ring_groups(plan: Plan) -> list[tuple[tuple[int, ...], str, list]]:
    """Split documents grouped by (ring ranks, comm, node groups); inter-node groups first."""
    groups: dict = defaultdict(list)
    for ring in plan.rings:
        groups[ring.ranks, ring.comm, ring.kind, ring.groups].append(ring)
    keys = sorted(groups, key=lambda k: (PRIORITY[k[2]], min(r.doc for r in groups[k])))
    return [(k[0], k[1], groups[k]) for k in keys]


def prefix_rows(rings: list) -> np.ndarray:
    """[i, j] K/V rows member i sends member j of an "allgather" ring when each member
    receives only what its queries attend to (MagiAttention's group-cast, DistCA's
    dispatch: `plan.meta["kv_prefix"]`): the rows of i's chunks before the end of j's
    last one (i's front chunk, and its back chunk when i > j); summed over the rings."""
    g = len(rings[0].ranks)
    rows = np.zeros((g, g))
    for ring in rings:
        b = np.asarray(ring.bounds)
        chunks = [(b[i], b[i + 1], b[2 * g - 1 - i], b[2 * g - i]) for i in range(g)]
        last = np.array([e2 if e2 > s2 else e1 for s1, e1, s2, e2 in chunks])  # end of j's last query row
        for i, (s1, e1, s2, e2) in enumerate(chunks):
            rows[i] += np.clip(last - s1, 0, e1 - s1) + np.clip(last - s2, 0, e2 - s2)
    np.fill_diagonal(rows, 0.0)
    return rows


def ring_tables(plan: Plan, rings: list, model: ModelSpec, fabric: Fabric,
                backward: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Attention seconds [i, s] of ring position i at step s (forward, or backward at its
    own efficiency), and K/V rows [i, s] it holds at step s (`Ring.schedule`), summed
    over the rings: what it sends at step s, as the rings' `Ring.messages` (vectorised here)."""
    ranks = rings[0].ranks
    seconds = np.zeros((len(ranks), len(ranks)))
    for gpu in {fabric.gpu[r] for r in ranks}:  # one table per GPU type of the ring
        mine = np.array([fabric.gpu[r] is gpu for r in ranks])
        table, rows = _ring_table(plan, rings, model, gpu, backward)
        seconds[mine] = table[mine]
    return seconds, rows


def _ring_table(plan: Plan, rings: list, model: ModelSpec, gpu, backward: bool) -> tuple[np.ndarray, np.ndarray]:
    """`ring_tables` with every rank a `gpu`. A doc's 2g chunk lengths l give, summed over
    docs with weight 1/efficiency, M[q, k] = sum l[q] l[k] / eff: full blocks k < q cost
    4*H*D*M[q, k], diagonal blocks 2*H*D*l[q](l[q]+1) (`cost.flops.block_flops`)."""
    ranks = rings[0].ranks
    g = len(ranks)
    lens = np.diff(np.array([r.bounds for r in rings], dtype=float), axis=1)  # [docs, 2g]
    chunk = np.array([plan.lengths[r.doc] / g for r in rings])
    weight = 1.0 / hardware.attention_efficiency(chunk, gpu, backward)
    M = (lens * weight[:, None]).T @ lens
    diag = (weight[:, None] * lens * (lens + 1)).sum(axis=0)
    hd = model.num_heads * model.head_dim
    a = np.arange(g)
    src = rings[0].schedule()  # [i, s]: position whose block i holds at step s
    flops = np.zeros((g, g))
    for q in (a[:, None], 2 * g - 1 - a[:, None]):
        for k in (src, 2 * g - 1 - src):
            flops += np.where(k < q, 4 * hd * M[q, k], 0.0) + np.where(k == q, 2 * hd * diag[q], 0.0)
    factor = ATTENTION_BACKWARD_FACTOR if backward else 1.0
    block = lens.sum(axis=0)
    return flops * factor / (gpu.peak_flops * model.tp), (block[a] + block[2 * g - 1 - a])[src]


def heads_seconds(plan: Plan, rings: list, model: ModelSpec, fabric: Fabric, backward: bool = False) -> list[float]:
    """Per member, seconds of its one kernel over a "heads" group's documents, forward or
    backward (`cost.seconds.heads_kernel_seconds`)."""
    lengths = [plan.lengths[ring.doc] for ring in rings]
    return [heads_kernel_seconds(model, fabric.gpu[r], lengths, len(rings[0].ranks), backward) for r in rings[0].ranks]


@dataclass
class LayerGraph:
    """Builds one layer's forward or backward task graph; `build` returns, per rank, the
    task that ends its layer.

    Each GPU's compute stream runs its kernels in the order the runtime's host queues them
    (`runtime.engine`: the rings a rank takes part in are stepped round-robin in queue
    order, inter-node, intra-node, and its local documents are one call after every
    ring's first step; in the backward the linear layers come first). Every compute task
    carries that order as a key (phase, round, queue position, 1) and `build` chains them.
    With the engine (`engine=True`, what the runtime does for every plan: sends posted on
    a communication stream once their data is there) a transfer waits for its data only;
    without it (`engine=False`, sends posted on the compute stream, as NCCL's
    `batch_isend_irecv` does without a side stream) a transfer posted at key (phase,
    round, queue position, 0 before the step's compute or 2 after it) also waits for
    every kernel the rank queued before it."""
    plan: Plan
    model: ModelSpec
    fabric: Fabric
    backward: bool
    engine: bool
    routes: dict
    remap: Counter
    linear_s: list
    """Per rank, (forward, backward) seconds of its linear layers (backward: with recomputation)."""
    tp_s: list
    """Per rank, (forward, backward) seconds of its tensor-parallel collectives (backward:
    with the recomputation's reruns)."""
    recompute: str = "none"
    """With "full", the backward reruns each attention kernel's forward before it."""
    grad_bucket: tuple = (0.0, 0.0)
    """(intra-node seconds, bytes across nodes) of the data-parallel collectives that run
    beside this layer: in the forward, the next layer's parameter all-gather; in the
    backward, the all-gather and gradient reduce-scatter of the layer before."""
    cp_group: bool = True
    """Context-parallel traffic (rings, relays, remaps) on its own process group, apart
    from the data-parallel collectives (as the runtime runs it): the two share links,
    piece by piece. False: one process group, whose one stream runs the layer's
    data-parallel collectives before any of its CP transfers."""
    remap_meets: bool = True
    """The remap as the runtime runs it (`remap_all_to_all`); False: each transfer leaves
    when its sender is ready and only receivers wait for it, the credit DistCA's ping-pong
    (`ping_pong.py`, which our runtime does not run) had before and keeps, a courtesy to
    the baseline (the NCCL rule lengthens the layer of `tests/test_baselines.py`'s
    ping-pong case by 3.7%)."""
    shared: LayerGraph | None = None
    """Build into this graph's timeline and stream order (several layers or nano-batches
    in one run; `ping_pong.py`)."""
    layer: int = 0
    nano: int = 0
    """Place in the stream order of a shared run: (layer, phase, nano-batch) lead every key."""
    scale: float = 1.0
    """Share of the plan's work and bytes this graph carries (a nano-batch: 1/2)."""
    tl: Timeline = None
    sent: Counter = None
    """Bytes per (class, src, dst): "kv", "grad" (dK/dV), a "heads" document's payloads
    ("qkv", "out", "dout", "dqkv"), "remap", "allreduce"."""

    def __post_init__(self):
        base = self.shared
        self.tl = base.tl if base else Timeline(num_streams=self.plan.num_ranks)
        self.sent = Counter()
        # per rank: (key, compute task); (rank, key, join task) of sends posted behind queued compute
        self.order: list[list] = base.order if base else [[] for _ in range(self.plan.num_ranks)]
        self.gates: list[tuple] = base.gates if base else []
        self.phase = 0
        self.dp_end: list = [None] * self.plan.num_ranks  # cp_group=False: CP transfers wait for these

    def _key(self, key: tuple) -> tuple:
        return (self.layer, self.phase, self.nano, *key)

    def compute(self, rank: int, seconds: float, kind: str, key: tuple, after, name) -> int | None:
        """A kernel of `seconds` on `rank`'s stream after `after`, queued at `key` (round,
        queue position, 1)."""
        seconds *= self.scale
        if seconds <= 0:
            return self.tl.join(after)
        task = self.tl.add(seconds, stream=rank, priority=PRIORITY[kind], after=after, label=(kind, rank, name))
        self.order[rank].append((self._key(key), task))
        return task

    def wait(self, rank: int, key: tuple, after, name) -> int | None:
        """The runtime's wait for a received partial sum (`comm.wait` before adding it): the
        rank's stream runs nothing queued after `key` (round, queue position, 2) until
        `after` is done."""
        after = [a for a in after if a is not None]
        if not after:
            return None
        task = self.tl.add(0.0, stream=rank, priority=PRIORITY["inter"], after=after, label=("wait", rank, name))
        self.order[rank].append((self._key(key), task))
        return task

    def post(self, rank: int, key: tuple, after) -> list:
        """What a send `rank` posts at `key` (round, queue position, 0 or 2) waits for:
        its data (`after`), and without the engine every kernel queued before it (sub-key 0:
        posted before the step's compute, 3: after it and its waits)."""
        if self.engine:
            return list(after)
        gate = self.tl.add(0.0, after=after, label=("join", rank, "post"))
        self.gates.append((rank, self._key(key), gate))
        return [gate]

    def fix_order(self) -> None:
        """Chain each rank's kernels in key order; gate each posted send behind the last
        kernel queued before it."""
        for rank, tasks in enumerate(self.order):
            tasks.sort(key=lambda kt: kt[0])
            for (_, a), (_, b) in zip(tasks, tasks[1:]):
                self.tl.edge(a, b)
        keys = [[k for k, _ in tasks] for tasks in self.order]
        for rank, key, gate in self.gates:
            i = bisect.bisect_left(keys[rank], key)
            if i > 0:
                self.tl.edge(self.order[rank][i - 1][1], gate)

    def transfer(self, src: int, dst: int, nbytes: float, after, name, kind: str) -> int | None:
        """A direct transfer, recorded in `sent`."""
        nbytes *= self.scale
        if nbytes > 0 and src != dst:
            self.sent[kind, src, dst] += nbytes
            if not self.cp_group and kind != "allreduce":
                after = list(after) + [self.dp_end[src], self.dp_end[dst]]
        return self.fabric.send(self.tl, src, dst, nbytes, after, name)

    def send(self, hop: tuple[int, int], rows: int, after, name, kind: str = "kv", members: int = 1) -> int | None:
        """`rows` rows of a split document's message over a hop, kind its payload
        (`plan.PAYLOADS`: "kv" K/V, "grad" their fp32 gradients, or a "heads" document's
        of `members` members), priced by `cost.flops.message_bytes`; a routed hop cuts the
        rows into one part per proxy pair (`plan.chunk_bounds`), each dispatched, sent
        across nodes and combined, as `runtime.routing` does (relays forward as soon as a
        part arrives)."""
        src, dst = hop
        per_row = message_bytes(self.model, kind, 1, members)
        proxies = self.routes.get(hop)
        if rows <= 0:
            return self.tl.join(after)
        if not proxies:
            return self.transfer(src, dst, rows * per_row, after, name, kind)
        b = chunk_bounds(int(rows), len(proxies))
        ends = []
        for j, (a, c) in enumerate(proxies):
            t = after
            for x, y in ((src, a), (a, c), (c, dst)):
                t = [self.transfer(x, y, (b[j + 1] - b[j]) * per_row, t, (name, "routed"), kind)]
            ends.append(t[0])
        return self.tl.join(ends)

    def attention(self, begin: list) -> list:
        """Attention of every rank after `begin[rank]`; per rank the task that ends it."""
        ends = [[b] for b in begin]
        groups = ring_groups(self.plan)
        for q, (ranks, comm, rings) in enumerate(groups):
            name = f"doc {rings[0].doc}" + "+" * (len(rings) > 1)
            if comm == "heads":
                blocks = [sum(ring.block_tokens(i) for ring in rings) for i in range(len(ranks))]
                rerun = heads_seconds(self.plan, rings, self.model, self.fabric) \
                    if self.backward and self.recompute == "full" else None
                done = ring_patterns.heads(self, ranks, rings[0].kind, q,
                                           heads_seconds(self.plan, rings, self.model, self.fabric, self.backward),
                                           blocks, begin, name, rerun)
                for i, r in enumerate(ranks):
                    ends[r].append(done[i])
                continue
            seconds, rows = ring_tables(self.plan, rings, self.model, self.fabric, self.backward)
            if self.backward and self.recompute == "full":
                seconds = seconds + ring_tables(self.plan, rings, self.model, self.fabric)[0]
            if comm == "allgather":  # the own block, then one kernel over the gathered K/V
                seconds = np.stack([seconds[:, 0], seconds[:, 1:].sum(axis=1)], axis=1)
                g = len(ranks)
                rows = prefix_rows(rings) if self.plan.meta.get("kv_prefix") else \
                    np.repeat(rows[:, :1], g, axis=1) * (1 - np.eye(g))  # [i, j]: i's whole block to every j
            floor = np.array([[hardware.profile(self.fabric.gpu[r]).attention_launch_s] for r in ranks])
            seconds = np.where(seconds > 0, np.maximum(seconds, floor), 0.0).tolist()
            if comm == "double":
                done = ring_patterns.double(self, ranks, q, rings[0].groups, seconds, rows.tolist(), begin, name)
            else:
                ring = (ring_patterns.ring_backward if self.backward else ring_patterns.ring_forward) \
                    if comm == "ring" else \
                    (ring_patterns.gather_backward if self.backward else ring_patterns.gather_forward)
                done = ring(self, ranks, rings[0].kind, q, seconds, rows.tolist(), begin, name)
            for i, r in enumerate(ranks):
                ends[r].append(done[i])
        for r in range(self.plan.num_ranks):  # after every ring's first step
            t = self.local_seconds(r)
            ends[r].append(self.compute(r, t, "local", (0, len(groups), 1), [begin[r]], "local documents"))
        return [self.tl.join(e) for e in ends]

    def local_seconds(self, rank: int) -> float:
        """One varlen call over the rank's whole documents (and, with full recomputation,
        its forward rerun in the backward)."""
        lengths = [s.num_tokens for s in self.plan.attention[rank] if s.doc not in self.plan.ring_of_doc]
        if not lengths:
            return 0.0
        gpu = self.fabric.gpu[rank]
        flops = attention_flops(self.model, lengths)
        total = float(np.sum(attention_seconds(self.model, gpu, flops, lengths, self.backward)))
        if self.backward and self.recompute == "full":
            total += float(np.sum(attention_seconds(self.model, gpu, flops, lengths)))
        return max(hardware.profile(gpu).attention_launch_s, total)

    def remap_all_to_all(self, begin: list, reverse: bool, name: str) -> list:
        """Per rank, the task after which its part of the remap is done. q, k and v travel
        toward the attention layout in the forward (their gradients back in the backward);
        o and its gradient the other way. As NCCL runs the runtime's `all_to_all_single`
        (one grouped kernel of sends and receives on each rank, launched when the rank's
        stream reaches it): a pair's bytes move once both ranks have posted, and a rank
        goes on when all of its sends and receives are done (without `remap_meets`, when
        its receives are)."""
        qkv = reverse != self.backward
        done = [[b] for b in begin]
        for (src, dst), tokens in sorted(self.remap.items()):
            if reverse:
                src, dst = dst, src
            nbytes = remap_bytes(self.model, tokens, qkv)
            posted = [begin[src], begin[dst]] if self.remap_meets else [begin[src]]
            t = self.transfer(src, dst, nbytes, posted, name, "remap")
            done[dst].append(t)
            if self.remap_meets:
                done[src].append(t)
        return [self.tl.join(x) for x in done]

    def linear(self, begin: list) -> list:
        ready = self.remap_all_to_all(begin, reverse=False, name="remap")
        out = []
        for r in range(self.plan.num_ranks):
            t = self.compute(r, self.linear_s[r][self.backward], "linear", (0, 0, 1), [ready[r]], "linear")
            out.append(self.compute(r, self.tp_s[r][self.backward], "tp", (0, 1, 1), [t], "tp collectives"))
        return self.remap_all_to_all(out, reverse=True, name="remap back")

    def data_parallel(self) -> list:
        """The layer's data-parallel collectives (`grad_bucket`), from the start of the
        layer: their intra-node part on each rank's NVLink ports, then their cross-node
        part on the NICs, each in pieces, so CP transfers queue between them (separate
        process groups: NCCL runs them beside each other on the same links)."""
        intra_s, nic_bytes = self.grad_bucket
        ends = []
        R = self.plan.num_ranks
        for r in range(R):
            links, t = (r, R + r), None
            for _ in range(DP_PIECES if intra_s > 0 else 0):
                t = self.tl.add(intra_s / DP_PIECES, links=links, after=[t],
                                label=("send", r, "data-parallel collectives"))
            peer = self.fabric.nic_peer(r)
            for _ in range(DP_PIECES if nic_bytes > 0 and peer is not None else 0):  # full size in a nano-batch too
                t = self.transfer(r, peer, nic_bytes / DP_PIECES / self.scale, [t], "data-parallel collectives",
                                  "allreduce")
            ends.append(t)
        return ends

    def build_layer(self, begin: list) -> list:
        """Per rank, the task that ends this graph's pass after `begin[rank]` (attention
        then linear layers, or in the backward the reverse), without the data-parallel
        collectives and before `fix_order`."""
        first, second = (self.linear, self.attention) if self.backward else (self.attention, self.linear)
        self.phase = 0
        mid = first(begin)
        self.phase = 1
        return second(mid)

    def build(self) -> list:
        """Per rank, the task that ends its layer."""
        dp = self.data_parallel()
        if not self.cp_group:
            self.dp_end = dp
        ends = self.build_layer([None] * self.plan.num_ranks)
        self.fix_order()
        return [self.tl.join([a, b]) for a, b in zip(ends, dp)]

