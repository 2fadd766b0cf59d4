"""The task graph of one transformer layer's forward or backward pass, built from a Plan.

Attention: split documents sharing a ring of ranks run as one ring (per step one kernel
and one K/V transfer per rank, as TransformerEngine does for packed sequences); local
documents are one kernel each. Then the remap all-to-all, the linear layers and the TP
collectives, and the remap back (backward: the reverse order). See `simulator.py` for
the model as a whole and `timeline.py` for how tasks are scheduled.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from ballonet import cost_model, hardware
from ballonet.plan import Plan, ring_schedule
from ballonet.simulation.fabric import Fabric
from ballonet.simulation.timeline import Timeline
from ballonet.specs import ModelSpec

PRIORITY = {"inter": 0, "intra": 1, "local": 2, "linear": 3, "tp": 4}
"""Queue order of a GPU's stream with the attention engine: inter-node, intra-node, local."""


def ring_groups(plan: Plan) -> list[tuple[tuple[int, ...], str, list]]:
    """Split documents grouped by (ring ranks, comm); inter-node groups first."""
    groups: dict = defaultdict(list)
    for ring in plan.rings:
        groups[ring.ranks, ring.comm, ring.kind].append(ring)
    keys = sorted(groups, key=lambda k: (PRIORITY[k[2]], min(r.doc for r in groups[k])))
    return [(k[0], k[1], groups[k]) for k in keys]


def ring_tables(plan: Plan, rings: list, model: ModelSpec, fabric: Fabric) -> tuple[np.ndarray, np.ndarray]:
    """Forward attention seconds [i, s] of ring position i at step s, and K/V rows [i, s]
    it holds at step s (`plan.ring_schedule`), summed over the rings: what it sends at
    step s, as the rings' `Ring.messages` (vectorised here). A doc's 2g chunk lengths l give, summed over docs with weight
    1/efficiency, M[q, k] = sum l[q] l[k] / eff: full blocks k < q cost 4*H*D*M[q, k],
    diagonal blocks 2*H*D*l[q](l[q]+1) (`cost_model.block_flops`)."""
    ranks = rings[0].ranks
    g = len(ranks)
    lens = np.diff(np.array([r.bounds for r in rings], dtype=float), axis=1)  # [docs, 2g]
    weight = np.array([1.0 / hardware.attention_efficiency(plan.lengths[r.doc] / g) for r in rings])
    M = (lens * weight[:, None]).T @ lens
    diag = (weight[:, None] * lens * (lens + 1)).sum(axis=0)
    hd = model.num_heads * model.head_dim
    a = np.arange(g)
    src = ring_schedule(g)  # [i, s]: position whose block i holds at step s
    flops = np.zeros((g, g))
    for q in (a[:, None], 2 * g - 1 - a[:, None]):
        for k in (src, 2 * g - 1 - src):
            flops += np.where(k < q, 4 * hd * M[q, k], 0.0) + np.where(k == q, 2 * hd * diag[q], 0.0)
    peak = np.array([fabric.gpu[r].peak_flops for r in ranks])
    block = lens.sum(axis=0)
    return flops / (peak[:, None] * model.tp), (block[a] + block[2 * g - 1 - a])[src]


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
    tp_s: list
    tl: Timeline = None
    chain: list = None

    def __post_init__(self):
        self.tl = Timeline(num_streams=self.plan.num_ranks)
        self.chain = [None] * self.plan.num_ranks

    def compute(self, rank: int, seconds: float, kind: str, step: int, after, name: str) -> int | None:
        if seconds <= 0:
            return self.tl.join(after)
        if not self.engine:
            after = list(after) + [self.chain[rank]]
        task = self.tl.add(seconds, stream=rank, priority=(PRIORITY[kind] << 24) + step, after=after,
                           label=(kind, rank, name))
        self.chain[rank] = task
        return task

    def hop(self, src: int, dst: int) -> tuple:
        """What a K/V hop src -> dst needs: (src, dst, proxies, links, latency, s per row)."""
        links, latency, per_byte = self.fabric.path(src, dst)
        return src, dst, self.routes.get((src, dst)), links, latency, per_byte * cost_model.kv_bytes(self.model, 1)

    def send(self, hop: tuple, rows: float, after, name) -> int | None:
        src, dst, proxies, links, latency, per_row = hop
        if rows <= 0:
            return self.tl.join(after)
        if proxies:
            nbytes = cost_model.kv_bytes(self.model, rows)
            return self.fabric.send_routed(self.tl, src, dst, nbytes, after, name, proxies)
        return self.tl.add(latency + rows * per_row, links=links, after=after, label=("send", src, name))

    def attention(self, begin: list) -> list:
        """Attention of every rank after `begin[rank]`; per rank the task that ends it."""
        factor = cost_model.ATTENTION_BACKWARD_FACTOR if self.backward else 1.0
        ends = [[b] for b in begin]
        for ranks, comm, rings in ring_groups(self.plan):
            seconds, rows = ring_tables(self.plan, rings, self.model, self.fabric)
            if comm != "ring":  # one kernel over the gathered K/V
                seconds = seconds.sum(axis=1, keepdims=True)
            seconds = np.where(seconds > 0, np.maximum(seconds * factor, hardware.ATTENTION_LAUNCH_S), 0.0).tolist()
            rows = rows.tolist()
            ring = (self.ring_backward if self.backward else self.ring_forward) if comm == "ring" else \
                (self.gather_backward if self.backward else self.gather_forward)
            done = ring(ranks, rings[0].kind, seconds, rows, begin, f"doc {rings[0].doc}" + "+" * (len(rings) > 1))
            for i, r in enumerate(ranks):
                ends[r].append(done[i])
        for r, segs in enumerate(self.plan.attention):
            for seg in segs:
                if seg.doc not in self.plan.ring_of_doc:
                    flops = cost_model.attention_flops(self.model, seg.num_tokens) * factor
                    t = cost_model.attention_time(self.model, self.fabric.gpu[r], flops, seg.num_tokens)
                    ends[r].append(self.compute(r, t, "local", 0, [begin[r]], ("doc", seg.doc)))
        return [self.tl.join(e) for e in ends]

    def hops(self, ranks) -> list:
        g = len(ranks)
        return [self.hop(ranks[i], ranks[(i + 1) % g]) for i in range(g)]

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
                next_dkv[j] = self.send(hops[i], rows[i][s], [c, dkv[i]], (name, "dkv", s))
            kv, dkv = next_kv, next_dkv
        return [self.tl.join(d + [dkv[i]]) for i, d in enumerate(done)]

    def gather_forward(self, ranks, kind, seconds, rows, begin, name) -> list:
        g, hops = len(ranks), self.hops(ranks)
        arrive = [begin[r] if self.engine else self.tl.join([begin[r], self.chain[r]]) for r in ranks]
        for s in range(g - 1):
            nxt = [None] * g
            for i in range(g):
                nxt[(i + 1) % g] = self.send(hops[i], rows[i][s], [arrive[i]], (name, "gather", s))
            arrive = nxt
        return [self.compute(r, seconds[i][0], kind, 0, [arrive[i]], (name, "attention", 0))
                for i, r in enumerate(ranks)]

    def gather_backward(self, ranks, kind, seconds, rows, begin, name) -> list:
        g, hops = len(ranks), self.hops(ranks)
        comp = [self.compute(r, seconds[i][0], kind, 0, [begin[r]], (name, "attention", 0))
                for i, r in enumerate(ranks)]
        arrive = [None] * g
        for s in range(g - 1):
            nxt = [None] * g
            for i in range(g):
                nxt[(i + 1) % g] = self.send(hops[i], rows[i][s], [comp[i], arrive[i]], (name, "reduce-scatter", s))
            arrive = nxt
        return [self.tl.join([comp[i], arrive[i]]) for i in range(g)]

    def remap_all_to_all(self, begin: list, reverse: bool, name: str) -> list:
        """Per rank, the task after which all of its incoming remap data has arrived."""
        incoming = [[b] for b in begin]
        for (src, dst), tokens in sorted(self.remap.items()):
            if reverse:
                src, dst = dst, src
            nbytes = cost_model.hidden_bytes(self.model, tokens) / self.model.tp
            incoming[dst].append(self.fabric.send(self.tl, src, dst, nbytes, [begin[src]], name))
        return [self.tl.join(x) for x in incoming]

    def linear(self, begin: list) -> list:
        factor = cost_model.LINEAR_BACKWARD_FACTOR if self.backward else 1.0
        ready = self.remap_all_to_all(begin, reverse=False, name="remap")
        out = []
        for r in range(self.plan.num_ranks):
            t = self.compute(r, self.linear_s[r] * factor, "linear", 0, [ready[r]], "linear")
            out.append(self.compute(r, self.tp_s[r], "tp", 0, [t], "tp collectives"))
        return self.remap_all_to_all(out, reverse=True, name="remap back")

    def build(self) -> list:
        """Per rank, the task that ends its layer."""
        start = [None] * self.plan.num_ranks
        if self.backward:
            return self.attention(self.linear(start))
        return self.linear(self.attention(start))
