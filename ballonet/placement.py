"""What every planner shares: the devices it plans for, and turning a placement into a Plan.

A *placement* says which rank holds each whole (local) document and, for each split
document, how many of its tokens each member rank holds. `assemble` turns it into a
`Plan`: zig-zag bounds that give every member exactly its token count, segments in the
attention engine's queue order (inter-node chunks, intra-node chunks, local documents),
and predicted memory per rank.

A plan rank is one GPU, or with tensor parallelism (`model.tp`) a group of `tp`
consecutive GPUs of one node holding the same tokens (see `fabric.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from ballonet import cost_model, hardware
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import Plan, Ring, Segment
from ballonet.specs import ClusterSpec, ModelSpec


@dataclass(frozen=True, kw_only=True)
class Devices:
    """Per plan rank: where it sits, how fast it is, how many tokens it can hold."""
    node: tuple[int, ...]
    nic: tuple[int, ...]
    local_index: tuple[int, ...]
    """Index of the rank inside its node (for rail alignment)."""
    gpu: tuple[hardware.GPUType, ...]
    group: tuple[int, ...]
    """Node-group index of each rank."""
    speed: np.ndarray
    """[R] peak FLOP/s of each rank's GPU: attention and linear work go in proportion."""
    token_cap: np.ndarray
    """[R] most tokens a rank may hold under its memory cap."""
    static_bytes: float
    act_bytes_per_token: float
    memory_total: tuple[float, ...]
    """[R] bytes a plan may use on each rank's GPU (state plus activations)."""

    @property
    def num_ranks(self) -> int:
        return len(self.node)

    @property
    def num_nodes(self) -> int:
        return self.node[-1] + 1

    def nodes(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for r, n in enumerate(self.node):
            out[n].append(r)
        return out


@functools.lru_cache(maxsize=16)  # every batch of a run plans on the same devices
def devices(cluster: ClusterSpec, model: ModelSpec, assume_homogeneous: bool = False) -> Devices:
    """The plan ranks of `cluster` for `model`. With `assume_homogeneous`, speeds are those
    of the first GPU type (memory caps stay real, so the plan stays valid). Its arrays are
    read-only: the result is shared between calls."""
    tp = model.tp
    for g in cluster.groups:
        if g.gpus_per_node % tp:
            raise InputError(f"tp={tp} does not divide the {g.gpus_per_node} GPUs per node of {g.gpu!r} nodes")
    gpus = range(0, cluster.num_ranks, tp)
    group_index = {id(g): i for i, g in enumerate(cluster.groups)}
    group = tuple(group_index[id(cluster.group_of(x))] for x in gpus)
    gpu = tuple(cluster.groups[i].gpu_type for i in group)
    num_dp = cluster.num_ranks // tp
    static = cost_model.static_bytes(model, num_dp)
    act = cost_model.activation_bytes_per_token(model)
    total = tuple(t.memory_bytes * cost_model.MEMORY_RESERVE for t in gpu)
    caps = []
    for t in total:
        cap = max(-1, math.floor((t - static) / act))
        while cap >= 0 and static + act * cap > t:  # guard the float rounding of the floor
            cap -= 1
        caps.append(cap)
    first = cluster.gpu_of(0).peak_flops
    speed = np.array([first if assume_homogeneous else t.peak_flops for t in gpu], dtype=float)
    token_cap = np.array(caps, dtype=np.int64)
    speed.flags.writeable = token_cap.flags.writeable = False
    return Devices(
        node=tuple(cluster.node_of(x) for x in gpus),
        nic=tuple(cluster.nic_of(x) for x in gpus),
        local_index=tuple(cluster.local_index(x) // tp for x in gpus),
        gpu=gpu,
        group=group,
        speed=speed,
        token_cap=token_cap,
        static_bytes=static,
        act_bytes_per_token=act,
        memory_total=total,
    )


def check_feasible(lengths: list[int], dev: Devices, model: ModelSpec) -> None:
    """Raise `InfeasiblePlan` when no plan can hold the batch: the model state alone is over
    a GPU's memory, a document is longer than the whole cluster holds, or the batch is."""
    if (dev.token_cap < 0).any():
        r = int(np.argmin(dev.token_cap))
        raise InfeasiblePlan(
            f"model {model.name!r} needs {dev.static_bytes / 2**30:.1f} GiB of weights and optimizer state per GPU, "
            f"over the {dev.memory_total[r] / 2**30:.1f} GiB a {dev.gpu[r].name} GPU may use")
    total_cap = int(dev.token_cap.sum())
    if lengths:
        doc = int(np.argmax(lengths))
        if lengths[doc] > total_cap:
            raise InfeasiblePlan(f"document {doc} has {lengths[doc]} tokens, over the {total_cap} tokens "
                                 f"the whole cluster can hold for model {model.name!r}")
    if sum(lengths) > total_cap:
        raise InfeasiblePlan(f"the batch has {sum(lengths)} tokens, over the {total_cap} tokens "
                             f"the whole cluster can hold for model {model.name!r}")


def check_lengths(lengths) -> list[int]:
    out = []
    for i, L in enumerate(lengths):
        if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or L < 1:
            raise InputError(f"document {i}: length must be a positive integer, got {L!r}")
        out.append(int(L))
    return out


def attention_work(model: ModelSpec, lengths) -> np.ndarray:
    """[D] forward attention cost of each whole document in peak-FLOP units: its FLOPs over
    the kernel efficiency at its length (seconds on a rank = work / its peak)."""
    L = np.asarray(lengths, dtype=float)
    flops = 2.0 * model.num_heads * model.head_dim * L * (L + 1)  # cost_model.attention_flops
    return flops / model.tp / hardware.attention_efficiency_array(L)


class NoRoom(Exception):
    """A greedy step found no slot with memory for document `doc`."""

    def __init__(self, doc: int = -1):
        super().__init__(doc)
        self.doc = doc


def lpt(docs: list[int], work, lengths: list[int], load: np.ndarray, speed: np.ndarray,
        token_room: np.ndarray, spill: list[int] | None = None) -> dict[int, list[int]]:
    """Whole documents, largest first, each to the slot that would finish it earliest
    ((load + work) / speed) among those with memory for it; ties to the lower slot.
    `work` is [D], or [slots, D] when a document costs more on some slots (unrelated
    machines; largest first by its least cost). Updates `load` and `token_room`; returns
    {slot: docs}. A document no slot has memory for raises `NoRoom`, or is appended to
    `spill` when given."""
    per_slot = isinstance(work, np.ndarray) and work.ndim == 2  # (np.ndim would copy a list each call)
    if per_slot and (work == work[0]).all():
        work, per_slot = work[0], False  # alike slots (a homogeneous cluster): the cheaper heap below
    if per_slot:
        least = np.min(work, axis=0)
        order = sorted(docs, key=lambda d: (-least[d], d))
        return _lpt_uniform(order, work, lengths, load, speed, token_room, spill)
    order = sorted(docs, key=lambda d: (-work[d], d))
    if len(set(speed.tolist())) > 1:
        return _lpt_uniform(order, work, lengths, load, speed, token_room, spill)
    loads, rooms = load.tolist(), token_room.tolist()
    heap = [(loads[i], i) for i in range(len(loads))]  # equal speeds: least loaded finishes first
    heapq.heapify(heap)
    out: dict[int, list[int]] = {}
    for d in order:
        L, w = lengths[d], float(work[d])
        skipped = []
        while heap and rooms[heap[0][1]] < L:
            skipped.append(heapq.heappop(heap))
        if not heap:
            if spill is None:
                raise NoRoom(d)
            spill.append(d)
            heap = skipped
            heapq.heapify(heap)
            continue
        i = heap[0][1]
        out.setdefault(i, []).append(d)
        loads[i] += w
        rooms[i] -= L
        heapq.heapreplace(heap, (loads[i], i))
        for item in skipped:
            heapq.heappush(heap, item)
    load[:] = loads
    token_room[:] = rooms
    return out


def _lpt_uniform(order, work, lengths, load, speed, token_room, spill) -> dict[int, list[int]]:
    """`lpt` on slots of unequal speed (uniform machines), one vector step per document."""
    out: dict[int, list[int]] = {}
    per_slot = np.ndim(work) == 2
    for d in order:
        w = work[:, d] if per_slot else work[d]
        finish = np.where(token_room >= lengths[d], (load + w) / speed, np.inf)
        i = int(np.argmin(finish))
        if finish[i] == np.inf:
            if spill is None:
                raise NoRoom(d)
            spill.append(d)
            continue
        out.setdefault(i, []).append(d)
        load[i] += w[i] if per_slot else w
        token_room[i] -= lengths[d]
    return out


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


def zigzag_bounds(length: int, tokens: list[int]) -> tuple[int, ...]:
    """2g+1 bounds giving ring position i exactly tokens[i] tokens: front chunk i of
    tokens[i] // 2 and the mirrored back chunk 2g-1-i of the rest. With front and back
    chunks of equal size a position's causal work is proportional to its tokens, whatever
    its place (chunk (s, a) at the front and its mirror at the back cost a*L together)."""
    g = len(tokens)
    bounds = [0] * (2 * g + 1)
    for i, t in enumerate(tokens):
        bounds[i + 1] = bounds[i] + t // 2
    bounds[2 * g] = length
    for i, t in enumerate(tokens):
        bounds[2 * g - 1 - i] = bounds[2 * g - i] - (t - t // 2)
    return tuple(bounds)


def assemble(name: str, lengths: list[int], dev: Devices, placement: Placement, *, comm: str = "ring",
             meta: dict | None = None) -> Plan:
    """The plan of `placement` (rings of `split` in ascending rank order, which groups them
    by node, so an inter-node ring crosses nodes only between node blocks)."""
    ring_specs = []  # (doc, ranks, bounds)
    for doc in sorted(placement.split):
        members = sorted(r for r, t in placement.split[doc].items() if t > 0)
        if len(members) == 1:
            placement.local[members[0]].append(doc)
            continue
        tokens = [placement.split[doc][r] for r in members]
        assert sum(tokens) == lengths[doc], (doc, tokens, lengths[doc])
        ring_specs.append((doc, tuple(members), zigzag_bounds(lengths[doc], tokens)))
    ring_specs += [(doc, tuple(ranks), tuple(bounds)) for doc, (ranks, bounds) in placement.rings.items()]
    segs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(dev.num_ranks)]  # (queue, doc, start, end)
    rings = []
    for doc, ranks, b in sorted(ring_specs):
        kind = "inter" if len({dev.node[r] for r in ranks}) > 1 else "intra"
        rings.append(Ring(doc=doc, kind=kind, ranks=ranks, bounds=b, comm=comm))
        queue, g = (0 if kind == "inter" else 1), len(ranks)
        for i, r in enumerate(ranks):  # chunks i and 2g-1-i (Ring.chunks_of), empty ones left out
            if b[i + 1] > b[i]:
                segs[r].append((queue, doc, b[i], b[i + 1]))
            if b[2 * g - i] > b[2 * g - 1 - i]:
                segs[r].append((queue, doc, b[2 * g - 1 - i], b[2 * g - i]))
    for r, docs in enumerate(placement.local):
        segs[r].extend((2, d, 0, lengths[d]) for d in docs)
    attention = tuple(tuple(Segment(d, a, e) for _, d, a, e in sorted(rank_segs)) for rank_segs in segs)
    return Plan(planner=name, lengths=tuple(lengths), node_of_rank=dev.node, nic_of_rank=dev.nic,
                attention=attention, rings=tuple(rings), memory_cap=dev.memory_total, meta=dict(meta or {}))


def attention_token_counts(plan: Plan) -> list[int]:
    return [sum(s.end - s.start for s in segs) for segs in plan.attention]


def with_memory(plan: Plan, dev: Devices) -> Plan:
    """`plan` with predicted memory per rank: state plus activations of the larger of its
    attention and linear token counts. Raises `InfeasiblePlan` if a rank is over its cap."""
    att = attention_token_counts(plan)
    lin = linear_token_counts(plan, att)
    used = tuple(dev.static_bytes + dev.act_bytes_per_token * max(a, b) for a, b in zip(att, lin))
    for r, (a, b) in enumerate(zip(att, lin)):
        if max(a, b) > dev.token_cap[r]:
            docs = sorted({s.doc for s in plan.attention[r]}, key=lambda d: -plan.lengths[d])
            biggest = f" (largest document there: {docs[0]}, {plan.lengths[docs[0]]} tokens)" if docs else ""
            raise InfeasiblePlan(f"{plan.planner}: rank {r} would hold {max(a, b)} tokens{biggest}, over its "
                                 f"limit of {int(dev.token_cap[r])} tokens on a {dev.gpu[r].name} GPU")
    return dataclasses.replace(plan, memory_bytes=used)


def linear_token_counts(plan: Plan, att: list[int]) -> list[int]:
    out = list(att)
    for t in plan.remap:
        out[t.src] -= t.num_tokens
        out[t.dst] += t.num_tokens
    return out


def apportion(total: int, weights: np.ndarray, caps: np.ndarray | None = None) -> np.ndarray:
    """Integers summing to `total` in proportion to `weights` (largest remainder, ties to
    the lower index), none above its cap: capped shares are fixed and the rest re-spread."""
    weights = np.asarray(weights, dtype=float)
    n = len(weights)
    caps = np.full(n, np.iinfo(np.int64).max // 4, dtype=np.int64) if caps is None else np.asarray(caps, np.int64)
    out = np.zeros(n, dtype=np.int64)
    free = np.ones(n, dtype=bool)
    left = total
    while left > 0 and free.any():
        w = np.where(free, weights, 0.0)
        if w.sum() <= 0:
            w = free.astype(float)
        ideal = left * w / w.sum()
        over = free & (ideal >= caps - out)
        if over.any():
            left -= int((caps - out)[over].sum())
            out[over] = caps[over]
            free &= ~over
            continue
        base = np.floor(ideal).astype(np.int64)
        rest = left - int(base.sum())
        frac = np.where(free, ideal - base, -1.0)
        order = np.lexsort((np.arange(n), -frac))
        base[order[:rest]] += 1
        out += base
        left = 0
    if left > 0:
        raise InfeasiblePlan(f"{total} tokens do not fit under the memory caps")
    return out
