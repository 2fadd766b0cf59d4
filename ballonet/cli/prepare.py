"""`ballonet prepare`: tokenize a corpus once into memory-mapped token shards for `train --corpus`."""

from __future__ import annotations

import json

from ballonet.cli.common import positive_int, subparser


def register(sub) -> None:
    p = subparser(sub, "prepare", cmd_prepare,
                  help="tokenize a corpus once into memory-mapped token shards for `train --corpus`",
                  description="Tokenize a .jsonl or .parquet file, or a folder of text files, into a new "
                              "folder of token shards with a document index (train with --corpus OUT).")
    p.add_argument("--data", required=True, help="a .jsonl or .parquet file, or a folder of text files")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (UTF-8 bytes, default), a Hugging Face tokenizer.json, or a folder holding one")
    p.add_argument("--out", required=True, help="the folder to create (must not exist)")
    p.add_argument("--text-column", default="text", help="JSON key or Parquet column of the text (default: text)")
    p.add_argument("--batch-size", type=positive_int, default=1024, help="documents per tokenizer call")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


def cmd_prepare(args) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from ballonet.training.data import prepare

    config = prepare.PrepareConfig(data=args.data, out=args.out, tokenizer=args.tokenizer,
                                   text_column=args.text_column, batch_size=args.batch_size)
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    console = Console(stderr=True)
    with Progress(*columns, console=console, transient=True, disable=args.json or not console.is_terminal) as bar:
        task = bar.add_task("tokenizing", total=prepare.input_bytes(args.data))
        manifest = prepare.prepare(config, progress=lambda n: bar.advance(task, n))
    if args.json:
        print(json.dumps({"out": args.out, **manifest}, indent=2, allow_nan=False))
    else:
        print(f"{args.out}: {manifest['num_docs']} documents, {manifest['num_tokens']} tokens "
              f"({manifest['dtype']}, vocabulary {manifest['vocab_size']}) in {len(manifest['shards'])} shard(s)")
    return 0
