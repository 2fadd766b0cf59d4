"""A cluster: node groups of alike nodes (`NodeGroup`), ranks numbered node by node, group
by group (`ClusterSpec`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

from ballonet.cost import hardware
from ballonet.errors import InputError

GBIT = 1e9 / 8
MAX_GPUS = 1 << 14
"""The most GPUs a cluster may have: planning time grows faster than the GPU count (one
batch of 16K tokens per GPU: 0.3 s on 2048 GPUs, 3.7 s on 8192, on one CPU core), and a
rank table of millions of GPUs would not fit in memory."""
RANGES = {"nic_gbps": (1e-3, 1e6), "intra_link_bw": (1e6, 1e15), "memory_gb": (1e-6, 1e6)}
"""What a node group's figures may be (Gb/s, bytes/s, GB), far beyond any real link or GPU:
a bandwidth of 5e-324 or a memory of 1e308 prices a step at Infinity or NaN, or overflows."""


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    gpu: str
    """GPU type, a key of `hardware.GPUS`."""
    num_nodes: int = 1
    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_gbps: float = 400.0
    """Line rate of one NIC in Gb/s."""
    intra_link_bw: float | None = None
    """Override of the GPU type's intra-node bandwidth, bytes/s one direction."""
    memory_gb: float | None = None
    """Override of the GPU type's memory in GB (1e9 bytes): a variant of the type (an
    A100 of 40 GB, an H100 NVL of 94 GB), or memory held back for other work."""
    loaned: bool = False
    """Nodes lent by another service (inference) that may take them back: `ballonet train
    --lease FILE` trains without them while FILE says `reclaimed`."""

    def __post_init__(self):
        if not isinstance(self.gpu, str):
            raise InputError(f"node group: gpu must be a GPU type name (a string), got {self.gpu!r}")
        hardware.gpu(self.gpu)
        if not isinstance(self.loaned, bool):
            raise InputError(f"node group {self.gpu!r}: loaned must be true or false, got {self.loaned!r}")
        for name, (lo, hi) in RANGES.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise InputError(f"node group {self.gpu!r}: {name} must be a number, got {value!r}")
            if value is not None and not math.isfinite(value):
                raise InputError(f"node group {self.gpu!r}: {name} must be finite, got {value!r}")
            if value is not None and value > 0 and not lo <= value <= hi:
                raise InputError(f"node group {self.gpu!r}: {name} must lie in [{lo:g}, {hi:g}], got {value!r}")
        for name in ("num_nodes", "gpus_per_node", "nics_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"node group {self.gpu!r}: {name} must be a positive integer, got {value!r}")
        if self.gpus_per_node % self.nics_per_node and self.nics_per_node % self.gpus_per_node:
            raise InputError(
                f"node group {self.gpu!r}: gpus_per_node={self.gpus_per_node} and "
                f"nics_per_node={self.nics_per_node} must divide one another")
        if not self.nic_gbps > 0:
            raise InputError(f"node group {self.gpu!r}: nic_gbps must be positive, got {self.nic_gbps!r}")
        if self.intra_link_bw is not None and not self.intra_link_bw > 0:
            raise InputError(f"node group {self.gpu!r}: intra_link_bw must be positive")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise InputError(f"node group {self.gpu!r}: memory_gb must be positive, got {self.memory_gb!r}")

    @cached_property
    def gpu_type(self) -> hardware.GPUType:
        gpu = hardware.gpu(self.gpu)
        if self.memory_gb is None:
            return gpu
        return dataclasses.replace(gpu, memory_bytes=self.memory_gb * hardware.GB)

    @property
    def intra_bw(self) -> float:
        return self.intra_link_bw or self.gpu_type.intra_link_bw

    @property
    def nic_bw(self) -> float:
        """Bytes/s of one NIC, one direction."""
        return self.nic_gbps * GBIT

    @property
    def gpus_per_nic(self) -> int:
        return max(1, self.gpus_per_node // self.nics_per_node)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    name: str
    groups: tuple[NodeGroup, ...]

    def __post_init__(self):
        if not self.groups:
            raise InputError(f"cluster {self.name!r} has no node groups")
        object.__setattr__(self, "groups", tuple(self.groups))
        num_gpus = sum(g.num_nodes * g.gpus_per_node for g in self.groups)
        if num_gpus > MAX_GPUS:
            raise InputError(f"cluster {self.name!r} has {num_gpus} GPUs, more than the {MAX_GPUS} Ballonet plans "
                             f"and simulates (fewer nodes)")

    @cached_property
    def _rank_table(self) -> tuple[tuple[int, int, int, int], ...]:
        """Per rank: (group index, node index, local index, global NIC index)."""
        rows, node, nic = [], 0, 0
        for gi, g in enumerate(self.groups):
            for _ in range(g.num_nodes):
                for j in range(g.gpus_per_node):
                    rows.append((gi, node, j, nic + j // g.gpus_per_nic))
                node += 1
                nic += g.gpus_per_node // g.gpus_per_nic
        return tuple(rows)

    @property
    def num_ranks(self) -> int:
        return len(self._rank_table)

    @property
    def num_nodes(self) -> int:
        return sum(g.num_nodes for g in self.groups)

    @property
    def num_nics(self) -> int:
        return sum(g.num_nodes * (g.gpus_per_node // g.gpus_per_nic) for g in self.groups)

    @property
    def homogeneous(self) -> bool:
        return len({(g.gpu, g.gpus_per_node, g.nics_per_node, g.nic_gbps, g.memory_gb) for g in self.groups}) == 1

    def group_of(self, rank: int) -> NodeGroup:
        return self.groups[self._rank_table[rank][0]]

    def node_of(self, rank: int) -> int:
        return self._rank_table[rank][1]

    def local_index(self, rank: int) -> int:
        return self._rank_table[rank][2]

    def nic_of(self, rank: int) -> int:
        return self._rank_table[rank][3]

    def gpu_of(self, rank: int) -> hardware.GPUType:
        return self.group_of(rank).gpu_type

    def ranks_of_node(self, node: int) -> list[int]:
        return [r for r, row in enumerate(self._rank_table) if row[1] == node]

    def nodes(self) -> list[list[int]]:
        """Ranks of each node, node by node."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for r, row in enumerate(self._rank_table):
            out[row[1]].append(r)
        return out

    @property
    def has_loans(self) -> bool:
        return any(g.loaned for g in self.groups)

    def without_loaned(self) -> ClusterSpec:
        """The cluster while its loaned groups are reclaimed: the other groups, in order."""
        own = tuple(g for g in self.groups if not g.loaned)
        if not own:
            raise InputError(f"cluster {self.name!r}: every node group is loaned; at least one must be the job's own")
        return dataclasses.replace(self, groups=own)

    def with_nodes(self, num_nodes: int) -> ClusterSpec:
        """The same cluster with `num_nodes` nodes of its first group (homogeneous presets)."""
        if len(self.groups) != 1:
            raise InputError(f"cluster {self.name!r} mixes node groups; set nodes per group in a TOML file")
        return dataclasses.replace(self, groups=(dataclasses.replace(self.groups[0], num_nodes=num_nodes),))

    def to_dict(self) -> dict:
        return {"name": self.name, "groups": [dataclasses.asdict(g) for g in self.groups]}

    @staticmethod
    def from_dict(d: dict) -> ClusterSpec:
        return ClusterSpec(name=d["name"], groups=tuple(NodeGroup(**g) for g in d["groups"]))
