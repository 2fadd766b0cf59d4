"""`ballonet plan`: plan one batch and show where every token goes, with per-rank balance
and traffic (`_plan_report` is the JSON view; `--out` writes the plan itself)."""

from __future__ import annotations

import json

from ballonet import specs, workloads
from ballonet.cli.common import (
    add_calibration_arg,
    add_target_args,
    add_zeppelin_options,
    check_batch_fits,
    positive_int,
    print_table,
    refuse_unused,
    seed,
    subparser,
    target_model,
    zeppelin_options,
)
from ballonet.paths import check_output, write_atomic
from ballonet.plan import InvalidPlan


def register(sub) -> None:
    from ballonet.planning import PLANNERS

    p = subparser(sub, "plan", cmd_plan, help="plan one batch: where every token goes, per-rank balance and traffic",
                  description="Plan one global batch with a planner and show each rank's tokens, attention "
                              "cost, linear tokens after remap and bytes moved, with balance figures.")
    add_target_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default="wlbllm",
                     help=f"workload preset ({', '.join(workloads.PRESETS)}) or lengths file to sample from")
    src.add_argument("--lengths", default=None,
                     help=f"file of document lengths, the batch itself in order: {workloads.LENGTHS_FILE_KINDS}")
    p.add_argument("--tokens-per-gpu", type=positive_int, default=16384, help="batch tokens per GPU (with --workload)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the batch sampler (with --workload)")
    p.add_argument("--planner", default="zeppelin", help=f"one of {', '.join(PLANNERS)}")
    add_zeppelin_options(p)
    p.add_argument("--out", default=None, help="write the plan as canonical JSON (Plan.from_json reads it)")
    p.add_argument("--json", action="store_true", help="print a JSON object: planner, valid, ranks, metrics")
    p.add_argument("--check-schedule", action="store_true",
                   help="record every rank's transfers of a training step on this plan (forward, full "
                        "recomputation, backward, remaps, relays, double rings) and replay them under NCCL's "
                        "rules; exit 1 if they would deadlock (adds \"schedule_check\" to --json)")
    add_calibration_arg(p)


def _plan_report(plan, cluster, model, plan_ms: float) -> dict:
    from ballonet.planning.metrics import (
        plan_metrics,
        rank_attention_seconds,
        rank_bytes,
        rank_classes,
    )

    seconds = rank_attention_seconds(plan, cluster, model)
    sent, received = rank_bytes(plan, model)
    ranks = [{"rank": r, "node": plan.node_of_rank[r], "gpu": cluster.gpu_of(r * model.tp).name,
              "tokens_attention": plan.attention_tokens(r), "tokens_linear": plan.linear_tokens(r),
              "attention_cost_s": seconds[r], "bytes_out": sent[r], "bytes_in": received[r],
              "memory_bytes": plan.memory_bytes[r], "documents": rank_classes(plan, r)}
             for r in range(plan.num_ranks)]
    try:
        plan.validate()
        valid = True
    except InvalidPlan:
        valid = False
    return {"planner": plan.planner, "valid": valid, "cluster": cluster.name, "num_gpus": cluster.num_ranks,
            "model": model.name, "num_documents": len(plan.lengths), "num_tokens": plan.num_tokens,
            "digest": plan.digest, "ranks": ranks,
            "metrics": {**plan_metrics(plan, cluster, model), "plan_ms": plan_ms}}


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def cmd_plan(args) -> int:
    import time

    from ballonet.planning import plan_batch

    if args.out:
        check_output(args.out, "--out")
    cluster = specs.cluster(args.cluster, num_nodes=args.nodes)
    model = target_model(args)
    if args.lengths:
        refuse_unused(args, "--lengths", ("tokens_per_gpu", "seed"), "is the batch itself, not sampled")
        lengths = workloads.load_lengths(args.lengths)
        if len(lengths) > workloads.MAX_DOCUMENTS:
            raise workloads.too_many_documents(f"--lengths {args.lengths}")
    else:
        check_batch_fits(args.tokens_per_gpu, cluster, model)
        lengths = workloads.get(args.workload).sample_batch(args.tokens_per_gpu * cluster.num_ranks, args.seed)
    options = zeppelin_options(args)
    start = time.perf_counter()
    plan = plan_batch(lengths, cluster, model, planner=args.planner, **options)
    plan_ms = (time.perf_counter() - start) * 1e3
    if args.out:
        text = plan.to_json()
        write_atomic(args.out, lambda tmp: _write_text(tmp, text))
    report = _plan_report(plan, cluster, model, plan_ms)
    check = _check_schedule(plan, model) if args.check_schedule else None
    if check is not None:
        report["schedule_check"] = check.to_dict()
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))
        return 0 if check is None or check.completes else 1
    rows = [[r["rank"], r["node"], r["gpu"], r["tokens_attention"], f"{r['attention_cost_s'] * 1e3:.3f}",
             r["tokens_linear"], f"{r['bytes_in'] / 2**20:.1f}", f"{r['bytes_out'] / 2**20:.1f}",
             "/".join(str(r["documents"][k]) for k in ("local", "intra", "inter"))] for r in report["ranks"]]
    m = report["metrics"]
    footer = (f"compute imbalance (max/mean step seconds) {m['compute_imbalance']:.3f}   "
              f"attention imbalance (max/mean seconds) {m['attention_imbalance']:.3f}   "
              f"linear imbalance (max/mean tokens after remap) {m['linear_imbalance']:.3f}\n"
              f"bytes per layer (forward): all {m['comm_bytes'] / 2**30:.2f} GiB, across nodes "
              f"{m['inter_node_bytes'] / 2**30:.2f} GiB, busiest NIC {m['max_nic_bytes'] / 2**30:.3f} GiB   "
              f"rings {m['num_rings']} ({m['num_inter_rings']} inter-node), planned in {plan_ms:.1f} ms"
              + ("" if report["valid"] else "\nINVALID PLAN"))
    print_table(f"{plan.planner}: {len(lengths)} documents, {plan.num_tokens} tokens on {cluster.num_ranks} GPUs "
                f"({cluster.name}), {model.name} (forward attention per layer)",
                ["rank", "node", "gpu", "tokens", "attention ms", "linear tokens", "MiB in", "MiB out",
                 "docs local/intra/inter"], rows, footer)
    if check is not None:
        print(_check_line(check))
        return 0 if check.completes else 1
    return 0


def _check_schedule(plan, model):
    import torch

    from ballonet.runtime.schedule import check_schedule

    return check_schedule(plan, kv_dtype=torch.bfloat16 if model.dtype_bytes == 2 else torch.float32,
                          row_elems=model.num_kv_heads // model.tp * model.head_dim)


def _check_line(check) -> str:
    if check.completes:
        return (f"schedule check: completes under NCCL's rules ({check.messages} messages in {check.batches} "
                f"batches and {check.collectives} collectives on {check.ranks} ranks)")
    return f"schedule check: FAILS: {check.reason}"
