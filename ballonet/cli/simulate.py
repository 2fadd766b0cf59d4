"""`ballonet simulate`: compare planners on a simulated cluster (step time, speedup, MFU),
with an optional bar chart (`--plot`) and Chrome traces (`--trace`)."""

from __future__ import annotations

import json
import os
import sys

from ballonet import specs, workloads
from ballonet.cli.common import (
    ZEPPELIN_OPTIONS,
    add_calibration_arg,
    add_target_args,
    add_zeppelin_options,
    check_batch_fits,
    infeasible_footer,
    positive_int,
    print_table,
    refuse_unused,
    row_cells,
    seed,
    subparser,
    target_model,
    zeppelin_options,
)
from ballonet.errors import InputError
from ballonet.paths import OUTPUT_ROOM, check_output, plot_formats, write_atomic


def register(sub) -> None:
    p = subparser(sub, "simulate", cmd_simulate,
                  help="compare planners on a simulated cluster: step time, speedup, MFU",
                  description="Sample --steps batches of a workload, plan each with every planner, and "
                              "simulate one training iteration per batch (ballonet.simulate).")
    add_target_args(p)
    p.add_argument("--workload", default="wlbllm",
                   help=f"workload preset ({', '.join(workloads.PRESETS)}) or lengths file to sample from: "
                        f"{workloads.LENGTHS_FILE_KINDS}")
    p.add_argument("--tokens-per-gpu", type=positive_int, default=16384, help="global batch tokens per GPU")
    p.add_argument("--max-length", type=positive_int, default=None, help="context window: documents are cut to it")
    p.add_argument("--planners", default="all", help="'all' or a comma-separated list (e.g. zeppelin,te_cp)")
    p.add_argument("--steps", type=positive_int, default=1, help="sampled batches to average over")
    p.add_argument("--seed", type=seed, default=0, help="seed of the batch sampler")
    add_zeppelin_options(p)
    p.add_argument("--no-engine", action="store_true",
                   help="every planner's sends posted behind the kernels queued before them (no communication "
                        "stream), double rings included; default: sends go once their data is there")
    p.add_argument("--one-group", action="store_true",
                   help="context-parallel and data-parallel traffic on one process group (the layer's FSDP "
                        "collectives first); default: separate groups, as the runtime runs them")
    p.add_argument("--tune", action="store_true",
                   help="run te_cp, llama_cp, wlb_llm and magi at their fastest CP degree (powers of two up to 64), "
                        "hybrid_dp and megatron_hcp at their fastest per-rank token budget (powers of two), as a "
                        "user tuning the job would")
    p.add_argument("--plot", default=None, help="write a bar chart of step times (.png, .svg, .pdf, ...)")
    p.add_argument("--trace", default=None,
                   help="write a Chrome/Perfetto trace of the first batch (out.json; out.PLANNER.json for several; "
                        "none for an infeasible planner)")
    p.add_argument("--json", action="store_true", help="print a JSON object with `results`")
    p.add_argument("--loan-schedule", metavar="FILE", default=None,
                   help="instead: tokens zeppelin trains over a period (TOML: lent = [[0, 8], [20, 24]] hours, "
                        "hours = 24) in which the cluster's loaned node groups are lent, reclaimed the other hours, "
                        "against its own groups alone; each change priced (the step in flight, a save and a load at "
                        "the checkpoint's size and the NICs' rate, --restart-s, the new plan)")
    p.add_argument("--restart-s", type=float, default=None,
                   help="with --loan-schedule: seconds a restart takes besides the load and the plan (default: "
                        "60, an assumption)")
    add_calibration_arg(p)


def _trace_paths(path: str, planners: list[str]) -> dict[str, str]:
    """--trace out.json: out.json for one planner, out.PLANNER.json for several."""
    if len(planners) == 1:
        return {planners[0]: path}
    root, ext = os.path.splitext(path)
    return {name: f"{root}.{name}{ext}" for name in planners}


def cmd_simulate(args) -> int:
    from rich.progress import Progress

    from ballonet.simulation import comparison

    cluster = specs.cluster(args.cluster, num_nodes=args.nodes)
    model = target_model(args)
    if args.loan_schedule:
        refuse_unused(args, "--loan-schedule", ("planners", "tune", "no_engine", "one_group", "plot", "trace"),
                      "prices zeppelin's plans alone, in a table")
        return _loan_day(args, cluster, model)
    if args.restart_s is not None:
        raise InputError("--restart-s needs --loan-schedule")
    planners = comparison.parse_planners(args.planners)
    twice = sorted({name for name in planners if planners.count(name) > 1})
    if twice:
        raise InputError(f"--planners {args.planners}: names {', '.join(twice)} more than once")
    if "zeppelin" not in planners:
        refuse_unused(args, "--planners", ZEPPELIN_OPTIONS, f"{args.planners} runs no zeppelin")
    check_batch_fits(args.tokens_per_gpu, cluster, model)
    traces = _trace_paths(args.trace, planners) if args.trace else {}
    for path in traces.values():
        check_output(path, "--trace")
    if args.plot:
        check_output(args.plot, "--plot", plot_formats(), min_free_bytes=OUTPUT_ROOM)
    popts = zeppelin_options(args)
    sopts = {"engine": not args.no_engine, "cp_group": not args.one_group}
    total = comparison.num_simulations(planners, args.steps)
    from rich.console import Console

    with Progress(console=Console(stderr=True), transient=True, disable=total < 4) as bar:
        task = bar.add_task("simulating", total=total)
        rows = comparison.compare(cluster, model, args.workload, args.tokens_per_gpu, planners, steps=args.steps,
                                  seed=args.seed, max_length=args.max_length, planner_options=popts,
                                  sim_options=sopts, tune=args.tune, progress=lambda n: bar.advance(task, n))
    if not any(r.feasible for r in rows):
        raise InputError(f"no planner can run the batch: {rows[0].reason}")
    written = [traces[r.planner] for r in rows if r.planner in traces and r.feasible]
    for r in rows:
        if r.planner in traces and r.feasible:
            write_atomic(traces[r.planner], r.first.to_chrome_trace)
    if written:
        print(f"wrote {len(written)} trace(s) (Perfetto, chrome://tracing): {', '.join(written)}", file=sys.stderr)
    title = (f"{model.name} on {cluster.num_ranks} GPUs ({cluster.name}), {args.workload}, "
             f"{args.tokens_per_gpu} tokens/GPU, {args.steps} batch(es)")
    if args.plot:
        from ballonet.cli.step_plot import plot_steps

        plot_steps(rows, args.plot, title)
        print(f"wrote the step plot: {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "num_gpus": cluster.num_ranks, "model": model.name,
                          "workload": args.workload, "tokens_per_gpu": args.tokens_per_gpu, "steps": args.steps,
                          "seed": args.seed, "results": [r.to_dict() for r in rows]}, indent=2, allow_nan=False))
        return 0
    table = [row_cells(r, ["step_time_s", "speedup_vs_te_cp", "mfu", "attention_imbalance", "exposed_comm_share",
                           "ratio_to_lower_bound"]) for r in rows]
    footer = "\n".join(x for x in (_in_wlb_order_line(rows, cluster, model), infeasible_footer(rows)) if x) or None
    print_table(title, ["planner", "step s", "vs te_cp", "MFU", "attn imbalance", "exposed comm",
                        "step / bound"], table, footer)
    return 0


def _in_wlb_order_line(rows, cluster, model) -> str | None:
    """Zeppelin's step on wlb_llm's outlier-delay steps, where the comparison priced it."""
    from ballonet.planning.wlb_llm import num_groups

    zep = next((r for r in rows if r.planner == "zeppelin" and r.step_in_wlb_order_s is not None), None)
    wlb = next((r for r in rows if r.planner == "wlb_llm" and r.feasible), None)
    if zep is None or wlb is None:
        return None
    groups = num_groups(cluster, model, wlb.options.get("cp_size"))
    return (f"zeppelin in wlb_llm's training order (the steps of its outlier delay over {groups} CP groups, as "
            f"`ballonet train --outlier-delay {groups}` trains): {zep.step_in_wlb_order_s:.3f} s, "
            f"{zep.step_in_wlb_order_s / wlb.step_time_s:.3f} of wlb_llm's step")


def _loan_day(args, cluster, model) -> int:
    """--loan-schedule: the period's tokens with the loans and without, each change priced."""
    import math

    from ballonet.simulation import loans

    schedule = loans.read_schedule(args.loan_schedule)
    restart_s = loans.RESTART_S if args.restart_s is None else args.restart_s
    if not (math.isfinite(restart_s) and restart_s >= 0):
        raise InputError(f"--restart-s must be a number >= 0, got {args.restart_s}")
    if not cluster.has_loans:
        raise InputError(f"--loan-schedule: cluster {cluster.name!r} has no node group with loaned = true")
    own = cluster.without_loaned()
    check_batch_fits(args.tokens_per_gpu * cluster.num_ranks // own.num_ranks, own, model)
    sampler = workloads.get(args.workload)
    batches = [sampler.sample_batch(args.tokens_per_gpu * cluster.num_ranks, args.seed + i, max_length=args.max_length)
               for i in range(args.steps)]
    options = zeppelin_options(args)
    day = loans.day(schedule, model, loans.membership(cluster, model, batches, **options),
                    loans.membership(own, model, batches, **options), sum(batches[0]), restart_s)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "model": model.name, "workload": args.workload,
                          "tokens_per_gpu": args.tokens_per_gpu, "steps": args.steps, "seed": args.seed,
                          "restart_s": restart_s, **day.to_dict()}, indent=2, allow_nan=False))
        return 0
    rows = [[f"{t.hour:g} h", t.to, f"{t.step_in_flight_s:.2f}", f"{t.save_s:.2f}", f"{t.restart_s:.1f}",
             f"{t.load_s:.2f}", f"{t.plan_s:.3f}", f"{t.downtime_s:.1f}", f"{t.lender_wait_s:.2f}"]
            for t in day.transitions]
    footer = (f"{schedule.lent_hours():g} of {schedule.hours:g} hours lent; step {day.full.step_s:.2f} s on "
              f"{cluster.num_ranks} GPUs, {day.own.step_s:.2f} s on the {own.num_ranks} of its own groups, "
              f"{day.tokens_per_step} tokens a step\ntokens: {day.tokens_with_loans:.4g} with the loans, "
              f"{day.tokens_alone:.4g} on its own groups alone ({day.tokens_with_loans / day.tokens_alone - 1:+.1%})")
    print_table(f"zeppelin, {model.name} on {cluster.name}, {args.workload}: the changes of {args.loan_schedule}",
                ["at", "to", "step in flight s", "save s", "restart s", "load s", "plan s", "downtime s",
                 "lender waits s"], rows, footer)
    return 0
