"""`distca`: core attention disaggregation, a baseline (docs/design.md, section 10).

DistCA (Zhuang et al. 2025, "Efficient Long-context Language Model Training by Core
Attention Disaggregation", arXiv 2510.18121; code: hao-ai-lab/distca,
`distca/planner/planner.py`) keeps the linear layers token-balanced and treats core
attention, softmax(QK^T)V, as stateless tasks that the same GPUs, time-shared as
*attention servers*, run wherever balance wants them:

* a CA-task (DistCA's `Item`) is a query chunk of a document with its K/V prefix, cut as a
  head/tail pair mirrored about the middle: query tokens p and L-1-p attend L+1 keys
  together, so a task's work is proportional to its tokens;
* the scheduler (`Planner.plan_items`) takes each server's attention work and the mean;
  servers under the mean by more than a tolerance are recipients, largest deficit first;
  each takes, from the tasks on servers over the mean, the one that sends the fewest bytes
  (its queries and K/V prefix) per unit of work moved: whole if that fits the need, else
  cut (a pair from the inner ends of its head and tail) to the work needed;
* ping-pong execution hides the dispatch of one nano-batch behind the attention of another.

In the Plan contract: a document whose tokens sit on one rank is a local document; one
with shards on several ranks is a `Ring` with comm "allgather" over those ranks, where a
member holding t tokens holds one zig-zag pair of t tokens (`assembly.zigzag_bounds`):
DistCA's mirrored head/tail pair, with the shards of one document on one rank merged. The
linear layout (DistCA's MLP layout) holds equal tokens per rank under memory caps
(`remap.linear_targets`); the remap (`remap.plan_remap`) carries q, k, v to the servers
and o back, DistCA's query dispatch. The all-gather gives each member the document's
K/V. The plan runs on the attention engine (`attention_engine=True`): gathers start when
their data is there and each rank runs its local attention meanwhile, the simulator's
form of the ping-pong overlap.

Departures, all known to us:
1. Home layout: whole documents packed by tokens (LPT under memory caps, the longest on
   different nodes; one that fits no rank is cut over the ranks with most room), where
   DistCA cuts documents at rank budgets in arrival order. So a document is split only
   when balance moves part of it.
2. Work is our cost model's: a document's FLOPs at the kernel efficiency of its length
   (`cost.seconds.attention_work`, the reference GPU), a shard its share by tokens (DistCA:
   raw FLOPs; both assume, as DistCA's composability does, that a shard keeps the
   kernel's efficiency). The cost model prices a shard at its own length
   (`planning.metrics`) or at L / members (the simulator), so the measured imbalance
   is a little above the scheduler's.
3. The priority is seconds on the links the bytes take (NVLink inside a node, the GPU's
   share of its NIC across nodes, `cost.seconds.p2p_time`) per unit of work, where DistCA
   counts bytes; and recipients go node by node (nodes holding the most surplus first,
   largest deficit first inside a node), where DistCA takes all recipients by deficit,
   so a long document's shards fill whole nodes instead of a few ranks on every node.
4. K/V: all-gathered whole among a document's members. A shard needs only its prefix, so
   this over-counts K/V by up to ~2x (the innermost pair needs about half); and the K/V of
   a moved shard travels twice (home to server by the remap, server to the other members
   by the all-gather) where DistCA sends each server its prefix once from the home.
   Backward: K/V gathered again and dK/dV returned in fp32, as the runtime does.
5. The remap moves only each rank's surplus tokens (fewer bytes than dispatching every
   moved shard), as every remapping plan here does.
6. No nano-batches: the overlap is the attention engine's, inside the attention phase;
   the linear layers of one nano-batch do not hide the other's dispatch.
7. After DistCA's recipient pass, a second pass moves work off ranks still over the mean
   by more than the tolerance (DistCA stops there) to the least busy ranks.
8. Speed-blind on mixed clusters, like the other baselines: work and tokens are balanced
   as if every GPU were alike; memory caps are real.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ballonet.cost.flops import kv_bytes, remap_bytes
from ballonet.cost.seconds import attention_work, p2p_time
from ballonet.errors import InputError
from ballonet.plan import RING_COMMS, Plan
from ballonet.planning.assembly import Placement, assemble, with_memory
from ballonet.planning.devices import Devices, check_feasible, check_lengths, devices
from ballonet.planning.packing import lpt
from ballonet.planning.remap import linear_targets, plan_remap
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["distca"]

MAX_MOVES = 16
"""Moves one recipient (or one donor, in the second pass) may make: a guard, rarely hit."""
MIN_MOVE = 0.01
"""Least work worth a move, as a share of the mean rank's: smaller surpluses and needs
are rounding (a token's work) left by earlier moves."""


@dataclass(frozen=True)
class Costs:
    """What the scheduler prices: per document its work per token and K/V bytes, per rank
    its node and seconds per byte inside and across nodes."""
    lengths: np.ndarray
    kv_row: float
    """K/V bytes of one token (a new member of a split document gathers about all of its rows)."""
    dispatch_per_token: float
    """Bytes the remap moves per token: q, k, v to the server and o back."""
    node: np.ndarray
    intra_s: np.ndarray
    """[R] seconds per byte inside the node (NVLink or PCIe)."""
    nic_s: np.ndarray
    """[R] seconds per byte across nodes (the GPU's share of its NIC)."""
    unit: np.ndarray
    """[D] work per token of each document: its work whole (`cost.seconds.attention_work`)
    over its length. A shard of t tokens costs t units wherever it runs (DistCA's
    composability: fused shards keep the kernel's efficiency)."""

    def work(self, d, tokens):
        """Attention work of `tokens` tokens of document `d` (array-like or scalar)."""
        return tokens * self.unit[d]


def _costs(lengths: list[int], cluster: ClusterSpec, model: ModelSpec, dev: Devices) -> Costs:
    L = np.asarray(lengths, dtype=float)
    big = 2.0**30  # seconds per byte of a large transfer (latency negligible)
    intra = [p2p_time(big, g.intra_bw, gpu=g.gpu_type) / big for g in cluster.groups]
    nic = [p2p_time(big, g.nic_bw / g.gpus_per_nic, nic=True, gpu=g.gpu_type) / big for g in cluster.groups]
    group = np.asarray(dev.group, dtype=np.int64)
    return Costs(unit=np.atleast_1d(attention_work(model, L)) / np.maximum(L, 1.0),
                 lengths=np.asarray(lengths, dtype=np.int64), kv_row=kv_bytes(model, 1),
                 dispatch_per_token=remap_bytes(model, 1, True) + remap_bytes(model, 1, False),
                 node=np.asarray(dev.node, dtype=np.int64), intra_s=np.array(intra)[group], nic_s=np.array(nic)[group])


@dataclass
class Servers:
    """The scheduler's state: every shard (document, rank, tokens, work) in flat arrays,
    per rank its attention work and tokens, per document where its shards are. A
    document has at most one shard per rank."""
    doc: np.ndarray
    """[S] document of each shard (S: capacity; the first `num` are in use)."""
    rank: np.ndarray
    tokens: np.ndarray
    """[S] tokens of the shard (0: moved away entirely)."""
    work: np.ndarray
    """[S] forward attention work of the shard (`Costs.work`)."""
    num: int
    load: np.ndarray
    """[R] attention work held by each rank."""
    held: np.ndarray
    """[R] attention tokens held by each rank."""
    shard_of: list[dict[int, int]]
    """Per document: {rank: shard index}."""
    docs_of: list[set[int]]
    """Per rank: the documents it holds a shard of."""
    on_node: np.ndarray
    """[D, nodes] tokens of each document held on each node."""
    mark: np.ndarray
    """[D] scratch (all False between calls): the documents of one rank."""
    mean: float
    """Mean work per rank: moves keep it (a shard's work is its tokens times its unit)."""


# ---- step 1: the home layout ------------------------------------------------------------


def _home(lengths: list[int], dev: Devices) -> list[tuple[int, int, int]]:
    """(document, rank, tokens) of the home layout: whole documents to ranks by tokens
    (LPT under memory caps, ties to the rank that comes first when nodes take turns, so
    the longest documents go to different nodes); a document that fits no rank is cut
    over the ranks with most room left."""
    R, D = dev.num_ranks, len(lengths)
    turns = np.lexsort((np.asarray(dev.node), np.asarray(dev.local_index)))  # slot i is rank turns[i]
    room = dev.token_cap[turns].astype(float)
    spill: list[int] = []
    placed = lpt(range(D), np.asarray(lengths, float), lengths, np.zeros(R), np.ones(R), room, spill)
    shards = [(d, int(turns[i]), lengths[d]) for i, docs in placed.items() for d in docs]
    room[turns] = room.copy()  # back to rank order
    for d in spill:
        left = lengths[d]
        for r in np.lexsort((np.arange(R), -room)).tolist():
            take = int(min(left, room[r]))
            if take > 0:
                shards.append((d, r, take))
                room[r] -= take
                left -= take
            if left == 0:
                break
    return sorted(shards)


def _servers(shards: list[tuple[int, int, int]], dev: Devices, costs: Costs) -> Servers:
    """The scheduler's state holding `shards`, with room for the shards moves create."""
    R, D, S = dev.num_ranks, len(costs.lengths), len(shards)
    capacity = S + 2 * MAX_MOVES * R  # each move makes at most one shard; each pass makes at most R * MAX_MOVES
    doc, rank, tokens = (np.zeros(capacity, np.int64) for _ in range(3))
    if shards:
        doc[:S], rank[:S], tokens[:S] = np.array(shards, dtype=np.int64).T
    work = np.zeros(capacity)
    work[:S] = costs.work(doc[:S], tokens[:S])
    st = Servers(doc=doc, rank=rank, tokens=tokens, work=work, num=S,
                 load=np.bincount(rank[:S], work[:S], minlength=R),
                 held=np.bincount(rank[:S], tokens[:S], minlength=R).astype(np.int64),
                 shard_of=[{} for _ in range(D)], docs_of=[set() for _ in range(R)],
                 on_node=np.zeros((D, dev.num_nodes), np.int64), mark=np.zeros(D, bool),
                 mean=float(work[:S].sum()) / R)
    np.add.at(st.on_node, (doc[:S], costs.node[rank[:S]]), tokens[:S])
    for i, (d, r, _) in enumerate(shards):
        st.shard_of[d][r] = i
        st.docs_of[r].add(d)
    return st


def _resize(st: Servers, costs: Costs, s: int, tokens: int) -> None:
    """Set shard `s` to `tokens` tokens, keeping the per-rank and per-document views."""
    d, r = int(st.doc[s]), int(st.rank[s])
    new = costs.work(d, tokens)
    st.load[r] += new - st.work[s]
    st.held[r] += tokens - st.tokens[s]
    st.on_node[d, costs.node[r]] += tokens - st.tokens[s]
    st.tokens[s], st.work[s] = tokens, new
    if tokens == 0:
        del st.shard_of[d][r]
        st.docs_of[r].discard(d)


def _give(st: Servers, costs: Costs, d: int, r: int, tokens: int) -> None:
    """Rank `r` takes `tokens` more tokens of document `d` (a new shard or a larger one)."""
    s = st.shard_of[d].get(r)
    if s is None:
        s = st.num
        st.num += 1
        st.doc[s], st.rank[s], st.tokens[s], st.work[s] = d, r, 0, 0.0
        st.shard_of[d][r] = s
        st.docs_of[r].add(d)
    _resize(st, costs, s, int(st.tokens[s]) + tokens)


# ---- step 2: the scheduler ------------------------------------------------------------------


def _best_shard(st: Servers, costs: Costs, b: int, need: float, room: int, cand: np.ndarray):
    """(shard, work to move) for recipient `b`, or None, and the shards of `cand` still on
    donors (ranks over the mean by more than `MIN_MOVE`). The pick is the shard whose move
    costs the fewest link seconds per unit of work moved (at most `need`, the donor's
    surplus and `room` tokens): the remap of the moved tokens over the donor-recipient
    link, plus, when `b` becomes a new member of a split document, the document's K/V:
    the rows held on b's node over NVLink, the rest over b's NIC."""
    rank, tokens = st.rank[cand], st.tokens[cand]
    surplus = st.load[rank] - st.mean
    keep = (tokens > 0) & (surplus > MIN_MOVE * st.mean)
    if not keep.all():
        cand, rank, tokens, surplus = cand[keep], rank[keep], tokens[keep], surplus[keep]
    if room <= 0 or len(cand) == 0:
        return None, cand
    doc = st.doc[cand]
    unit = costs.unit[doc]
    move = np.minimum(np.minimum(tokens * unit, surplus), need)
    tau = np.minimum(np.ceil(move / unit), np.minimum(tokens, room))
    move = np.minimum(move, tau * unit)
    mine = list(st.docs_of[b])
    st.mark[mine] = True
    new_member = (tau < tokens) & ~st.mark[doc]
    st.mark[mine] = False
    node_b = costs.node[b]
    link = np.where(costs.node[rank] == node_b, np.maximum(costs.intra_s[rank], costs.intra_s[b]),
                    np.maximum(costs.nic_s[rank], costs.nic_s[b]))
    near = st.on_node[doc, node_b]  # rows a new member on b's node gathers inside it; the rest cross nodes
    kv = costs.kv_row * (near * costs.intra_s[b] + (costs.lengths[doc] - near) * costs.nic_s[b])
    seconds = tau * (costs.dispatch_per_token * link) + np.where(new_member, kv, 0.0)
    i = int(np.argmin(seconds / move))
    return (int(cand[i]), float(move[i])), cand


def _move(st: Servers, costs: Costs, s: int, b: int, amount: float, room: int) -> None:
    """Move `amount` of work of shard `s` to rank `b` (the whole shard, or the tokens that
    carry that work; at most `room`)."""
    d, tokens = int(st.doc[s]), int(st.tokens[s])
    tau = tokens if amount >= st.work[s] * (1 - 1e-9) else max(1, round(amount / costs.unit[d]))
    tau = min(tau, tokens, room)
    _give(st, costs, d, b, tau)
    _resize(st, costs, s, tokens - tau)


def _room(st: Servers, dev: Devices, r: int) -> int:
    return int(dev.token_cap[r] - st.held[r])


def _recipients(st: Servers, costs: Costs, dev: Devices, threshold: float) -> int:
    """Pass 1 (DistCA's): ranks under the mean by more than `threshold` each take work
    from the ranks over the mean until within `threshold` of it; node by node, nodes
    holding the most surplus first, largest deficit first inside a node (departure 3).
    Recipients never become donors, so the candidate shards only shrink."""
    moves = 0
    cand = np.flatnonzero(st.load[st.rank[:st.num]] > st.mean)
    surplus = np.bincount(costs.node, np.maximum(st.load - st.mean, 0.0), minlength=dev.num_nodes)
    node_turn = np.argsort(np.lexsort((np.arange(dev.num_nodes), -surplus)))  # most surplus first
    for b in sorted(range(dev.num_ranks), key=lambda r: (node_turn[costs.node[r]], st.load[r], r)):
        for _ in range(MAX_MOVES):
            need = st.mean - st.load[b]
            if need <= threshold:
                break
            pick, cand = _best_shard(st, costs, b, need, _room(st, dev, b), cand)
            if pick is None:
                break
            _move(st, costs, pick[0], b, pick[1], _room(st, dev, b))
            moves += 1
    return moves


def _donors(st: Servers, costs: Costs, dev: Devices, threshold: float) -> int:
    """Pass 2 (departure 7): each rank still over the mean by more than `threshold`,
    busiest first, levels with the least busy rank with room, again while it stays over."""
    moves = 0
    for a in sorted(range(dev.num_ranks), key=lambda r: (-st.load[r], r)):
        for _ in range(MAX_MOVES):
            if st.load[a] - st.mean <= threshold:
                break
            free = np.where(dev.token_cap > st.held, st.load, np.inf)
            free[a] = np.inf
            b = int(np.argmin(free))
            gap = st.load[a] - free[b]
            mine = np.array([st.shard_of[d][a] for d in sorted(st.docs_of[a])], dtype=np.int64)
            pick = _best_shard(st, costs, b, gap / 2, _room(st, dev, b), mine)[0] if gap > threshold else None
            if pick is None:
                break
            _move(st, costs, pick[0], b, pick[1], _room(st, dev, b))
            moves += 1
    return moves


def _schedule(st: Servers, costs: Costs, dev: Devices, tolerance: float) -> int:
    """Both passes; returns the number of moves."""
    if dev.num_ranks < 2 or st.load.sum() <= 0:
        return 0
    threshold = max(tolerance, MIN_MOVE) * st.mean
    return _recipients(st, costs, dev, threshold) + _donors(st, costs, dev, threshold)


# ---- the planner --------------------------------------------------------------------------


def _placement(st: Servers, num_ranks: int) -> Placement:
    placement = Placement(num_ranks=num_ranks)
    for d, shards in enumerate(st.shard_of):
        if len(shards) == 1:
            placement.local[next(iter(shards))].append(d)
        else:
            placement.split[d] = {r: int(st.tokens[s]) for r, s in shards.items()}
    return placement


def distca(lengths, cluster: ClusterSpec, model: ModelSpec, *, tolerance: float = 0.05,
           comm: str = "allgather") -> Plan:
    """Core attention disaggregation (DistCA; the module docstring says what it reproduces
    and where it departs). Configuration: `tolerance`, the share of the mean attention
    work a rank may stay under (or, in the second pass, over) it, DistCA's
    `tolerance_factor` (default 0.1; its runs try 0.05 first, the default here; under
    `MIN_MOVE` it acts as `MIN_MOVE`); `comm`, how a split document's members get its
    K/V: "allgather" (each member gathers it, DistCA's dispatch) or "ring" (passed
    around the members, context parallelism's way: the same bytes in total, fewer
    across nodes; not DistCA's)."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise InputError(f"distca option tolerance must be a number in [0, 1), got {tolerance!r}")
    if comm not in RING_COMMS:
        raise InputError(f"distca option comm must be one of {', '.join(RING_COMMS)}, got {comm!r}")
    lengths = check_lengths(lengths)
    dev = devices(cluster, model)
    check_feasible(lengths, dev, model)
    costs = _costs(lengths, cluster, model, dev)
    st = _servers(_home(lengths, dev), dev, costs)
    moves = _schedule(st, costs, dev, float(tolerance))
    placement = _placement(st, dev.num_ranks)
    meta = {"tolerance": float(tolerance), "comm": comm, "moves": moves, "split_docs": len(placement.split)}
    plan = assemble("distca", lengths, dev, placement, comm=comm, attention_engine=True, meta=meta)
    targets = linear_targets(sum(lengths), np.ones(dev.num_ranks), dev.token_cap)
    plan = dataclasses.replace(plan, remap=plan_remap(list(plan.attention_token_counts), targets, dev.node))
    return with_memory(plan, dev).validate()
