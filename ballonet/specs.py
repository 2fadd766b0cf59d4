"""What is being trained and on what: `ClusterSpec`, `ModelSpec`, and their presets.

A cluster is a list of node groups; every node of a group is alike (GPU type, GPUs per
node, intra-node link, NICs). Ranks are numbered node by node, group by group. A group
may be `loaned` (inference nodes lent to training while serving is quiet): a job runs
over every group, or over the others while the loan is reclaimed (`job_cluster`). GPU j of a
node with m NICs reaches NIC j * m // gpus_per_node, so with 8 GPUs and 4 NICs, GPUs 0
and 1 share NIC 0 (the static NIC-GPU affinity that routing works around).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ballonet.cost import hardware
from ballonet.errors import InputError
from ballonet.user_files import read_toml
from ballonet.paths import looks_like_path

GBIT = 1e9 / 8
MAX_GPUS = 1 << 14
"""The most GPUs a cluster may have: planning time grows faster than the GPU count (one
batch of 16K tokens per GPU: 0.3 s on 2048 GPUs, 3.7 s on 8192, on one CPU core), and a
rank table of millions of GPUs would not fit in memory."""


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
        for name in ("nic_gbps", "intra_link_bw", "memory_gb"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise InputError(f"node group {self.gpu!r}: {name} must be a number, got {value!r}")
            if value is not None and not math.isfinite(value):
                raise InputError(f"node group {self.gpu!r}: {name} must be finite, got {value!r}")
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


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tp: int = 1
    """Tensor-parallel degree: heads and FFN are split over `tp` GPUs of one node."""
    dtype_bytes: int = 2
    """Bytes per activation element (2 for bf16)."""
    recompute: str | None = None
    """Activation recomputation: "none", "selective" (the MLP), "linear" (every linear
    layer, not attention nor the exchanges) or "full" (every layer); None: the cheapest
    under which the plan fits in memory, per rank (`cost.recompute.cheapest_per_rank`)."""
    recompute_layers: int | None = None
    """With "selective" or "linear" recomputation: how many layers (the first ones)
    recompute so, the others one mode below (selective: none, as Megatron's
    `--recompute-num-layers`, for the MLP; linear: selective); None: every layer. With
    `recompute` None the cost model picks this too: as few as each rank's memory needs."""

    def __post_init__(self):
        if self.recompute not in (None, "none", "selective", "linear", "full"):
            raise InputError(f"model {self.name!r}: recompute must be none, selective, linear or full, "
                             f"got {self.recompute!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "recompute") or (f.name == "recompute_layers" and v is None):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"model {self.name!r}: {f.name} must be a positive integer, got {v!r}")
        if self.recompute_layers is not None and (self.recompute not in ("selective", "linear")
                                                  or self.recompute_layers > self.num_layers):
            raise InputError(f"model {self.name!r}: recompute_layers={self.recompute_layers} needs selective or "
                             f"linear recomputation and at most its {self.num_layers} layers")
        if self.hidden % self.num_heads:
            raise InputError(f"model {self.name!r}: hidden={self.hidden} is not a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of num_kv_heads")
        if self.num_heads % self.tp or self.num_kv_heads % self.tp:
            raise InputError(f"model {self.name!r}: tp={self.tp} must divide its {self.num_heads} heads and "
                             f"{self.num_kv_heads} KV heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h = self.hidden
        per_layer = h * (h + 2 * self.kv_dim) + h * h + 3 * h * self.ffn_hidden + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


def _group(gpu, **kw) -> NodeGroup:
    return NodeGroup(gpu=gpu, **kw)


CLUSTERS: dict[str, ClusterSpec] = {
    c.name: c
    for c in [
        # Zeppelin cluster A: A800, 8 GPUs and 4x200 Gb/s RoCE NICs per node.
        ClusterSpec(name="a800-4nic", groups=(_group("a800", num_nodes=2, nics_per_node=4, nic_gbps=200),)),
        # Cluster B: H800, 8 NICs per node (400 Gb/s each).
        ClusterSpec(name="h800-8nic", groups=(_group("h800", num_nodes=2, nics_per_node=8, nic_gbps=400),)),
        # Cluster C: H200, 8x400 Gb/s NICs per node.
        ClusterSpec(name="h200-8nic", groups=(_group("h200", num_nodes=2, nics_per_node=8, nic_gbps=400),)),
        # Training nodes plus inference nodes loaned at off-peak hours (issue: heterogeneous
        # clusters). Inference nodes typically carry fewer, slower NICs.
        ClusterSpec(name="h800+h20", groups=(_group("h800", num_nodes=2, nics_per_node=8, nic_gbps=400),
                                             _group("h20", num_nodes=2, nics_per_node=4, nic_gbps=200, loaned=True))),
        ClusterSpec(name="a800+l40s", groups=(_group("a800", num_nodes=2, nics_per_node=4, nic_gbps=200),
                                              _group("l40s", num_nodes=2, nics_per_node=2, nic_gbps=200,
                                                     loaned=True))),
        # Emulated runs on CPU processes (gloo): small nodes, one "NIC" per GPU.
        ClusterSpec(name="cpu", groups=(_group("cpu", num_nodes=2, gpus_per_node=2, nics_per_node=2, nic_gbps=10),)),
    ]
}

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        # LLaMA-1 shapes (Touvron et al. 2023); 3B as OpenLLaMA-3B.
        ModelSpec(name="llama-3b", num_layers=26, hidden=3200, num_heads=32, num_kv_heads=32,
                  ffn_hidden=8640, vocab_size=32000),
        ModelSpec(name="llama-7b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=32,
                  ffn_hidden=11008, vocab_size=32000),
        ModelSpec(name="llama-13b", num_layers=40, hidden=5120, num_heads=40, num_kv_heads=40,
                  ffn_hidden=13824, vocab_size=32000),
        ModelSpec(name="llama-30b", num_layers=60, hidden=6656, num_heads=52, num_kv_heads=52,
                  ffn_hidden=17920, vocab_size=32000),
        ModelSpec(name="llama3-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                  ffn_hidden=14336, vocab_size=128256),
        # Trains on CPU in seconds; byte-level vocabulary.
        ModelSpec(name="tiny", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                  ffn_hidden=176, vocab_size=256, dtype_bytes=4),
        # Llama-3.2-1B shapes (untied head): the one-GPU training check.
        ModelSpec(name="llama3-1b", num_layers=16, hidden=2048, num_heads=32, num_kv_heads=8,
                  ffn_hidden=8192, vocab_size=128256),
    ]
}


def load_toml(path: str, kind: str = "cluster file") -> dict:
    """A TOML file's table (read through `user_files`: a regular file, bounded); one-line
    InputError naming the file and `kind` otherwise."""
    return read_toml(path, kind)


def cluster_from_toml(path: str) -> ClusterSpec:
    """A cluster file: `name = "..."` and one `[[node_groups]]` table per group, with the
    fields of `NodeGroup` (gpu, num_nodes, gpus_per_node, nics_per_node, nic_gbps,
    intra_link_bw, memory_gb, loaned)."""
    data = load_toml(path)
    groups = data.get("node_groups")
    if not isinstance(groups, list) or not groups:
        raise InputError(f"{path}: field 'node_groups' must be a non-empty array of tables ([[node_groups]])")
    known = {f.name for f in dataclasses.fields(NodeGroup)}
    parsed = []
    name = data.get("name", os.path.splitext(os.path.basename(path))[0])
    if not isinstance(name, str):
        raise InputError(f"{path}: field 'name' must be a string, got {name!r}")
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise InputError(f"{path}: node_groups[{i}]: expected a table ([[node_groups]]), got {g!r}")
        unknown = sorted(set(g) - known)
        if unknown:
            raise InputError(f"{path}: node_groups[{i}]: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
        if "gpu" not in g:
            raise InputError(f"{path}: node_groups[{i}]: field 'gpu' is missing")
        try:
            parsed.append(NodeGroup(**g))
        except InputError as e:
            raise InputError(f"{path}: node_groups[{i}]: {e}") from None
    try:
        return ClusterSpec(name=name, groups=tuple(parsed))
    except InputError as e:
        raise InputError(f"{path}: {e}") from None


def cluster(name_or_path: str, num_nodes: int | None = None, **overrides) -> ClusterSpec:
    """A preset by name or a TOML file by path. A preset wins over a local file of the same
    name unless the argument looks like a path (a separator or a .toml suffix: `./h200-8nic`).
    `num_nodes` (`--nodes`) sets the nodes of a one-group cluster; a cluster of several node
    groups sets its nodes per group, and `num_nodes`, if given, must be their sum.
    `overrides` (fields of `NodeGroup`, such as `gpus_per_node=2`) apply to every group."""
    if name_or_path in CLUSTERS and not looks_like_path(name_or_path, (".toml",)):
        spec = CLUSTERS[name_or_path]
    elif looks_like_path(name_or_path, (".toml",)) or os.path.exists(name_or_path):
        spec = cluster_from_toml(name_or_path)
    else:
        raise InputError(f"unknown cluster {name_or_path!r}; presets: {', '.join(CLUSTERS)} (or a .toml file)")
    if num_nodes is not None and len(spec.groups) > 1:
        if num_nodes != spec.num_nodes:
            raise InputError(f"--nodes {num_nodes}: cluster {spec.name!r} has {len(spec.groups)} node groups of "
                             f"{spec.num_nodes} nodes in all ({_group_counts(spec)}); set nodes per group in a "
                             f"cluster file")
    elif num_nodes is not None:
        overrides["num_nodes"] = num_nodes
    if overrides:
        known = {f.name for f in dataclasses.fields(NodeGroup)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise InputError(f"unknown cluster field {bad[0]!r}; known: {', '.join(sorted(known))}")
        spec = dataclasses.replace(spec, groups=tuple(dataclasses.replace(g, **overrides) for g in spec.groups))
    return spec


def _group_counts(spec: ClusterSpec) -> str:
    return " + ".join(f"{g.num_nodes} x {g.gpus_per_node} {g.gpu}" + (" loaned" if g.loaned else "")
                      for g in spec.groups)


def job_cluster(name_or_path: str, world_size: int, num_nodes: int | None = None) -> ClusterSpec:
    """The topology a training job of `world_size` ranks runs on. One node group: its nodes
    are `num_nodes` (default 1) of world_size / num_nodes ranks each, as the job is launched.
    Several groups: the file's nodes and GPUs, as they are (`num_nodes`, if given, must be
    their sum); the job has as many ranks as the groups have GPUs, or, while the loaned
    groups are reclaimed, as many as the others have (the members torch's rendezvous
    formed decide which)."""
    spec = cluster(name_or_path)
    if len(spec.groups) == 1:
        nodes = num_nodes or 1
        if world_size % nodes:
            raise InputError(f"{world_size} ranks cannot be spread evenly over --nodes {nodes}")
        return cluster(name_or_path, num_nodes=nodes, gpus_per_node=world_size // nodes)
    cluster(name_or_path, num_nodes=num_nodes)  # a --nodes that disagrees with the groups fails here
    if world_size == spec.num_ranks:
        return spec
    if spec.has_loans and world_size == spec.without_loaned().num_ranks:
        return spec.without_loaned()
    own = f", {spec.without_loaned().num_ranks} without its loaned groups" if spec.has_loans else ""
    raise InputError(f"cluster {spec.name!r} has {spec.num_ranks} GPUs in its node groups ({_group_counts(spec)}"
                     f"{own}), the job {world_size} ranks")


def model_from_toml(path: str) -> ModelSpec:
    """A model file: the fields of `ModelSpec` (num_layers, hidden, num_heads, num_kv_heads,
    ffn_hidden, vocab_size; optionally tp, dtype_bytes, recompute), every one of them, or
    `base = "PRESET"` and the fields that differ from that preset. `name` defaults to the
    file's stem."""
    data = load_toml(path, "model file")
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(data) - known - {"base"})
    if unknown:
        raise InputError(f"{path}: unknown field {unknown[0]!r}; known: base, {', '.join(sorted(known))}")
    values: dict[str, Any] = {"name": os.path.splitext(os.path.basename(path))[0]}
    base = data.pop("base", None)
    if base is not None:
        if base not in MODELS:
            raise InputError(f"{path}: base {base!r} is not a model preset ({', '.join(MODELS)})")
        values = {**dataclasses.asdict(MODELS[base]), **values}
    values.update(data)
    missing = [f.name for f in dataclasses.fields(ModelSpec)
               if f.default is dataclasses.MISSING and f.name not in values]
    if missing:
        raise InputError(f"{path}: field {missing[0]!r} is missing (or give base = \"PRESET\")")
    try:
        return ModelSpec(**values)
    except InputError as e:
        raise InputError(f"{path}: {e}") from None


def model(name: str, **overrides) -> ModelSpec:
    """A model preset by name or a TOML model file by path (`model_from_toml`); `overrides`
    (such as `tp=2`) replace its fields."""
    if name in MODELS and not looks_like_path(name, (".toml",)):
        spec = MODELS[name]
    elif looks_like_path(name, (".toml",)) or os.path.exists(name):
        spec = model_from_toml(name)
    else:
        raise InputError(f"unknown model {name!r}; presets: {', '.join(MODELS)} (or a .toml file)")
    return dataclasses.replace(spec, **overrides) if overrides else spec
