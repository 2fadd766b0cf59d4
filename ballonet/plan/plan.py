"""The Plan: the one contract between planner, simulator and runtime.

A plan says, for one global batch of documents (`lengths`, in input order), where every
token lives in each of two layouts:

* the **attention layout**: per rank, an ordered list of `Segment`s (token ranges of one
  document). A whole document on one rank is a *local* document. A *split* document has a
  `Ring`: its ordered group of ranks and its 2g zig-zag chunk bounds; the rank at ring
  position i holds chunks i and 2g-1-i, in that order (empty chunks are left out). An
  inter-node "double" ring is node-major: `Ring.groups` groups of n ranks, one per node.
* the **linear layout** (token-balanced), reached from the attention layout by the remap
  `Transfer`s: rank `src` sends the tokens at positions [start, end) of its
  attention-local order to `dst`. A rank keeps the tokens it does not send, in order, and
  appends what it receives, ordered by (src, start).

The traffic of split documents is `Plan.ring_messages()` (`RingMessage`: phase, payload,
document, step, source, destination, rows), the one walk of the ring schedule that the
metrics, the routing planner, the simulator and the runtime's byte prediction share. A
"ring" document runs g steps: at step s, ring position i computes with (and then passes
on) the K/V block of position (i - s) mod g (`ring_schedule`). An "allgather" document
sends every block to every other member before attention, and every block's dK/dV back to
its owner after. A "double" document runs an inner ring inside each node and passes each
block once per round to the same position of the next node (`ring_traffic`). A "heads"
document (DeepSpeed-Ulysses, inside one node) gathers every member's q, k, v rows for
each member's 1/g of the heads, and sends each result row back to its owner.

Inter-node ring hops may carry a `Route`: each message of the hop (K/V or dK/dV rows) is
cut into len(proxies) row ranges (`Route.part_bounds`, i.e. `chunk_bounds(rows, k)`), and
part j travels src -> proxies[j][0] (intra-node) -> proxies[j][1] (across nodes,
rail-aligned) -> dst (intra-node), each leg carrying the part's rows.

Token counts here are model-free; the cost model turns them into bytes and seconds. What
the planner decided for the model it planned for is typed fields too: each rank's memory
(`memory_bytes`, `memory_cap`), its activation recomputation (`recompute`) and whether the
plan is made for the attention engine (`attention_engine`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property

from ballonet.plan.layout import Segment, Transfer
from ballonet.plan.recompute import RankRecompute, RecomputeMode
from ballonet.plan.ring_traffic import RING_COMMS, SPLIT_KINDS, Ring, RingMessage, Route

__all__ = ["InvalidPlan", "Plan"]


class InvalidPlan(Exception):
    """A plan that breaks the contract: a planner bug, never a user error (so not an
    `InputError`: the CLI reports it as a bug, not as bad input)."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Plan:
    planner: str
    lengths: tuple[int, ...]
    node_of_rank: tuple[int, ...]
    nic_of_rank: tuple[int, ...]
    attention: tuple[tuple[Segment, ...], ...]
    rings: tuple[Ring, ...] = ()
    remap: tuple[Transfer, ...] = ()
    routes: tuple[Route, ...] = ()
    memory_bytes: tuple[float, ...] = ()
    """Predicted peak activation + state memory per rank (empty: not estimated)."""
    memory_cap: tuple[float, ...] = ()
    attention_engine: bool = False
    """Made for Zeppelin's attention engine: transfers start as soon as their data is there
    and each rank runs ready work in queue order (inter-node, intra-node, local), so local
    attention fills ring waits. False: the baselines' loop (fixed order; a ring step's
    send issued after the previous step's compute). The simulator models it."""
    recompute: tuple[RankRecompute, ...] = ()
    """[R] what each rank recomputes for the model the plan was made for: the cheapest
    recomputation its tokens fit under (`cost.recompute.cheapest_per_rank`), which the
    simulator and the trainer's `--recompute auto` run. Empty: not decided (a plan built
    by hand); they then decide it from the plan's tokens the same way."""
    meta: dict = field(default_factory=dict, compare=False)
    """Free-form records of how the planner got there (options, thresholds, the candidates
    it compared); part of the JSON, read by no code."""

    # ---- derived views ---------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @cached_property
    def ring_of_doc(self) -> dict[int, Ring]:
        return {r.doc: r for r in self.rings}

    @cached_property
    def doc_offsets(self) -> tuple[int, ...]:
        """Global position of each document's first token (input order); one extra at the end."""
        out, acc = [0], 0
        for n in self.lengths:
            acc += n
            out.append(acc)
        return tuple(out)

    def local_docs(self, rank: int) -> list[int]:
        return [s.doc for s in self.attention[rank] if s.doc not in self.ring_of_doc]

    @cached_property
    def attention_token_counts(self) -> tuple[int, ...]:
        """Tokens each rank holds in the attention layout."""
        return tuple(sum([s.end - s.start for s in segs]) for segs in self.attention)

    @cached_property
    def linear_token_counts(self) -> tuple[int, ...]:
        """Tokens each rank holds in the linear layout (after the remap)."""
        out = list(self.attention_token_counts)
        for t in self.remap:
            n = t.end - t.start  # (`num_tokens`, without its property call: each candidate counts once)
            out[t.src] -= n
            out[t.dst] += n
        return tuple(out)

    def attention_tokens(self, rank: int) -> int:
        return self.attention_token_counts[rank]

    def linear_tokens(self, rank: int) -> int:
        return self.linear_token_counts[rank]

    def linear_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """The linear layout of `rank` as (src rank, start, end) ranges of attention-local
        orders: the kept ranges of its own tokens, then incoming transfers by (src, start)."""
        outgoing = sorted((t.start, t.end) for t in self.remap if t.src == rank)
        pieces, cursor = [], 0
        for start, end in outgoing:
            if start > cursor:
                pieces.append((rank, cursor, start))
            cursor = end
        total = self.attention_tokens(rank)
        if total > cursor:
            pieces.append((rank, cursor, total))
        incoming = sorted((t.src, t.start, t.end) for t in self.remap if t.dst == rank)
        return pieces + incoming

    def ring_messages(self) -> Iterator[RingMessage]:
        """Every ring message of one forward and one backward pass, ring by ring
        (`Ring.messages`)."""
        for ring in self.rings:
            yield from ring.messages()

    def remap_tokens(self) -> Counter:
        counts: Counter = Counter()
        get = counts.get  # (a pair's first transfer: no `Counter.__missing__` call)
        for t in self.remap:
            pair = (t.src, t.dst)
            counts[pair] = get(pair, 0) + t.end - t.start
        return counts

    @cached_property
    def remap_pairs(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """`remap_tokens()` as (sources, destinations, tokens), one entry a pair, counted once."""
        pairs = self.remap_tokens()
        return tuple(s for s, _ in pairs), tuple(d for _, d in pairs), tuple(pairs.values())

    # ---- validation ------------------------------------------------------------------

    def validate(self) -> Plan:
        """Raise `InvalidPlan` unless the plan keeps the contract; return self."""
        n = self.num_ranks
        _check(len(self.attention) == n and len(self.nic_of_rank) == n, "per-rank tables differ in length")
        _check(all(L >= 1 for L in self.lengths), "a document has no tokens")
        seen: list[list[tuple[int, int, int]]] = [[] for _ in self.lengths]
        for rank, segs in enumerate(self.attention):
            for s in segs:
                if not 0 <= s.doc < len(self.lengths):  # (messages built only on failure: hot loop)
                    raise InvalidPlan(f"rank {rank}: unknown document {s.doc}")
                if not 0 <= s.start < s.end <= self.lengths[s.doc]:
                    raise InvalidPlan(f"rank {rank}: bad segment {s}")
                seen[s.doc].append((s.start, s.end, rank))
        for doc, ranges in enumerate(seen):
            ranges.sort()
            cursor = 0
            for start, end, _ in ranges:
                if start != cursor:
                    raise InvalidPlan(f"document {doc}: tokens {cursor}..{start} missing or doubled")
                cursor = end
            if cursor != self.lengths[doc]:
                raise InvalidPlan(f"document {doc}: covered up to {cursor} of {self.lengths[doc]}")
            if len(ranges) > 1 and doc not in self.ring_of_doc and len({r for _, _, r in ranges}) > 1:
                raise InvalidPlan(f"document {doc} spans ranks but has no ring")
        _check(len(self.ring_of_doc) == len(self.rings), "a document has two rings")
        held: dict[tuple[int, int], list[Segment]] = {}  # (rank, ring's doc) -> segments, in local order
        in_ring = self.ring_of_doc
        for rank, segs in enumerate(self.attention):
            for s in segs:
                if s.doc in in_ring:
                    held.setdefault((rank, s.doc), []).append(s)
        for ring in self.rings:
            self._validate_ring(ring, held)
        self._validate_remap()
        for route in self.routes:
            self._validate_route(route)
        if self.recompute and not (len(self.recompute) == n and all(
                isinstance(m, RecomputeMode) and isinstance(k, int) and k >= 0 and (k == 0 or m != RecomputeMode.NONE)
                for m, k in self.recompute)):  # (messages built only on failure, here and below: per rank or ring)
            raise InvalidPlan(f"recompute {self.recompute}: not one (mode, layers) per rank")
        full = {m == RecomputeMode.FULL for m, _ in self.recompute}
        _check(len(full) <= 1, "recompute: full on some ranks only (it reruns the exchanges: every rank or none)")
        if self.memory_bytes:
            for rank, (used, cap) in enumerate(zip(self.memory_bytes, self.memory_cap)):
                if not used <= cap:
                    raise InvalidPlan(f"rank {rank}: {used / 2**30:.1f} GiB over its cap of {cap / 2**30:.1f} GiB")
        return self

    def _validate_ring(self, ring: Ring, held_by: dict[tuple[int, int], list[Segment]]) -> None:
        g, L = len(ring.ranks), self.lengths[ring.doc]
        _check(ring.kind in SPLIT_KINDS and ring.comm in RING_COMMS, f"ring of document {ring.doc}: bad kind")
        if not (len(set(ring.ranks)) == g and all(0 <= r < self.num_ranks for r in ring.ranks)):
            raise InvalidPlan(f"ring of document {ring.doc}: ranks {ring.ranks}")
        b = ring.bounds
        if not (len(b) == 2 * g + 1 and b[0] == 0 and b[-1] == L and all(x <= y for x, y in zip(b, b[1:]))):
            raise InvalidPlan(f"ring of document {ring.doc}: bounds {b}")
        nodes = {self.node_of_rank[r] for r in ring.ranks}
        if (ring.kind == "inter") != (len(nodes) > 1):
            raise InvalidPlan(f"ring of document {ring.doc}: kind {ring.kind} spans {len(nodes)} nodes")
        if ring.comm == "double":
            k = ring.groups
            _check(isinstance(k, int) and k >= 2 and g % k == 0,
                   f"ring of document {ring.doc}: {g} ranks in {k} groups")
            n = g // k
            group_nodes = [{self.node_of_rank[r] for r in ring.ranks[a * n:(a + 1) * n]} for a in range(k)]
            _check(all(len(x) == 1 for x in group_nodes) and len(set.union(*group_nodes)) == k,
                   f"ring of document {ring.doc}: its {k} groups are not one node each")
        elif ring.groups != 1:
            raise InvalidPlan(f"ring of document {ring.doc}: groups {ring.groups} with comm {ring.comm}")
        if ring.comm == "heads" and ring.kind != "intra":
            raise InvalidPlan(f"ring of document {ring.doc}: comm heads spans {len(nodes)} nodes (heads are split "
                              f"inside one node)")
        for i, rank in enumerate(ring.ranks):  # `ring.chunks_of(i)`, compared as (start, end) pairs
            held = held_by.get((rank, ring.doc), ())
            pairs = [(x, y) for x, y in ((b[i], b[i + 1]), (b[2 * g - 1 - i], b[2 * g - i])) if y > x]
            if [(s.start, s.end) for s in held] != pairs:
                raise InvalidPlan(f"rank {rank} holds {tuple(held)} of document {ring.doc}, "
                                  f"ring says {ring.chunks_of(i)}")

    def _validate_remap(self) -> None:
        outgoing: list[list[tuple[int, int]]] = [[] for _ in range(self.num_ranks)]
        held = self.attention_token_counts
        for t in self.remap:
            if 0 <= t.src < self.num_ranks:
                outgoing[t.src].append((t.start, t.end))
        for rank in range(self.num_ranks):
            out = sorted(outgoing[rank])
            cursor = 0
            for start, end in out:
                if not cursor <= start < end:
                    raise InvalidPlan(f"rank {rank}: overlapping or empty remap ranges")
                cursor = end
            if cursor > held[rank]:
                raise InvalidPlan(f"rank {rank}: remap sends more tokens than it holds")
        for t in self.remap:
            if t.src == t.dst or not 0 <= t.dst < self.num_ranks:
                raise InvalidPlan(f"bad remap transfer {t}")

    def _validate_route(self, route: Route) -> None:
        ring = self.ring_of_doc.get(route.doc)
        if ring is None or ring.kind != "inter" or ring.comm != "ring":
            raise InvalidPlan(f"route for document {route.doc}, which has no inter-node ring of comm \"ring\"")
        g = len(ring.ranks)
        hops = {(ring.ranks[i], ring.ranks[(i + 1) % g]) for i in range(g)}
        _check((route.src, route.dst) in hops, f"route {route.src}->{route.dst} is not a hop of document {route.doc}")
        src_node, dst_node = self.node_of_rank[route.src], self.node_of_rank[route.dst]
        _check(src_node != dst_node and bool(route.proxies), f"route {route.src}->{route.dst} does not cross nodes")
        for a, b in route.proxies:
            _check(self.node_of_rank[a] == src_node and self.node_of_rank[b] == dst_node,
                   f"route {route.src}->{route.dst}: proxy pair ({a}, {b}) on the wrong nodes")

    # ---- serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict:
        d = asdict(self)
        d["attention"] = [[[s["doc"], s["start"], s["end"]] for s in segs] for segs in d["attention"]]
        d["remap"] = [[t["src"], t["dst"], t["start"], t["end"]] for t in d["remap"]]
        return d

    def to_json(self) -> str:
        """Canonical JSON: the same plan gives byte-identical text in every process."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Plan:
        d = json.loads(text)
        return Plan(
            planner=d["planner"],
            lengths=tuple(d["lengths"]),
            node_of_rank=tuple(d["node_of_rank"]),
            nic_of_rank=tuple(d["nic_of_rank"]),
            attention=tuple(tuple(Segment(*s) for s in segs) for segs in d["attention"]),
            rings=tuple(Ring(doc=r["doc"], kind=r["kind"], ranks=tuple(r["ranks"]), bounds=tuple(r["bounds"]),
                             comm=r["comm"], groups=r.get("groups", 1)) for r in d["rings"]),
            remap=tuple(Transfer(*t) for t in d["remap"]),
            routes=tuple(Route(doc=r["doc"], src=r["src"], dst=r["dst"],
                               proxies=tuple(tuple(p) for p in r["proxies"])) for r in d["routes"]),
            memory_bytes=tuple(d["memory_bytes"]),
            memory_cap=tuple(d["memory_cap"]),
            attention_engine=d["attention_engine"],
            recompute=tuple(RankRecompute(RecomputeMode(m), k) for m, k in d.get("recompute", ())),
            meta=d["meta"],
        )

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON; ranks compare it before running a plan."""
        return _sha(self.to_json())


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidPlan(message)
