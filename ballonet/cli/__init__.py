"""`ballonet` command line: thin argparse subcommands over library functions.

Every command prints a human view by default and, where it has one, a JSON object with
`--json`. Bad input (argparse's errors included) is one line on stderr and exit code 2;
output paths are checked before any work and files are written whole or not at all.

One module per subcommand (`cost`, `demo`, `train`, `export`, `simulate`, `plan`,
`calibrate`, `prepare`), each with its `cmd_*` function and a `register(sub)` that adds its parser;
`common` holds what they share (the one-line-error parser, argument groups, tables),
`step_plot` the chart of `simulate --plot`.
Heavy libraries (torch, rich, matplotlib) are imported inside the commands, so `--help`
stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from ballonet.cli import calibrate, cost, demo, export, plan, prepare, simulate, train
from ballonet.cli.common import Parser, unrecognized
from ballonet.errors import InputError

__all__ = ["build_parser", "main"]

DESCRIPTION = ("Ballonet: plan, simulate and train language models on batches of variable-length, long-context "
               "documents, balanced over GPUs (of one type or several).")
EPILOG = ("Start with `ballonet demo` (a simulated comparison, then 4 CPU ranks training); `ballonet COMMAND --help` "
          "describes a command's flags, docs/guide.md every command.")


def build_parser() -> argparse.ArgumentParser:
    from ballonet import __version__

    parser = Parser(prog="ballonet", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"ballonet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, cost, train, export, simulate, plan, calibrate, prepare):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand that was given them, not by `ballonet`
        args.parser.error(unrecognized(extra, args.parser))
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that left early (`| head`) is noticed here, not at exit
        return code
    except InputError as e:
        from ballonet.training.jobs.launch import report_rank_error

        line = f"ballonet {args.command}: error: {_one_line(str(e))}"
        if not report_rank_error(line):
            print(line, file=sys.stderr)
        return e.exit_code
    except ValueError as e:  # json.dumps(..., allow_nan=False): every JSON output is strict
        if "not JSON compliant" not in str(e):
            raise
        print(f"ballonet {args.command}: error: the result holds a number JSON cannot hold (NaN or Infinity), "
              "which strict parsers refuse; check the inputs' values", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not Python's traceback; outputs are written whole or not at all
        print(f"ballonet {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
        print(f"ballonet {args.command}: error: the output was closed before all of it was written (broken pipe)",
              file=sys.stderr)
        return 2


def _one_line(message: str) -> str:
    """`message` with its control characters escaped (a file name may hold a newline), so
    that an error stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
