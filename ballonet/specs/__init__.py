"""What is being trained and on what: `ClusterSpec`, `ModelSpec`, and their presets.

A cluster is a list of node groups; every node of a group is alike (GPU type, GPUs per
node, intra-node link, NICs). Ranks are numbered node by node, group by group. A group
may be `loaned` (inference nodes lent to training while serving is quiet): a job runs
over every group, or over the others while the loan is reclaimed (`job_cluster`). GPU j of a
node with m NICs reaches NIC j * m // gpus_per_node, so with 8 GPUs and 4 NICs, GPUs 0
and 1 share NIC 0 (the static NIC-GPU affinity that routing works around).

`cluster_spec.py` and `model_spec.py` hold the types, `presets.py` the named ones,
`files.py` the TOML files users write; here, the lookups by name or path.
"""

from __future__ import annotations

import dataclasses
import os

from ballonet.errors import InputError
from ballonet.paths import looks_like_path
from ballonet.specs.cluster_spec import GBIT, MAX_GPUS, ClusterSpec, NodeGroup
from ballonet.specs.files import cluster_from_toml, load_toml, model_from_toml
from ballonet.specs.model_spec import ModelSpec
from ballonet.specs.presets import CLUSTERS, MODELS

__all__ = ["CLUSTERS", "GBIT", "MAX_GPUS", "MODELS", "ClusterSpec", "ModelSpec", "NodeGroup", "cluster",
           "cluster_from_toml", "job_cluster", "load_toml", "model", "model_from_toml"]


def _preset_or_file(name: str, presets: dict, from_toml, kind: str):
    """The preset `name`, or the TOML file at `name` (`from_toml`): a preset wins over a
    local file of the same name unless `name` looks like a path."""
    if name in presets and not looks_like_path(name, (".toml",)):
        return presets[name]
    if looks_like_path(name, (".toml",)) or os.path.exists(name):
        return from_toml(name)
    raise InputError(f"unknown {kind} {name!r}; presets: {', '.join(presets)} (or a .toml file)")


def cluster(name_or_path: str, num_nodes: int | None = None, **overrides) -> ClusterSpec:
    """A preset by name or a TOML file by path. A preset wins over a local file of the same
    name unless the argument looks like a path (a separator or a .toml suffix: `./h200-8nic`).
    `num_nodes` (`--nodes`) sets the nodes of a one-group cluster; a cluster of several node
    groups sets its nodes per group, and `num_nodes`, if given, must be their sum.
    `overrides` (fields of `NodeGroup`, such as `gpus_per_node=2`) apply to every group."""
    spec = _preset_or_file(name_or_path, CLUSTERS, cluster_from_toml, "cluster")
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


def model(name: str, **overrides) -> ModelSpec:
    """A model preset by name or a TOML model file by path (`model_from_toml`); `overrides`
    (such as `tp=2`) replace its fields."""
    spec = _preset_or_file(name, MODELS, model_from_toml, "model")
    return dataclasses.replace(spec, **overrides) if overrides else spec
