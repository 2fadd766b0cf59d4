"""Text sources the tests of prepared corpora share: a few of the Python standard
library's modules (nothing downloaded), a small byte-level BPE trained on them, and the
documents written as JSONL, Parquet and a folder of text files."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import tokenizers

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXT_FILES = sorted((STDLIB / "json").glob("*.py")) + sorted((STDLIB / "email").glob("_*.py"))


def train_tokenizer(folder: Path, vocab_size: int = 600) -> Path:
    """A byte-level BPE trained on the text files, with a BOS, saved as folder/tokenizer.json."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in TEXT_FILES], trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def texts() -> list[str]:
    """The documents: the text files, cut into pieces of varied size, one of them empty."""
    out = []
    for i, path in enumerate(TEXT_FILES):
        text = path.read_text()
        out += [text[: 500 + 300 * i], text[500 + 300 * i:], ""]
    return out


def write_sources(tmp_path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = texts()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(docs)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), parquet, row_group_size=5)
    folder = tmp_path / "folder"
    for i, t in enumerate(docs):
        (folder / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
        (folder / f"sub{i % 2}" / f"{i:03d}.txt").write_text(t)
    return {"jsonl": jsonl, "parquet": parquet, "folder": folder}
