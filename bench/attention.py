"""Per-rank attention compute time and bytes sent, by planner, on 4 gloo ranks (2 nodes of 2).

    OMP_NUM_THREADS=1 python bench/attention.py [--tokens 131072] [--scale 8] [--reps 3] [--out bench/results]

A `wlbllm` batch of `--tokens` tokens (seed 0), every length divided by `--scale`, planned
on the emulated `cpu` cluster for the `tiny` model (H=4, H_kv=2, D=16), runs through
`ballonet.runtime.attention` forward and backward in fp32 on the CPU kernel. Per rank:
the median over `--reps` runs of the main thread's CPU time (time.thread_time: honest on
a shared 2-core machine, where wall time mostly measures the neighbours; gloo transfers
run on other threads), and the bytes it sent (counted, checked against the plan).
Writes attention.md and attention.json to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ballonet
from ballonet import workloads
from ballonet.runtime import ByteCounter, attention
from ballonet.runtime.comm import predicted_bytes

PLANNERS = ("zeppelin", "te_cp", "packed_dp")
WORLD = 4


def _rank(rank: int, init_file: str, plans: dict, reps: int, heads: tuple[int, int, int], results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    H, H_kv, D = heads
    out = {}
    for name, plan in plans.items():
        T = plan.attention_tokens(rank)
        gen = torch.Generator().manual_seed(rank)
        q, k, v, dout = (torch.randn(T, h, D, generator=gen) for h in (H, H_kv, H_kv, H))
        times, counter = [], ByteCounter()
        for rep in range(reps + 1):  # the first run warms up and counts bytes
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            dist.barrier()
            start = time.thread_time()
            attention(q, k, v, plan, rank, counter=counter if rep == 0 else None).backward(dout)
            if rep:
                times.append(time.thread_time() - start)
        out[name] = {"tokens": T, "cpu_s": statistics.median(times), "counter": counter}
    results.put((rank, out))
    dist.destroy_process_group()


def measure(plans: dict, reps: int, heads) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), plans, reps, heads, results))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    return [got[r] for r in range(WORLD)]


def summarise(plans: dict, per_rank: list[dict], heads) -> dict:
    _, H_kv, D = heads
    rows = {}
    for name, plan in plans.items():
        cpu = [r[name]["cpu_s"] for r in per_rank]
        counted = ByteCounter()
        for r in per_rank:
            counted = counted.merge(r[name]["counter"])
        predicted = predicted_bytes(plan, H_kv, D, torch.float32)
        sent = [sum(b for (src, _), b in counted.total().items() if src == rank) for rank in range(WORLD)]
        inter = sum(b for (s, d), b in counted.total().items() if plan.node_of_rank[s] != plan.node_of_rank[d])
        rows[name] = {
            "tokens_per_rank": [r[name]["tokens"] for r in per_rank],
            "rings": len(plan.rings),
            "cpu_s_per_rank": cpu,
            "cpu_s_max": max(cpu),
            "cpu_s_mean": statistics.mean(cpu),
            "imbalance": max(cpu) / statistics.mean(cpu),
            "bytes_sent_per_rank": sent,
            "bytes_total": sum(sent),
            "bytes_inter_node": inter,
            "bytes_match_plan": counted.forward == predicted.forward and counted.backward == predicted.backward,
        }
    return rows


def write(out_dir: str, config: dict, rows: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "attention.json"), "w") as f:
        json.dump({"config": config, "results": rows}, f, indent=1)
    base = rows[PLANNERS[-1]]["cpu_s_max"]
    lines = [
        "# Attention engine: per-rank compute and bytes, by planner",
        "",
        f"Command: `{config['command']}`  ",
        f"Batch: {config['num_docs']} `wlbllm` documents, lengths / {config['scale']} "
        f"({config['num_tokens']} tokens, longest {config['max_length']}); cluster `cpu` (2 nodes x 2 ranks, gloo); "
        f"model `tiny` (H={config['heads'][0]}, H_kv={config['heads'][1]}, D={config['heads'][2]}); fp32, "
        f"forward + backward; median of {config['reps']} runs of each rank's main-thread CPU time.  ",
        f"Machine: {config['machine']}",
        "",
        "CPU time is the main thread's (kernels, merges, bookkeeping); gloo moves the bytes on its own "
        "threads, so transfers are not in it. `bytes = plan`: counted bytes per (src, dst) equal "
        "`runtime.comm.predicted_bytes`, forward and backward.",
        "",
        "| planner | rings | tokens per rank | CPU s per rank | max | mean | max/mean | max vs packed_dp "
        "| MB sent | MB inter-node | bytes = plan |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['rings']} | {r['tokens_per_rank']} | {[round(x, 3) for x in r['cpu_s_per_rank']]} "
            f"| {r['cpu_s_max']:.3f} | {r['cpu_s_mean']:.3f} | {r['imbalance']:.2f} | {r['cpu_s_max'] / base:.2f} "
            f"| {r['bytes_total'] / 1e6:.2f} | {r['bytes_inter_node'] / 1e6:.2f} | {'yes' if r['bytes_match_plan'] else 'NO'} |")
    with open(os.path.join(out_dir, "attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    lengths = [max(1, n // args.scale) for n in workloads.sample_batch("wlbllm", args.tokens, seed=0)]
    cluster, model = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2), ballonet.model("tiny")
    heads = (model.num_heads, model.num_kv_heads, model.head_dim)
    plans = {name: ballonet.plan_batch(lengths, cluster, model, planner=name) for name in PLANNERS}
    rows = summarise(plans, measure(plans, args.reps, heads), heads)
    config = {"command": f"OMP_NUM_THREADS=1 python bench/attention.py --tokens {args.tokens} --scale {args.scale} "
                         f"--reps {args.reps}",
              "num_docs": len(lengths), "num_tokens": sum(lengths), "max_length": max(lengths), "scale": args.scale,
              "heads": heads, "reps": args.reps, "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, torch {torch.__version__}"}
    write(args.out, config, rows)
    print(open(os.path.join(args.out, "attention.md")).read())
    return 0 if all(r["bytes_match_plan"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
