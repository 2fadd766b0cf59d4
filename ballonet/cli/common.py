"""What every `ballonet` subcommand shares: the one-line-error parser, argument types and
groups, `--calibration`, and the rich tables the human views print."""

from __future__ import annotations

import argparse
import dataclasses

from ballonet import specs
from ballonet.errors import InputError
from ballonet.user_files import INT64_MAX


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block) and no abbreviated flags (`--npro`
    is refused, not taken for `--nproc`: `train` passes its flags on to torchrun's ranks, and
    an abbreviation would meet torchrun's own parser); `--help` is unchanged."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def unrecognized(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" line, with the flag meant: Ballonet's name for
    another trainer's flag (`foreign_flags`), or a flag of this command close to it."""
    import difflib

    from ballonet.cli.foreign_flags import equivalent

    message = f"unrecognized arguments: {' '.join(extra)}"
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for arg in extra:
        ours = equivalent(arg, set(known)) if arg.startswith("--") else None
        if ours:
            return f"{message}; {ours}"
    for arg in (a.split("=", 1)[0] for a in extra if a.startswith("--")):
        close = [k for k in known if k.startswith(arg)] or difflib.get_close_matches(arg, known, n=1)
        if close:
            return f"{message}; did you mean {' or '.join(close[:3])}?"
    return message


def seed(text: str) -> int:
    """A sampler's seed: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if not 0 <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2^63 - 1, got {text!r}")
    return value


def refuse_unused(args, flag: str, dests: tuple[str, ...], why: str) -> None:
    """Refuse, in one line, each of `dests`' flags given (set off its default) beside `flag`,
    which ignores them, instead of ignoring them silently."""
    given = [f"--{d.replace('_', '-')}" for d in dests if getattr(args, d) != args.parser.get_default(d)]
    if given:
        raise InputError(f"{flag} {why}: {', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value > INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected a positive integer below 2^63, got {text!r}")
    return value


def subparser(sub, name: str, func, help: str, description: str) -> argparse.ArgumentParser:
    """The subcommand `name`, running `func(args)`."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=func, parser=p)
    return p


def target_model(args):
    """--model (a preset, a model TOML file, or hf:DIR: a Hugging Face folder's config.json,
    as `train` reads it) with --tp."""
    from ballonet.integrations import hf_model

    spec = hf_model.model_spec(args.model) if args.model.startswith(hf_model.PREFIX) else specs.model(args.model)
    return dataclasses.replace(spec, tp=args.tp) if args.tp else spec


def add_target_args(p) -> None:
    """--cluster, --nodes, --model, --tp: what is planned or simulated."""
    p.add_argument("--cluster", default="h200-8nic", help=f"cluster preset ({', '.join(specs.CLUSTERS)}) or TOML file")
    p.add_argument("--nodes", type=positive_int, default=None,
                   help="number of nodes (default: the preset's); a cluster of several node groups sets its nodes "
                        "per group, and --nodes, if given, must be their sum")
    p.add_argument("--model", default="llama-7b",
                   help=f"model preset ({', '.join(specs.MODELS)}), TOML file, or hf:DIR (a Hugging Face folder)")
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


ZEPPELIN_OPTIONS = ("no_routing", "no_remap", "no_hierarchical", "no_double", "assume_homogeneous")
"""The destinations of `add_zeppelin_options`'s flags."""


def zeppelin_options(args) -> dict:
    """The planner options `add_zeppelin_options`'s flags ask for."""
    options = {k[3:]: False for k in ZEPPELIN_OPTIONS if k.startswith("no_") and getattr(args, k)}
    if args.assume_homogeneous:
        options["assume_homogeneous"] = True
    return options


def check_batch_fits(tokens_per_gpu: int, cluster, model, flag: str = "--tokens-per-gpu") -> None:
    """Refuse, before a batch is drawn, one larger than the whole cluster can hold (the
    planner's own capacity: `planning.devices`)."""
    from ballonet.errors import InfeasiblePlan
    from ballonet.planning.devices import check_feasible, devices

    dev = devices(cluster, model)
    check_feasible([], dev, model)  # the model state alone over a GPU's memory
    capacity, num_tokens = int(dev.token_cap.sum()), tokens_per_gpu * cluster.num_ranks
    if num_tokens > capacity:
        raise InfeasiblePlan(f"{flag} {tokens_per_gpu}: a batch of {num_tokens} tokens, over the {capacity} tokens "
                             f"the whole cluster can hold for model {model.name!r}")


def add_calibration_arg(p) -> None:
    """--calibration FILE: price the command's GPUs with a measured profile (`ballonet
    calibrate`), those of the profile's GPU type, which the cluster must have (a profile
    that would price nothing is refused), or those of --calibration-gpu. Wraps the
    parser's command, so call it after set_defaults(func=...)."""
    p.add_argument("--calibration", metavar="FILE", help="calibration profile from `ballonet calibrate` "
                                                         "(default: the built-in profiles)")
    p.add_argument("--calibration-gpu", metavar="GPU",
                   help="with --calibration: price this GPU type of the cluster with the profile, whatever type "
                        "it was measured on (default: the profile's own type, which the cluster must have)")
    func = p.get_default("func")

    def calibrated(args) -> int:
        import dataclasses

        from ballonet import calibration
        from ballonet.cost import hardware

        if not args.calibration:
            if args.calibration_gpu:
                raise InputError("--calibration-gpu needs --calibration")
            return func(args)
        profile = calibration.load(args.calibration)
        cluster = specs.cluster(args.cluster, num_nodes=getattr(args, "nodes", None))
        has = sorted({g.gpu for g in cluster.groups})
        if args.calibration_gpu:
            hardware.gpu(args.calibration_gpu)  # an unknown type fails here
            if args.calibration_gpu not in has:
                raise InputError(f"--calibration-gpu {args.calibration_gpu}: cluster {cluster.name!r} has no such GPU "
                                 f"(it has {', '.join(has)})")
            profile = dataclasses.replace(profile, gpu=args.calibration_gpu)
        elif profile.gpu not in has:
            raise InputError(f"--calibration {args.calibration}: a profile of {profile.gpu!r}, which cluster "
                             f"{cluster.name!r} does not have (it has {', '.join(has)}), so it would price nothing; "
                             f"to price one of those with it, add --calibration-gpu GPU")
        with calibration.use(profile):
            return func(args)

    p.set_defaults(func=calibrated)


def _broken_pipe() -> None:
    raise BrokenPipeError


def stdout_console(width: int | None = None):
    """A rich console on stdout (`width` columns, or the terminal's) whose closed pipe
    (`| head`) raises BrokenPipeError for `cli.main` to report, instead of rich's silent
    exit 1."""
    from rich.console import Console

    console = Console(width=width)
    console.on_broken_pipe = _broken_pipe
    return console


def print_table(title: str, columns: list[str], rows: list[list], footer: str | None = None) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(x) for x in row])
    console = stdout_console()
    if not console.is_terminal:  # piped or redirected: no terminal width to fit, so no name is cut
        from rich.measure import Measurement

        natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
        console = stdout_console(width=max(console.width, natural))
    console.print(table)
    if footer:  # piped: the lines as they are, not wrapped at the table's width
        console.print(footer, soft_wrap=not console.is_terminal)


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
