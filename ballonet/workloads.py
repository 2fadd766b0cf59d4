"""Document-length workloads: length files, fitted presets, seeded global batches.

A `Workload` is a distribution of document lengths in tokens, kept as a table of knots:

- a quantile table (`cdf` given): knot i is the length at cumulative probability
  `cdf[i]`; draws use the inverse CDF, interpolating log(length) linearly between
  knots, so heavy tails stay heavy. The presets are such tables, fitted by
  `scripts/fit_workloads.py` from the real lists in `data/workloads/`.
- an empirical sample (`cdf` is None): the knots are the lengths of a file, and each
  draw picks one of them uniformly.

Either way every document costs one uniform double from the numpy Generator, so a batch
for a larger token budget starts with the same documents as one for a smaller budget.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ballonet import user_files
from ballonet.errors import InputError
from ballonet.paths import looks_like_path

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESET_NAMES = ("wlbllm", "prolong", "shortmix")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
LENGTHS_FILE_KINDS = ("a .json list of lengths, a .npy array, a .jsonl file (one object per line with length, "
                      "input_ids or text), or text with one length per line")
"""What `load_lengths` reads (and so `plan --lengths`, `--workload` and `train --corpus`)."""
_FIRST_CHUNK = 256
MAX_DOCUMENTS = 1 << 20
"""The most documents one batch may hold (a sampled batch or a `--lengths` file): a batch
is drawn and planned in memory, and planning it takes time in proportion."""
"""Documents drawn at once when filling a batch; the chunk doubles until the budget is met."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    lengths: tuple[int, ...]
    """Knots in tokens, ascending: a quantile table's values, or an empirical sample."""
    cdf: tuple[float, ...] | None = None
    """Cumulative probability at each knot, from 0.0 to 1.0, increasing; None for a sample."""
    source: str = ""
    """Where the lengths come from (a file, a dataset, or the parameters of a synthetic mix)."""

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(self.lengths))
        if not self.lengths:
            raise InputError(f"workload {self.name!r} has no lengths")
        bad = [x for x in self.lengths if not _is_positive_int(x)]
        if bad:
            raise InputError(f"workload {self.name!r}: length must be a positive integer, got {bad[0]!r}")
        if list(self.lengths) != sorted(self.lengths):
            raise InputError(f"workload {self.name!r}: lengths must be in ascending order")
        if self.cdf is not None:
            object.__setattr__(self, "cdf", tuple(float(p) for p in self.cdf))
            p = np.asarray(self.cdf)
            if len(p) != len(self.lengths) or len(p) < 2:
                raise InputError(f"workload {self.name!r}: cdf needs one value per length (at least 2)")
            if p[0] != 0.0 or p[-1] != 1.0 or np.any(np.diff(p) <= 0):
                raise InputError(f"workload {self.name!r}: cdf must rise strictly from 0.0 to 1.0")

    @cached_property
    def _knots(self) -> np.ndarray:
        knots = np.asarray(self.lengths, dtype=np.float64)
        return knots if self.cdf is None else np.log(knots)

    def sample_lengths(self, num_docs: int, rng: np.random.Generator) -> np.ndarray:
        """`num_docs` document lengths (int64), one uniform draw of `rng` each."""
        if not _is_int(num_docs) or num_docs < 0:
            raise InputError(f"num_docs must be a non-negative integer, got {num_docs!r}")
        u = rng.random(num_docs)
        if self.cdf is None:
            return np.asarray(self.lengths, dtype=np.int64)[(u * len(self.lengths)).astype(np.int64)]
        lengths = np.rint(np.exp(np.interp(u, self.cdf, self._knots))).astype(np.int64)
        return np.maximum(lengths, 1)

    def sample_batch(self, num_tokens: int, seed: int | tuple[int, ...], max_length: int | None = None) -> list[int]:
        """One global batch of exactly `num_tokens` tokens: documents drawn in order until
        the budget is met, each cut to `max_length` (the context window; None: no cut), the
        last one trimmed to fit. Deterministic for a given `seed` (an int or a tuple of ints,
        as numpy's `default_rng` takes them)."""
        if not _is_positive_int(num_tokens):
            raise InputError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if max_length is not None and not _is_positive_int(max_length):
            raise InputError(f"max_length must be a positive integer or None, got {max_length!r}")
        rng = np.random.default_rng(_check_seed(seed))
        chunks, total, num_docs, drawn = [], 0, _FIRST_CHUNK, 0
        while total < num_tokens:
            if drawn > MAX_DOCUMENTS:
                raise too_many_documents(f"a batch of {num_tokens} tokens of workload {self.name!r}")
            chunk = self.sample_lengths(num_docs, rng)
            drawn += num_docs
            if max_length is not None:
                np.minimum(chunk, max_length, out=chunk)
            chunks.append(chunk)
            total += int(chunk.sum())
            num_docs *= 2
        lengths = np.concatenate(chunks)
        ends = np.cumsum(lengths)
        last = int(np.searchsorted(ends, num_tokens))  # first document reaching the budget
        if last + 1 > MAX_DOCUMENTS:
            raise too_many_documents(f"a batch of {num_tokens} tokens of workload {self.name!r}")
        lengths = lengths[: last + 1]
        lengths[-1] -= ends[last] - num_tokens
        return lengths.tolist()

    def batches(self, num_tokens: int, seed: int, num_steps: int,
                max_length: int | None = None) -> Iterator[list[int]]:
        """`num_steps` batches; step i is `sample_batch(num_tokens, (seed, i), max_length)`."""
        if not _is_int(num_steps) or num_steps < 0:
            raise InputError(f"num_steps must be a non-negative integer, got {num_steps!r}")
        _check_seed(seed)
        for step in range(num_steps):
            yield self.sample_batch(num_tokens, (seed, step), max_length)


def too_many_documents(what: str) -> InputError:
    return InputError(f"{what} holds more than {MAX_DOCUMENTS} documents, the most one batch may hold "
                      "(fewer tokens or GPUs)")


# ---- length files ----------------------------------------------------------------------


def load_lengths(path: str) -> list[int]:
    """Document lengths from a file, by extension: `.json` (a list of integers), `.jsonl`
    or `.ndjson` (one object per line with `length`, `input_ids` or `text`; text counts
    UTF-8 bytes, as the byte-level tokenizer does), `.npy` (a 1-D array), anything else:
    text, one length per line. Blank lines are skipped. Read through `user_files` (a
    regular file, at most LIMITS["lengths"] bytes)."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise InputError(f"{path}: no such lengths file")
    if os.path.isdir(path):
        raise InputError(f"{path}: not a file (a folder)")
    suffix = os.path.splitext(path)[1].lower()
    readers = {".json": _read_json, ".npy": _read_npy, **{s: _read_jsonl for s in JSONL_SUFFIXES}}
    lengths = readers.get(suffix, _read_text)(path)
    if not lengths:
        raise InputError(f"{path}: no lengths in file")
    if len(lengths) > MAX_FILE_DOCUMENTS:
        raise InputError(f"{path}: {len(lengths)} lengths, more than the {MAX_FILE_DOCUMENTS} a lengths file may hold")
    return lengths


MAX_FILE_DOCUMENTS = 100_000_000
"""Lengths in one lengths file (a sample to draw batches from; 800 MB as int64)."""


def _read_text(path: str) -> list[int]:
    lengths = []
    text = user_files.read_text(path, "lengths", what="a lengths file")
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        value: int | str
        try:
            value = int(line) if len(line) <= user_files.MAX_INT_DIGITS else line
        except ValueError:
            value = line
        lengths.append(_length(value, f"{path}:{line_no}", shown=line[:40]))
    return lengths


def _read_json(path: str) -> list[int]:
    data = user_files.read_json(path, "lengths", what="a lengths file", line_numbers=True)
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of lengths, got a {type(data).__name__}")
    return [_length(value, f"{path}[{i}]") for i, value in enumerate(data)]


MAX_LINE = 256 << 20
"""Bytes of one JSON Lines line (one document)."""


def read_jsonl(path, row_value: Callable[[object, str], object], folder=None) -> list:
    """`row_value(row, where)` of each non-blank line of a JSON Lines file, `where` being
    "path:line". The one JSONL reader: lengths files here, corpora in `training.data.corpus`.
    Read through `user_files` (a regular file; each line bounded as `loads_json` bounds
    JSON, at most MAX_LINE bytes). Malformed lines and non-UTF-8 bytes are one-line
    InputErrors naming the line."""
    values = []
    with user_files.open_file(path, "data", folder, what="a JSON Lines file") as f:
        for line_no, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
            where = f"{path}:{line_no}"
            if len(line) > MAX_LINE:
                raise InputError(f"{where}: a line over {MAX_LINE} bytes")
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{path}: not JSON Lines (not UTF-8 text)") from None
            values.append(row_value(user_files.loads_json(text, where, "JSON Lines"), where))
    return values


def _read_jsonl(path: str) -> list[int]:
    return read_jsonl(path, lambda row, where: _length(_jsonl_length(row, where), where))


def _jsonl_length(row, where: str):
    if isinstance(row, dict):
        if "length" in row:
            return row["length"]
        if isinstance(row.get("input_ids"), list):
            return len(row["input_ids"])
        if isinstance(row.get("text"), str):
            return len(row["text"].encode("utf-8", "surrogatepass"))  # a lone surrogate as prepare writes it
    raise InputError(f"{where}: expected an object with a 'length', 'input_ids' (list) or 'text' (string) field")


def _read_npy(path: str) -> list[int]:
    array = user_files.load_npy(path, "lengths", what="a numeric .npy array")
    if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "iuf":
        raise InputError(f"{path}: expected a 1-D integer array, got shape {getattr(array, 'shape', '?')} "
                         f"dtype {getattr(array, 'dtype', '?')}")
    bad = np.flatnonzero(~(np.isfinite(array) & (array >= 1) & (np.floor(array) == array)))
    if bad.size:
        _length(array[bad[0]].item(), f"{path}[{bad[0]}]")
    too_big = np.flatnonzero(array > np.iinfo(np.int64).max if array.dtype.kind == "u" else
                             array >= 2.0**63 if array.dtype.kind == "f" else np.zeros(len(array), bool))
    if too_big.size:
        raise InputError(f"{path}[{too_big[0]}]: length {array[too_big[0]].item()} is above 2^63 - 1")
    return array.astype(np.int64).tolist()


def _length(value, where: str, shown: str | None = None) -> int:
    """`value` as a positive int (an integral float such as 4096.0 counts), else one line
    naming `where`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_positive_int(value):
        raise InputError(f"{where}: length must be a positive integer, got {value if shown is None else shown!r}")
    return int(value)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_positive_int(x) -> bool:
    return _is_int(x) and x >= 1


def _check_seed(seed):
    parts = seed if isinstance(seed, tuple) else (seed,)
    if not parts or not all(_is_int(s) and s >= 0 for s in parts):
        raise InputError(f"seed must be a non-negative integer (or a tuple of them), got {seed!r}")
    return [int(s) for s in parts]


# ---- presets -----------------------------------------------------------------------------


def _load_preset(name: str) -> Workload:
    data = json.loads((PRESET_DIR / f"{name}.json").read_text())
    return Workload(name=name, lengths=data["lengths"], cdf=data["cdf"], source=data["source"])


PRESETS: dict[str, Workload] = {name: _load_preset(name) for name in PRESET_NAMES}
"""wlbllm, prolong: quantile tables of the real lists in data/workloads/; shortmix:
a synthetic short-heavy mix (ArXiv/GitHub-like), see `presets/shortmix.json`."""


def from_file(path: str) -> Workload:
    """The empirical distribution of a lengths file (any format of `load_lengths`)."""
    return Workload(name=os.path.basename(path), lengths=tuple(sorted(load_lengths(path))), source=os.fspath(path))


def get(name_or_path: str) -> Workload:
    """A preset by name, or the empirical distribution of a lengths file by path (a preset
    wins over a local file of the same name unless the argument looks like a path)."""
    name_or_path = os.fspath(name_or_path)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path) or looks_like_path(name_or_path):
        return from_file(name_or_path)
    raise InputError(f"unknown workload {name_or_path!r}; presets: {', '.join(PRESETS)} (or a lengths file)")


def sample_batch(name_or_path: str, num_tokens: int, seed: int, max_length: int | None = None) -> list[int]:
    """`get(name_or_path).sample_batch(num_tokens, seed, max_length)`."""
    return get(name_or_path).sample_batch(num_tokens, seed, max_length)
