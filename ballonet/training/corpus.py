"""Corpora: a fixed, ordered list of documents (token id arrays) with stable ids, and the
byte tokenizer (UTF-8 bytes, vocabulary 256, nothing to download).

Sources: JSON Lines (`text`, `input_ids` or `length` per line), a folder of text files,
the Python standard library's own sources (`stdlib`, the zero-download default), or a
lengths file read as `plan --lengths` reads it (synthetic tokens drawn with a seed).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path
from typing import Callable

import numpy as np

from ballonet.errors import InputError
from ballonet.workloads import JSONL_SUFFIXES, load_lengths, read_jsonl


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids: vocabulary 256, no special tokens, nothing to download.
    Documents are never concatenated into one sequence, so no separator is needed."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError("byte token ids must lie in [0, 256)")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ---- corpora -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Corpus:
    name: str
    names: tuple[str, ...]
    """Where each document came from ("file.jsonl:12", a relative path, ...)."""
    lengths: np.ndarray
    """[D] tokens per document, all >= 1; the document id is the index."""
    vocab_size: int
    read: Callable[[int], np.ndarray]
    """Document id -> its [L] int64 token ids (may read a file)."""

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

    def read(doc: int) -> np.ndarray:
        d = docs[doc]
        return _random_tokens(seed, doc, d, tokenizer.vocab_size) if isinstance(d, int) else d

    return _corpus(str(path), [w for w, _ in rows], [d if isinstance(d, int) else len(d) for d in docs], vocab, read)


def _random_tokens(seed: int, doc: int, length: int, vocab_size: int) -> np.ndarray:
    return np.random.default_rng([seed, doc]).integers(0, vocab_size, length, dtype=np.int64)


def _walk(root: Path, suffix: str, exclude: frozenset[str]) -> list[Path]:
    """Files under `root` ending in `suffix`, skipping folders named in `exclude`, sorted
    by relative path (so document ids do not depend on the file system's order)."""
    found = []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in exclude and not d.startswith(".")]
        found += [Path(folder, f) for f in files if f.endswith(suffix) and not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_bytes(path: Path) -> np.ndarray:
    try:
        return np.fromfile(path, dtype=np.uint8).astype(np.int64)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None


def from_text_dir(path: str | os.PathLike, suffix: str = "", exclude=()) -> Corpus:
    """Each file under `path` (recursively, hidden ones skipped) is a document of byte
    tokens, read when needed. Its id is its rank in the sorted relative paths."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root}: not a folder")
    sized = [(p, p.stat().st_size) for p in _walk(root, suffix, frozenset(exclude))]
    files = [p for p, size in sized if size > 0]
    names = [p.relative_to(root).as_posix() for p in files]
    lengths = [size for _, size in sized if size > 0]
    return _corpus(str(root), names, lengths, 256, lambda doc: _read_bytes(files[doc]))


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

    def read(doc: int) -> np.ndarray:
        return _random_tokens(seed, doc, lengths[doc], vocab_size)

    return _corpus(name, [f"{name}[{i}]" for i in range(len(lengths))], lengths, vocab_size, read)


CORPUS_KINDS = ("'stdlib', a folder of text files (one document each), a JSON Lines file (.jsonl: text, "
                "input_ids or length per line), or any other file as a lengths file (a .json list, a .npy array, "
                "or text with one length per line; synthetic tokens)")
"""What `load_corpus` takes (the help of `train --corpus`)."""


def load_corpus(spec: str, seed: int = 0) -> Corpus:
    """"stdlib", a folder of text files, a JSON Lines file (.jsonl, .ndjson), or any other
    file as a lengths file, read as `workloads.load_lengths` reads it (tokens drawn with `seed`)."""
    if spec == "stdlib":
        return stdlib()
    path = Path(spec)
    if path.is_dir():
        return from_text_dir(path)
    if not path.is_file():
        raise InputError(f"corpus {spec!r}: no such file or folder (use {CORPUS_KINDS})")
    if path.suffix.lower() in JSONL_SUFFIXES:
        return from_jsonl(path, seed=seed)
    return from_lengths(load_lengths(path), seed=seed, name=str(path))


