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
    print("Ballonet demo: the cost of documents of growing length for llama-7b on h200-8nic\n")
    model = specs.model("llama-7b")
    group = specs.cluster("h200-8nic").groups[0]
    rows = []
    for length in (512, 2048, 8192, 32768, 131072):
        c = cost_model.sequence_cost(model, group, length)
        share = c.attention_time_s / (c.attention_time_s + c.linear_time_s)
        rows.append([length, f"{c.attention_time_s * 1e3:.3f}", f"{c.linear_time_s * 1e3:.3f}", f"{share:.0%}"])
    _print_table("per-layer forward time on one H200", ["tokens", "attention ms", "linear ms", "attention share"], rows)
    c = cost_model.sequence_cost(model, group, 4096).breakeven_chunk_tokens
    print(f"\nA ring step hides its K/V transfer above {c['intra']} tokens per chunk on NVLink "
          f"and {c['inter']} on a 400 Gb/s NIC.")
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="a short tour: what variable-length batches cost and how Ballonet balances them",
                       description="Runs the README's main job.")
    p.set_defaults(func=cmd_demo)


# ---- entry point ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ballonet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_cost):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as e:
        print(f"ballonet {args.command}: error: {e}", file=sys.stderr)
        return 2
