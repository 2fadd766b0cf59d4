"""Per-rank parameter + optimizer memory with FSDP2 on 4 ranks: fully sharded against
replicated (`--shard none`), measured on the trained model (each rank's local shards of
the parameters and of AdamW's states, after one step).

    python bench/train_memory.py            # writes bench/results/train_memory.md

Target (issue 15): about a quarter per rank with full sharding on 4 ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from _common import command, record, write_text
from distributed import run_ranks

from ballonet.training.loop import TrainConfig, train

OUT = os.path.join(os.path.dirname(__file__), "results", "train_memory.md")


def _measure(rank, world_size, model, shards):
    out = {}
    for shard in shards:
        record = train(TrainConfig(model=model, corpus="stdlib", global_tokens=1024, max_doc_tokens=512, steps=1,
                                   shard=shard, log_every=10))[-1]
        out[shard] = (record["param_bytes_max"], record["memory_peak_bytes_max"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    shards = ("none", "full")
    results = run_ranks(args.ranks, _measure, args.model, shards)[0]
    base = results["none"][0]
    lines = ["# Per-rank parameter + optimizer memory, FSDP2", "",
             f"`{command('train_memory.py', argv, env='')}` "
             f"({args.ranks} gloo ranks on CPU, model {args.model}, fp32 weights, AdamW; "
             "largest rank's local parameter shards + optimizer states after one step).", "",
             "| --shard | param + optimizer bytes per rank | vs replicated | process peak RSS (MiB) |",
             "| --- | --- | --- | --- |"]
    for shard in shards:
        local, peak = results[shard]
        lines.append(f"| {shard} | {local:,} | {local / base:.3f} | {peak / 2**20:.0f} |")
    lines += ["", f"Ideal with {args.ranks} ranks: {1 / args.ranks:.3f}; FSDP2 pads a parameter whose first "
              "dimension the ranks do not divide, which would show as more. Peak RSS is the whole process "
              "(PyTorch, the corpus, activations), not the weights alone.", ""]
    record(command("train_memory.py", argv, env=""), {"results": results}, os.path.splitext(args.out)[0] + ".json")
    write_text(args.out, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
