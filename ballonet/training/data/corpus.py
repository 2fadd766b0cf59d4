"""Corpora: a fixed, ordered list of documents (token id arrays) with stable ids, and the
byte tokenizer (UTF-8 bytes, vocabulary 256, nothing to download).

Sources: JSON Lines (`text`, `input_ids` or `length` per line), a folder of text files,
the Python standard library's own sources (`stdlib`, the zero-download default), a
lengths file read as `plan --lengths` reads it (synthetic tokens drawn with a seed), or a
folder written by `ballonet prepare` (memory-mapped token shards; each read takes only
the tokens asked for).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ballonet import user_files
from ballonet.errors import InputError
from ballonet.paths import read_json_object
from ballonet.workloads import JSONL_SUFFIXES, load_lengths, read_jsonl


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, no special tokens, nothing to download.
    Documents are never concatenated into one sequence, so no separator is needed."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """A lone surrogate (JSON's "\\ud800") is its 3 bytes, as `ballonet prepare` writes it."""
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError("byte token ids must lie in [0, 256)")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ---- corpora -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Corpus:
    name: str
    names: Sequence[str]
    """Where each document came from ("file.jsonl:12", a relative path, ...)."""
    lengths: np.ndarray
    """[D] tokens per document, all >= 1; the document id is the index."""
    vocab_size: int
    read: Callable[[int], np.ndarray]
    """Document id -> its [L] int64 token ids (may read a file)."""
    read_range: Callable[[int, int, int], np.ndarray] | None = None
    """(doc, start, end) -> its tokens [start, end), reading only those (None: slice `read`)."""

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def tokens(self, doc: int) -> np.ndarray:
        ids = self.read(doc)
        if len(ids) != self.lengths[doc]:
            raise InputError(f"{self.names[doc]}: changed while in use ({len(ids)} tokens, was {self.lengths[doc]})")
        return ids

    def tokens_range(self, doc: int, start: int, end: int) -> np.ndarray:
        """[end - start] token ids of document `doc` from `start` to `end`."""
        if not 0 <= start <= end <= self.lengths[doc]:
            raise ValueError(f"{self.names[doc]}: tokens [{start}, {end}) outside its {self.lengths[doc]}")
        if self.read_range is None:
            return self.tokens(doc)[start:end]
        return self.read_range(doc, start, end)


def _corpus(name: str, names: list[str], lengths: list[int], vocab_size: int, read) -> Corpus:
    if not lengths:
        raise InputError(f"{name}: empty corpus (no document has any tokens)")
    return Corpus(name=name, names=tuple(names), lengths=np.asarray(lengths, dtype=np.int64),
                  vocab_size=vocab_size, read=read)


def _jsonl_record(record, where: str, tokenizer: ByteTokenizer) -> tuple[str, np.ndarray | int]:
    """(where, token ids) of a text or input_ids row, (where, length) of a length row."""
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return where, tokenizer.encode(record["text"])
    if isinstance(record, dict) and isinstance(record.get("input_ids"), list):
        ids = record["input_ids"]
        if all(type(i) is int and i >= 0 for i in ids):
            return where, np.asarray(ids, dtype=np.int64)
        raise InputError(f"{where}: input_ids must be a list of non-negative integers")
    if isinstance(record, dict) and "length" in record:
        n = record["length"]
        if type(n) is int and n >= 0:
            return where, n
        raise InputError(f"{where}: length must be a non-negative integer, got {n!r}")
    raise InputError(f'{where}: expected an object with "text" (a string), "input_ids" (a list) or "length"')


def from_jsonl(path: str | os.PathLike, tokenizer: ByteTokenizer = ByteTokenizer(), seed: int = 0) -> Corpus:
    """One document per line: {"text": str} (tokenized), {"input_ids": [int, ...]}, or
    {"length": int} (seeded random tokens, as `from_lengths` makes them). Blank lines and
    empty documents are skipped; names are "path:line"."""
    path = Path(path)
    rows = [(w, d) for w, d in read_jsonl(path, lambda r, w: _jsonl_record(r, w, tokenizer))
            if (d if isinstance(d, int) else len(d))]
    docs = [d for _, d in rows]
    vocab = max([int(d.max()) + 1 for d in docs if not isinstance(d, int)] + [tokenizer.vocab_size])

    def read_range(doc: int, start: int, end: int) -> np.ndarray:
        d = docs[doc]
        return _random_tokens(seed, doc, start, end, tokenizer.vocab_size) if isinstance(d, int) else d[start:end]

    lengths = [d if isinstance(d, int) else len(d) for d in docs]
    corpus = _corpus(str(path), [w for w, _ in rows], lengths, vocab, lambda doc: read_range(doc, 0, lengths[doc]))
    return dataclasses.replace(corpus, read_range=read_range)


SYNTHETIC_BLOCK = 1 << 16
"""Tokens of a synthetic document drawn from one seed: a read draws only the blocks it
covers, so a document of 2e8 tokens costs a step no more than its slice."""


def _random_tokens(seed: int, doc: int, start: int, end: int, vocab_size: int) -> np.ndarray:
    """Tokens [start, end) of synthetic document `doc`: block b from the seed (seed, doc, b)."""
    B = SYNTHETIC_BLOCK
    blocks = [np.random.default_rng([seed, doc, b]).integers(0, vocab_size, B, dtype=np.int64)
              for b in range(start // B, -(-end // B))]
    out = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
    return out[start % B: start % B + end - start]


def _read_bytes(path: Path, root: Path, size: int) -> np.ndarray:
    data = user_files.read_bytes(path, "document", root, what="a corpus document")
    if len(data) != size:
        raise InputError(f"{path}: changed while in use ({len(data)} bytes, was {size})")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def from_text_dir(path: str | os.PathLike, suffix: str = "", exclude=()) -> Corpus:
    """Each file under `path` (recursively, hidden ones skipped) is a document of byte
    tokens, read when needed. Its id is its rank in the sorted relative paths. Every file
    is read through `user_files`: a regular file, inside `path` (a symlink out of it, a
    dangling or looping one, a FIFO, is one line)."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root}: not a folder")
    sized = [(Path(p), user_files.check(p, "document", root, what="a corpus document").st_size)
             for p in user_files.files_under(root, suffix, frozenset(exclude))]
    files = [(p, size) for p, size in sized if size > 0]
    names = [p.relative_to(root).as_posix() for p, _ in files]
    return _corpus(str(root), names, [size for _, size in files], 256,
                   lambda doc: _read_bytes(files[doc][0], root, files[doc][1]))


STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
"""Installed packages, and test suites (which some distributions do not ship)."""


def stdlib() -> Corpus:
    """The demo corpus present on every machine: the Python standard library's .py files
    (about 700 documents, median ~8K tokens, longest ~750K: real and long-tailed)."""
    corpus = from_text_dir(sysconfig.get_paths()["stdlib"], suffix=".py", exclude=STDLIB_EXCLUDE)
    return dataclasses.replace(corpus, name="stdlib")


def from_lengths(lengths, seed: int = 0, vocab_size: int = 256, name: str = "synthetic") -> Corpus:
    """Documents of the given lengths with seeded uniform random tokens (made on demand)."""
    lengths = [int(n) for n in lengths]
    for doc, n in enumerate(lengths):
        if n < 1:
            raise InputError(f"{name}: document {doc} has length {n}; lengths must be positive")

    def read_range(doc: int, start: int, end: int) -> np.ndarray:
        return _random_tokens(seed, doc, start, end, vocab_size)

    corpus = _corpus(name, [f"{name}[{i}]" for i in range(len(lengths))], lengths, vocab_size,
                     lambda doc: read_range(doc, 0, lengths[doc]))
    return dataclasses.replace(corpus, read_range=read_range)


# ---- prepared corpora (written by `ballonet prepare`, training/data/prepare.py) -------------

PREPARED_FORMAT = "ballonet-tokens"
PREPARED_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.npy"
"""int64 [D, 5]: shard, offset, length, source, record of each document."""
TOKENIZER_FILE = "tokenizer.json"


def shard_name(shard: int) -> str:
    return f"tokens-{shard:05d}.bin"


class _PreparedNames(Sequence):
    """Document names ("source:record") made when asked, not held for millions of documents."""

    def __init__(self, sources: list[str], index: np.ndarray, by_row: bool):
        self._sources, self._index, self._by_row = sources, index, by_row

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, doc):
        if isinstance(doc, slice):
            return [self[i] for i in range(*doc.indices(len(self)))]
        source, record = self._sources[self._index[doc, 3]], int(self._index[doc, 4])
        return f"{source}:{record}" if self._by_row else source


def _read_manifest(root: Path) -> dict:
    """The manifest, every field checked before any shard is opened: shard files are plain
    file names inside `root` (no folder, no absolute path, no symlink out), the dtype is
    unsigned, the vocabulary covers the largest id it states."""
    path = root / MANIFEST
    manifest = read_json_object(path, "a prepared corpus manifest", folder=root)
    if manifest.get("format") != PREPARED_FORMAT:
        raise InputError(f"{path}: not a prepared corpus (format is not {PREPARED_FORMAT!r})")
    if manifest.get("version") != PREPARED_VERSION:
        raise InputError(f"{path}: version {manifest.get('version')!r}; this Ballonet reads {PREPARED_VERSION}")

    def bad(field: str, what: str):
        return InputError(f"{path}: field {field!r}: {what}")

    def count(field: str, value, least: int) -> int:
        if type(value) is not int or value < least:
            raise bad(field, f"must be an integer >= {least}, got {value!r}")
        return value

    try:
        dtype = np.dtype(manifest.get("dtype"))
    except TypeError:
        dtype = None
    if not isinstance(manifest.get("dtype"), str) or dtype is None or dtype.kind != "u" or dtype.itemsize > 4:
        raise bad("dtype", f"must be an unsigned integer type (uint8, uint16, uint32), got {manifest.get('dtype')!r}")
    vocab = count("vocab_size", manifest.get("vocab_size"), 1)
    if "max_token_id" in manifest and count("max_token_id", manifest["max_token_id"], 0) >= vocab:
        raise bad("vocab_size", f"{vocab}, but token ids reach {manifest['max_token_id']} (field 'max_token_id')")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards or not all(isinstance(x, dict) for x in shards):
        raise bad("shards", "must be a non-empty list of objects with 'file' and 'num_tokens'")
    real_root = os.path.realpath(root)
    for i, shard in enumerate(shards):
        name = shard.get("file")
        if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
                or os.path.dirname(os.path.realpath(os.path.join(real_root, name))) != real_root):
            raise bad(f"shards[{i}].file", f"must be a file name inside {root} (no folder, no symlink out), "
                                           f"got {name!r}")
        count(f"shards[{i}].num_tokens", shard.get("num_tokens"), 0)
    sources = manifest.get("sources")
    if not isinstance(sources, list) or not sources or not all(isinstance(x, str) for x in sources):
        raise bad("sources", "must be a non-empty list of strings")
    return manifest


_INDEX_COLUMNS = ("shard", "offset", "length", "source", "record")


def _read_index(root: Path, manifest: dict) -> np.ndarray:
    """index.npy, each row checked: its shard exists, its tokens lie inside that shard."""
    path = root / INDEX
    index = user_files.load_npy(path, "index", root, what="a prepared corpus index")
    if not isinstance(index, np.ndarray) or index.ndim != 2 or index.shape[1] != 5 or index.dtype != np.int64:
        raise InputError(f"{path}: not a document index (int64 [documents, 5])")
    shard_tokens = np.array([s["num_tokens"] for s in manifest["shards"]], dtype=np.int64)
    shard_T, offset_T, length_T = index[:, 0], index[:, 1], index[:, 2]
    in_shard = (shard_T >= 0) & (shard_T < len(shard_tokens))
    limits = {0: ~in_shard, 2: length_T < 1, 3: (index[:, 3] < 0) | (index[:, 3] >= len(manifest["sources"])),
              4: index[:, 4] < 0}
    limits[1] = ~limits[0] & ((offset_T < 0) | (offset_T > shard_tokens[np.where(in_shard, shard_T, 0)] - length_T))
    for column in sorted(limits):
        rows = np.flatnonzero(limits[column])
        if len(rows):
            row = int(rows[0])
            raise InputError(f"{path}: row {row} column {column} ({_INDEX_COLUMNS[column]}): {int(index[row, column])} "
                             f"is outside what the manifest allows (shard {int(shard_T[row])}, "
                             f"{int(length_T[row])} tokens at offset {int(offset_T[row])})")
    return index


class _Shard:
    """A token shard, open: `read` takes tokens [start, end) with one `pread`. Not memory-
    mapped: a shard that shrinks while in use (truncated, rewritten) would kill the process
    with SIGBUS at the first page past its new end; a short read here is one line."""

    def __init__(self, path: Path, file, dtype: np.dtype, num_tokens: int):
        self.path, self._file, self.dtype, self.num_tokens = path, file, dtype, num_tokens

    def read(self, start: int, end: int) -> np.ndarray:
        size = self.dtype.itemsize
        try:
            data = os.pread(self._file.fileno(), (end - start) * size, start * size)
        except OSError as e:
            raise InputError(f"{self.path}: cannot read a token shard ({e.strerror})") from None
        if len(data) != (end - start) * size:
            raise InputError(f"{self.path}: changed while in use (tokens [{start}, {end}) are no longer there)")
        return np.frombuffer(data, dtype=self.dtype)

    def largest(self) -> int:
        """The largest token id, read a block at a time."""
        block = 1 << 24
        return max((int(self.read(s, min(s + block, self.num_tokens)).max())
                    for s in range(0, self.num_tokens, block)), default=0)


def _open_shards(root: Path, manifest: dict, index: np.ndarray) -> list[_Shard]:
    dtype = np.dtype(manifest["dtype"])
    shards = []
    for i, shard in enumerate(manifest["shards"]):
        path = root / shard["file"]
        expected = int(index[index[:, 0] == i, 2].sum())
        f = user_files.open_file(path, "data", root, what="a token shard")
        size = os.fstat(f.fileno()).st_size
        if size != expected * dtype.itemsize or shard["num_tokens"] != expected:
            f.close()
            raise InputError(f"{path}: {size} bytes, the index says {expected} tokens of {dtype.name}: corrupt")
        shards.append(_Shard(path, f, dtype, expected))
    if "max_token_id" not in manifest:  # written before prepare recorded it: one pass over the shards
        largest = max((s.largest() for s in shards), default=0)
        if largest >= manifest["vocab_size"]:
            raise InputError(f"{root / MANIFEST}: field 'vocab_size': {manifest['vocab_size']}, but token ids "
                             f"reach {largest}")
    return shards


def from_prepared(path: str | os.PathLike) -> Corpus:
    """A folder written by `ballonet prepare`: lengths from its index, tokens read from the
    memory-mapped shards only when asked, and only the range asked for. Every field of the
    manifest and every index row is checked before a shard is opened; a token id at or
    above `vocab_size` (which a manifest could understate) is refused when it is read."""
    root = Path(path)
    manifest = _read_manifest(root)
    index = _read_index(root, manifest)
    shards = _open_shards(root, manifest, index)
    shard_T, offset_T = index[:, 0], index[:, 1]
    vocab_size = manifest["vocab_size"]

    def read_range(doc: int, start: int, end: int) -> np.ndarray:
        begin = int(offset_T[doc]) + start
        ids = shards[shard_T[doc]].read(begin, begin + end - start).astype(np.int64)
        if len(ids) and int(ids.max()) >= vocab_size:
            raise InputError(f"{root / manifest['shards'][shard_T[doc]]['file']}: token id {int(ids.max())} of "
                             f"document {names[doc]} is not below the manifest's vocab_size {vocab_size}")
        return ids

    lengths = index[:, 2].copy()
    names = _PreparedNames(manifest["sources"], index, by_row=len(manifest["sources"]) == 1)
    return Corpus(name=str(root), names=names, lengths=lengths, vocab_size=vocab_size,
                  read=lambda doc: read_range(doc, 0, int(lengths[doc])), read_range=read_range)


CORPUS_KINDS = ("'stdlib', a folder written by `ballonet prepare`, a folder of text files (one document each), a JSON Lines file (.jsonl: text, "
                "input_ids or length per line), or any other file as a lengths file (a .json list, a .npy array, "
                "or text with one length per line; synthetic tokens)")
"""What `load_corpus` takes (the help of `train --corpus`)."""


def load_corpus(spec: str, seed: int = 0) -> Corpus:
    """"stdlib", a folder from `ballonet prepare`, a folder of text files, a JSON Lines file
    (.jsonl, .ndjson), or any other file as a lengths file, read as `workloads.load_lengths`
    reads it (tokens drawn with `seed`)."""
    if spec == "stdlib":
        return stdlib()
    path = Path(spec)
    if os.path.lexists(path / MANIFEST):
        return from_prepared(path)
    if path.is_dir():
        prepared = sorted(n for n in os.listdir(path) if n == INDEX or (n.startswith("tokens-") and n.endswith(".bin")))
        if prepared:
            raise InputError(f"{path}: holds {prepared[0]} but no {MANIFEST}: a prepared corpus without its manifest "
                             "(prepare it again), not a folder of text files")
        return from_text_dir(path)
    if not path.is_file():
        raise InputError(f"corpus {spec!r}: no such file or folder (use {CORPUS_KINDS})")
    if path.suffix.lower() in JSONL_SUFFIXES:
        return from_jsonl(path, seed=seed)
    return from_lengths(load_lengths(path), seed=seed, name=str(path))


