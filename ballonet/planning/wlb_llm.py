"""`wlb_llm`: WLB-LLM's packing and adaptive sharding, a baseline (docs/design.md, section 10).

WLB-LLM (Wang et al., "WLB-LLM: Workload-Balanced 4D Parallelism for Large Language
Model Training", OSDI 2025, arXiv 2503.17924) balances two levels:

* Packing: documents go to the data-parallel CP groups by estimated workload (attention
  plus linear FLOPs), largest first, each to the least loaded group with room: its
  variable-length packing (groups hold unequal token counts, equal work).
* Sharding inside a CP group of c ranks, chosen per group's batch (WLB-LLM's adaptive
  sharding selection, from a kernel-latency estimate):
  - per-document: every document zig-zag split into 2c chunks, chunk i and 2c-1-i to
    rank i, so every rank has the same attention work on every document, at the cost of
    short chunks (low kernel efficiency) for short documents;
  - per-sequence: the group's documents concatenated (input order) and the sequence
    zig-zag split into 2c chunks, so short documents mostly stay whole on one rank and
    only those crossing a chunk boundary are split (TransformerEngine's THD sharding);
  the one whose busiest rank's estimated attention seconds (`cost.seconds.attention_work`
  per chunk, at the chunk's own length) is smaller.

The CP degree is a job setting (`cp_size`, default one node's GPUs); `bench/paper.py`
and `ballonet simulate --tune` use the degree its users would pick for each
configuration: the fastest of the powers of two (`comparison.compare(tune=True)`).

* Outlier delay (its variable-length packing with outlier delay): a document too long to
  balance is held back in a queue, one level per length range, and released when its
  level holds one for every micro-batch (here: every CP group), so that each gets one.
  `outlier_steps` gives the steps that train a batch's documents in the long run under
  it; `comparison.compare` prices WLB-LLM as their weighted sum (docs/design.md, section
  10).

Departures: a per-sequence split document is its own
ring over the ranks holding its pieces, where TransformerEngine passes the whole
sequence's K/V around the group (fewer bytes here: kinder to the baseline); kernel
latency is our cost model's.
"""

from __future__ import annotations

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.flops import attention_flops, linear_flops_per_token, zigzag_flops
from ballonet.cost.seconds import attention_work
from ballonet.errors import InputError
from ballonet.outliers import outlier_level
from ballonet.plan import Plan, chunk_bounds
from ballonet.planning.assembly import Placement, assemble, with_memory
from ballonet.planning.cp_groups import cp_setup, node_cp_size, pack_groups
from ballonet.planning.devices import devices
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["SHARDINGS", "num_groups", "outlier_steps", "wlb_llm"]

SHARDINGS = ("adaptive", "document", "sequence")


def _flops(model: ModelSpec, lengths) -> np.ndarray:
    """Forward attention plus linear FLOPs of each document (WLB-LLM's workload estimate)."""
    L = np.asarray(lengths, dtype=float)
    return attention_flops(model, L) + linear_flops_per_token(model) * L


def per_sequence(lengths: list[int], docs: list[int], c: int) -> tuple[dict[int, int], dict[int, tuple]]:
    """The group's documents `docs` concatenated and zig-zag split into 2c chunks (chunk k
    to rank k, or 2c-1-k in the second half; ranks are 0..c-1 of the group): ({doc: rank}
    of the documents held whole, {doc: (ranks, 2g+1 bounds)} of the split ones, ranks
    ascending, each member's piece before the middle as its front chunk and the one after
    as its back chunk, empty where it has none)."""
    total = sum(lengths[d] for d in docs)
    cuts = chunk_bounds(total, 2 * c)
    whole: dict[int, int] = {}
    split: dict[int, tuple] = {}
    start = 0
    for d in docs:
        end = start + lengths[d]
        front: dict[int, int] = {}  # owner -> tokens of the document in its first-half chunk
        back: dict[int, int] = {}  # ... and in its second-half chunk
        k = int(np.searchsorted(cuts, start, side="right")) - 1
        while k < 2 * c and cuts[k] < end:
            n = min(end, cuts[k + 1]) - max(start, cuts[k])
            if n > 0:
                owner = k if k < c else 2 * c - 1 - k
                (front if k < c else back)[owner] = n
            k += 1
        start = end
        owners = sorted(set(front) | set(back))
        if len(owners) == 1:
            whole[d] = owners[0]
            continue
        sizes = [front.get(r, 0) for r in owners] + [back.get(r, 0) for r in reversed(owners)]
        split[d] = (tuple(owners), tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)])))
    return whole, split


def _estimate(model: ModelSpec, lengths: list[int], c: int, whole: dict, split: dict) -> float:
    """Busiest rank's forward attention seconds on the reference GPU (each piece at its
    own chunk length): WLB-LLM's kernel-latency estimate, from our cost model."""
    load = np.zeros(c)
    for d, r in whole.items():
        load[r] += float(attention_work(model, [lengths[d]])[0])
    for d, (ranks, bounds) in split.items():
        g = len(ranks)
        flops = zigzag_flops(model, bounds)
        sizes = np.diff(np.asarray(bounds))
        per_rank = sizes[:g] + sizes[::-1][:g]
        eff = hardware.attention_efficiency(np.maximum(per_rank / 2, 1.0))
        load[list(ranks)] += flops / model.tp / eff
    return float(load.max())


def num_groups(cluster: ClusterSpec, model: ModelSpec, cp_size: int | None = None) -> int:
    """How many CP groups `wlb_llm` makes with `cp_size` (its default when None)."""
    dev = devices(cluster, model)
    cp = cp_size if cp_size is not None else node_cp_size(dev)
    return max(1, dev.num_ranks // cp) if isinstance(cp, int) and cp >= 1 else 1


def outlier_steps(lengths, groups: int, filler) -> list[tuple[float, list[int]]]:
    """(weight, documents) of the steps that train `lengths`' documents in the long run under
    WLB-LLM's outlier delay with `groups` CP groups (its micro-batches here), every step of
    the batch's tokens. A group's share is C = tokens / groups; an outlier is a document
    of (C/2, C], one that fills most of a group alone (longer ones cannot go one to a group
    within the step's tokens, and are packed as usual). Outliers wait in a queue, one level
    per length range (2^(k-1), 2^k], until their level holds `groups`; then each group gets
    one, the step filled with other documents. So the batch is trained in release steps
    (a level's outliers in turn, `groups` of them) and normal steps, both filled with the
    batch's other documents and then those of `filler` (an iterable of lengths from the same
    source, read once) that are not outliers. Weights: a level's release steps carry its outlier tokens
    (x_l = its tokens / a release step's outlier tokens), normal steps the rest (1 - sum x_l,
    at least 0); without outliers, the batch itself at weight 1."""
    lengths = [int(x) for x in lengths]
    budget = sum(lengths)
    level = [outlier_level(L, budget, groups) for L in lengths]
    levels: dict[int, list[int]] = {}
    for L, k in zip(lengths, level):
        if k is not None:
            levels.setdefault(k, []).append(L)
    if groups < 2 or not levels:
        return [(1.0, lengths)]
    normal = [L for L, k in zip(lengths, level) if k is None]
    normal += [int(L) for L in filler if outlier_level(int(L), budget, groups) is None]

    def fill(step: list[int]) -> list[int]:
        """`step` topped up with normal documents (the batch's first, then `filler`'s) up to
        the first that would overflow the batch's tokens."""
        total = sum(step)
        for L in normal:
            if total + L > budget:
                break
            step.append(L)
            total += L
        return step

    steps = []
    for _, docs in sorted(levels.items()):
        release = [docs[i % len(docs)] for i in range(groups)]
        steps.append((sum(docs) / sum(release), fill(release)))
    rest = 1.0 - sum(w for w, _ in steps)
    if rest > 0:
        steps.insert(0, (rest, fill([])))
    return steps


def wlb_llm(lengths, cluster: ClusterSpec, model: ModelSpec, *, cp_size: int | None = None,
            sharding: str = "adaptive") -> Plan:
    """WLB-LLM (the module docstring says what it reproduces and where it departs).
    Configuration: `cp_size`, the CP degree (a divisor of the ranks; default one node's
    GPUs, WLB-LLM's CP inside NVLink domains); `sharding`, "adaptive" (WLB-LLM's: per
    group, per-document or per-sequence, whichever its estimate says is faster),
    "document" or "sequence"."""
    if sharding not in SHARDINGS:
        raise InputError(f"wlb_llm option sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    lengths, dev, cp_size, groups = cp_setup(lengths, cluster, model, cp_size, "wlb_llm")
    packed = pack_groups(lengths, _flops(model, lengths), groups, dev, "wlb_llm")
    placement = Placement(num_ranks=dev.num_ranks)
    chosen = {"document": 0, "sequence": 0}
    for i, group in enumerate(groups):
        docs = sorted(packed[i])
        if cp_size == 1:
            placement.local[group[0]].extend(docs)
            continue
        options: dict[str, tuple[dict, dict]] = {}
        if sharding in ("adaptive", "document"):
            options["document"] = ({}, {d: (tuple(range(cp_size)), chunk_bounds(lengths[d], 2 * cp_size))
                                        for d in docs})
        if sharding in ("adaptive", "sequence"):
            options["sequence"] = per_sequence(lengths, docs, cp_size)
        name = min(options, key=lambda k: (_estimate(model, lengths, cp_size, *options[k]), k))
        chosen[name] += 1
        whole, split = options[name]
        for d, r in whole.items():
            placement.local[group[r]].append(d)
        for d, (ranks, bounds) in split.items():
            placement.rings[d] = (tuple(group[r] for r in ranks), bounds)
    meta = {"cp_size": cp_size, "sharding": sharding, "groups_by_sharding": chosen}
    return with_memory(assemble("wlb_llm", lengths, dev, placement, meta=meta), dev).validate()
