"""What every `ballonet` subcommand shares: the one-line-error parser, argument types and
groups, `--calibration`, and the rich tables the human views print."""

from __future__ import annotations

import argparse

from ballonet import specs


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block); `--help` is unchanged."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def subparser(sub, name: str, func, help: str, description: str) -> argparse.ArgumentParser:
    """The subcommand `name`, running `func(args)`."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=func)
    return p


def add_target_args(p) -> None:
    """--cluster, --nodes, --model, --tp: what is planned or simulated."""
    p.add_argument("--cluster", default="h200-8nic", help=f"cluster preset ({', '.join(specs.CLUSTERS)}) or TOML file")
    p.add_argument("--nodes", type=positive_int, default=None, help="number of nodes (default: the preset's)")
    p.add_argument("--model", default="llama-7b", help=f"model preset ({', '.join(specs.MODELS)})")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree (default: the preset's)")


def add_zeppelin_options(p) -> None:
    """Zeppelin's parts switched off one by one (the paper's ablation)."""
    p.add_argument("--no-routing", action="store_true", help="ablation: zeppelin without the routing layer")
    p.add_argument("--no-remap", action="store_true", help="ablation: zeppelin without the remapping layer")
    p.add_argument("--no-hierarchical", action="store_true",
                   help="ablation: zeppelin without hierarchical classes (split documents span every rank)")
    p.add_argument("--no-double", action="store_true",
                   help="zeppelin without double rings across nodes (a ring inside each node, rounds between "
                        "rail peers): every ring across nodes is one ring through them")
    p.add_argument("--assume-homogeneous", action="store_true",
                   help="zeppelin plans as if every GPU were the cluster's first type (memory caps stay real; "
                        "the simulator still runs the real devices)")


def zeppelin_options(args) -> dict:
    """The planner options `add_zeppelin_options`'s flags ask for."""
    options = {k: False for k in ("routing", "remap", "hierarchical", "double") if getattr(args, f"no_{k}")}
    if args.assume_homogeneous:
        options["assume_homogeneous"] = True
    return options


def add_calibration_arg(p) -> None:
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


def print_table(title: str, columns: list[str], rows: list[list], footer: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(x) for x in row])
    console = Console()
    if not console.is_terminal:  # piped or redirected: no terminal width to fit, so no name is cut
        from rich.measure import Measurement

        natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
        console = Console(width=max(console.width, natural))
    console.print(table)
    if footer:
        console.print(footer)


_CELL_FORMATS = {"step_time_s": "{:.3f}", "speedup_vs_te_cp": "{:.2f}x", "mfu": "{:.1%}",
                 "attention_imbalance": "{:.2f}", "exposed_comm_share": "{:.1%}", "ratio_to_lower_bound": "{:.2f}"}


def row_cells(row, keys: list[str]) -> list[str]:
    """A comparison row's planner and figures, or "infeasible" (the reasons go under the
    table: `infeasible_footer`)."""
    if not row.feasible:
        return [row.planner, "infeasible"] + ["-"] * (len(keys) - 1)
    values = [getattr(row, k) for k in keys]
    return [row.planner] + ["-" if v is None else _CELL_FORMATS[k].format(v) for k, v in zip(keys, values)]


def infeasible_footer(rows) -> str | None:
    lines = [f"infeasible: {r.reason}" for r in rows if not r.feasible]
    return "\n".join(lines) or None
