"""The command line's parsers as the tests read them (no tests here)."""

import argparse

from ballonet import cli


def subcommand_flags() -> dict[str, set[str]]:
    """Each `ballonet` subcommand's option strings, from the real parsers."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}
