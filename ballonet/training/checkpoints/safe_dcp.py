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

import contextlib
import io
import itertools
import math
import os
import pathlib
import pickle
import pickletools
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo

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
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
"""The dtypes a checkpoint's tensor may have (weights and AdamW's states; never a quantised,
complex or bool tensor)."""
GLOBALS = frozenset({f"{c.__module__} {c.__qualname__}" for c in SAFE_GLOBALS}
                    | {"torch Size", "torch.serialization _get_layout", "collections OrderedDict"}
                    | {f"torch {str(d).removeprefix('torch.')}" for d in DTYPES})
"""Every global a `.metadata` Ballonet writes names ("module name", pickle's GLOBAL opcode),
checked on the opcodes before anything is unpickled: no other callable (`bytearray(3e9)`,
which torch's weights-only unpickler allows, included) is ever called."""
_REFUSED_OPS = frozenset({"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})
"""Opcodes that name a callable other than by GLOBAL (protocol 2 writes none of them)."""
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 40


def _metadata_error(path, reason: str) -> InputError:
    return InputError(f"{path}: not a checkpoint's metadata that is safe to load ({reason})")


def read_safe_metadata(path, folder) -> dcp_metadata.Metadata:
    """DCP's `Metadata` from the file `path` through torch's weights-only unpickler, its
    storage items checked to lie inside plain files of `folder`. InputError otherwise."""
    from torch import _weights_only_unpickler

    data = user_files.read_bytes(path, "metadata", folder, what="a checkpoint's metadata")
    if data[:2] != bytes([pickle.PROTO[0], METADATA_PROTOCOL]):
        raise _metadata_error(path, f"not pickle protocol {METADATA_PROTOCOL}, the only one Ballonet writes and reads")
    _check_opcodes(data, path)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            metadata = _weights_only_unpickler.load(io.BytesIO(data), encoding="utf-8")
    except Exception as e:  # noqa: BLE001 - the unpickler refuses with many exception types
        raise _metadata_error(path, last_line(e)) from None
    if type(metadata) is not dcp_metadata.Metadata or not isinstance(metadata.storage_data, dict):
        raise _metadata_error(path, f"holds a {type(metadata).__name__}, not DCP's Metadata with storage_data")
    _check_storage(metadata.storage_data, path, folder)
    return metadata


def _check_opcodes(data: bytes, path) -> None:
    """Walk the pickle's opcodes without running any: every global one of `GLOBALS`."""
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _REFUSED_OPS or (op.name == "GLOBAL" and arg not in GLOBALS):
                raise _metadata_error(path, f"calls {arg or op.name!r}, which no checkpoint's metadata holds")
    except InputError:  # a ValueError too: the refusal above, said once
        raise
    except (ValueError, EOFError) as e:  # genops on a torn or malformed pickle
        raise _metadata_error(path, f"malformed pickle ({e})") from None


def check_tensors(metadata: dcp_metadata.Metadata, expected: dict[str, tuple[torch.Size, torch.dtype]], path,
                  scope: tuple[str, ...]) -> None:
    """Before anything is allocated: every tensor item of `metadata` is well formed (a
    dtype of `DTYPES`, integer sizes, chunks inside it covering each element exactly once,
    each chunk's bytes stored), and the items under the prefixes `scope` are exactly
    `expected` ({flattened name: (size, dtype)}, the state the run builds), sizes and
    dtypes equal. InputError naming `path` and the item otherwise."""
    items = metadata.state_dict_metadata
    if not isinstance(items, dict):
        raise _metadata_error(path, "no table of items")
    for fqn, item in items.items():
        if not isinstance(fqn, str):
            raise _metadata_error(path, f"an item named {fqn!r}")
        if type(item) is dcp_metadata.TensorStorageMetadata:
            _check_tensor(fqn, item, metadata.storage_data, path)
        elif type(item) is dcp_metadata.BytesStorageMetadata:
            if dcp_metadata.MetadataIndex(fqn) not in metadata.storage_data:
                raise _metadata_error(path, f"item {fqn!r} has no stored bytes")
        else:
            raise _metadata_error(path, f"item {fqn!r} of type {type(item).__name__}")
    for fqn, (size, dtype) in expected.items():
        item = items.get(fqn)
        if type(item) is not dcp_metadata.TensorStorageMetadata:
            raise InputError(f"{path}: the checkpoint has no tensor {fqn!r}, which this model has (a checkpoint of "
                             "another model?)")
        if tuple(item.size) != tuple(size) or item.properties.dtype != dtype:
            raise InputError(f"{path}: tensor {fqn!r} is {item.properties.dtype} {list(item.size)} in the checkpoint, "
                             f"{dtype} {list(size)} in this model (a checkpoint of another model?)")
    for fqn, item in items.items():
        if fqn.startswith(scope) and fqn not in expected and type(item) is dcp_metadata.TensorStorageMetadata:
            raise InputError(f"{path}: the checkpoint holds tensor {fqn!r}, which this model has not (a checkpoint "
                             "of another model?)")


def expected_tensors(state_dict: dict) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{flattened name, as DCP's metadata names it: (global size, dtype)} of every tensor
    (DTensors included) of a state dict."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    return {fqn: (t.shape, t.dtype) for fqn, t in flat.items() if isinstance(t, torch.Tensor)}


def _ints(value, ndim: int) -> bool:
    return isinstance(value, tuple) and len(value) == ndim and all(type(v) is int for v in value)


def _check_tensor(fqn: str, item, storage: dict, path) -> None:
    properties, size, chunks = item.properties, item.size, item.chunks
    dtype = getattr(properties, "dtype", None)
    if type(properties) is not dcp_metadata.TensorProperties or dtype not in DTYPES:
        raise _metadata_error(path, f"tensor {fqn!r} has dtype {dtype!r}, not one of "
                                    f"{', '.join(str(d) for d in DTYPES)}")
    if not isinstance(size, tuple) or len(size) > MAX_DIMS or not _ints(size, len(size)) or min(size, default=0) < 0 \
            or math.prod(size) > MAX_ELEMENTS:
        raise _metadata_error(path, f"tensor {fqn!r} has size {size!r}")
    if not isinstance(chunks, list) or not chunks:
        raise _metadata_error(path, f"tensor {fqn!r} has no chunks (its values are stored nowhere)")
    corners: set[tuple[int, ...]] = set()
    total = 0
    for chunk in chunks:
        if (type(chunk) is not dcp_metadata.ChunkStorageMetadata or not _ints(chunk.offsets, len(size))
                or not _ints(chunk.sizes, len(size))
                or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size))):
            raise _metadata_error(path, f"tensor {fqn!r} has a chunk outside its size {list(size)}")
        volume = math.prod(chunk.sizes)
        if volume:
            stored = storage.get(dcp_metadata.MetadataIndex(fqn, torch.Size(chunk.offsets)))
            if stored is None or stored.length < volume * dtype.itemsize:
                raise _metadata_error(path, f"tensor {fqn!r}: a chunk at {list(chunk.offsets)} has "
                                            f"{'no' if stored is None else 'too few'} stored bytes")
            corners ^= _corners(chunk.offsets, chunk.sizes)
        total += volume
    if total < math.prod(size):
        raise _metadata_error(path, f"tensor {fqn!r}: its chunks hold {total} of its {math.prod(size)} elements")
    if total > math.prod(size) or corners != _corners((0,) * len(size), tuple(size)):
        raise _metadata_error(path, f"tensor {fqn!r} has overlapping chunks")


def _corners(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The corners of a box, counted mod 2 (an empty box's cancel out). Boxes inside a
    tensor whose volumes add up to the tensor's tile it exactly if and only if the corners
    an odd number of boxes have are the tensor's own: the parity of how many boxes cover
    each element follows from the corners' (its d-dimensional difference is theirs), so an
    element covered twice leaves a corner behind. Linear in the chunks, where comparing
    every pair of them took 30 s for 8000 chunks."""
    out: set[tuple[int, ...]] = set()
    for corner in itertools.product(*((o, o + n) for o, n in zip(offsets, sizes))):
        out ^= {corner}
    return out


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
        if info.transform_descriptors:  # DCP would decompress it (zstd) into memory, unbounded
            raise _metadata_error(path, f"item {index.fqn!r} is stored through transforms "
                                        f"{str(info.transform_descriptors)[:80]}, which Ballonet never writes")


class _FolderFiles(FileSystem):
    """DCP's file system, its files opened through `user_files` (a regular file inside the
    checkpoint folder, opened non-blocking): a data file swapped for a FIFO after the
    metadata was checked would have blocked DCP's plain `open` for ever."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise ValueError(f"{path}: a checkpoint is only read here")
        with user_files.open_file(path, "data", self.folder, what="a checkpoint's data file") as f:
            yield f


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader reading `.metadata` weights-only (`read_safe_metadata`), its
    files through `user_files` (`_FolderFiles`). Its `read_metadata` takes no rank: DCP then
    never falls back to per-rank metadata files (which Ballonet does not write) after
    logging the first failure with a traceback."""

    def __init__(self, path):
        super().__init__(path)
        self.fs = _FolderFiles(self.path)

    def read_metadata(self):
        metadata = read_safe_metadata(self._get_metadata_path(), self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        """Each item DCP reads, checked first (`check_stored_item`)."""
        where = f"{os.path.join(self.path, sinfo.relative_path)} (bytes {sinfo.offset}+{sinfo.length})"
        check_stored_item(_Slice(file, sinfo.offset, sinfo.length), where)
        return super()._slice_file(file, sinfo)


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
ITEM_GLOBALS = frozenset({"torch._utils _rebuild_tensor_v2", "collections OrderedDict"}
                         | {f"torch {name}" for name in ("FloatStorage", "BFloat16Storage", "HalfStorage",
                                                          "DoubleStorage", "LongStorage", "IntStorage")})
"""Every global the pickle of a stored item names: `torch.save` of a tensor of `DTYPES`
(its rebuild function, its storage's class, its hooks' OrderedDict), or none (a plain value)."""
_ITEM_REFUSED_OPS = _REFUSED_OPS - {"BINPERSID"}
"""A stored tensor names its storage by BINPERSID, which torch's loader resolves itself."""


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of a seekable binary file, as a file of their own."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self._file, self._start, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(base + offset, 0), self._length)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer)[:max(self._length - self._pos, 0)]
        self._file.seek(self._start + self._pos)
        n = self._file.readinto(view) or 0
        self._pos += n
        return n


def check_stored_item(item, where: str) -> None:
    """Before `torch.load` reads a stored item (a tensor, or a plain value): it is
    `torch.save`'s zip, its entries stored uncompressed (so no entry holds more than the
    item's own bytes: no decompression bomb), one pickle whose globals are `ITEM_GLOBALS`
    (a tensor's rebuild, never `bytearray(2**31)`, which torch's weights-only unpickler
    allows and which allocated 2.3 GB from a 70 KB item). InputError naming `where`."""
    try:
        with zipfile.ZipFile(item) as z:
            infos = z.infolist()
            pickles = [i for i in infos if i.filename.endswith("data.pkl")]
            if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
                raise ValueError("a compressed entry, which torch.save never writes")
            if len(pickles) != 1 or pickles[0].file_size > MAX_ITEM_PICKLE:
                raise ValueError("not one torch.save pickle")
            for op, arg, _ in pickletools.genops(z.read(pickles[0])):
                if op.name in _ITEM_REFUSED_OPS or (op.name == "GLOBAL" and arg not in ITEM_GLOBALS):
                    raise ValueError(f"its pickle calls {arg or op.name!r}, which no stored tensor holds")
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as e:
        raise InputError(f"{where}: not an item a checkpoint stores ({str(e)[:160]})") from None


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
    line = lines[-1] if lines else type(e).__name__
    return line.removeprefix(f"{InputError.__module__}.{InputError.__name__}: ")[:300]  # ours, as DCP relays it
