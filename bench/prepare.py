"""`ballonet prepare` against the `tokenizers` library's own batch encoding of the same file.

    OMP_NUM_THREADS=1 python bench/prepare.py [--reps 5] [--vocab 8192] [--copies 2] [--out bench/results]

Corpus: the Python standard library's .py files (`corpus.stdlib`, on every machine),
`--copies` times over, as one JSON Lines file of {"text": ...}. Tokenizer: a byte-level
BPE of `--vocab` entries trained here with `tokenizers` on those files (nothing downloaded).
Side by side, alternating within each repetition, wall-clock seconds:

* `tokenizers`: read the file, `json.loads` each line, `Tokenizer.encode_batch_fast` on
  batches of 1024 texts (the ids are kept as the library returns them);
* `prepare`: `ballonet.training.data.prepare.prepare` (what `ballonet prepare` runs): the same
  reading and encoding, plus the ids flattened to numpy, the shards and index written, the
  folder renamed into place;
* `prepare byte`: the same with the byte tokenizer (no `tokenizers` at all), for scale.

Target: `prepare` within 1.5x of `tokenizers` (ratio of medians). Writes prepare.md and
prepare.json to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import tokenizers
from _common import RESULTS, command, record, write_text

from ballonet.training.data.corpus import stdlib
from ballonet.training.data.prepare import PrepareConfig, prepare

BATCH = 1024
TARGET = 1.5


def write_corpus(folder: Path, copies: int) -> tuple[Path, list[Path]]:
    """The standard library's .py files, `copies` times over, as one JSON Lines file."""
    corpus = stdlib()
    files = [Path(sysconfig.get_paths()["stdlib"], name) for name in corpus.names]
    path = folder / "stdlib.jsonl"
    with open(path, "w") as f:
        for _ in range(copies):
            for file in files:
                f.write(json.dumps({"text": file.read_text(errors="replace")}) + "\n")
    return path, files


def train_tokenizer(files: list[Path], vocab: int, folder: Path) -> Path:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in files[::4]], trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def library_encoding(path: Path, tokenizer_file: Path) -> int:
    """The baseline: the tokenizers library encoding the file's texts in batches."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    num_tokens, texts = 0, []
    with open(path, "rb") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) == BATCH:
                num_tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts))
                texts = []
    if texts:
        num_tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts))
    return num_tokens


def run_prepare(path: Path, tokenizer: str, folder: Path) -> int:
    out = folder / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    manifest = prepare(PrepareConfig(data=str(path), out=str(out), tokenizer=tokenizer, batch_size=BATCH))
    return manifest["num_tokens"]


def measure(path: Path, tokenizer_file: Path, folder: Path, reps: int) -> dict[str, dict]:
    runs = {"tokenizers": lambda: library_encoding(path, tokenizer_file),
            "prepare": lambda: run_prepare(path, str(tokenizer_file), folder),
            "prepare byte": lambda: run_prepare(path, "byte", folder)}
    times = {name: [] for name in runs}
    tokens = {}
    for rep in range(reps + 1):  # the first repetition warms up
        for name, run in runs.items():
            start = time.perf_counter()
            tokens[name] = run()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: {"seconds": times[name], "median_s": statistics.median(times[name]), "tokens": tokens[name]}
            for name in runs}


def report(results: dict, command: str, path: Path, vocab: int) -> str:
    base = results["tokenizers"]["median_s"]
    ratio = results["prepare"]["median_s"] / base
    mb = path.stat().st_size / 1e6
    lines = [
        "# `ballonet prepare` vs the tokenizers library's batch encoding",
        "",
        f"Command: `{command}`  ",
        f"Input: {path.name}, {mb:.1f} MB of JSON Lines (the standard library's .py files); tokenizer: "
        f"byte-level BPE, vocabulary {vocab}, trained at bench time; batches of {BATCH} texts.  ",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
        f"tokenizers {tokenizers.__version__}; RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}",
        "",
        "| run | tokens | median s | MB/s | runs (s) | vs tokenizers |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['tokens']} | {r['median_s']:.2f} | {mb / r['median_s']:.1f} "
                     f"| {[round(s, 2) for s in r['seconds']]} | {r['median_s'] / base:.2f}x |")
    verdict = "met" if ratio <= TARGET else "NOT met"
    lines += ["", f"Target: `prepare` within {TARGET}x of `tokenizers`: {ratio:.2f}x, {verdict}. Both produce the "
                  "same number of tokens (the prepared folder holds exactly the library's ids; "
                  "tests/test_prepare.py checks them document by document)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path, files = write_corpus(folder, args.copies)
        tokenizer_file = train_tokenizer(files, args.vocab, folder)
        results = measure(path, tokenizer_file, folder, args.reps)
        cmd = command("prepare.py", argv)
        text = report(results, cmd, path, args.vocab)
    if results["prepare"]["tokens"] != results["tokenizers"]["tokens"]:
        raise SystemExit("bench/prepare.py: prepare and the library produced different token counts")
    record(cmd, {"results": results}, os.path.join(args.out, "prepare.json"))
    write_text(os.path.join(args.out, "prepare.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
