"""Reading and writing DCP checkpoints so that loading cannot run code, by construction.

DCP's `.metadata` (a pickle) is written in pickle protocol 2 (`SafeWriter`) and read by
torch's own weights-only unpickler (`torch._weights_only_unpickler`), which resolves a
global only by its exact "module.name" among torch's defaults and DCP's metadata classes
(`SAFE_GLOBALS`: never a dotted name through a module's attributes) and calls nothing
else; every storage item must lie inside a plain file of the checkpoint folder
(`read_safe_metadata`). Non-tensor items go through `torch.load(weights_only=True)`
(`SafeLoadPlanner`). Used by `checkpoint.py` and `export.py`.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ballonet import user_files
from ballonet.errors import InputError

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

    data = user_files.read_bytes(path, "metadata", folder, what="a checkpoint's metadata")
    if data[:2] != bytes([pickle.PROTO[0], METADATA_PROTOCOL]):
        raise _metadata_error(path, f"not pickle protocol {METADATA_PROTOCOL}, the only one Ballonet writes and reads")
    _check_globals(data, path)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            metadata = _weights_only_unpickler.load(io.BytesIO(data), encoding="utf-8")
    except Exception as e:  # noqa: BLE001 - the unpickler refuses with many exception types
        raise _metadata_error(path, last_line(e)) from None
    if type(metadata) is not dcp_metadata.Metadata or not isinstance(metadata.storage_data, dict):
        raise _metadata_error(path, f"holds a {type(metadata).__name__}, not DCP's Metadata with storage_data")
    _check_storage(metadata.storage_data, path, folder)
    return metadata


_OPCODES_REFUSED = frozenset({"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})


def _check_globals(data: bytes, path) -> None:
    """Every global the pickle names is one DCP's metadata holds (`SAFE_GLOBALS`, torch's
    dtypes, `torch.Size`, the layout getter), checked by reading its opcodes, before
    anything is unpickled: torch's weights-only defaults (`bytearray`, for one, which a
    40-byte file can ask for 3 GB of) are never called."""
    allowed = {f"{g.__module__} {g.__qualname__}" for g in (*SAFE_GLOBALS, torch.Size,
                                                              torch.serialization._get_layout)}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _OPCODES_REFUSED:
                raise _metadata_error(path, f"opcode {op.name}, which DCP's metadata never holds")
            if op.name == "GLOBAL" and arg not in allowed and not (
                    arg.startswith("torch ") and isinstance(getattr(torch, arg[6:], None), torch.dtype)):
                raise _metadata_error(path, f"global {arg.replace(' ', '.')!r} is not one DCP's metadata holds")
    except InputError:
        raise
    except ValueError as e:  # a malformed pickle
        raise _metadata_error(path, str(e)[:200]) from None


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
        _check_plain_item(value, read_item.dest_index.fqn)
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


MAX_ITEM_PICKLE = 16 << 20
"""Bytes of one non-tensor item's pickle (a few hundred, for an optimizer's hyperparameters)."""


def _check_plain_item(value: io.BytesIO, fqn: str) -> None:
    """A non-tensor item is `torch.save`'s zip of plain values (numbers, strings, lists:
    what an optimizer's hyperparameters are): a pickle naming any global (`bytearray`,
    which would allocate what it is asked) is refused before `torch.load` reads it."""
    try:
        with zipfile.ZipFile(value) as z:
            pickles = [i for i in z.infolist() if i.filename.endswith("data.pkl")]
            if len(pickles) != 1 or pickles[0].file_size > MAX_ITEM_PICKLE:
                raise ValueError("not one torch.save pickle of plain values")
            ops = {op.name for op, _, _ in pickletools.genops(z.read(pickles[0]))}
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        raise pickle.UnpicklingError(f"item {fqn!r}: not a plain value ({str(e)[:120]})") from None
    named = ops & {"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"}
    if named:
        raise pickle.UnpicklingError(f"item {fqn!r}: not a plain value (its pickle calls {sorted(named)[0]})")
    value.seek(0)


# ---- files and errors ------------------------------------------------------------------


def fsync_path(path: str) -> None:
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
    fsync_path(os.path.dirname(path) or ".")


_BOILERPLATE = ("Weights only load failed", "Check the documentation of torch.load", "Please file an issue")
"""torch.load's lines around the reason a weights-only load failed (one of them advises
loading the file unsafely)."""


def last_line(e: BaseException) -> str:
    """The innermost message of a (possibly DCP-wrapped, multi-line) exception, one line."""
    lines = [line.strip() for line in str(e).splitlines()
             if line.strip() and not line.strip().startswith(_BOILERPLATE)]
    return (lines[-1] if lines else type(e).__name__)[:300]
