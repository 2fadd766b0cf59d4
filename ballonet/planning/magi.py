"""`magi`: MagiAttention's dispatch, a baseline (docs/design.md, section 10).

MagiAttention (Sand AI, "MagiAttention: A Distributed Attention Towards Linear
Scalability for Ultra-Long Context, Heterogeneous Mask Training", arXiv 2505.13211;
SandAI-org/MagiAttention) shards one packed sequence per context-parallel group:

* dispatch: the sequence is cut into chunks of `chunk_size` tokens (512 in its
  examples); each chunk's workload is its *area*, the number of (query, key) pairs its
  mask lets through (causal inside each document here); a load-balancing solver (its
  default, `MinHeapDispatchAlg`) takes chunks by area, largest first, each to the rank
  with the least area that holds fewer than ceil(chunks / ranks) chunks, so every rank
  holds (nearly) the same tokens and about the same area. The rest of the model runs on
  the dispatched tokens: no remap;
* zero-redundant communication: each rank receives, once, exactly the remote K/V its
  query chunks attend to (group-cast), and returns their dK/dV partials once (group-
  reduce); its local attention overlaps the fetch (overlap degree 1).

In the Plan contract a rank holding chunks of a document holds one zig-zag pair of the
same number of tokens (`assembly.zigzag_bounds`: a pair's causal work is proportional to
its tokens, as the solver's chunks of a long document together are), and a document
held by several ranks is an "allgather" ring over them. The simulator prices its K/V as
MagiAttention sends it (`plan.meta["kv_prefix"]`: each member receives from each other
member only the rows before its last query row, and returns their gradients), not as
the runtime's all-gather sends whole blocks (up to ~1.3x the bytes).

Departures: chunks of one document on one rank become one zig-zag pair of as many
tokens (the area the solver balanced moves a little between ranks holding different
documents); documents go to the data-parallel CP groups by tokens (LPT under memory
caps, each group one packed sequence, documents in input order); the CP degree is a
job setting (`cp_size`, default one node's GPUs), which `bench/paper.py` tunes per
configuration as for the other CP baselines; the kernel (FlexFlashAttention) is priced
as every planner's, at the chunk lengths of the plan; the multi-stage overlap beyond
degree 1 is not modelled.
"""

from __future__ import annotations

import heapq

import numpy as np

from ballonet.errors import InputError
from ballonet.plan import Plan
from ballonet.planning.assembly import Placement, assemble, with_memory
from ballonet.planning.cp_groups import cp_setup, pack_groups
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["dispatch", "magi"]

CHUNK_SIZE = 512
"""MagiAttention's chunk size in its examples (`DispatchConfig.chunk_size`)."""


def _areas(lengths: list[int], docs: list[int], cuts: tuple[int, ...]) -> tuple[np.ndarray, list[list]]:
    """Area of each chunk of the concatenated documents (causal inside each document)
    and, per chunk, its pieces (doc, tokens)."""
    areas = np.zeros(len(cuts) - 1)
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(len(cuts) - 1)]
    k, start = 0, 0
    for d in docs:
        end = start + lengths[d]
        while k < len(cuts) - 1 and cuts[k] < end:
            a, b = max(start, cuts[k]) - start, min(end, cuts[k + 1]) - start  # rows [a, b) of the document
            if b > a:
                areas[k] += (b * (b + 1) - a * (a + 1)) / 2
                pieces[k].append((d, b - a))
            if cuts[k + 1] > end:
                break
            k += 1
        start = end
    return areas, pieces


def dispatch(lengths: list[int], docs: list[int], ranks: int, chunk_size: int = CHUNK_SIZE) -> list[dict[int, int]]:
    """MagiAttention's min-heap dispatch of the documents `docs` (concatenated in this
    order) over `ranks` ranks: per rank, {doc: tokens} of the chunks it holds."""
    total = sum(lengths[d] for d in docs)
    n = max(1, -(-total // chunk_size))
    cuts = tuple(min(total, i * chunk_size) for i in range(n + 1))
    areas, pieces = _areas(lengths, docs, cuts)
    limit = -(-n // ranks)
    held = [0] * ranks
    heap = [(0.0, r) for r in range(ranks)]
    out: list[dict[int, int]] = [{} for _ in range(ranks)]
    for k in sorted(range(n), key=lambda i: (-areas[i], i)):
        while True:
            load, r = heapq.heappop(heap)
            if held[r] < limit:
                break
        held[r] += 1
        for d, t in pieces[k]:
            out[r][d] = out[r].get(d, 0) + t
        heapq.heappush(heap, (load + areas[k], r))
    return out


def magi(lengths, cluster: ClusterSpec, model: ModelSpec, *, cp_size: int | None = None,
         chunk_size: int = CHUNK_SIZE) -> Plan:
    """MagiAttention (the module docstring says what it reproduces and where it departs).
    Configuration: `cp_size`, the CP degree (a divisor of the ranks; default one node's
    GPUs), the rest data-parallel; `chunk_size`, the dispatch granularity in tokens."""
    lengths, dev, cp_size, groups = cp_setup(lengths, cluster, model, cp_size, "magi")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"magi: chunk_size must be a positive integer, got {chunk_size!r}")
    packed = pack_groups(lengths, lengths, groups, dev, "magi")
    placement = Placement(num_ranks=dev.num_ranks)
    for i, group in enumerate(groups):
        docs = sorted(packed[i])
        if not docs:
            continue
        split: dict[int, dict[int, int]] = {}
        for r, held in zip(group, dispatch(lengths, docs, cp_size, chunk_size)):
            for d, t in held.items():
                split.setdefault(d, {})[r] = t
        for d, members in split.items():
            if len(members) == 1:
                placement.local[next(iter(members))].append(d)
            else:
                placement.split[d] = members
    meta = {"cp_size": cp_size, "chunk_size": chunk_size, "kv_prefix": True}
    return with_memory(assemble("magi", lengths, dev, placement, comm="allgather", meta=meta), dev).validate()

