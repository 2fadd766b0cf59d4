"""`ballonet cost`: what one document costs on one GPU (FLOPs, time, memory, ring break-even),
for each GPU type of the cluster (or the one `--gpu` names)."""

from __future__ import annotations

import json

from ballonet import specs
from ballonet.cli.common import (
    add_calibration_arg,
    add_target_args,
    positive_int,
    print_table,
    subparser,
    target_model,
)
from ballonet.cost.memory import BELOW, activation_bytes, memory_cap
from ballonet.cost.recompute import cheapest_per_rank
from ballonet.cost.seconds import sequence_cost
from ballonet.errors import InputError


def register(sub) -> None:
    p = subparser(sub, "cost", cmd_cost, help="FLOPs, time, memory and ring break-even of one document",
                  description="What one document of --length tokens costs on one GPU of the cluster: on each of "
                              "its GPU types, or on --gpu's.")
    add_target_args(p)  # the nodes shard the model state, so they set the memory left for activations
    p.add_argument("--length", type=positive_int, required=True, help="document length in tokens")
    p.add_argument("--gpu", default=None, help="price this GPU type of the cluster only (default: each of its types)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON object (a cluster of several GPU types without --gpu: one per type, under "
                        "\"gpus\")")
    add_calibration_arg(p)


def cmd_cost(args) -> int:
    cluster = specs.cluster(args.cluster, num_nodes=args.nodes)
    model = target_model(args)
    types = list(dict.fromkeys(g.gpu for g in cluster.groups))
    if args.gpu is not None and args.gpu not in types:
        raise InputError(f"--gpu {args.gpu}: cluster {cluster.name!r} has no such GPU (it has {', '.join(types)})")
    groups = [next(g for g in cluster.groups if g.gpu == t) for t in ([args.gpu] if args.gpu else types)]
    reports = [_report(args, cluster, model, group) for group in groups]
    if args.json:
        out = reports[0] if len(reports) == 1 else {"model": model.name, "cluster": cluster.name,
                                                    "length": args.length, "gpus": reports}
        print(json.dumps(out, indent=2, allow_nan=False))
        return 0
    for group, report in zip(groups, reports):
        _print(args, cluster, model, group, report)
    return 0


def _report(args, cluster, model, group) -> dict:
    """The cost of one --length document on one GPU of `group` (the model state sharded over
    the group's GPUs, as `sequence_cost` prices it)."""
    if group.gpus_per_node % model.tp:
        raise InputError(f"--tp {model.tp} does not divide the {group.gpus_per_node} GPUs per node of "
                         f"{cluster.name!r} ({group.gpu})")
    num_dp = group.num_nodes * group.gpus_per_node // model.tp
    if cheapest_per_rank(model, [args.length], [group.gpu_type], num_dp) is None:
        need = activation_bytes(model, args.length, args.length, "full")
        room = memory_cap(model, group.gpu_type, num_dp)
        raise InputError(f"--length {args.length}: one document of {args.length} tokens cannot fit one {group.gpu} "
                         f"for {model.name}, even with full recomputation ({need / 2**30:.4g} GiB of activations, "
                         f"{max(room, 0) / 2**30:.4g} GiB left for them); the planner splits such a document over GPUs "
                         f"(`ballonet plan --lengths`)")
    cost = sequence_cost(model, group, args.length)
    return {
        "model": model.name,
        "cluster": cluster.name,
        "gpu": group.gpu,
        "length": args.length,
        "attention_flops_fwd": cost.attention_flops_fwd,
        "linear_flops_fwd": cost.linear_flops_fwd,
        "attention_time_s": cost.attention_time_s,
        "attention_backward_time_s": cost.attention_backward_time_s,
        "linear_time_s": cost.linear_time_s,
        "recompute": cost.recompute,
        "recompute_layers": cost.recompute_layers,
        "step_time_s": cost.step_time_s,
        "activation_bytes": cost.activation_bytes,
        "breakeven_chunk_tokens": cost.breakeven_chunk_tokens,
    }


def _print(args, cluster, model, group, cost: dict) -> None:
    att_share = cost["attention_time_s"] / (cost["attention_time_s"] + cost["linear_time_s"])
    partial = cost["recompute"] in BELOW
    layers = f", {cost['recompute_layers']} of {model.num_layers} layers" if partial else ""
    rows = [
        ["attention FLOPs (fwd, per layer)", f"{cost['attention_flops_fwd']:.3e}"],
        ["linear FLOPs (fwd, per layer)", f"{cost['linear_flops_fwd']:.3e}"],
        ["attention time (fwd, per layer)", f"{cost['attention_time_s'] * 1e3:.3f} ms"],
        ["attention time (bwd, per layer)", f"{cost['attention_backward_time_s'] * 1e3:.3f} ms"],
        ["linear time (fwd, per layer)", f"{cost['linear_time_s'] * 1e3:.3f} ms"],
        ["attention share of layer time", f"{att_share:.1%}"],
        ["fwd+bwd, all layers, one GPU", f"{cost['step_time_s']:.3f} s"],
        ["activation memory", f"{cost['activation_bytes'] / 2**30:.2f} GiB (recompute: {cost['recompute']}{layers})"],
        ["break-even ring chunk, NVLink/intra", f"{cost['breakeven_chunk_tokens']['intra']} tokens"],
        ["break-even ring chunk, NIC/inter", f"{cost['breakeven_chunk_tokens']['inter']} tokens"],
    ]
    print_table(f"{model.name}, one {args.length}-token document on {group.gpu} ({cluster.name})",
                ["quantity", "value"], rows)
