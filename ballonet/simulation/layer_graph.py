"""The task graph of one transformer layer's forward or backward pass, built from a Plan.

Attention: split documents sharing a ring of ranks run as one ring (per step one kernel
and one K/V transfer per rank, as TransformerEngine does for packed sequences); a rank's
local documents are one varlen kernel call (as `runtime.engine` runs them). Then the
remap all-to-all, the linear layers and the TP collectives, and the remap back
(backward: the reverse order). Every transfer moves what the runtime sends: K/V rows of
`dtype_bytes`, dK/dV as fp32, q/k/v out to the attention layout and o back
(`cost.flops.remap_bytes`); `LayerGraph.sent` records the bytes per (class, src, dst).
In the backward, one layer's gradient all-reduce bucket shares the links with it. See
`simulator.py` for the model as a whole and `timeline.py` for how tasks are scheduled.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import ATTENTION_BACKWARD_FACTOR, attention_flops, kv_bytes, kv_grad_bytes, remap_bytes
from ballonet.cost.seconds import attention_seconds
from ballonet.plan import Plan, chunk_bounds
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


@dataclass
class LayerGraph:
    """Builds one layer's forward or backward task graph; `build` returns, per rank, the
    task that ends its layer."""
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
    """Backward only: (intra-node seconds, bytes across nodes) of the gradient all-reduce
    bucket of the previous layer, which runs while this layer's backward does."""
    tl: Timeline = None
    chain: list = None
    sent: Counter = None
    """Bytes per (class, src, dst): "kv", "grad" (dK/dV), "remap", "allreduce"."""

    def __post_init__(self):
        self.tl = Timeline(num_streams=self.plan.num_ranks)
        self.chain = [None] * self.plan.num_ranks
        self.sent = Counter()

    def compute(self, rank: int, seconds: float, kind: str, step: int, after, name: str) -> int | None:
        if seconds <= 0:
            return self.tl.join(after)
        if not self.engine:
            after = list(after) + [self.chain[rank]]
        task = self.tl.add(seconds, stream=rank, priority=(PRIORITY[kind] << 24) + step, after=after,
                           label=(kind, rank, name))
        self.chain[rank] = task
        return task

    def transfer(self, src: int, dst: int, nbytes: float, after, name, kind: str) -> int | None:
        """A direct transfer, recorded in `sent`."""
        if nbytes > 0 and src != dst:
            self.sent[kind, src, dst] += nbytes
        return self.fabric.send(self.tl, src, dst, nbytes, after, name)

    def send(self, hop: tuple[int, int], rows: int, after, name, kind: str = "kv") -> int | None:
        """K/V rows (kind "kv") or their fp32 gradients ("grad") over a ring hop; a routed
        hop cuts the rows into one part per proxy pair (`plan.chunk_bounds`), each
        dispatched, sent across nodes and combined, as `runtime.routing` does."""
        src, dst = hop
        per_row = (kv_bytes if kind == "kv" else kv_grad_bytes)(self.model, 1)
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
        for ranks, comm, rings in ring_groups(self.plan):
            seconds, rows = ring_tables(self.plan, rings, self.model, self.fabric, self.backward)
            if self.backward and self.recompute == "full":
                seconds = seconds + ring_tables(self.plan, rings, self.model, self.fabric)[0]
            if comm == "allgather":  # one kernel over the gathered K/V
                seconds = seconds.sum(axis=1, keepdims=True)
            floor = np.array([[hardware.profile(self.fabric.gpu[r]).attention_launch_s] for r in ranks])
            seconds = np.where(seconds > 0, np.maximum(seconds, floor), 0.0).tolist()
            name = f"doc {rings[0].doc}" + "+" * (len(rings) > 1)
            if comm == "double":
                done = self.double(ranks, rings[0].groups, seconds, rows.tolist(), begin, name)
            else:
                ring = (self.ring_backward if self.backward else self.ring_forward) if comm == "ring" else \
                    (self.gather_backward if self.backward else self.gather_forward)
                done = ring(ranks, rings[0].kind, seconds, rows.tolist(), begin, name)
            for i, r in enumerate(ranks):
                ends[r].append(done[i])
        for r in range(self.plan.num_ranks):
            t = self.local_seconds(r)
            ends[r].append(self.compute(r, t, "local", 0, [begin[r]], "local documents"))
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

    def hops(self, ranks) -> list:
        g = len(ranks)
        return [(ranks[i], ranks[(i + 1) % g]) for i in range(g)]

    def ring_forward(self, ranks, kind, seconds, rows, begin, name) -> list:
        g, hops = len(ranks), self.hops(ranks)
        arrive = [begin[r] for r in ranks]
        last = [self.chain[r] for r in ranks]  # the send of step s waits for compute s-1 (no engine)
        done = [[] for _ in ranks]
        for s in range(g):
            nxt = [None] * g
            for i, r in enumerate(ranks):
                if s < g - 1:
                    after = [arrive[i]] if self.engine else [arrive[i], last[i]]
                    nxt[(i + 1) % g] = self.send(hops[i], rows[i][s], after, (name, "kv", s))
                c = self.compute(r, seconds[i][s], kind, s, [arrive[i]], (name, "step", s))
                last[i] = c
                done[i].append(c)
            arrive = nxt
        return [self.tl.join(d) for d in done]

    def ring_backward(self, ranks, kind, seconds, rows, begin, name) -> list:
        g, hops = len(ranks), self.hops(ranks)
        kv = [begin[r] for r in ranks]
        dkv = [None] * g
        done = [[] for _ in ranks]
        for s in range(g):
            next_kv, next_dkv = [None] * g, [None] * g
            for i, r in enumerate(ranks):
                c = self.compute(r, seconds[i][s], kind, s, [kv[i]], (name, "step", s))
                done[i].append(c)
                j = (i + 1) % g
                if s < g - 1:
                    after = [kv[i]] if self.engine else [kv[i], c]
                    next_kv[j] = self.send(hops[i], rows[i][s], after, (name, "kv", s))
                if s >= 1:  # the gradient of the block held at step s, toward its owner
                    next_dkv[j] = self.send(hops[i], rows[i][s], [c, dkv[i]], (name, "dkv", s), "grad")
            kv, dkv = next_kv, next_dkv
        return [self.tl.join(d + [dkv[i]]) for i, d in enumerate(done)]

    def double(self, ranks, k: int, seconds, rows, begin, name) -> list:
        """A "double" ring (`ring_traffic.double_schedule`), forward or backward, with the
        attention engine: per round an inner ring in each node group; each round's first
        block goes on to the same position of the next group as soon as it is there; in
        the backward, dK/dV partials follow the inner ring and each node's sum for a round's
        first block goes straight home, once the next round's first step is queued (where the
        runtime posts it, so that waiting for the sum never holds that step's compute back)
        or after the last round."""
        g = len(ranks)
        n = g // k
        inner = [(i // n) * n + (i % n + 1) % n for i in range(g)]
        arrive = {(i, 0): begin[r] for i, r in enumerate(ranks)}  # (position, step) -> its block is there
        done = [[] for _ in ranks]
        dkv: dict[int, int | None] = {}  # position -> its predecessor's partial of the step's block
        round_first = [None] * g  # the compute of the round's first step
        home: dict[int, tuple] = {}  # position -> (its node's sum of the last round's first block, owner)
        last = [None] * g  # each position's latest compute
        for s in range(g):
            j, t = divmod(s, n)
            incoming: dict[int, int | None] = {}
            for i, r in enumerate(ranks):
                here = arrive[i, s]
                c = self.compute(r, seconds[i][s], "inter", s, [here], (name, "step", s))
                done[i].append(c)
                last[i] = c
                if t == 0:
                    round_first[i] = c
                if t < n - 1:
                    arrive[inner[i], s + 1] = self.send((r, ranks[inner[i]]), rows[i][s], [here], (name, "kv", s))
                if t == 0 and j < k - 1:
                    nxt = ((i // n + 1) % k) * n + i % n
                    arrive[nxt, s + n] = self.send((r, ranks[nxt]), rows[i][s], [here], (name, "kv out", s))
                if i in home:  # as the runtime: posted once the next round's first step is queued
                    total, owner = home.pop(i)
                    done[owner].append(self.send((r, ranks[owner]), rows[i][(j - 1) * n], [total, c],
                                                 (name, "dkv home", s), "grad"))
                if self.backward and t >= 1:
                    incoming[inner[i]] = self.send((r, ranks[inner[i]]), rows[i][s], [c, dkv.get(i)],
                                                   (name, "dkv", s), "grad")
            dkv = incoming
            if self.backward and t == n - 1:
                for i, r in enumerate(ranks):
                    total = self.tl.join([round_first[i], dkv.get(i), last[i]])  # the node's sum of the round's first block
                    owner = ((i // n - j) % k) * n + i % n
                    if j == 0:
                        done[i].append(total)
                    elif n > 1 and j < k - 1:
                        home[i] = (total, owner)
                    else:
                        done[owner].append(self.send((r, ranks[owner]), rows[i][j * n], [total],
                                                     (name, "dkv home", s), "grad"))
                dkv = {}
        return [self.tl.join(d) for d in done]

    def gather(self, ranks, rows, begin, name) -> list:
        """K/V of every member sent straight to every other member (as the runtime does);
        per member the task after which all have arrived."""
        g = len(ranks)
        start = [begin[r] if self.engine else self.tl.join([begin[r], self.chain[r]]) for r in ranks]
        arrive = [[start[i]] for i in range(g)]
        for i in range(g):
            for j in range(g):
                if j != i:  # rows[i][0]: position i's own block
                    arrive[j].append(self.send((ranks[i], ranks[j]), rows[i][0], [start[i]], (name, "gather")))
        return [self.tl.join(a) for a in arrive]

    def gather_forward(self, ranks, kind, seconds, rows, begin, name) -> list:
        arrive = self.gather(ranks, rows, begin, name)
        return [self.compute(r, seconds[i][0], kind, 0, [arrive[i]], (name, "attention", 0))
                for i, r in enumerate(ranks)]

    def gather_backward(self, ranks, kind, seconds, rows, begin, name) -> list:
        """K/V gathered again, one kernel, then each member's block gradient sent home."""
        g, arrive = len(ranks), self.gather(ranks, rows, begin, name)
        comp = [self.compute(r, seconds[i][0], kind, 0, [arrive[i]], (name, "attention", 0))
                for i, r in enumerate(ranks)]
        back = [[comp[i]] for i in range(g)]
        for i in range(g):
            for j in range(g):
                if j != i:
                    back[j].append(self.send((ranks[i], ranks[j]), rows[j][0], [comp[i]], (name, "dkv"), "grad"))
        return [self.tl.join(back[i]) for i in range(g)]

    def remap_all_to_all(self, begin: list, reverse: bool, name: str) -> list:
        """Per rank, the task after which all of its incoming remap data has arrived. q, k
        and v travel toward the attention layout in the forward (their gradients back in
        the backward); o and its gradient the other way."""
        qkv = reverse != self.backward
        incoming = [[b] for b in begin]
        for (src, dst), tokens in sorted(self.remap.items()):
            if reverse:
                src, dst = dst, src
            nbytes = remap_bytes(self.model, tokens, qkv)
            incoming[dst].append(self.transfer(src, dst, nbytes, [begin[src]], name, "remap"))
        return [self.tl.join(x) for x in incoming]

    def linear(self, begin: list) -> list:
        ready = self.remap_all_to_all(begin, reverse=False, name="remap")
        out = []
        for r in range(self.plan.num_ranks):
            t = self.compute(r, self.linear_s[r][self.backward], "linear", 0, [ready[r]], "linear")
            out.append(self.compute(r, self.tp_s[r][self.backward], "tp", 0, [t], "tp collectives"))
        return self.remap_all_to_all(out, reverse=True, name="remap back")

    def allreduce_bucket(self) -> list:
        """The previous layer's gradient bucket, from the start of this backward: its
        intra-node part on each rank's NVLink ports, then its cross-node part on the NICs,
        each in pieces, so ring and remap transfers queue between them (the links are
        shared: NCCL runs the bucket's collectives beside them, not before them)."""
        intra_s, nic_bytes = self.grad_bucket
        ends = []
        R = self.plan.num_ranks
        for r in range(R):
            links, t = (r, R + r), None
            for _ in range(NUM_BUCKET_PIECES if intra_s > 0 else 0):
                t = self.tl.add(intra_s / NUM_BUCKET_PIECES, links=links, after=[t],
                                label=("send", r, "grad all-reduce"))
            peer = self.fabric.nic_peer(r)
            for _ in range(NUM_BUCKET_PIECES if nic_bytes > 0 and peer is not None else 0):
                t = self.transfer(r, peer, nic_bytes / NUM_BUCKET_PIECES, [t], "grad all-reduce", "allreduce")
            ends.append(t)
        return ends

    def build(self) -> list:
        """Per rank, the task that ends its layer."""
        start = [None] * self.plan.num_ranks
        if self.backward:
            bucket = self.allreduce_bucket()
            return [self.tl.join([a, b]) for a, b in zip(self.attention(self.linear(start)), bucket)]
        return self.linear(self.attention(start))


NUM_BUCKET_PIECES = 8
"""Pieces a gradient bucket's NIC traffic is cut into (links serve transfers in order)."""
