"""Turning a placement into a Plan (every planner ends here).

A *placement* says which rank holds each whole (local) document and, for each split
document, how many of its tokens each member rank holds. `assemble` turns it into a
`Plan`: zig-zag bounds that give every member exactly its token count, segments in the
attention engine's queue order (inter-node chunks, intra-node chunks, local documents),
and predicted memory per rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from operator import sub

import numpy as np

from ballonet.errors import InfeasiblePlan
from ballonet.plan import Plan, Ring, Segment
from ballonet.planning.devices import Devices

__all__ = ["Placement", "assemble", "with_memory", "zigzag_bounds"]


@dataclass
class Placement:
    """Mutable result of a planner before assembly."""
    num_ranks: int
    local: list[list[int]] = field(default_factory=list)
    """Per rank, the documents it holds whole."""
    split: dict[int, dict[int, int]] = field(default_factory=dict)
    """Per split document, tokens held by each member rank (ring in ascending rank order)."""
    rings: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """Per split document with a fixed ring: (ranks in ring order, 2g+1 bounds)."""

    def __post_init__(self):
        if not self.local:
            self.local = [[] for _ in range(self.num_ranks)]

    def copy(self) -> Placement:
        """A copy to assemble again (`assemble` moves a split document of one member to `local`)."""
        return Placement(num_ranks=self.num_ranks, local=list(map(list, self.local)),
                         split={d: sh.copy() for d, sh in self.split.items()}, rings=dict(self.rings))


def zigzag_bounds(length: int, tokens: list[int]) -> tuple[int, ...]:
    """2g+1 bounds giving ring position i exactly tokens[i] tokens: front chunk i of
    tokens[i] // 2 and the mirrored back chunk 2g-1-i of the rest. With front and back
    chunks of equal size a position's causal work is proportional to its tokens, whatever
    its place (chunk (s, a) at the front and its mirror at the back cost a*L together)."""
    front = list(accumulate([t // 2 for t in tokens], initial=0))  # bounds 0..g
    back = list(accumulate([t - t // 2 for t in tokens], sub, initial=length))  # bounds 2g down to g
    return (*front[:-1], *reversed(back))


def assemble(name: str, lengths: list[int], dev: Devices, placement: Placement, *, comm: str = "ring",
             double: bool = False, attention_engine: bool = False, meta: dict | None = None) -> Plan:
    """The plan of `placement` (rings of `split` in ascending rank order, which groups them
    by node, so an inter-node ring crosses nodes only between node blocks). With `double`,
    an inter-node ring of `split` with as many members on each of its nodes runs as a
    "double" ring (a ring inside each node, rounds across nodes between rail peers)."""
    ring_specs = []  # (doc, ranks, bounds)
    for doc in sorted(placement.split):
        shares = placement.split[doc]
        members = sorted([r for r, t in shares.items() if t > 0])
        if len(members) == 1:
            placement.local[members[0]].append(doc)
            continue
        tokens = [shares[r] for r in members]
        assert sum(tokens) == lengths[doc], (doc, tokens, lengths[doc])
        ring_specs.append((doc, tuple(members), zigzag_bounds(lengths[doc], tokens)))
    ring_specs += [(doc, tuple(ranks), tuple(bounds)) for doc, (ranks, bounds) in placement.rings.items()]
    # Ring chunks per rank, inter-node rings' then intra-node rings' (the engine's queue
    # order), each by (document, start): documents come in order, a member's front chunk
    # before its back one.
    chunks: tuple[list[list[Segment]], list[list[Segment]]] = ([[] for _ in range(dev.num_ranks)],
                                                                [[] for _ in range(dev.num_ranks)])
    held = [sum(map(lengths.__getitem__, docs)) for docs in placement.local]  # [R] tokens: `attention_token_counts`
    rings = []
    fixed = set(placement.rings)
    node_of = dev.node.__getitem__
    for doc, ranks, b in sorted(ring_specs):
        first = node_of(ranks[0])
        kind = "intra" if all(node_of(r) == first for r in ranks) else "inter"
        per_node = Counter(map(node_of, ranks)) if double and kind == "inter" and doc not in fixed else None
        if per_node is not None and len(set(per_node.values())) == 1:
            rings.append(Ring(doc=doc, kind=kind, ranks=ranks, bounds=b, comm="double", groups=len(per_node)))
        else:
            rings.append(Ring(doc=doc, kind=kind, ranks=ranks, bounds=b, comm=comm))
        queue, back = chunks[0 if kind == "inter" else 1], b[::-1]
        for i, r in enumerate(ranks):  # chunks i and 2g-1-i (Ring.chunks_of), empty ones left out
            start, end = b[i], b[i + 1]
            if end > start:
                queue[r].append(Segment(doc, start, end))
                held[r] += end - start
            start, end = back[i + 1], back[i]  # (b[2g-1-i], b[2g-i])
            if end > start:
                queue[r].append(Segment(doc, start, end))
                held[r] += end - start
    batch = tuple(lengths)
    whole = whole_segments(batch)
    attention = tuple((*inter, *intra, *map(whole.__getitem__, sorted(docs)))  # local documents last
                      if inter or intra else tuple(map(whole.__getitem__, sorted(docs)))
                      for inter, intra, docs in zip(*chunks, placement.local, strict=True))
    plan = Plan(planner=name, lengths=batch, node_of_rank=dev.node, nic_of_rank=dev.nic,
                attention=attention, rings=tuple(rings), memory_cap=dev.memory_total,
                attention_engine=attention_engine, meta=dict(meta or {}))
    plan.__dict__["attention_token_counts"] = tuple(held)  # (the cached count, as `replaced` keeps it)
    return plan


@functools.lru_cache(maxsize=8)
def whole_segments(lengths: tuple[int, ...]) -> tuple[Segment, ...]:
    """Each document of a batch as one segment: the planners assemble several plans of one
    batch, and segments are values."""
    return tuple(Segment(d, 0, n) for d, n in enumerate(lengths))


def over_cap(plan: Plan, dev: Devices) -> str | None:
    """Why `plan` does not fit: the first rank whose larger of its attention and linear
    token counts is over its token cap; None when every rank's fits."""
    att, lin = plan.attention_token_counts, plan.linear_token_counts
    over = np.nonzero(np.maximum(att, lin) > dev.token_cap)[0]
    if not len(over):
        return None
    r = int(over[0])
    docs = sorted({s.doc for s in plan.attention[r]}, key=lambda d: -plan.lengths[d])
    biggest = f" (largest document there: {docs[0]}, {plan.lengths[docs[0]]} tokens)" if docs else ""
    return (f"{plan.planner}: rank {r} would hold {max(att[r], lin[r])} tokens{biggest}, over its "
            f"limit of {int(dev.token_cap[r])} tokens on a {dev.gpu[r].name} GPU")


def with_memory(plan: Plan, dev: Devices) -> Plan:
    """`plan` with predicted memory per rank: state plus activations of the larger of its
    attention and linear token counts. Raises `InfeasiblePlan` if a rank is over its cap
    (`over_cap`)."""
    why = over_cap(plan, dev)
    if why is not None:
        raise InfeasiblePlan(why)
    att, lin = plan.attention_token_counts, plan.linear_token_counts
    used = tuple(dev.static_bytes + dev.act_bytes_per_token * max(a, b) for a, b in zip(att, lin))
    return replaced(plan, memory_bytes=used)


_COUNTS = {"attention_token_counts": ("attention",), "ring_of_doc": ("rings",),
           "linear_token_counts": ("attention", "remap")}
"""Plan's cached token counts and what each is computed from."""


def replaced(plan: Plan, **changes) -> Plan:
    """`dataclasses.replace(plan, **changes)` keeping the cached counts (`_COUNTS`) that
    `changes` leave as they were, so that each candidate counts its tokens once."""
    new = dataclasses.replace(plan, **changes)
    for name, inputs in _COUNTS.items():
        if name in plan.__dict__ and not any(f in changes for f in inputs):
            new.__dict__[name] = plan.__dict__[name]
    return new
