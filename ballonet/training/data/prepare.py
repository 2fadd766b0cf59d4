"""`ballonet prepare`: a corpus tokenized once, written as memory-mapped token shards.

Input: a JSON Lines file (one document per line, its text under `text_column`), a
Parquet file (one document per row of `text_column`), or a folder of text files (one
document per file, sorted by relative path). Tokenizer: "byte" (UTF-8 bytes, nothing to
install) or a Hugging Face tokenizer (a `tokenizer.json`, or a folder holding one), run
by the `tokenizers` library in batches.

Output, a folder (format in `corpus.PREPARED_FORMAT`, read by `corpus.from_prepared`):

    manifest.json        format, version, dtype, vocabulary, largest token id, tokenizer,
                         shards, sources
    index.npy            int64 [D, 5]: shard, offset, length, source, record per document
    tokens-00000.bin     raw token ids (dtype of the manifest), documents back to back
    tokenizer.json       a copy of the tokenizer (absent for "byte")

It is written in a temporary folder beside `out` and renamed into place at the end, so
`out` is either complete or absent. Empty documents are skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ballonet import user_files
from ballonet.errors import InputError
from ballonet.paths import check_free_space
from ballonet.training.data.corpus import (
    INDEX,
    MANIFEST,
    PREPARED_FORMAT,
    PREPARED_VERSION,
    TOKENIZER_FILE,
    ByteTokenizer,
    shard_name,
)

Progress = Callable[[int], None]
"""Called with the input bytes just consumed."""


@dataclasses.dataclass(kw_only=True)
class PrepareConfig:
    data: str
    """A .jsonl file, a .parquet file, or a folder of text files."""
    out: str
    """The folder to create; it must not exist."""
    tokenizer: str = "byte"
    """"byte", a tokenizer.json, or a folder holding one."""
    text_column: str = "text"
    """The JSON key or Parquet column holding each document's text."""
    batch_size: int = 1024
    """Documents tokenized per call of the tokenizer."""
    shard_tokens: int = 1 << 28
    """Tokens per shard file at most (a longer document gets a shard of its own)."""
    add_special_tokens: bool = True
    """Let the tokenizer's post-processor add its special tokens (a BOS, for most)."""

    def __post_init__(self):
        if self.batch_size < 1 or self.shard_tokens < 1:
            raise InputError("batch size and shard tokens must be positive")
        if not self.text_column:
            raise InputError("--text-column must not be empty")


# ---- tokenizers ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Encoder:
    name: str
    vocab_size: int
    encode: Callable[[list[str]], tuple[np.ndarray, np.ndarray]]
    """texts -> (flat token ids, [len(texts)] lengths)."""
    file: Path | None = None
    """The tokenizer.json it came from."""
    text: str | None = None
    """That file's text, as read (copied into the prepared folder)."""

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.vocab_size <= 1 << 8 else np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


def _encode_bytes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    blobs = [t.encode("utf-8", errors="surrogatepass") for t in texts]
    return np.frombuffer(b"".join(blobs), dtype=np.uint8), np.fromiter(map(len, blobs), np.int64, len(blobs))


def hf_encode_fn(tokenizer, add_special_tokens: bool, dtype, vocab_size: int,
                 where: str) -> Callable[[list[str]], tuple[np.ndarray, np.ndarray]]:
    """The `tokenizers` library's batch encoding (offsets skipped), flattened to numpy; an
    id at or above `vocab_size` (a special token its post-processor adds, say, that its
    vocabulary lacks) is an InputError naming the tokenizer file `where`."""
    def encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int64, int(lengths.sum()))
        if ids.size and int(ids.max()) >= vocab_size:
            raise InputError(f"{where}: the tokenizer gives token id {int(ids.max())}, beyond its vocabulary of "
                             f"{vocab_size}")
        return ids.astype(dtype), lengths

    return encode


def load_tokenizer(spec: str, add_special_tokens: bool = True) -> Encoder:
    """"byte", a tokenizer.json file, or a folder with one. InputError names the path."""
    if spec == "byte":
        return Encoder("byte", ByteTokenizer().vocab_size, _encode_bytes)
    path, folder = Path(spec), None
    if path.is_dir():
        if not os.path.lexists(path / TOKENIZER_FILE):
            raise InputError(f"{path}: no {TOKENIZER_FILE} in this folder (a Hugging Face tokenizer folder has one)")
        path, folder = path / TOKENIZER_FILE, path
    elif not os.path.lexists(path):
        raise InputError(f"tokenizer {spec!r}: no such file or folder (use 'byte', a tokenizer.json or its folder)")
    text = user_files.read_text(path, "tokenizer", folder, what="a Hugging Face tokenizer file")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InputError("a Hugging Face tokenizer needs the tokenizers library: pip install 'ballonet[data]'") from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the library raises plain Exception on bad files
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise InputError(f"{path}: not a Hugging Face tokenizer file ({reason})") from None
    # The ids its vocabulary holds need not be 0..n-1: the largest bounds the embedding.
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    vocab = max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    encoder = Encoder(str(path), vocab, None, path, text)  # type: ignore[arg-type]
    return dataclasses.replace(encoder, encode=hf_encode_fn(tokenizer, add_special_tokens, encoder.dtype, vocab,
                                                            str(path)))


# ---- sources -------------------------------------------------------------------------


Batch = tuple[list[int], list[int], list[str]]
"""(source index, record number, text) of each document, as three lists."""


def _jsonl_batches(path: Path, source: int, column: str, size: int, progress: Progress) -> Iterator[Batch]:
    records, texts = [], []
    with user_files.open_file(path, "data", what="a JSON Lines file") as f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), start=1):
            progress(len(line))
            if len(line) > MAX_LINE:
                raise InputError(f"{path}:{lineno}: a line over {MAX_LINE} bytes")
            if not line.strip():
                continue
            try:
                record = user_files.loads_json(line.decode("utf-8"), f"{path}:{lineno}", "JSON Lines")
            except UnicodeDecodeError:
                raise InputError(f"{path}:{lineno}: not JSON Lines (not UTF-8 text)") from None
            text = record.get(column) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise InputError(f"{path}:{lineno}: expected an object with {column!r} (a string)")
            records.append(lineno)
            texts.append(text)
            if len(texts) == size:
                yield [source] * size, records, texts
                records, texts = [], []
    if texts:
        yield [source] * len(texts), records, texts


def _parquet_batches(path: Path, source: int, column: str, size: int, progress: Progress) -> Iterator[Batch]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow: pip install 'ballonet[data]'") from None
    user_files.check(path, "data", what="a Parquet file")
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors are many
        raise InputError(f"{path}: not a Parquet file ({str(e).splitlines()[0][:200]})") from None
    names = file.schema_arrow.names
    if column not in names:
        raise InputError(f"{path}: no column {column!r} (columns: {', '.join(names)}); choose one with --text-column")
    kind = file.schema_arrow.field(column).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise InputError(f"{path}: column {column!r} holds {kind}, not text")
    index = names.index(column)
    for g in range(file.metadata.num_row_groups):  # a few KB of zstd can hold GBs of text
        text_bytes = file.metadata.row_group(g).column(index).total_uncompressed_size
        if text_bytes > MAX_ROW_GROUP:
            raise InputError(f"{path}: row group {g} holds {text_bytes >> 20:,} MiB of text uncompressed, over "
                             f"{MAX_ROW_GROUP >> 20:,} MiB: write it with smaller row groups (pyarrow's row_group_size)")
    num_rows, row, file_bytes = max(file.metadata.num_rows, 1), 0, path.stat().st_size
    for batch in file.iter_batches(batch_size=size, columns=[column]):
        texts = batch.column(0).to_pylist()
        progress(file_bytes * len(texts) // num_rows)
        rows = range(row, row + len(texts))
        kept = [(r, t) for r, t in zip(rows, texts) if t is not None]
        row += len(texts)
        if kept:
            yield [source] * len(kept), [r for r, _ in kept], [t for _, t in kept]


def _folder_batches(root: Path, files: list[Path], size: int, progress: Progress) -> Iterator[Batch]:
    for start in range(0, len(files), size):
        texts = []
        for path in files[start: start + size]:
            data = user_files.read_bytes(path, "document", root, what="a text file")
            progress(len(data))
            texts.append(data.decode("utf-8", errors="replace"))
        yield list(range(start, start + len(texts))), [0] * len(texts), texts


MAX_LINE = 256 << 20
"""Bytes of one JSON Lines line (one document)."""
MAX_ROW_GROUP = 1 << 30
"""Uncompressed bytes of a Parquet row group's text column (what reading it may hold in
memory; pyarrow writes row groups of about 64-128 MB by default)."""


def list_sources(data: str) -> list[Path]:
    """The input files, in document order."""
    path = Path(data)
    if path.is_dir():
        files = [Path(p) for p in user_files.files_under(path)
                 if user_files.check(p, "document", path, what="a text file").st_size > 0]
        if not files:
            raise InputError(f"{path}: no non-empty file in this folder")
        return files
    if not os.path.lexists(path):
        raise InputError(f"--data {data!r}: no such file or folder (use a .jsonl or .parquet file, or a folder of "
                         "text files)")
    return [path]


def text_batches(data: str, column: str, size: int, progress: Progress = lambda n: None) -> Iterator[Batch]:
    """Batches of texts from `data` (see the module docstring), each with its source."""
    sources = list_sources(data)
    if Path(data).is_dir():
        yield from _folder_batches(Path(data), sources, size, progress)
    elif sources[0].suffix == ".parquet":
        yield from _parquet_batches(sources[0], 0, column, size, progress)
    else:
        yield from _jsonl_batches(sources[0], 0, column, size, progress)


# ---- writing -------------------------------------------------------------------------


class _ShardWriter:
    """Appends documents to tokens-NNNNN.bin files of at most `shard_tokens` tokens and
    collects the index rows."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.rows: list[np.ndarray] = []
        self.shard_sizes: list[int] = []
        self.max_id = 0
        self._file = None

    def _open_next(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = open(self.folder / shard_name(len(self.shard_sizes)), "wb")
        self.shard_sizes.append(0)

    def write(self, ids: np.ndarray, lengths: np.ndarray, sources: list[int], records: list[int]) -> None:
        keep = lengths > 0
        lengths, starts = lengths[keep], (np.cumsum(lengths) - lengths)[keep]
        sources, records = np.asarray(sources)[keep], np.asarray(records)[keep]
        rows = np.empty((len(lengths), 5), dtype=np.int64)
        for i, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            if self._file is None or (self.shard_sizes[-1] and self.shard_sizes[-1] + n > self.shard_tokens):
                self._open_next()
            self._file.write(ids[start: start + n].tobytes())
            rows[i, :3] = len(self.shard_sizes) - 1, self.shard_sizes[-1], n
            self.shard_sizes[-1] += n
        rows[:, 3], rows[:, 4] = sources, records
        self.rows.append(rows)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))

    def close(self) -> np.ndarray:
        if self._file is not None:
            self._file.close()
        return np.concatenate(self.rows) if self.rows else np.zeros((0, 5), dtype=np.int64)


def _write_folder(folder: Path, config: PrepareConfig, encoder: Encoder, progress: Progress) -> dict:
    writer = _ShardWriter(folder, encoder.dtype, config.shard_tokens)
    try:
        for sources, records, texts in text_batches(config.data, config.text_column, config.batch_size, progress):
            if not all(texts):  # no text, no document (not even the tokenizer's special tokens)
                sources, records, texts = map(list, zip(*[(s, r, t) for s, r, t in zip(sources, records, texts) if t]))
                if not texts:
                    continue
            ids, lengths = encoder.encode(texts)
            writer.write(ids.astype(encoder.dtype, copy=False), lengths, sources, records)
    finally:
        index = writer.close()
    if not len(index):
        raise InputError(f"{config.data}: no document has any text")
    np.save(folder / INDEX, index)
    if encoder.text is not None:
        (folder / TOKENIZER_FILE).write_text(encoder.text, encoding="utf-8")
    root = Path(config.data)
    manifest = {
        "format": PREPARED_FORMAT, "version": PREPARED_VERSION, "dtype": encoder.dtype.name,
        "vocab_size": encoder.vocab_size, "max_token_id": writer.max_id, "num_docs": len(index), "num_tokens": int(index[:, 2].sum()),
        "tokenizer": {"source": encoder.name, "file": TOKENIZER_FILE if encoder.file else None,
                      "add_special_tokens": config.add_special_tokens},
        "text_column": config.text_column,
        "shards": [{"file": shard_name(i), "num_tokens": n} for i, n in enumerate(writer.shard_sizes)],
        "sources": [p.relative_to(root).as_posix() if root.is_dir() else str(p) for p in list_sources(config.data)],
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False) + "\n")
    return manifest


def prepare(config: PrepareConfig, progress: Progress = lambda n: None) -> dict:
    """Tokenize `config.data` into the new folder `config.out`; returns the manifest.
    On any error (InputError on bad input) nothing is left at `config.out`."""
    out = Path(config.out)
    if out.exists():
        raise InputError(f"{out}: already exists (prepare writes a new folder; remove it or choose another)")
    encoder = load_tokenizer(config.tokenizer, config.add_special_tokens)
    sources = list_sources(config.data)  # bad --data fails before a folder is made
    if not out.parent.is_dir():  # as every other output: a mistyped path makes no tree of folders
        raise InputError(f"--out {out}: folder {str(out.parent)!r} does not exist")
    _check_room(out, sources, encoder)
    try:
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise InputError(f"--out {out}: cannot make the folder ({e.strerror or e})") from None
    try:
        manifest = _write_folder(tmp, config, encoder, progress)
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a disk that filled or turned read-only meanwhile
            raise InputError(f"--out {out}: cannot write ({e.strerror or e})") from None
        raise
    return manifest


def _check_room(out: Path, sources: list[Path], encoder: Encoder) -> None:
    """Before any work: the folder `out` goes in is writable and, where the output's size
    can be bounded (text input: at most one token per byte), its disk has room for it."""
    existing = out.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {existing} is not a writable folder")
    if sources[0].suffix != ".parquet":  # compressed: its size bounds nothing
        num_bytes = sum(p.stat().st_size for p in sources)
        check_free_space(str(existing), num_bytes * encoder.dtype.itemsize + (1 << 20),
                         f"--out {out} (up to one token per input byte)")


def input_bytes(data: str) -> int:
    """Total size of the input files (the progress bar's total)."""
    return sum(p.stat().st_size for p in list_sources(data))
