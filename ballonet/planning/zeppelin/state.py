"""The partitioner's state, as values: what its steps read (`Batch`) and fill (`RankFill`).

`classes.py` builds a `Batch` once per global batch under each recomputation's caps and
hands it, with the `RankFill` that level 2 fills node by node, to each step;
`refinement.py` levels the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ballonet.cost import hardware
from ballonet.planning.devices import Devices
from ballonet.planning.zeppelin.thresholds import THRESHOLDS
from ballonet.specs import ModelSpec

__all__ = ["Batch", "Crossover", "NodeRanks", "RankFill", "node_ranks"]


@dataclass(frozen=True)
class Crossover:
    """The lengths above which a document's ring hides its transfers, for one node group."""
    intra: float | None
    """Inside a node: 2 c*_nvlink (None on a node of one rank)."""
    inter: float
    """Across two whole nodes of n ranks: 2 n c*_nic."""
    intra_bw: float
    """Bytes/s of a ring hop inside a node (NVLink, or PCIe on a PCIe-only node)."""
    crossing_bw: float
    """Bytes/s of one NIC at line rate, for a ring hop that crosses nodes (routed over
    `rails` of them, `ring_pricing.crossing_seconds`)."""
    rank_nic_bw: float = 0.0
    """Bytes/s of one rank's NIC share when every rank of the node sends at once (a
    "double" ring's rounds): line rate over the GPUs a NIC serves."""
    rails: int = 1
    """Distinct NICs a node's ranks reach: the most proxy pairs a routed crossing hop
    spreads over (`ring_pricing.crossing_seconds`)."""
    dp_piece: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds a piece of a layer's data-parallel collectives holds a
    rank's NIC share (`cost.seconds.dp_piece_seconds`): a crossing hop behind one waits."""


@dataclass(frozen=True)
class Batch:
    """What every placement step reads: the documents, their work and the devices."""
    lengths: list[int]
    length_array: np.ndarray
    """[D] `lengths` as floats (the vector steps read it)."""
    work: np.ndarray
    """[D] attention work of each document, in peak-FLOP units (split documents counted at
    the efficiency of their blocks)."""
    work_list: list[float]
    """`work` as a list (the greedy steps index it one document at a time)."""
    dev: Devices
    model: ModelSpec
    gpu: hardware.GPUType
    """The fastest rank's GPU type: `work` is at its kernel efficiencies."""
    crossovers: list[Crossover]
    """Per node group (`Devices.group`)."""
    linear_on_rank: np.ndarray
    """[R] linear work per token a rank keeps (`StepWeights.linear_per_token` on ranks of
    nodes the remap does not even out: PCIe-only nodes; else 0)."""
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """What the steps compute from this batch alone, kept for the search's other level 1s
    of it (`classes._node_work`, `node_ranks`); `dataclasses.replace` starts a new one empty."""


@dataclass
class RankFill:
    """What level 2 fills in, rank by rank (mutated node by node), for refinement."""
    local: list[list[int]]
    """Per rank, the documents it holds whole."""
    split_shares: dict[int, dict[int, float]]
    """Per split document, the work share of each member rank."""
    token_room: np.ndarray
    """[R] tokens each rank may still take under its memory cap."""


@dataclass(frozen=True)
class NodeRanks:
    """One node's ranks and what levels 1 and 2 read of their devices (`node_ranks`)."""
    ranks: np.ndarray
    speed: np.ndarray
    speed_sum: float
    """`speed.sum()`: the node's speed."""
    token_sum: int
    """The tokens the node's ranks may hold."""
    most_tokens: int
    """The most tokens a rank of the node may hold."""
    near_cap: np.ndarray
    """[ranks] `Thresholds.near_cap` of each rank's token cap."""


def node_ranks(batch: Batch, nodes: list[list[int]]) -> list[NodeRanks]:
    """`NodeRanks` of each of `nodes` (the batch's devices' ranks), made once per batch and
    nodes (`Batch.memo`) for every level 1 and placement of it."""
    key = ("node_ranks", tuple(map(tuple, nodes)))
    if key not in batch.memo:
        dev = batch.dev
        out = []
        for rs in nodes:
            ranks = np.array(rs)
            speed, cap = dev.speed[ranks], dev.token_cap[ranks]
            for a in (ranks, speed):
                a.setflags(write=False)
            out.append(NodeRanks(ranks=ranks, speed=speed, speed_sum=speed.sum(), token_sum=cap.sum(),
                                 most_tokens=int(cap.max()), near_cap=THRESHOLDS.near_cap * cap))
        batch.memo[key] = out
    return batch.memo[key]
