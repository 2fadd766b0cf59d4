"""Each rank's compute of a multi-GPU plan, replayed rank by rank on one device, against
the simulator's per-rank compute.

    python bench/rank_replay.py --out bench/results/rank_replay        # one GPU: 32-GPU zeppelin plan
    python bench/rank_replay.py --device cpu --cluster cpu --nodes 2 --gpus-per-node 2 \\
        --model tiny --tokens-per-gpu 512 --out /tmp/replay             # the CPU dry run

Plans one batch (zeppelin, a workload's lengths) for `--nodes` nodes of `--cluster` and
simulates it (`ballonet.simulate`, no recomputation, bf16 on a GPU). Then, for each
rank, on this one device:

* attention: the engine's own forward and backward passes (`runtime.engine`) on that
  rank's tokens, with the rank's metadata (`runtime.step_meta`, moved in one copy) and
  a stand-in for its peers that sends nothing (received blocks are left as allocated):
  every kernel call, index map and merge the rank runs, none of the waiting;
* linear: one of the model's blocks (`training.parallelism.model.Block`, its attention the identity)
  forward and backward on the rank's tokens of the linear layout.

Each timed as the median of `--repeats` after a warm-up (CUDA events on a GPU), against
the simulator's per-rank seconds of the same layer (its forward and backward task
graphs: attention tasks, linear tasks). On a GPU, one forward and backward of each
rank's attention also runs under `torch.cuda.set_sync_debug_mode(--sync-debug)`
("error": a host-device synchronisation in the engine fails the run). Writes OUT.json
(per rank, the figures and the command) and OUT.md (a summary).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time

import torch
from _common import command, record, write_text

import ballonet
from ballonet import runtime, workloads
from ballonet.plan import Plan, Segment
from ballonet.runtime import engine, kernels
from ballonet.runtime.comm import Pending, Sent
from ballonet.training.parallelism.model import Block


class LocalComm:
    """`comm.P2P`'s interface for a rank alone: nothing is sent, received blocks are
    left as allocated, no wait waits."""

    def empty(self, like, rows, dtype=None):
        return like.new_empty((like.shape[0], rows) + tuple(like.shape[2:]), dtype=dtype or like.dtype)

    def ready(self):
        return None

    def post(self, posts):
        return [Sent(inner=Pending(), across=Pending()) for _ in posts]

    def wait(self, pending):
        pass

    def finish(self):
        pass


def _timer(device: torch.device):
    def median_ms(fn, repeats: int) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    return median_ms


def _sync_debug(device: torch.device, mode: str | None):
    if device.type != "cuda" or not mode:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scope():
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return scope()


def simulated(sim) -> dict[str, list[float]]:
    """Per rank, seconds of one layer's attention and linear tasks, forward and backward."""
    out = {f"{kind}_{phase}": [0.0] * sim.num_gpus for kind in ("attention", "linear") for phase in ("fwd", "bwd")}
    for (_, tl, *_), phase in zip(sim.timelines, ("fwd", "bwd")):
        for task in range(tl.num_tasks):
            kind, rank, _ = tl.label[task]
            if tl.stream[task] >= 0 and kind != "tp":
                out[f"{'linear' if kind == 'linear' else 'attention'}_{phase}"][rank] += tl.duration[task]
    return out


def _one_rank_plan(tokens: int) -> Plan:
    return Plan(planner="replay", lengths=(tokens,), node_of_rank=(0,), nic_of_rank=(0,),
                attention=((Segment(0, 0, tokens),),))


def replay_rank(plan: Plan, rank: int, spec, device, dtype, kernel, block, median_ms, repeats: int,
                sync_debug: str | None) -> dict:
    meta = runtime.to_device(runtime.step_meta(plan, rank), device).attention
    T, H, K, D = plan.attention_tokens(rank), spec.num_heads, spec.num_kv_heads, spec.head_dim
    gen = torch.Generator(device=device).manual_seed(rank)
    q = torch.randn(T, H, D, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(T, K, D, device=device, dtype=dtype, generator=gen) for _ in range(2))
    comm, scale = LocalComm(), kernels.default_scale(D)
    out, lse = engine._forward(comm, meta, q, k, v, kernel, scale)
    dout = torch.randn_like(out)
    with _sync_debug(device, sync_debug):  # the engine's passes, with the metadata already on the device
        engine._forward(comm, meta, q, k, v, kernel, scale)
        engine._backward(comm, meta, dout, q, k, v, out, lse, kernel, scale)
    row = {"rank": rank, "tokens_attention": T, "tokens_linear": plan.linear_tokens(rank),
           "attention_fwd_ms": median_ms(lambda: engine._forward(comm, meta, q, k, v, kernel, scale), repeats),
           "attention_bwd_ms": median_ms(lambda: engine._backward(comm, meta, dout, q, k, v, out, lse, kernel, scale),
                                         repeats)}
    T_lin = plan.linear_tokens(rank)
    one = _one_rank_plan(max(T_lin, 1))
    lin_meta = runtime.to_device(runtime.step_meta(one, 0), device)
    x = torch.randn(max(T_lin, 1), spec.hidden, device=device, dtype=dtype, requires_grad=True)

    def identity(q, k, v, *_):
        return q

    def linear_fwd():
        return block(x, lin_meta.positions, one, 0, None, identity, None, lin_meta)

    y = linear_fwd()
    dy = torch.randn_like(y)
    row["linear_fwd_ms"] = median_ms(linear_fwd, repeats)
    row["linear_fwd_bwd_ms"] = median_ms(lambda: linear_fwd().backward(dy), repeats)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="h200-8nic")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--workload", default="wlbllm")
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sync-debug", default="error", help='torch.cuda.set_sync_debug_mode around one pass ("": off)')
    p.add_argument("--out", default="bench/results/rank_replay", help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/rank_replay.py: no CUDA device (use --device cpu for the dry run)")
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cluster = ballonet.cluster(args.cluster, num_nodes=args.nodes,
                               **({"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}))
    spec = dataclasses.replace(ballonet.model(args.model), recompute="none", dtype_bytes=dtype.itemsize)
    lengths = workloads.get(args.workload).sample_batch(args.tokens_per_gpu * cluster.num_ranks, args.seed)
    plan = ballonet.plan_batch(lengths, cluster, spec, planner="zeppelin")
    sim = simulated(ballonet.simulate(plan, cluster, spec))
    kernel = kernels.select(None, device)
    block = Block(spec).to(device=device, dtype=dtype)
    median_ms = _timer(device)
    start = time.time()
    rows = []
    for rank in range(plan.num_ranks):
        row = replay_rank(plan, rank, spec, device, dtype, kernel, block, median_ms, args.repeats, args.sync_debug)
        for key, values in sim.items():
            row[f"sim_{key}_ms"] = values[rank] * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "kernel": kernel.name, "dtype": str(dtype).removeprefix("torch."),
              "cluster": cluster.name, "num_gpus": cluster.num_ranks, "model": spec.name,
              "workload": args.workload, "tokens_per_gpu": args.tokens_per_gpu, "rings": len(plan.rings),
              "routes": len(plan.routes), "sync_debug": args.sync_debug if device.type == "cuda" else None,
              "seconds": time.time() - start, "ranks": rows, "summary": summary(rows)}
    result = record(command("rank_replay.py", argv, env="" if device.type == "cuda" else "OMP_NUM_THREADS=1 "),
                    result, f"{args.out}.json")
    write_text(f"{args.out}.md", markdown(result))
    print(markdown(result))
    return 0


def summary(rows: list[dict]) -> dict:
    """Measured against simulated: per-rank ratios and the imbalance (max/mean) of each."""
    def ratio(a, b):
        return [r[a] / r[b] for r in rows if r[b] > 0]

    def imbalance(key):
        values = [r[key] for r in rows]
        mean = statistics.mean(values)
        return max(values) / mean if mean > 0 else 1.0

    for r in rows:
        r["attention_ms"] = r["attention_fwd_ms"] + r["attention_bwd_ms"]
        r["sim_attention_ms"] = r["sim_attention_fwd_ms"] + r["sim_attention_bwd_ms"]
        r["sim_linear_fwd_bwd_ms"] = r["sim_linear_fwd_ms"] + r["sim_linear_bwd_ms"]
    out = {}
    for name, a, b in (("attention fwd", "attention_fwd_ms", "sim_attention_fwd_ms"),
                       ("attention bwd", "attention_bwd_ms", "sim_attention_bwd_ms"),
                       ("linear fwd+bwd", "linear_fwd_bwd_ms", "sim_linear_fwd_bwd_ms")):
        ratios = ratio(a, b)
        out[name] = {"median_ratio": statistics.median(ratios) if ratios else None,
                     "min_ratio": min(ratios, default=None), "max_ratio": max(ratios, default=None),
                     "imbalance_measured": imbalance(a), "imbalance_simulated": imbalance(b)}
    return out


def markdown(result: dict) -> str:
    lines = [f"## {result['date']}: each rank's compute of a {result['num_gpus']}-GPU zeppelin plan on one "
             f"{result['device']}",
             "", f"`{result['command']}`", "",
             f"{result['model']} layer shapes, {result['dtype']}, kernel `{result['kernel']}`, {result['workload']} "
             f"batch of {result['tokens_per_gpu']} tokens per GPU on {result['cluster']}: {result['rings']} rings, "
             f"{result['routes']} routed hops. Per rank, one layer: the engine's attention passes alone (peers "
             f"stand-in, nothing sent) and a block's linear work, median of repeats, against the simulator's "
             f"tasks of the same layer"
             + (f"; the engine's passes ran under `set_sync_debug_mode({result['sync_debug']!r})`."
                if result["sync_debug"] else "."),
             "", "| part | measured / simulated, median (min-max) | imbalance max/mean, measured | simulated |",
             "| --- | --- | --- | --- |"]
    for name, s in result["summary"].items():
        if s["median_ratio"] is None:
            continue
        lines.append(f"| {name} | {s['median_ratio']:.2f} ({s['min_ratio']:.2f}-{s['max_ratio']:.2f}) | "
                     f"{s['imbalance_measured']:.2f} | {s['imbalance_simulated']:.2f} |")
    lines += ["", "| rank | tokens att/lin | attention ms (sim) | linear fwd+bwd ms (sim) |", "| --- | --- | --- | --- |"]
    for r in result["ranks"]:
        lines.append(f"| {r['rank']} | {r['tokens_attention']}/{r['tokens_linear']} | {r['attention_ms']:.2f} "
                     f"({r['sim_attention_ms']:.2f}) | {r['linear_fwd_bwd_ms']:.2f} ({r['sim_linear_fwd_bwd_ms']:.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
