"""Where a training step's compute goes on this CPU, measured piece by piece against the
profile's price of each piece (the question behind bench/fidelity.py's errors).

    python bench/investigations/fidelity_breakdown.py --profile bench/results/fidelity_profile.json [--planner packed_dp]
        [--ranks 2] [--lengths 2048,1024,...]

On 2 gloo ranks on one node (or 4 on two, as bench/fidelity.py runs them), one batch
planned with the profile as bench/fidelity.py plans it, each rank times (CPU time of its
thread, median of 5, after a warm-up):

* attention: the runtime engine on the rank's own documents (a one-rank plan), forward
  and backward, times the model's layers;
* the model without its attention core on the rank's tokens (GEMMs, elementwise, head, loss);
* the whole model (`training.parallelism.model.Transformer`) on the real plan, bare and wrapped by
  FSDP2 as the training loop wraps it, timed alternately (`calibration.measure_compute.
  paired_s`, as calibrate times the same difference): the median of their paired
  differences is the framework's work (two separate medians differ by more than it);
* a torch.profiler table of the FSDP2 step on rank 0 (ops by self CPU time).

and the profile's price of the same pieces (`ballonet.cost`, as the simulator adds them).
Writes bench/results/fidelity_breakdown.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[1:1] = [ROOT, BENCH]  # after this folder: the checkout (ballonet, tests), bench/ (_common, fidelity)

import numpy as np
import torch
import torch.distributed as dist

import ballonet
from _common import command, record, write_text
from ballonet import calibration, runtime
from ballonet.calibration.measure_compute import paired_s
from ballonet.cost import hardware
from ballonet.cost.flops import attention_flops, head_flops_per_token, loss_bytes_per_token
from ballonet.cost.seconds import attention_seconds, elementwise_time, framework_time, linear_time
from ballonet.plan import Plan, Segment
from ballonet.planning import plan_batch
from ballonet.simulation import simulate
from tests.distributed import run_ranks

LENGTHS = [2048, 1024, 700, 512, 300, 200, 150, 100, 64, 1000, 1200, 412, 300, 100, 78]
"""8188 tokens: long and short documents, about fidelity.py's 8192 a step."""


def _median_s(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        dist.barrier()
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _one_rank(lengths) -> Plan:
    return Plan(planner="local", lengths=tuple(lengths), node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, n) for d, n in enumerate(lengths)),))


def _measure(rank: int, plan: Plan, spec, with_table: bool) -> dict:
    from ballonet.training.parallelism import parallel
    from ballonet.training.parallelism.model import Transformer

    local = [s.num_tokens for s in plan.attention[rank]]
    T = sum(local)
    ids = torch.randint(0, spec.vocab_size, (T,))
    H, K, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(T, H, D, requires_grad=True)
    k, v = (torch.randn(T, K, D, requires_grad=True) for _ in range(2))
    out = {}
    with torch.no_grad():
        fwd = _median_s(lambda: runtime.attention(q, k, v, _one_rank(local), 0, verify_plan=False))
    o = runtime.attention(q, k, v, _one_rank(local), 0, verify_plan=False)
    do = torch.randn_like(o)
    bwd = _median_s(lambda: torch.autograd.backward(o, do, retain_graph=True))
    out["attention"] = spec.num_layers * (fwd + bwd)
    no_core = Transformer(spec, attention_fn=lambda q, k, v, *_: q)
    out["model without attention"] = _median_s(lambda: no_core.loss(ids, ids, _one_rank([T]), 0).backward())
    bare = Transformer(spec)
    fsdp = Transformer(spec)
    parallel.parallelize(fsdp, parallel.device_mesh(dist.get_world_size(), "full", torch.device("cpu")))
    out["FSDP2 model, real plan"], out["bare model, real plan"], out["framework"] = paired_s(
        lambda: fsdp.loss(ids, ids, plan, rank).backward(), lambda: bare.loss(ids, ids, plan, rank).backward(),
        torch.device("cpu"), 5)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # on every rank: FSDP2's collectives need all
        fsdp.loss(ids, ids, plan, rank).backward()
    if with_table:
        out["table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return out


def _price(rank: int, plan: Plan, spec, cluster) -> dict:
    gpu = hardware.gpu("cpu")
    local = [s.num_tokens for s in plan.attention[rank]]
    T = sum(local)
    flops = attention_flops(spec, np.array(local))
    att = sum(attention_seconds(spec, gpu, f, n, launch_floor=True)
              + attention_seconds(spec, gpu, f, n, backward=True, launch_floor=True) for f, n in zip(flops, local))
    head = head_flops_per_token(spec) * 3 * T / (gpu.peak_flops * hardware.linear_efficiency(T, gpu))
    loss = 3 * elementwise_time(spec, gpu, T, loss_bytes_per_token(spec))
    layers = spec.num_layers * 3 * (linear_time(spec, gpu, T) + elementwise_time(spec, gpu, T))
    res = simulate(plan, cluster, spec)
    return {"attention": spec.num_layers * att, "model without attention": layers + head + loss,
            "framework": framework_time(spec, gpu),
            "simulated compute (no optimizer)": res.compute_s[rank] - res.optimizer_s}


def rank_fn(rank: int, world: int, planner: str, profile_path: str, lengths: list[int]) -> dict:
    from ballonet.training.jobs import host

    host.setup_cpu_rank()  # as `ballonet train` runs a CPU rank
    torch.manual_seed(rank)
    spec = ballonet.model("tiny")
    nodes = 1 if world <= 2 else 2
    cluster = ballonet.cluster("cpu", num_nodes=nodes, gpus_per_node=world // nodes)
    with calibration.use(calibration.load(profile_path)):
        plan = plan_batch(lengths, cluster, spec, planner)
    measured = _measure(rank, plan, spec, with_table=rank == 0)
    with calibration.use(calibration.load(profile_path)):
        priced = _price(rank, plan, spec, cluster)
    return {"measured": measured, "priced": priced}


def report(results: list[dict], args, command: str) -> str:
    lines = [f"# Where a step's compute goes (CPU, tiny model, {args.ranks} gloo ranks)", "",
             f"Command: `{command}`. Profile: `{os.path.relpath(args.profile, ROOT)}`. Planner {args.planner}, "
             f"one batch of {sum(args.lengths)} tokens ({len(args.lengths)} documents). CPU seconds of each rank's "
             "thread, "
             f"median of 5. Load average at the start: {args.load:.1f}.", "",
             "| rank | piece | measured (s) | priced (s) | priced / measured |", "| --- | --- | --- | --- | --- |"]
    for rank, r in enumerate(results):
        m, p = r["measured"], r["priced"]
        rows = [("attention (engine, fwd+bwd, all layers)", m["attention"], p["attention"]),
                ("model without attention (GEMMs, elementwise, head, loss)", m["model without attention"],
                 p["model without attention"]),
                ("framework: FSDP2 model - bare model (paired)", m["framework"], p["framework"]),
                ("sum of the three pieces", m["attention"] + m["model without attention"] + m["framework"],
                 p["attention"] + p["model without attention"] + p["framework"]),
                ("FSDP2 model on the real plan (the loop's compute)", m["FSDP2 model, real plan"],
                 p["simulated compute (no optimizer)"])]
        for name, meas, priced in rows:
            lines.append(f"| {rank} | {name} | {meas:.4f} | {priced:.4f} | {priced / meas:.2f} |")
    lines += ["", "Rank 0's FSDP2 step under torch.profiler (ops by self CPU time, which is the profiler's wall "
              "clock: FSDP's collectives include their wait for other ranks; the profiler adds its own overhead):", "", "```", results[0]["measured"]["table"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=os.path.join(ROOT, "bench", "results", "fidelity_profile.json"))
    p.add_argument("--planner", default="packed_dp")
    p.add_argument("--ranks", type=int, default=2, choices=[2, 4], help="gloo ranks: 2 on one node, 4 on two")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="the batch's document lengths, comma-separated")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fidelity_breakdown.md"))
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    args.load = os.getloadavg()[0]
    results = run_ranks(args.ranks, rank_fn, args.planner, args.profile, args.lengths)
    cmd = command("investigations/fidelity_breakdown.py", argv)
    text = report(results, args, cmd)
    record(cmd, {"results": results}, os.path.splitext(args.out)[0] + ".json")
    write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
