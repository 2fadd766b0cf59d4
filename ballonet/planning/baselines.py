"""The baselines (docs/design.md, section 10), each a function returning a Plan like `zeppelin`'s.

Every baseline takes (lengths, cluster, model, **options) and returns a validated plan with
predicted memory, or raises `InfeasiblePlan` naming the document and the limit its own
scheme hits. None remaps or routes: their linear layout is their attention layout and
their rings use the fixed GPU-NIC affinity. Like the systems they reproduce, they are
speed-blind on mixed clusters (token or FLOP counts, not seconds). Split documents use
equal zig-zag chunks (`plan.chunk_bounds(L, 2g)`) with no padding, over rings in rank order.
"""

from __future__ import annotations

import numpy as np

from ballonet.cost.flops import attention_flops, linear_flops_per_token
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import Plan, chunk_bounds
from ballonet.planning.assembly import Placement, assemble, with_memory
from ballonet.planning.cp_groups import cp_groups, pack_groups
from ballonet.planning.devices import Devices, check_feasible, check_lengths, devices
from ballonet.planning.packing import NoRoom, lpt
from ballonet.planning.wlb_llm import wlb_llm
from ballonet.specs import ClusterSpec, ModelSpec


def _setup(lengths, cluster, model) -> tuple[list[int], Devices]:
    lengths = check_lengths(lengths)
    dev = devices(cluster, model)
    check_feasible(lengths, dev, model)
    return lengths, dev


def _finish(name: str, lengths, dev: Devices, placement: Placement, comm: str = "ring", meta=None) -> Plan:
    return with_memory(assemble(name, lengths, dev, placement, comm=comm, meta=meta), dev).validate()


def _whole(name: str, lengths, dev: Devices, cost: np.ndarray, limit: str) -> Plan:
    """Whole documents to ranks, largest `cost` first, to the rank with the least cost
    (LPT) that has memory for it."""
    R = dev.num_ranks
    placement = Placement(num_ranks=R)
    try:
        for r, docs in lpt(range(len(lengths)), cost, lengths, np.zeros(R), np.ones(R), dev.token_cap.astype(float)).items():
            placement.local[r] = docs
    except NoRoom as e:
        raise InfeasiblePlan(f"{name}: document {e.doc} ({lengths[e.doc]} tokens) fits no single GPU with the rest "
                             f"of the batch ({limit}: at most {int(dev.token_cap.max())} tokens per GPU)") from None
    return _finish(name, lengths, dev, placement)


def packed_dp(lengths, cluster: ClusterSpec, model: ModelSpec) -> Plan:
    """Token-balanced packing per DP rank with a document mask, no splitting (Megatron-LM /
    torchtitan sequence packing). Configuration: none to choose. Departure: LPT on token counts instead of first-fit in
    arrival order, which only makes the baseline better balanced in tokens."""
    lengths, dev = _setup(lengths, cluster, model)
    return _whole("packed_dp", lengths, dev, np.asarray(lengths, dtype=float), "packed_dp never splits")


def flops_dp(lengths, cluster: ClusterSpec, model: ModelSpec) -> Plan:
    """Whole documents to DP ranks balanced on estimated FLOPs (attention plus linear), by
    LPT: the sequence balancing of veRL (`get_seqlen_balanced_partitions`, Karmarkar-Karp)
    and slime. Configuration: none to choose. Departure: LPT instead of Karmarkar-Karp
    (both are near-equal here)."""
    lengths, dev = _setup(lengths, cluster, model)
    return _whole("flops_dp", lengths, dev, _flops(model, lengths), "flops_dp never splits")


def _flops(model: ModelSpec, lengths) -> np.ndarray:
    """Forward attention plus linear FLOPs of each document (the systems' FLOP estimate)."""
    L = np.asarray(lengths, dtype=float)
    return attention_flops(model, L) + linear_flops_per_token(model) * L



def _split_all(name: str, lengths, dev: Devices, groups, comm: str, cp_size, meta=None) -> Plan:
    placement = Placement(num_ranks=dev.num_ranks)
    for group, docs in zip(groups, pack_groups(lengths, lengths, groups, dev, name)):
        for d in docs:
            if len(group) == 1:
                placement.local[group[0]].append(d)
            else:
                placement.rings[d] = (tuple(group), chunk_bounds(lengths[d], 2 * len(group)))
    return _finish(name, lengths, dev, placement, comm=comm, meta={"cp_size": len(groups[0]), **(meta or {})})


def te_cp(lengths, cluster: ClusterSpec, model: ModelSpec, *, cp_size: int | None = None) -> Plan:
    """TransformerEngine / Megatron-LM context parallelism (`cp_comm_type="p2p"`, THD
    format): every document zig-zag split over all ranks of its CP group, ring P2P of K/V
    in rank order over the fixed GPU-NIC affinity; documents go to the data-parallel CP
    groups by tokens. Configuration: `cp_size` as a Megatron user sets it, the smallest
    degree (a divisor of the ranks) under which the batch fits in memory, the rest
    data-parallel (`context_cp_size`); `cp_size=<ranks>` is CP over the whole cluster,
    a stress case. Departure: no padding of documents to multiples of 2*cp (chunks may
    be empty)."""
    lengths, dev = _setup(lengths, cluster, model)
    if cp_size is not None:
        return _split_all("te_cp", lengths, dev, cp_groups(dev.num_ranks, cp_size, "te_cp"), "ring", cp_size)
    return _smallest_cp("te_cp", lengths, dev, "ring")


def context_cp_sizes(num_ranks: int) -> list[int]:
    """CP degrees a user can pick, smallest first: the divisors of the ranks."""
    return [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]


def _smallest_cp(name: str, lengths, dev: Devices, comm: str) -> Plan:
    """The plan of the smallest CP degree that holds the context (longest document) in the
    batch's tokens per rank (Megatron: context / tokens per GPU) and fits in memory."""
    per_rank = -(-sum(lengths) // dev.num_ranks)
    need = -(-max(lengths) // per_rank) if lengths else 1
    last = InfeasiblePlan(f"{name}: no CP degree of {dev.num_ranks} ranks holds the batch")
    for cp in (d for d in context_cp_sizes(dev.num_ranks) if d >= min(need, dev.num_ranks)):
        try:
            return _split_all(name, lengths, dev, cp_groups(dev.num_ranks, cp, name), comm, cp,
                              meta={"cp_size_rule": "context / tokens per rank, then memory"})
        except InfeasiblePlan as e:
            last = e
    raise last


def llama_cp(lengths, cluster: ClusterSpec, model: ModelSpec, *, cp_size: int | None = None) -> Plan:
    """Llama-3 context parallelism (Dubey et al. 2024, section 3.3.2): every document split
    into 2*cp zig-zag chunks over its CP group, K/V all-gathered before attention.
    Configuration: `cp_size` default as `te_cp`'s (the smallest that fits, the rest
    data-parallel; Llama-3 used CP 16 for 128K contexts). Departure: per-document
    all-gather groups; no padding."""
    lengths, dev = _setup(lengths, cluster, model)
    if cp_size is not None:
        return _split_all("llama_cp", lengths, dev, cp_groups(dev.num_ranks, cp_size, "llama_cp"), "allgather",
                          cp_size)
    return _smallest_cp("llama_cp", lengths, dev, "allgather")


def hybrid_dp(lengths, cluster: ClusterSpec, model: ModelSpec, *, rank_tokens: int | None = None) -> Plan:
    """ByteScale-style data-aware sharding (Ge et al. 2025): a document longer than a
    rank's token budget (`rank_tokens`, default the batch's mean per rank) is split over
    ceil(L / budget) consecutive ranks; shorter ones stay whole, packed by tokens (LPT)
    around the long ones. Configuration: the budget is the batch's mean tokens per rank
    (ByteScale sizes CP groups to need, not to a fixed degree). Departures: CP groups are consecutive ranks in rank order (no
    topology search), and packing balances tokens, not ByteScale's FLOP estimate."""
    lengths, dev = _setup(lengths, cluster, model)
    R = dev.num_ranks
    budget = _budget(lengths, R, rank_tokens, "hybrid_dp")
    placement = Placement(num_ranks=R)
    tokens = np.zeros(R)
    cursor = 0
    long = sorted((d for d, L in enumerate(lengths) if L > budget), key=lambda d: (-lengths[d], d))
    for d in long:
        g = min(-(-lengths[d] // budget), R)
        ranks = sorted((cursor + i) % R for i in range(g))
        cursor = (cursor + g) % R
        bounds = chunk_bounds(lengths[d], 2 * g)
        placement.rings[d] = (tuple(ranks), bounds)
        for i, r in enumerate(ranks):
            tokens[r] += bounds[i + 1] - bounds[i] + bounds[2 * g - i] - bounds[2 * g - 1 - i]
    short = [d for d, L in enumerate(lengths) if L <= budget]
    try:
        for r, docs in lpt(short, np.asarray(lengths, float), lengths, tokens.copy(), np.ones(R),
                           dev.token_cap - tokens).items():
            placement.local[r] = docs
    except NoRoom as e:
        raise InfeasiblePlan(f"hybrid_dp: document {e.doc} ({lengths[e.doc]} tokens) fits no GPU beside the "
                             f"long documents (at most {int(dev.token_cap.max())} tokens per GPU)") from None
    return _finish("hybrid_dp", lengths, dev, placement, meta={"rank_tokens": budget})


def _budget(lengths, num_ranks: int, rank_tokens, name: str) -> int:
    if rank_tokens is None:
        return max(1, -(-sum(lengths) // num_ranks))
    if not isinstance(rank_tokens, int) or rank_tokens < 1:
        raise InputError(f"{name}: rank_tokens must be a positive integer, got {rank_tokens!r}")
    return rank_tokens


def megatron_hcp(lengths, cluster: ClusterSpec, model: ModelSpec, *, rank_tokens: int | None = None) -> Plan:
    """Megatron-Core hybrid (dynamic) context parallelism: each document gets the smallest
    power-of-two CP size that keeps L/cp within a rank's token budget (`rank_tokens`,
    default the batch's mean per rank); a greedy scheduler takes documents by L^2/cp,
    largest first, and puts each on the aligned block of cp ranks whose busiest rank is
    least loaded. Configuration: the budget is the batch's mean tokens per rank, so CP
    sizes follow each document's need. Departure: one scheduling round per batch (no
    micro-batch loop)."""
    lengths, dev = _setup(lengths, cluster, model)
    R = dev.num_ranks
    budget = _budget(lengths, R, rank_tokens, "megatron_hcp")
    max_cp = 1 << (R.bit_length() - 1)
    cps = {d: min(1 << max(0, (-(-L // budget) - 1).bit_length()), max_cp) for d, L in enumerate(lengths)}
    load = np.zeros(R)
    room = dev.token_cap.astype(float)
    placement = Placement(num_ranks=R)
    for d in sorted(range(len(lengths)), key=lambda d: (-lengths[d] ** 2 / cps[d], d)):
        cp, L = cps[d], lengths[d]
        blocks = (R // cp) * cp
        fits = room[:blocks].reshape(-1, cp).min(axis=1) >= -(-L // (2 * cp)) * 2
        if not fits.any():
            raise InfeasiblePlan(f"megatron_hcp: document {d} ({L} tokens) fits no block of {cp} GPUs "
                                 f"(at most {int(dev.token_cap.max())} tokens per GPU)")
        busiest = np.where(fits, load[:blocks].reshape(-1, cp).max(axis=1), np.inf)
        ranks = tuple(range(int(np.argmin(busiest)) * cp, (int(np.argmin(busiest)) + 1) * cp))
        load[list(ranks)] += L * L / cp
        if cp == 1:
            placement.local[ranks[0]].append(d)
            room[ranks[0]] -= L
            continue
        bounds = chunk_bounds(L, 2 * cp)
        placement.rings[d] = (ranks, bounds)
        for i, r in enumerate(ranks):
            room[r] -= bounds[i + 1] - bounds[i] + bounds[2 * cp - i] - bounds[2 * cp - 1 - i]
    return _finish("megatron_hcp", lengths, dev, placement, meta={"rank_tokens": budget})


BASELINES = {
    "packed_dp": packed_dp,
    "flops_dp": flops_dp,
    "te_cp": te_cp,
    "llama_cp": llama_cp,
    "hybrid_dp": hybrid_dp,
    "wlb_llm": wlb_llm,
    "megatron_hcp": megatron_hcp,
}
