"""The devices a planner plans for: one row per plan rank (where it sits, how fast it is,
how many tokens it may hold), and the input checks every planner runs first.

A plan rank is one GPU, or with tensor parallelism (`model.tp`) a group of `tp`
consecutive GPUs of one node holding the same tokens (`rank_hardware`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.memory import MEMORY_RESERVE, activation_bytes_per_token, static_bytes
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["Devices", "RankHardware", "check_feasible", "check_lengths", "devices", "rank_hardware"]


@dataclass(frozen=True, kw_only=True)
class RankHardware:
    """Per plan rank of a cluster at tensor-parallel degree `tp`: a plan rank is `tp`
    consecutive GPUs of one node holding the same tokens (one GPU when tp = 1)."""
    tp: int
    node: tuple[int, ...]
    nic: tuple[int, ...]
    """The NIC of the rank's first GPU (GPU-NIC affinity)."""
    nics: tuple[tuple[int, ...], ...]
    """Every NIC the rank's GPUs reach (a TP group sends its shards through all of them)."""
    local_index: tuple[int, ...]
    """Index of the rank inside its node (for rail alignment)."""
    group: tuple[int, ...]
    """Node-group index (`ClusterSpec.groups`)."""
    gpu: tuple[hardware.GPUType, ...]
    intra_bw: tuple[float, ...]
    """Bytes/s one direction of the rank's intra-node link."""
    nic_bw: tuple[float, ...]
    """Bytes/s of one of its NICs."""

    @property
    def num_ranks(self) -> int:
        return len(self.node)


@functools.lru_cache(maxsize=32)
def rank_hardware(cluster: ClusterSpec, tp: int = 1) -> RankHardware:
    """The plan ranks of `cluster` at tensor-parallel degree `tp`; `InputError` when `tp`
    does not divide a node's GPUs."""
    for g in cluster.groups:
        if g.gpus_per_node % tp:
            raise InputError(f"tp={tp} does not divide the {g.gpus_per_node} GPUs per node of {g.gpu!r} nodes")
    firsts = range(0, cluster.num_ranks, tp)
    group_index = {id(g): i for i, g in enumerate(cluster.groups)}
    groups = [cluster.group_of(x) for x in firsts]
    return RankHardware(
        tp=tp,
        node=tuple(cluster.node_of(x) for x in firsts),
        nic=tuple(cluster.nic_of(x) for x in firsts),
        nics=tuple(tuple(sorted({cluster.nic_of(x + k) for k in range(tp)})) for x in firsts),
        local_index=tuple(cluster.local_index(x) // tp for x in firsts),
        group=tuple(group_index[id(g)] for g in groups),
        gpu=tuple(g.gpu_type for g in groups),
        intra_bw=tuple(g.intra_bw for g in groups),
        nic_bw=tuple(g.nic_bw for g in groups),
    )


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
        """Each node's ranks (a fresh list: callers may change it)."""
        return [list(ranks) for ranks in self._node_ranks]

    @functools.cached_property
    def gpu_types(self) -> tuple[hardware.GPUType, ...]:
        """Each GPU type of the ranks once, in rank order."""
        return tuple({g.name: g for g in self.gpu}.values())

    @functools.cached_property
    def gpu_names(self) -> np.ndarray:
        """[R] the name of each rank's GPU type."""
        return _read_only(np.array([g.name for g in self.gpu]))

    @functools.cached_property
    def type_index(self) -> np.ndarray:
        """[R] each rank's GPU type, as an index into `gpu_types`."""
        index = {t.name: i for i, t in enumerate(self.gpu_types)}
        return _read_only(np.array([index[g.name] for g in self.gpu], dtype=np.int64))

    def per_type(self, values) -> np.ndarray:
        """[R] of `values`, one per GPU type of `gpu_types`: each rank's."""
        return np.asarray(values, dtype=float)[self.type_index]

    def node_means(self, values: np.ndarray) -> np.ndarray:
        """[nodes] the mean of `values` ([R]) over each node's ranks."""
        if self._even_nodes:
            return values.reshape(self.num_nodes, -1).mean(axis=1)
        return np.array([values[list(ranks)].mean() for ranks in self._node_ranks])

    @functools.cached_property
    def _even_nodes(self) -> bool:
        """Whether the nodes hold as many ranks each, in rank order."""
        ranks = self._node_ranks
        return all(len(rs) == len(ranks[0]) for rs in ranks) and list(self.node) == sorted(self.node)

    @functools.cached_property
    def _node_ranks(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for r, n in enumerate(self.node):
            out[n].append(r)
        return tuple(tuple(ranks) for ranks in out)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=16)  # every batch of a run plans on the same devices
def devices(cluster: ClusterSpec, model: ModelSpec, assume_homogeneous: bool = False) -> Devices:
    """The plan ranks of `cluster` for `model`. With `assume_homogeneous`, speeds are those
    of the first GPU type (memory caps stay real, so the plan stays valid). Its arrays are
    read-only: the result is shared between calls."""
    tp = model.tp
    hw = rank_hardware(cluster, tp)  # where each rank sits and its hardware
    gpu = hw.gpu
    num_dp = cluster.num_ranks // tp
    static = static_bytes(model, num_dp)
    act = activation_bytes_per_token(model)
    total = tuple(t.memory_bytes * MEMORY_RESERVE for t in gpu)
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
        node=hw.node,
        nic=hw.nic,
        local_index=hw.local_index,
        gpu=hw.gpu,
        group=hw.group,
        speed=speed,
        token_cap=token_cap,
        static_bytes=static,
        act_bytes_per_token=act,
        memory_total=total,
    )


def infeasibility(lengths: list[int], dev: Devices, model: ModelSpec) -> str | None:
    """Why no plan can hold the batch, or None: the model state alone is over a GPU's
    memory, a document is longer than the whole cluster holds, or the batch is."""
    if (dev.token_cap < 0).any():
        r = int(np.argmin(dev.token_cap))
        return (f"model {model.name!r} needs {dev.static_bytes / 2**30:.1f} GiB of weights and optimizer state per GPU, "
                f"over the {dev.memory_total[r] / 2**30:.1f} GiB a {dev.gpu[r].name} GPU may use")
    total_cap = int(dev.token_cap.sum())
    if lengths:
        doc = int(np.argmax(lengths))
        if lengths[doc] > total_cap:
            return (f"document {doc} has {lengths[doc]} tokens, over the {total_cap} tokens "
                    f"the whole cluster can hold for model {model.name!r}")
    if sum(lengths) > total_cap:
        return (f"the batch has {sum(lengths)} tokens, over the {total_cap} tokens "
                f"the whole cluster can hold for model {model.name!r}")
    return None


def check_feasible(lengths: list[int], dev: Devices, model: ModelSpec) -> None:
    """Raise `InfeasiblePlan` when no plan can hold the batch (`infeasibility`)."""
    why = infeasibility(lengths, dev, model)
    if why is not None:
        raise InfeasiblePlan(why)


def check_lengths(lengths) -> list[int]:
    out = []
    for i, L in enumerate(lengths):
        if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or L < 1:
            raise InputError(f"document {i}: length must be a positive integer, got {L!r}")
        out.append(int(L))
    return out
