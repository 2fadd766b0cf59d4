"""`ballonet` command line: thin argparse subcommands over library functions.

Every command prints a human view by default and, where it has one, a JSON object with
`--json`. Bad input (argparse's errors included) is one line on stderr and exit code 2;
output paths are checked before any work and files are written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ballonet import cost_model, specs, workloads
from ballonet.errors import InputError
from ballonet.paths import check_output, write_atomic
from ballonet.plan import InvalidPlan


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block); `--help` is unchanged."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    if group.gpus_per_node % model.tp:
        raise InputError(f"--tp {model.tp} does not divide the {group.gpus_per_node} GPUs per node of {cluster.name!r}")
    cost = cost_model.sequence_cost(model, group, args.length)
    report = {
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
        ["attention time (bwd, per layer)", f"{cost.attention_backward_time_s * 1e3:.3f} ms"],
        ["linear time (fwd, per layer)", f"{cost.linear_time_s * 1e3:.3f} ms"],
        ["attention share of layer time", f"{att_share:.1%}"],
        ["fwd+bwd, all layers, one GPU", f"{cost.step_time_s:.3f} s"],
        ["activation memory", f"{cost.activation_bytes / 2**30:.2f} GiB (recompute: {cost.recompute})"],
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
    _add_calibration_arg(p)


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
                 [_row_cells(r, ["step_time_s", "speedup_vs_te_cp", "mfu", "attention_imbalance",
                                 "exposed_comm_share"]) for r in rows], _infeasible_footer(rows))
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


def _check_launch_flags(args) -> None:
    """The flags `TrainConfig` does not hold: the launch, and where the run writes."""
    for flag, value, least in (("--nproc", args.nproc, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                               ("--max-restarts", args.max_restarts, 0)):
        if value is not None and value < least:
            raise InputError(f"{flag} must be {'positive' if least else 'non-negative'}, got {value}")
    if args.json_log:
        check_output(args.json_log, "--json-log")
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise InputError(f"--checkpoint-dir {args.checkpoint_dir}: is a file; give a folder")


def cmd_train(args) -> int:
    _check_launch_flags(args)
    from ballonet.training import config as train_config
    from ballonet.training.launch import launch
    from ballonet.training.loop import preflight, train

    if args.nproc is not None and "RANK" not in os.environ:
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


_CELL_FORMATS = {"step_time_s": "{:.3f}", "speedup_vs_te_cp": "{:.2f}x", "mfu": "{:.1%}",
                 "attention_imbalance": "{:.2f}", "exposed_comm_share": "{:.1%}", "ratio_to_lower_bound": "{:.2f}"}


def _row_cells(row, keys: list[str]) -> list[str]:
    """The planner and its figures, or "infeasible" (the reasons go under the table: `_infeasible_footer`)."""
    if not row.feasible:
        return [row.planner, "infeasible"] + ["-"] * (len(keys) - 1)
    values = [getattr(row, k) for k in keys]
    return [row.planner] + ["-" if v is None else _CELL_FORMATS[k].format(v) for k, v in zip(keys, values)]


def _infeasible_footer(rows) -> str | None:
    lines = [f"infeasible: {r.reason}" for r in rows if not r.feasible]
    return "\n".join(lines) or None


def _plot_formats() -> tuple[str, ...]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return tuple("." + ext for ext in FigureCanvasAgg(Figure()).get_supported_filetypes())


def _trace_paths(path: str, planners: list[str]) -> dict[str, str]:
    """--trace out.json: out.json for one planner, out.PLANNER.json for several."""
    if len(planners) == 1:
        return {planners[0]: path}
    root, ext = os.path.splitext(path)
    return {name: f"{root}.{name}{ext}" for name in planners}


def _plot_rows(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.feasible]
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
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1][1:].lower()))
    plt.close(fig)


def cmd_simulate(args) -> int:
    from rich.progress import Progress

    from ballonet.simulation import comparison

    cluster = specs.cluster(args.cluster, num_nodes=args.nodes)
    model = specs.model(args.model, **({"tp": args.tp} if args.tp else {}))
    planners = comparison.parse_planners(args.planners)
    traces = _trace_paths(args.trace, planners) if args.trace else {}
    for path in traces.values():
        check_output(path, "--trace")
    if args.plot:
        check_output(args.plot, "--plot", _plot_formats())
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
    if not any(r.feasible for r in rows):
        raise InputError(f"no planner can run the batch: {rows[0].reason}")
    for r in rows:
        if r.planner in traces and r.feasible:
            write_atomic(traces[r.planner], r.first.to_chrome_trace)
    title = (f"{model.name} on {cluster.num_ranks} GPUs ({cluster.name}), {args.workload}, "
             f"{args.tokens_per_gpu} tokens/GPU, {args.steps} batch(es)")
    if args.plot:
        _plot_rows(rows, args.plot, title)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "num_gpus": cluster.num_ranks, "model": model.name,
                          "workload": args.workload, "tokens_per_gpu": args.tokens_per_gpu, "steps": args.steps,
                          "seed": args.seed, "results": [r.to_dict() for r in rows]}, indent=2))
        return 0
    table = [_row_cells(r, ["step_time_s", "speedup_vs_te_cp", "mfu", "attention_imbalance", "exposed_comm_share",
                            "ratio_to_lower_bound"]) for r in rows]
    _print_table(title, ["planner", "step s", "vs te_cp", "MFU", "attn imbalance", "exposed comm",
                         "step / bound"], table, _infeasible_footer(rows))
    return 0


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="compare planners on a simulated cluster: step time, speedup, MFU",
                       description="Sample --steps batches of a workload, plan each with every planner, and "
                                   "simulate one training iteration per batch (ballonet.simulate).")
    _add_target_args(p)
    p.add_argument("--workload", default="wlbllm",
                   help=f"workload preset ({', '.join(workloads.PRESETS)}) or lengths file to sample from: "
                        f"{workloads.LENGTHS_FILE_KINDS}")
    p.add_argument("--tokens-per-gpu", type=_positive_int, default=16384, help="global batch tokens per GPU")
    p.add_argument("--max-length", type=_positive_int, default=None, help="context window: documents are cut to it")
    p.add_argument("--planners", default="all", help="'all' or a comma-separated list (e.g. zeppelin,te_cp)")
    p.add_argument("--steps", type=_positive_int, default=1, help="sampled batches to average over")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch sampler")
    _add_zeppelin_options(p)
    p.add_argument("--no-engine", action="store_true",
                   help="ablation: zeppelin's attention run in a fixed order, sends issued after compute")
    p.add_argument("--plot", default=None, help="write a bar chart of step times (.png, .svg, .pdf, ...)")
    p.add_argument("--trace", default=None,
                   help="write a Chrome/Perfetto trace of the first batch (out.json; out.PLANNER.json for several; "
                        "none for an infeasible planner)")
    p.add_argument("--json", action="store_true", help="print a JSON object with `results`")
    p.set_defaults(func=cmd_simulate)
    _add_calibration_arg(p)


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


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def cmd_plan(args) -> int:
    import time

    from ballonet.planning import plan_batch

    if args.out:
        check_output(args.out, "--out")
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
        text = plan.to_json()
        write_atomic(args.out, lambda tmp: _write_text(tmp, text))
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
    src.add_argument("--workload", default="wlbllm",
                     help=f"workload preset ({', '.join(workloads.PRESETS)}) or lengths file to sample from")
    src.add_argument("--lengths", default=None,
                     help=f"file of document lengths, the batch itself in order: {workloads.LENGTHS_FILE_KINDS}")
    p.add_argument("--tokens-per-gpu", type=_positive_int, default=16384, help="batch tokens per GPU (with --workload)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch sampler")
    p.add_argument("--planner", default="zeppelin", help=f"one of {', '.join(PLANNERS)}")
    _add_zeppelin_options(p)
    p.add_argument("--out", default=None, help="write the plan as canonical JSON (Plan.from_json reads it)")
    p.add_argument("--json", action="store_true", help="print a JSON object: planner, valid, ranks, metrics")
    p.set_defaults(func=cmd_plan)
    _add_calibration_arg(p)


# ---- calibrate -----------------------------------------------------------------------


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's kernels and links; write a calibration profile",
                       description="Time attention (forward and backward), the linear layers and, under torchrun, "
                                   "point-to-point, all-to-all and all-reduce, with the runtime's own kernels and "
                                   "collectives; write the profile that --calibration FILE reads.")
    p.add_argument("--out", help="write the profile (JSON) to this file")
    p.add_argument("--json", action="store_true", help="print the profile and the raw measurements as JSON")
    p.add_argument("--plot", help="plot measured points and fitted curves to this image file")
    p.add_argument("--quick", action="store_true", help="a few seconds: short lengths, few sizes")
    p.add_argument("--max-length", type=_positive_int, default=None, help="longest document timed (tokens)")
    p.add_argument("--gpu", default=None, help="GPU type the profile is for (default: detected; 'cpu' on a CPU)")
    p.add_argument("--model", default=None, help="model whose layer shape the linear part is timed with "
                                                 "(default: tiny on CPU, llama-7b on a GPU)")
    p.add_argument("--cluster", default="cpu", help="cluster preset giving the nominal NIC rate")

    def run(args) -> int:
        from ballonet import calibrate

        return calibrate.command(args)

    p.set_defaults(func=run)


def _add_calibration_arg(p) -> None:
    """--calibration FILE: price the command's GPUs with a measured profile (`ballonet
    calibrate`). Wraps the parser's command, so call it after set_defaults(func=...)."""
    p.add_argument("--calibration", metavar="FILE", help="calibration profile from `ballonet calibrate` "
                                                         "(default: the built-in profiles)")
    func = p.get_default("func")

    def calibrated(args) -> int:
        from ballonet import calibration

        if not args.calibration:
            return func(args)
        with calibration.use(calibration.load(args.calibration)):
            return func(args)

    p.set_defaults(func=calibrated)


# ---- entry point ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ballonet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_cost, _add_train, _add_simulate, _add_plan, _add_calibrate):
        add(sub)
    _add_prepare(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except InputError as e:
        from ballonet.training.launch import report_rank_error

        line = f"ballonet {args.command}: error: {e}"
        if not report_rank_error(line):
            print(line, file=sys.stderr)
        return 2
