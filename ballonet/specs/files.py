"""Cluster and model files: TOML read through `user_files` (a regular file, bounded), every
field checked, one line naming the file and the field otherwise."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ballonet.errors import InputError
from ballonet.specs.cluster_spec import ClusterSpec, NodeGroup
from ballonet.specs.model_spec import ModelSpec
from ballonet.specs.presets import MODELS
from ballonet.user_files import read_toml

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
    for field in ("base", "name"):
        if field in data and not isinstance(data[field], str):
            raise InputError(f"{path}: field {field!r} must be a string, got {data[field]!r}")
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
