"""Sharded, safe, atomic checkpoints with `torch.distributed.checkpoint` (DCP).

A checkpoint folder holds one finished checkpoint, `step-NNNNNNNN/`, named by the text
file `latest`:

    step-00000010/  DCP files: each rank writes its own shards of the model and optimizer
                    (FSDP2 DTensors); `.metadata` indexes them
                    ballonet.json: step, world size, loader state (JSON), RNG states
    latest          "step-00000010"

Saving: every rank writes into `.tmp-step-N/` (DCP fsyncs each file), rank 0 adds
`ballonet.json`, fsyncs, renames the folder into place, then replaces `latest` (write,
fsync, rename) and only then deletes the previous checkpoint. A save killed at any point
leaves `latest` naming a complete checkpoint; stale `.tmp-*` folders are removed when
the next run starts (`clean_stale`).

Loading never executes code from the checkpoint, by construction: DCP's `.metadata` (a
pickle) is written in pickle protocol 2 and read by torch's own weights-only unpickler
(`torch._weights_only_unpickler`), which resolves a global only by its exact "module.name"
among torch's defaults and DCP's metadata classes (`SAFE_GLOBALS`: never a dotted name
through a module's attributes) and calls nothing else; every storage item must lie inside
a plain file of the checkpoint folder. Tensors and non-tensor items go through
`torch.load(weights_only=True)`; step, loader state and RNG are JSON, checked field by
field. Shards reassemble on any world size (DCP reshards DTensors), so a run saved on 4
ranks resumes on 2; RNG states are restored only on the world size that saved them.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pathlib
import pickle
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ballonet.errors import InputError

LATEST = "latest"
META = "ballonet.json"
FORMAT = "ballonet-dcp-2"
"""2: `.metadata` in pickle protocol 2, read weights-only (1, before it, was read by a
module-wide allow-list that a dotted global name could escape: refused)."""
DCP_METADATA = ".metadata"
METADATA_PROTOCOL = 2
"""The only pickle protocol torch's weights-only unpickler reads."""
SAFE_GLOBALS = (
    dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta, dcp_metadata.TensorStorageMetadata,
    dcp_metadata.TensorProperties, dcp_metadata.ChunkStorageMetadata, dcp_metadata.BytesStorageMetadata,
    dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo, type(pathlib.Path()),
)
"""What DCP's metadata holds besides torch's weights-only defaults (tensors' sizes, dtypes,
layouts): its dataclasses, the memory-format enum, the storage record of each item, and the
checkpoint's path."""


def _metadata_error(path, reason: str) -> InputError:
    return InputError(f"{path}: not a checkpoint's metadata that is safe to load ({reason})")


def read_safe_metadata(path, folder) -> dcp_metadata.Metadata:
    """DCP's `Metadata` from the file `path` through torch's weights-only unpickler, its
    storage items checked to lie inside plain files of `folder`. InputError otherwise."""
    from torch import _weights_only_unpickler

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _metadata_error(path, e.strerror or type(e).__name__) from None
    if data[:2] != bytes([pickle.PROTO[0], METADATA_PROTOCOL]):
        raise _metadata_error(path, f"not pickle protocol {METADATA_PROTOCOL}, the only one Ballonet writes and reads")
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            metadata = _weights_only_unpickler.load(io.BytesIO(data), encoding="utf-8")
    except Exception as e:  # noqa: BLE001 - the unpickler refuses with many exception types
        raise _metadata_error(path, _last_line(e)) from None
    if type(metadata) is not dcp_metadata.Metadata or not isinstance(metadata.storage_data, dict):
        raise _metadata_error(path, f"holds a {type(metadata).__name__}, not DCP's Metadata with storage_data")
    _check_storage(metadata.storage_data, path, folder)
    return metadata


def _check_storage(storage: dict, path, folder) -> None:
    """Every item of `storage` (MetadataIndex -> _StorageInfo) inside a plain file of `folder`."""
    root = os.path.realpath(folder)
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if type(info) is not _StorageInfo or type(index) is not dcp_metadata.MetadataIndex:
            raise _metadata_error(path, f"a storage item of type {type(info).__name__}")
        name = info.relative_path
        if name not in sizes:
            if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
                    or os.path.dirname(os.path.realpath(os.path.join(root, name))) != root):
                raise _metadata_error(path, f"storage file {name!r} is not a file name inside {folder}")
            full = os.path.join(root, name)
            if not os.path.isfile(full):
                raise _metadata_error(path, f"storage file {name!r} is missing from {folder}")
            sizes[name] = os.path.getsize(full)
        offset, length = info.offset, info.length
        if (type(offset) is not int or type(length) is not int or offset < 0 or length < 0
                or offset + length > sizes[name]):
            raise _metadata_error(path, f"item {index.fqn!r}: bytes [{offset!r}, +{length!r}) outside {name} "
                                        f"({sizes[name]} bytes)")
        descriptors = info.transform_descriptors
        if descriptors is not None and not all(isinstance(d, str) for d in descriptors):
            raise _metadata_error(path, f"item {index.fqn!r}: transform descriptors are not strings")


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader reading `.metadata` weights-only (`read_safe_metadata`). Its
    `read_metadata` takes no rank: DCP then never falls back to per-rank metadata files
    (which Ballonet does not write) after logging the first failure with a traceback."""

    def read_metadata(self):
        metadata = read_safe_metadata(self._get_metadata_path(), self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeWriter(dcp.FileSystemWriter):
    """A FileSystemWriter whose `.metadata` is in pickle protocol 2, which `SafeReader` reads
    (DCP writes its default protocol, which the weights-only unpickler does not read)."""

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)  # completes `metadata` (storage items) and writes it
        per_rank = not getattr(self, "use_collectives", True) and self.rank is not None
        path = self._get_metadata_path(self.rank if per_rank else None)
        write_durably(str(path), pickle.dumps(metadata, protocol=METADATA_PROTOCOL))


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items (optimizer hyperparameters) through the weights-only unpickler."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# ---- files -----------------------------------------------------------------------------


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: str | bytes) -> None:
    """Write, fsync, rename over `path`, fsync the folder: all or nothing."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(path) or ".")


def clean_stale(folder: str) -> None:
    """Remove what an interrupted save left behind (rank 0, before any save)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(".tmp-") or name == f"{LATEST}.tmp":
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def latest(folder: str) -> str | None:
    """The finished checkpoint `latest` names, or None if the folder holds none.
    Raises InputError for a folder with something else in it, or a dangling `latest`."""
    if not os.path.isdir(folder):
        return None
    pointer = os.path.join(folder, LATEST)
    if not os.path.exists(pointer):
        foreign = sorted(n for n in os.listdir(folder) if not n.startswith("."))
        if foreign:
            raise InputError(f"{folder}: not a ballonet checkpoint folder (no '{LATEST}' file, holds {foreign[0]!r})")
        return None
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{pointer}: unreadable ({e})") from None
    path = os.path.join(folder, name)
    if os.sep in name or not name.startswith("step-") or not os.path.isfile(os.path.join(path, META)):
        raise InputError(f"{pointer}: names {name!r}, which is not a complete checkpoint in {folder}")
    return path


def read_meta(path: str) -> dict:
    """The checkpoint's `ballonet.json`, each field checked (step, world size, loader
    position, RNG states); InputError naming the file and the field otherwise."""
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{meta_path}: corrupt checkpoint metadata ({e})") from None
    if isinstance(meta, dict) and meta.get("format") == "ballonet-dcp-1":
        raise InputError(f"{meta_path}: saved by an earlier Ballonet (ballonet-dcp-1), whose checkpoint metadata "
                         f"is not loaded (reading it safely needs {FORMAT}); start the run again")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(f"{meta_path}: not a {FORMAT} checkpoint")

    def count(where: str, value, least: int) -> None:
        if type(value) is not int or value < least:
            raise InputError(f"{meta_path}: field {where!r} must be an integer >= {least}, got {value!r}")

    count("step", meta.get("step"), 1)
    count("world_size", meta.get("world_size"), 1)
    loader = meta.get("loader")
    if not isinstance(loader, dict):
        raise InputError(f"{meta_path}: field 'loader' must be an object, got {loader!r}")
    for key in ("epoch", "position", "offset", "batch"):
        count(f"loader.{key}", loader.get(key), 0)
    rng = meta.get("rng")
    if not isinstance(rng, list) or not all(isinstance(r, str) for r in rng):
        raise InputError(f"{meta_path}: field 'rng' must be a list of strings")
    return meta


# ---- RNG -------------------------------------------------------------------------------


def _rng_tensor(device: torch.device) -> torch.Tensor:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return torch.cat(states)


def _gather_rng(group, device: torch.device) -> list[str]:
    """Every rank's RNG state (CPU, and CUDA on GPU), base64, gathered to all ranks."""
    mine = _rng_tensor(device)
    if group is None:
        return [base64.b64encode(mine.numpy().tobytes()).decode()]
    comm_device = device if device.type == "cuda" else torch.device("cpu")
    everyone = [torch.empty_like(mine, device=comm_device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine.to(comm_device), group=group)
    return [base64.b64encode(t.cpu().numpy().tobytes()).decode() for t in everyone]


def _set_rng(encoded: str, device: torch.device, where: str) -> None:
    try:
        state = torch.frombuffer(bytearray(base64.b64decode(encoded, validate=True)), dtype=torch.uint8)
    except ValueError:
        raise InputError(f"{where}: field 'rng' holds a string that is not base64") from None
    cpu_size = torch.get_rng_state().numel()
    if state.numel() < cpu_size:
        raise InputError(f"{where}: field 'rng' holds a state of {state.numel()} bytes, not {cpu_size}")
    torch.set_rng_state(state[:cpu_size].clone())
    if device.type == "cuda" and state.numel() > cpu_size:
        torch.cuda.set_rng_state(state[cpu_size:].clone(), device)


# ---- save and load ---------------------------------------------------------------------


def checkpoint_bytes(num_params: int) -> int:
    """What one checkpoint takes on disk, a little more than: fp32 master weights and
    AdamW's two fp32 states per parameter (DCP's own records add about 6% for the tiny
    model), plus a MiB of metadata."""
    return int(12 * num_params * 1.1) + (1 << 20)


def check_folder(folder: str, num_params: int) -> None:
    """Before training: `folder` is a folder (or can be made as one) that this process can
    write, on a disk with room for the next checkpoint (two while the first run saves:
    the previous one is deleted only once the new one is complete). InputError otherwise."""
    flag = f"--checkpoint-dir {folder}"
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise InputError(f"{flag}: is a file, not a folder")
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"{flag}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag}: {existing} is not writable")
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # the free space cannot be known here: a full disk is reported at the save
    has_one = os.path.isfile(os.path.join(folder, LATEST))
    need = checkpoint_bytes(num_params) * (1 if has_one else 2)
    if free < need:
        raise InputError(f"{flag}: {free / 2**20:.1f} MiB free on its disk, checkpoints of this model need "
                         f"{need / 2**20:.1f} MiB")


def save(folder: str, step: int, model, optimizer, loader_state: dict, rank: int, group, device) -> str:
    """Collective: write checkpoint `step` of every rank's shards; returns its folder. A
    disk that fills or turns read-only meanwhile is one InputError line, nothing half-written."""
    tmp = os.path.join(folder, f".tmp-step-{step:08d}")
    try:
        return _save(folder, tmp, step, model, optimizer, loader_state, rank, group, device)
    except (OSError, CheckpointException) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(f"--checkpoint-dir {folder}: cannot write the checkpoint of step {step} "
                         f"({_last_line(e)})") from None


def _save(folder: str, tmp: str, step: int, model, optimizer, loader_state: dict, rank: int, group, device) -> str:
    name = f"step-{step:08d}"
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    rng = _gather_rng(group, device)
    _barrier(group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=SafeWriter(tmp, sync_files=True),
             process_group=group, no_dist=group is None)
    final = os.path.join(folder, name)
    if rank == 0:
        world = 1 if group is None else dist.get_world_size(group)
        meta = {"format": FORMAT, "step": step, "world_size": world, "loader": loader_state, "rng": rng}
        write_durably(os.path.join(tmp, META), json.dumps(meta))
        previous = latest(folder)
        if os.path.exists(final):  # a run restarted without --resume reached this step again
            if previous == final:
                os.remove(os.path.join(folder, LATEST))
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_path(folder)
        write_durably(os.path.join(folder, LATEST), name)
        for other in os.listdir(folder):
            if other.startswith("step-") and other != name:
                shutil.rmtree(os.path.join(folder, other), ignore_errors=True)
    _barrier(group)
    return final


def load(path: str, model, optimizer, rank: int, group, device) -> dict:
    """Collective: restore model and optimizer shards from checkpoint `path` (any world
    size) and RNG (same world size); returns its metadata (step, loader state)."""
    meta = read_meta(path)
    read_safe_metadata(os.path.join(path, DCP_METADATA), path)  # refused here in one line, before DCP logs it
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        with warnings.catch_warnings():  # torch.load's warning on a crafted item: the refusal says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), process_group=group,
                     no_dist=group is None)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure
        raise InputError(f"{path}: corrupt or foreign checkpoint ({_last_line(e)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    world = 1 if group is None else dist.get_world_size(group)
    if meta.get("world_size") == world and len(meta.get("rng", [])) == world:
        _set_rng(meta["rng"][rank], device, os.path.join(path, META))
    return meta


_BOILERPLATE = ("Weights only load failed", "Check the documentation of torch.load", "Please file an issue")
"""torch.load's lines around the reason a weights-only load failed (one of them advises
loading the file unsafely)."""


def _last_line(e: BaseException) -> str:
    """The innermost message of a (possibly DCP-wrapped, multi-line) exception, one line."""
    lines = [line.strip() for line in str(e).splitlines()
             if line.strip() and not line.strip().startswith(_BOILERPLATE)]
    return (lines[-1] if lines else type(e).__name__)[:300]


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group)
