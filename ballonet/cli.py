"""`ballonet` command line: thin argparse subcommands over library functions.

Every command prints a human view by default and, where it has one, a JSON object with
`--json`. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from ballonet import cost_model, specs
from ballonet.errors import InputError
from ballonet.plan import InvalidPlan


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _print_table(title: str, columns: list[str], rows: list[list], footer: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(x) for x in row])
    console = Console()
    console.print(table)
    if footer:
        console.print(footer)


def _add_target_args(p) -> None:
    """--cluster, --nodes, --model, --tp: what is planned or simulated."""
    p.add_argument("--cluster", default="h200-8nic", help=f"cluster preset ({', '.join(specs.CLUSTERS)}) or TOML file")
    p.add_argument("--nodes", type=_positive_int, default=None, help="number of nodes (default: the preset's)")
    p.add_argument("--model", default="llama-7b", help=f"model preset ({', '.join(specs.MODELS)})")
    p.add_argument("--tp", type=_positive_int, default=None, help="tensor-parallel degree (default: the preset's)")


def _add_zeppelin_options(p) -> None:
    """Zeppelin's parts switched off one by one (the paper's ablation)."""
    p.add_argument("--no-routing", action="store_true", help="ablation: zeppelin without the routing layer")
    p.add_argument("--no-remap", action="store_true", help="ablation: zeppelin without the remapping layer")
    p.add_argument("--no-hierarchical", action="store_true",
                   help="ablation: zeppelin without hierarchical classes (split documents span every rank)")
    p.add_argument("--assume-homogeneous", action="store_true",
                   help="zeppelin plans as if every GPU were the cluster's first type (memory caps stay real; "
                        "the simulator still runs the real devices)")


# ---- cost ----------------------------------------------------------------------------


def cmd_cost(args) -> int:
    cluster = specs.cluster(args.cluster)
    model = specs.model(args.model, **({"tp": args.tp} if args.tp else {}))
    group = cluster.groups[0]
    cost = cost_model.sequence_cost(model, group, args.length)
    report = {
        "model": model.name,
        "cluster": cluster.name,
        "gpu": group.gpu,
        "length": args.length,
        "attention_flops_fwd": cost.attention_flops_fwd,
        "linear_flops_fwd": cost.linear_flops_fwd,
        "attention_time_s": cost.attention_time_s,
        "linear_time_s": cost.linear_time_s,
        "step_time_s": cost.step_time_s,
        "activation_bytes": cost.activation_bytes,
        "breakeven_chunk_tokens": cost.breakeven_chunk_tokens,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    att_share = cost.attention_time_s / (cost.attention_time_s + cost.linear_time_s)
    rows = [
        ["attention FLOPs (fwd, per layer)", f"{cost.attention_flops_fwd:.3e}"],
        ["linear FLOPs (fwd, per layer)", f"{cost.linear_flops_fwd:.3e}"],
        ["attention time (fwd, per layer)", f"{cost.attention_time_s * 1e3:.3f} ms"],
        ["linear time (fwd, per layer)", f"{cost.linear_time_s * 1e3:.3f} ms"],
        ["attention share of layer time", f"{att_share:.1%}"],
        ["fwd+bwd, all layers, one GPU", f"{cost.step_time_s:.3f} s"],
        ["activation memory", f"{cost.activation_bytes / 2**30:.2f} GiB"],
        ["break-even ring chunk, NVLink/intra", f"{cost.breakeven_chunk_tokens['intra']} tokens"],
        ["break-even ring chunk, NIC/inter", f"{cost.breakeven_chunk_tokens['inter']} tokens"],
    ]
    _print_table(f"{model.name}, one {args.length}-token document on {group.gpu} ({cluster.name})",
                 ["quantity", "value"], rows)
    return 0


def _add_cost(sub) -> None:
    p = sub.add_parser("cost", help="FLOPs, time, memory and ring break-even of one document",
                       description="What one document of --length tokens costs on one GPU of the cluster.")
    p.add_argument("--model", default="llama-7b", help=f"model preset ({', '.join(specs.MODELS)})")
    p.add_argument("--cluster", default="h200-8nic", help=f"cluster preset ({', '.join(specs.CLUSTERS)}) or TOML file")
    p.add_argument("--length", type=_positive_int, required=True, help="document length in tokens")
    p.add_argument("--tp", type=_positive_int, default=None, help="tensor-parallel degree (default: the preset's)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_cost)


# ---- demo ----------------------------------------------------------------------------


def cmd_demo(args) -> int:
    import os
    import tempfile

    from ballonet.simulation import comparison
    from ballonet.training.launch import launch

    cluster, model = specs.cluster("a800-4nic", num_nodes=4), specs.model("llama-7b")
    planners = ["zeppelin", "te_cp", "hybrid_dp", "packed_dp"]
    print(f"1/2  Simulated: {model.name} on {cluster.num_ranks} A800 GPUs (4 nodes, 2 GPUs per 200 Gb/s NIC), "
          f"wlbllm documents, {args.tokens_per_gpu} tokens per GPU\n", flush=True)
    rows = comparison.compare(cluster, model, "wlbllm", args.tokens_per_gpu, planners, steps=1, seed=args.seed)
    _print_table("one training iteration, simulated", ["planner", "step s", "vs te_cp", "MFU", "attn imbalance",
                                                       "exposed comm"],
                 [[r.planner, f"{r.step_time_s:.3f}", f"{r.speedup_vs_te_cp:.2f}x", f"{r.mfu:.1%}",
                   f"{r.attention_imbalance:.2f}", f"{r.exposed_comm_share:.1%}"] for r in rows])
    print(f"\n2/2  Real: the tiny model trained on 4 CPU ranks (2 emulated nodes of 2) with zeppelin plans, "
          f"on the Python standard library's source files, {args.steps} steps\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        argv = ["--model", "tiny", "--corpus", "stdlib", "--planner", "zeppelin", "--nodes", "2",
                "--global-tokens", "8192", "--max-doc-tokens", "4096", "--steps", str(args.steps),
                "--seed", str(args.seed), "--json-log", log, "--log-every", "5"]
        code = launch(argv, nproc=4, max_restarts=0)
        if code:
            return code
        with open(log) as f:
            records = [json.loads(line) for line in f]
    first, last = records[0], records[-1]
    imbalance = sorted(r["compute_s_max"] / r["compute_s_mean"] for r in records)
    print(f"\nloss {first['loss']:.3f} -> {last['loss']:.3f} over {len(records)} steps; per-rank compute "
          f"max/mean: median {imbalance[len(imbalance) // 2]:.2f}, worst {imbalance[-1]:.2f}; "
          f"planning {sum(r['plan_ms'] for r in records) / len(records):.1f} ms per batch (in the background)")
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="a short tour: a simulated comparison, then a real 4-rank training",
                       description="The README's main job: simulate planners on a 32-GPU A800 cluster, then "
                                   "train the tiny model on 4 CPU ranks with zeppelin plans.")
    p.add_argument("--steps", type=_positive_int, default=20, help="training steps (default: %(default)s)")
    p.add_argument("--tokens-per-gpu", type=_positive_int, default=16384, help="simulated tokens per GPU")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)


# ---- train ---------------------------------------------------------------------------


def _strip_launch_flags(argv: list[str]) -> list[str]:
    """The `train` arguments each torchrun rank gets: without --nproc / --max-restarts."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--max-restarts"):
            skip = True
        elif not a.startswith(("--nproc=", "--max-restarts=")):
            out.append(a)
    return out


def cmd_train(args) -> int:
    import os

    from ballonet.training import config as train_config
    from ballonet.training.launch import launch
    from ballonet.training.loop import preflight, train

    if args.nproc and "RANK" not in os.environ:
        if args.nproc < 1:
            raise InputError(f"--nproc must be positive, got {args.nproc}")
        if args.gpus_per_node and args.gpus_per_node * args.nodes != args.nproc:
            raise InputError(f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} != --nproc {args.nproc}")
        preflight(train_config.config_from_args(args), args.nproc)  # bad input fails before any launch
        argv = args.argv[args.argv.index("train") + 1:]
        return launch(_strip_launch_flags(argv), args.nproc, args.max_restarts)
    train(train_config.config_from_args(args))
    return 0


def _add_train(sub) -> None:
    from ballonet.training import config as train_config

    p = sub.add_parser("train", help="train a model on balanced, planned batches (torchrun; gloo on CPU)",
                       description="Train with torchrun (`torchrun --nproc-per-node N -m ballonet train ...`) "
                                   "or let `--nproc N` launch it.")
    train_config.add_arguments(p)
    p.set_defaults(func=cmd_train)


# ---- prepare -------------------------------------------------------------------------


def cmd_prepare(args) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from ballonet.training import prepare

    config = prepare.PrepareConfig(data=args.data, out=args.out, tokenizer=args.tokenizer,
                                   text_column=args.text_column, batch_size=args.batch_size)
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=args.json) as bar:
        task = bar.add_task("tokenizing", total=prepare.input_bytes(args.data))
        manifest = prepare.prepare(config, progress=lambda n: bar.advance(task, n))
    if args.json:
        print(json.dumps({"out": args.out, **manifest}, indent=2))
    else:
        print(f"{args.out}: {manifest['num_docs']} documents, {manifest['num_tokens']} tokens "
              f"({manifest['dtype']}, vocabulary {manifest['vocab_size']}) in {len(manifest['shards'])} shard(s)")
    return 0


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus once into memory-mapped token shards for `train --corpus`",
                       description="Tokenize a .jsonl or .parquet file, or a folder of text files, into a new "
                                   "folder of token shards with a document index (train with --corpus OUT).")
    p.add_argument("--data", required=True, help="a .jsonl or .parquet file, or a folder of text files")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (UTF-8 bytes, default), a Hugging Face tokenizer.json, or a folder holding one")
    p.add_argument("--out", required=True, help="the folder to create (must not exist)")
    p.add_argument("--text-column", default="text", help="JSON key or Parquet column of the text (default: text)")
    p.add_argument("--batch-size", type=_positive_int, default=1024, help="documents per tokenizer call")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=cmd_prepare)


# ---- simulate ------------------------------------------------------------------------


def _plot_rows(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2, 4))
    names = [r.planner for r in rows]
    ax.bar(names, [r.step_time_s for r in rows], color="tab:blue", label="step time")
    ax.scatter(names, [r.lower_bound_s for r in rows], color="black", marker="_", s=600, label="lower bound")
    for i, r in enumerate(rows):
        if r.speedup_vs_te_cp:
            ax.annotate(f"{r.speedup_vs_te_cp:.2f}x", (i, r.step_time_s), ha="center", va="bottom")
    ax.set_ylabel("seconds per step")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_simulate(args) -> int:
    from rich.progress import Progress

    from ballonet.simulation import comparison

    cluster = specs.cluster(args.cluster, num_nodes=args.nodes)
    model = specs.model(args.model, **({"tp": args.tp} if args.tp else {}))
    planners = comparison.parse_planners(args.planners)
    popts = {k: False for k in ("routing", "remap", "hierarchical") if getattr(args, f"no_{k}")}
    if args.assume_homogeneous:
        popts["assume_homogeneous"] = True
    sopts = {"engine": False} if args.no_engine else {}
    total = comparison.num_simulations(planners, args.steps)
    from rich.console import Console

    with Progress(console=Console(stderr=True), transient=True, disable=total < 4) as bar:
        task = bar.add_task("simulating", total=total)
        rows = comparison.compare(cluster, model, args.workload, args.tokens_per_gpu, planners, steps=args.steps,
                                  seed=args.seed, max_length=args.max_length, planner_options=popts,
                                  sim_options=sopts, progress=lambda n: bar.advance(task, n))
    if args.trace:
        for r in rows:
            path = args.trace if len(rows) == 1 else args.trace.replace(".json", f".{r.planner}.json")
            r.first.to_chrome_trace(path)
    title = (f"{model.name} on {cluster.num_ranks} GPUs ({cluster.name}), {args.workload}, "
             f"{args.tokens_per_gpu} tokens/GPU, {args.steps} batch(es)")
    if args.plot:
        _plot_rows(rows, args.plot, title)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "num_gpus": cluster.num_ranks, "model": model.name,
                          "workload": args.workload, "tokens_per_gpu": args.tokens_per_gpu, "steps": args.steps,
                          "seed": args.seed, "results": [r.to_dict() for r in rows]}, indent=2))
        return 0
    table = [[r.planner, f"{r.step_time_s:.3f}",
              f"{r.speedup_vs_te_cp:.2f}x" if r.speedup_vs_te_cp else "-", f"{r.mfu:.1%}",
              f"{r.attention_imbalance:.2f}", f"{r.exposed_comm_share:.1%}", f"{r.ratio_to_lower_bound:.2f}"]
             for r in rows]
    _print_table(title, ["planner", "step s", "vs te_cp", "MFU", "attn imbalance", "exposed comm",
                         "step / bound"], table)
    return 0


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="compare planners on a simulated cluster: step time, speedup, MFU",
                       description="Sample --steps batches of a workload, plan each with every planner, and "
                                   "simulate one training iteration per batch (ballonet.simulate).")
    _add_target_args(p)
    p.add_argument("--workload", default="wlbllm", help="workload preset (wlbllm, prolong, shortmix) or lengths file")
    p.add_argument("--tokens-per-gpu", type=_positive_int, default=16384, help="global batch tokens per GPU")
    p.add_argument("--max-length", type=_positive_int, default=None, help="context window: documents are cut to it")
    p.add_argument("--planners", default="all", help="'all' or a comma-separated list (e.g. zeppelin,te_cp)")
    p.add_argument("--steps", type=_positive_int, default=1, help="sampled batches to average over")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch sampler")
    _add_zeppelin_options(p)
    p.add_argument("--no-engine", action="store_true",
                   help="ablation: zeppelin's attention run in a fixed order, sends issued after compute")
    p.add_argument("--plot", default=None, help="write a bar chart of step times (PNG)")
    p.add_argument("--trace", default=None,
                   help="write a Chrome/Perfetto trace of the first batch (out.json; out.PLANNER.json for several)")
    p.add_argument("--json", action="store_true", help="print a JSON object with `results`")
    p.set_defaults(func=cmd_simulate)


# ---- plan ----------------------------------------------------------------------------


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


def cmd_plan(args) -> int:
    import time

    from ballonet import workloads
    from ballonet.planning import plan_batch

    cluster = specs.cluster(args.cluster, num_nodes=args.nodes)
    model = specs.model(args.model, **({"tp": args.tp} if args.tp else {}))
    if args.lengths:
        lengths = workloads.load_lengths(args.lengths)
    else:
        lengths = workloads.get(args.workload).sample_batch(args.tokens_per_gpu * cluster.num_ranks, args.seed)
    options = {k: False for k in ("routing", "remap", "hierarchical") if getattr(args, f"no_{k}")}
    if args.assume_homogeneous:
        options["assume_homogeneous"] = True
    start = time.perf_counter()
    plan = plan_batch(lengths, cluster, model, planner=args.planner, **options)
    plan_ms = (time.perf_counter() - start) * 1e3
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
    report = _plan_report(plan, cluster, model, plan_ms)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = [[r["rank"], r["node"], r["gpu"], r["tokens_attention"], f"{r['attention_cost_s'] * 1e3:.3f}",
             r["tokens_linear"], f"{r['bytes_in'] / 2**20:.1f}", f"{r['bytes_out'] / 2**20:.1f}",
             "/".join(str(r["documents"][k]) for k in ("local", "intra", "inter"))] for r in report["ranks"]]
    m = report["metrics"]
    footer = (f"attention imbalance (max/mean seconds) {m['attention_imbalance']:.3f}   "
              f"linear imbalance (max/mean tokens after remap) {m['linear_imbalance']:.3f}\n"
              f"bytes per layer (forward): all {m['comm_bytes'] / 2**30:.2f} GiB, across nodes "
              f"{m['inter_node_bytes'] / 2**30:.2f} GiB, busiest NIC {m['max_nic_bytes'] / 2**30:.3f} GiB   "
              f"rings {m['num_rings']} ({m['num_inter_rings']} inter-node), planned in {plan_ms:.1f} ms"
              + ("" if report["valid"] else "\nINVALID PLAN"))
    _print_table(f"{plan.planner}: {len(lengths)} documents, {plan.num_tokens} tokens on {cluster.num_ranks} GPUs "
                 f"({cluster.name}), {model.name} (forward attention per layer)",
                 ["rank", "node", "gpu", "tokens", "attention ms", "linear tokens", "MiB in", "MiB out",
                  "docs local/intra/inter"], rows, footer)
    return 0


def _add_plan(sub) -> None:
    from ballonet.planning import PLANNERS

    p = sub.add_parser("plan", help="plan one batch: where every token goes, per-rank balance and traffic",
                       description="Plan one global batch with a planner and show each rank's tokens, attention "
                                   "cost, linear tokens after remap and bytes moved, with balance figures.")
    _add_target_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default="wlbllm", help="workload preset (wlbllm, prolong, shortmix) or file to sample")
    src.add_argument("--lengths", default=None, help="file of document lengths: the batch itself, in order")
    p.add_argument("--tokens-per-gpu", type=_positive_int, default=16384, help="batch tokens per GPU (with --workload)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch sampler")
    p.add_argument("--planner", default="zeppelin", help=f"one of {', '.join(PLANNERS)}")
    _add_zeppelin_options(p)
    p.add_argument("--out", default=None, help="write the plan as canonical JSON (Plan.from_json reads it)")
    p.add_argument("--json", action="store_true", help="print a JSON object: planner, valid, ranks, metrics")
    p.set_defaults(func=cmd_plan)


# ---- entry point ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ballonet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_cost, _add_train, _add_simulate, _add_plan):
        add(sub)
    _add_prepare(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except InputError as e:
        print(f"ballonet {args.command}: error: {e}", file=sys.stderr)
        return 2
