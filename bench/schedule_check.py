"""The schedule checker (`ballonet plan --check-schedule`) on every planner's plans: does
every rank's transfer schedule complete under NCCL's rules, and how long does the check
take, from 32 to 1024 ranks.

    OMP_NUM_THREADS=1 python bench/schedule_check.py --out bench/results/schedule_check.json

For each cluster size (H800 nodes of 8 GPUs) and planner: one batch of `--workload`
lengths, `--tokens-per-gpu` tokens per GPU, planned for llama-7b; the check's messages,
batches and seconds (recording every rank's step, then the replay; one run each, CPU
time of this process). Writes OUT (JSON) and OUT with .md (a table).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _common import command, record, write_text

import ballonet
from ballonet import workloads
from ballonet.runtime.schedule import check_schedule


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="4,128", help="comma-separated node counts (8 GPUs each)")
    p.add_argument("--cluster", default="h800-8nic")
    p.add_argument("--workload", default="prolong")
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--planners", default=",".join(ballonet.PLANNERS))
    p.add_argument("--out", default="bench/results/schedule_check.json")
    args = p.parse_args(argv)
    rows, model = [], ballonet.model("llama-7b")
    for nodes in map(int, args.nodes.split(",")):
        cluster = ballonet.cluster(args.cluster, num_nodes=nodes)
        lengths = workloads.get(args.workload).sample_batch(args.tokens_per_gpu * cluster.num_ranks, 0)
        for planner in args.planners.split(","):
            try:
                plan = ballonet.plan_batch(lengths, cluster, model, planner=planner)
            except ballonet.InputError as e:
                rows.append({"gpus": cluster.num_ranks, "planner": planner, "infeasible": str(e)})
                continue
            start = time.process_time()  # bytes: bf16 K/V rows of the model's KV heads, as `plan --check-schedule`
            check = check_schedule(plan, kv_dtype=torch.bfloat16, row_elems=model.num_kv_heads * model.head_dim)
            row = {"gpus": cluster.num_ranks, "planner": planner, "check_s": time.process_time() - start,
                   "rings": len(plan.rings), "double_rings": sum(r.comm == "double" for r in plan.rings),
                   "routes": len(plan.routes), "remap": bool(plan.remap), **check.to_dict()}
            rows.append(row)
            print(row, flush=True)
    recorded = record(command("schedule_check.py", argv), {"workload": args.workload, "cluster": args.cluster,
                                                           "tokens_per_gpu": args.tokens_per_gpu, "rows": rows},
                      args.out)
    write_text(args.out.removesuffix(".json") + ".md", markdown(recorded))
    return 0 if all(r.get("completes", True) for r in rows) else 1


def markdown(recorded: dict) -> str:
    lines = [f"# The schedule checker on every planner's plans ({recorded['date']})", "",
             f"`{recorded['command']}` on {recorded['machine']}: llama-7b, {recorded['workload']} batches of "
             f"{recorded['tokens_per_gpu']} tokens per GPU on {recorded['cluster']} nodes; one training step "
             "(forward, full recomputation, backward) of every rank recorded, then replayed under NCCL's rules. "
             "Seconds: CPU time of one run (the VM is shared; take them as the order of magnitude).", "",
             "| GPUs | planner | completes | messages | batches | rings (double) | routed hops | remap | check s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in recorded["rows"]:
        if "infeasible" in r:
            lines.append(f"| {r['gpus']} | {r['planner']} | infeasible | | | | | | |")
            continue
        lines.append(f"| {r['gpus']} | {r['planner']} | {'yes' if r['completes'] else 'NO: ' + r['reason']} | "
                     f"{r['messages']} | {r['batches']} | {r['rings']} ({r['double_rings']}) | {r['routes']} | "
                     f"{'yes' if r['remap'] else 'no'} | {r['check_s']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
