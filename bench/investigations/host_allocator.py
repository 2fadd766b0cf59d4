"""What a CPU rank's step pays the host allocator: with glibc's defaults, with the settings
`ballonet train` and `ballonet calibrate` give a CPU rank (`training.jobs.host`), and with the
settings and the heap warmed as `ballonet train` warms it before its first step.

    OMP_NUM_THREADS=1 python bench/investigations/host_allocator.py [--ranks 4] [--steps 8] [--groups 3]

Each group starts --ranks gloo ranks (2 emulated nodes from 4 ranks) that train the tiny
model as the training loop does (FSDP2, AdamW, gradients set to None after each step) on
the batches `ballonet train` takes from bench/fidelity.py's long documents (16384 tokens a
step, seed 0), planned by packed_dp: one rank holds the long documents, the others short
ones (fidelity's light ranks). Groups cycle (in a rotating order) through glibc's defaults,
`host.setup_cpu_rank()`, and that with `host.warm_heap(host.step_heap_bytes(...))` for
the step's tokens, so a slow spell of a shared machine falls on all. Per rank and step,
over forward and backward as the loop times its compute: the thread's minor page faults,
its system CPU time and its whole CPU time; the first step of a group is left out.
Figures: medians over steps and groups, and the most faults of any one step (a rank faults
in its heap in the first step that needs more than any before it); a CPU-time ratio is
the median over the cycles of groups of the ratio of two arms' mean CPU times.
Writes bench/results/host_allocator.md and .json.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[1:1] = [ROOT, BENCH]  # after this folder: the checkout (ballonet, tests), bench/ (_common, fidelity)

import numpy as np
import torch
import torch.distributed as dist

import ballonet
from _common import command, record, write_text
from fidelity import long_lengths
from ballonet.planning import plan_batch
from ballonet.training.jobs import host
from ballonet.training.parallelism import parallel
from ballonet.training.data.loader import Cursor, document_order, take_pieces
from ballonet.training.parallelism.model import Transformer
from tests.distributed import run_ranks

TOKENS = 16384
MAX_DOC = 12288


def batches(steps: int, seed: int = 0) -> list[list[int]]:
    """The first `steps` batches `ballonet train` takes from fidelity's long lengths (seed
    `seed`, TOKENS a step, documents cut at MAX_DOC): the training loader's own functions."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lengths.txt")
        long_lengths(path, seed)
        with open(path) as f:
            lengths = np.array([int(x) for x in f.read().split()])
    out, cursor = [], Cursor()
    for _ in range(steps):
        pieces, cursor = take_pieces(lengths, lambda epoch: document_order(len(lengths), epoch, seed, True), cursor,
                                     TOKENS, MAX_DOC, None)
        out.append([p.end - p.start for p in pieces])
    return out


ARMS = ("defaults", "settings", "warmed")
"""glibc's defaults; `host.setup_cpu_rank()`; that and the heap warmed (as `ballonet train`)."""


def rank_fn(rank: int, world: int, arm: str, lengths: list[list[int]]) -> list[dict]:
    took = host.setup_cpu_rank() if arm != "defaults" else False
    torch.manual_seed(0)
    spec = ballonet.model("tiny")
    cluster = ballonet.cluster("cpu", num_nodes=2 if world > 2 else 1, gpus_per_node=world // (2 if world > 2 else 1))
    model = Transformer(spec)
    parallel.parallelize(model, parallel.device_mesh(world, "full", torch.device("cpu")))
    optimizer = torch.optim.AdamW(model.parameters())
    if arm == "warmed" and took:
        host.warm_heap(host.step_heap_bytes(spec, TOKENS, parallel.local_parameter_bytes(model)))
    steps = []
    for batch in lengths:
        plan = plan_batch(batch, cluster, spec, "packed_dp")
        T = sum(s.num_tokens for s in plan.attention[rank])
        ids = torch.randint(0, spec.vocab_size, (T,))
        dist.barrier()
        before, cpu = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        model.loss(ids, ids, plan, rank).backward()
        cpu = time.thread_time() - cpu
        after = resource.getrusage(resource.RUSAGE_THREAD)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append({"tokens": T, "cpu_s": cpu, "sys_s": after.ru_stime - before.ru_stime,
                      "minor_faults": after.ru_minflt - before.ru_minflt, "settings_taken": took})
    return steps[1:]


def summarize(groups: list[dict], world: int) -> list[dict]:
    rows = []
    cycles = [groups[i:i + len(ARMS)] for i in range(0, len(groups), len(ARMS))]

    def ratio(rank: int, num: str, den: str) -> float:
        def mean_cpu(cycle: list[dict], arm: str) -> float:
            return statistics.mean(s["cpu_s"] for g in cycle if g["arm"] == arm for s in g["ranks"][rank])
        return statistics.median(mean_cpu(c, num) / mean_cpu(c, den) for c in cycles)

    for rank in range(world):
        row: dict = {"rank": rank}
        for arm in ARMS:
            steps = [s for g in groups if g["arm"] == arm for s in g["ranks"][rank]]
            for key in ("minor_faults", "sys_s", "cpu_s"):
                row[f"{key}_{arm}"] = statistics.median(s[key] for s in steps)
            row[f"most_faults_{arm}"] = max(s["minor_faults"] for s in steps)
        row["cpu_ratio"] = ratio(rank, "settings", "defaults")
        row["cpu_ratio_warmed"] = ratio(rank, "warmed", "settings")
        rows.append(row)
    return rows


def report(rows: list[dict], args, cmd: str, seconds: float, taken: bool) -> str:
    lines = ["# The host allocator in a CPU rank's step (tiny model, gloo ranks)", "",
             f"Command: `{cmd}` ({seconds:.0f} s, load average {args.load:.1f} at the start). {args.ranks} ranks, "
             f"{args.steps} steps a group (the first left out), {args.groups} groups of each arm, in cycles whose order "
             "rotates: glibc's "
             f"defaults; `training.jobs.host.setup_cpu_rank()` (the allocator {'took' if taken else 'refused'} its "
             "settings); those settings and the heap warmed before the first step as `ballonet train` warms it "
             "(`host.warm_heap(host.step_heap_bytes(...))`). Each step: the next batch `ballonet train` takes from "
             "bench/fidelity.py's long documents (16384 tokens), planned by packed_dp. Per rank: medians over steps "
             "and groups of the forward and backward's minor page faults, system CPU time and CPU time of the "
             "rank's thread, and the most faults in one step; CPU-time ratios: settings / defaults and warmed / "
             "settings, each the median over the cycles of groups of the ratio of their means.", "",
             "| rank | minor faults (defaults / settings / warmed) | most in one step | system ms | CPU s | "
             "settings / defaults | warmed / settings |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def arms(key: str, fmt: str, scale: float = 1.0) -> str:
        return " / ".join(format(r[f"{key}_{arm}"] * scale, fmt) for arm in ARMS)
    for r in rows:
        lines.append(f"| {r['rank']} | {arms('minor_faults', '.0f')} | {arms('most_faults', '.0f')} | "
                     f"{arms('sys_s', '.1f', 1e3)} | {arms('cpu_s', '.3f')} | {r['cpu_ratio']:.3f} | "
                     f"{r['cpu_ratio_warmed']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, choices=[2, 4])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--groups", type=int, default=3, help="groups of each arm (defaults, settings, warmed)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "host_allocator"))
    args = p.parse_args(argv)
    if args.steps < 2 or args.groups < 1:
        p.error(f"--steps must be at least 2 and --groups at least 1, got {args.steps} and {args.groups}")
    args.load = os.getloadavg()[0]
    t0 = time.time()
    lengths = batches(args.steps)
    groups = []
    for i in range(args.groups):
        for arm in ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]:  # rotated: no arm always runs first
            groups.append({"arm": arm, "ranks": run_ranks(args.ranks, rank_fn, arm, lengths)})
    taken = all(s["settings_taken"] for g in groups if g["arm"] != "defaults" for r in g["ranks"] for s in r)
    rows = summarize(groups, args.ranks)
    cmd, seconds = command("investigations/host_allocator.py", argv), time.time() - t0
    record(cmd, {"rows": rows, "groups": groups, "load": args.load, "seconds": seconds}, args.out + ".json")
    text = report(rows, args, cmd, seconds, taken)
    write_text(args.out + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
