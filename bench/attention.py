"""Per-rank attention compute time and bytes sent, by planner, on 4 gloo ranks (2 nodes of 2);
bytes per NIC with and without routing, and the remap's share of the traffic.

    OMP_NUM_THREADS=1 python bench/attention.py [--tokens 131072] [--scale 8] [--reps 3] [--out bench/results]

A `wlbllm` and a `prolong` batch of `--tokens` tokens (seed 0), every length divided by
`--scale`, planned on the emulated `cpu` cluster (one NIC per rank) for the `tiny` model
(H=4, H_kv=2, D=16), run through `ballonet.runtime.attention` forward and backward in
fp32 on the CPU kernel: `zeppelin` with its routes and without (`routing=False`), and on
`wlbllm` also `te_cp` and `packed_dp`. Per rank: the median over `--reps` runs of the main
thread's CPU time (time.thread_time: honest on a shared 2-core machine, where wall time
mostly measures the neighbours; gloo transfers run on other threads), and the bytes it
sent (counted, checked against the plan). The remap of one layer (q, k, v to the attention
layout, the attention output back; forward and backward) runs once per plan, counted.
Writes attention.md and attention.json to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import RESULTS, command, record, write_text

import ballonet
from ballonet import workloads
from ballonet.runtime import ByteCounter, attention, remap
from ballonet.runtime.comm import link_bytes, nic_bytes
from ballonet.runtime.routing import predicted_bytes

PLANNERS = ("zeppelin", "te_cp", "packed_dp")
DIRECT = "zeppelin, direct"
"""zeppelin with routing=False: the same placement, every hop straight across."""
WORKLOADS = ("wlbllm", "prolong")
WORLD = 4


def _remap_layer(plan, rank: int, heads, counter: ByteCounter) -> None:
    """One layer's remaps, forward and backward: q, k, v [T_lin, H + 2 H_kv, D] to the
    attention layout, the attention output [T_att, H, D] back to the linear one."""
    H, H_kv, D = heads
    qkv = torch.randn(plan.linear_tokens(rank), H + 2 * H_kv, D, requires_grad=True)
    o = torch.randn(plan.attention_tokens(rank), H, D, requires_grad=True)
    moved = remap(qkv, plan, rank, "linear", "attention", counter=counter).sum()
    (moved + remap(o, plan, rank, "attention", "linear", counter=counter).sum()).backward()


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
        remap_counter = ByteCounter()
        _remap_layer(plan, rank, heads, remap_counter)
        out[name] = {"tokens": T, "cpu_s": statistics.median(times), "counter": counter, "remap": remap_counter}
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
        counted, remapped = ByteCounter(), ByteCounter()
        for r in per_rank:
            counted, remapped = counted.merge(r[name]["counter"]), remapped.merge(r[name]["remap"])
        predicted = predicted_bytes(plan, H_kv, D, torch.float32)
        sent = [sum(b for (src, _), b in counted.total().items() if src == rank) for rank in range(WORLD)]
        links, nic = link_bytes(counted.total(), plan.node_of_rank), nic_bytes(counted.total(), plan)
        remap_bytes = sum(remapped.total().values())
        rows[name] = {
            "routed_hops": len(plan.routes),
            "bytes_intra_node": links["intra"],
            "bytes_per_nic": {f"{way}{n}": b for (way, n), b in sorted(nic.items(), key=lambda kv: (kv[0][1], kv[0][0]))},
            "nic_max": max(nic.values()),
            "nic_spread": max(nic.values()) / statistics.mean(nic.values()) if any(nic.values()) else 1.0,
            "remap_bytes": remap_bytes,
            "remap_bytes_inter_node": link_bytes(remapped.total(), plan.node_of_rank)["inter"],
            "remap_share": remap_bytes / (remap_bytes + sum(sent)) if remap_bytes + sum(sent) else 0.0,
            "tokens_per_rank": [r[name]["tokens"] for r in per_rank],
            "rings": len(plan.rings),
            "cpu_s_per_rank": cpu,
            "cpu_s_max": max(cpu),
            "cpu_s_mean": statistics.mean(cpu),
            "imbalance": max(cpu) / statistics.mean(cpu),
            "bytes_sent_per_rank": sent,
            "bytes_total": sum(sent),
            "bytes_inter_node": links["inter"],
            "bytes_match_plan": counted.forward == predicted.forward and counted.backward == predicted.backward,
        }
    return rows


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def write(out_dir: str, config: dict, rows: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    record(config["command"], {"config": config, "results": rows}, os.path.join(out_dir, "attention.json"))
    batch = config["batches"]["wlbllm"]
    base = rows[f"wlbllm: {PLANNERS[-1]}"]["cpu_s_max"]
    lines = [
        "# Attention engine: per-rank compute and bytes, by planner",
        "",
        f"Command: `{config['command']}`  ",
        f"Batch: {batch['num_docs']} `wlbllm` documents, lengths / {config['scale']} "
        f"({batch['num_tokens']} tokens, longest {batch['max_length']}); cluster `cpu` (2 nodes x 2 ranks, gloo, "
        f"one NIC per rank); model `tiny` (H={config['heads'][0]}, H_kv={config['heads'][1]}, D={config['heads'][2]}); "
        f"fp32, forward + backward; median of {config['reps']} runs of each rank's main-thread CPU time.  ",
        f"Machine: {config['machine']}",
        "",
        "CPU time is the main thread's (kernels, merges, bookkeeping, and waiting in relays for parts to "
        "forward); gloo moves the bytes on its own threads, so transfers are not in it. `bytes = plan`: counted "
        "bytes per (src, dst) equal `runtime.routing.predicted_bytes`, forward and backward (routes followed).",
        "",
        "| planner | rings | tokens per rank | CPU s per rank | max | mean | max/mean | max vs packed_dp "
        "| MB sent | MB inter-node | bytes = plan |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, r in rows.items():
        if key.startswith("wlbllm: "):
            lines.append(
                f"| {key[8:]} | {r['rings']} | {r['tokens_per_rank']} | {[round(x, 3) for x in r['cpu_s_per_rank']]} "
                f"| {r['cpu_s_max']:.3f} | {r['cpu_s_mean']:.3f} | {r['imbalance']:.2f} | {r['cpu_s_max'] / base:.2f} "
                f"| {_mb(r['bytes_total'])} | {_mb(r['bytes_inter_node'])} | {'yes' if r['bytes_match_plan'] else 'NO'} |")
    lines += [
        "",
        "## Routing and remap: `zeppelin` with and without routes",
        "",
        "Batches: " + "; ".join(f"`{w}`: {b['num_docs']} documents, {b['num_tokens']} tokens, longest {b['max_length']}"
                                for w, b in config["batches"].items()) + ". Same placement both ways "
        "(`plan_batch(..., routing=False)` only drops the routes).",
        "",
        "Attention bytes (K/V forward, K/V and dK/dV backward) per NIC direction, counted: a transfer between "
        "nodes leaves by the sender's NIC (`out`) and enters by the receiver's (`in`); NIC n serves rank n. "
        "`NIC max/mean`: the busiest NIC direction over the mean of all eight. Remap: one layer's two remaps "
        "(q, k, v in; attention output out), forward and backward, counted; its share is of remap + attention "
        "bytes, all links.",
        "",
        "| batch | routing | routed hops | MB per NIC direction (out0 in0 out1 in1 ...) | NIC max MB | NIC max/mean "
        "| MB intra-node | MB inter-node | remap MB (inter-node) | remap share | CPU s max | bytes = plan |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for workload in config["batches"]:
        for name, routing in (("zeppelin", "on"), (DIRECT, "off")):
            r = rows[f"{workload}: {name}"]
            lines.append(
                f"| {workload} | {routing} | {r['routed_hops']} | {' '.join(_mb(b) for b in r['bytes_per_nic'].values())} "
                f"| {_mb(r['nic_max'])} | {r['nic_spread']:.2f} | {_mb(r['bytes_intra_node'])} "
                f"| {_mb(r['bytes_inter_node'])} | {_mb(r['remap_bytes'])} ({_mb(r['remap_bytes_inter_node'])}) "
                f"| {100 * r['remap_share']:.1f}% | {r['cpu_s_max']:.3f} | {'yes' if r['bytes_match_plan'] else 'NO'} |")
    write_text(os.path.join(out_dir, "attention.md"), "\n".join(lines) + "\n")


def plans_for(args) -> tuple[dict, dict]:
    """{"workload: planner": plan} and the batches' shapes."""
    cluster, model = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2), ballonet.model("tiny")
    plans, batches = {}, {}
    for workload in WORKLOADS:
        lengths = [max(1, n // args.scale) for n in workloads.sample_batch(workload, args.tokens, seed=0)]
        batches[workload] = {"num_docs": len(lengths), "num_tokens": sum(lengths), "max_length": max(lengths)}
        for name in PLANNERS if workload == "wlbllm" else PLANNERS[:1]:
            plans[f"{workload}: {name}"] = ballonet.plan_batch(lengths, cluster, model, planner=name)
        direct = ballonet.plan_batch(lengths, cluster, model, routing=False)
        routed = plans[f"{workload}: zeppelin"]
        assert direct == dataclasses.replace(routed, routes=()), "routing=False changed more than the routes"
        plans[f"{workload}: {DIRECT}"] = direct
    return dict(sorted(plans.items(), key=lambda kv: kv[0].split(":")[0] != "wlbllm")), batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    model = ballonet.model("tiny")
    heads = (model.num_heads, model.num_kv_heads, model.head_dim)
    plans, batches = plans_for(args)
    rows = summarise(plans, measure(plans, args.reps, heads), heads)
    config = {"command": command("attention.py", argv),
              "batches": batches, "scale": args.scale, "heads": heads, "reps": args.reps,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"}
    write(args.out, config, rows)
    print(open(os.path.join(args.out, "attention.md")).read())
    return 0 if all(r["bytes_match_plan"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
