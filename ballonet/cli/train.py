"""`ballonet train`: run the training loop under torchrun, or launch it with `--nproc N`."""

from __future__ import annotations

import os

from ballonet.cli.common import subparser
from ballonet.errors import InputError
from ballonet.paths import check_output


def register(sub) -> None:
    from ballonet.training import config as train_config

    p = subparser(sub, "train", cmd_train, help="train a model on balanced, planned batches (torchrun; gloo on CPU)",
                  description="Train with torchrun (`torchrun --nproc-per-node N -m ballonet train ...`) "
                              "or let `--nproc N` launch it.")
    train_config.add_arguments(p)


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
