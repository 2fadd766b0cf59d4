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
    """The `train` arguments each torchrun rank gets: without --nproc / --max-restarts /
    --gpus-per-node (the launcher's)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--max-restarts", "--gpus-per-node"):
            skip = True
        elif not a.startswith(("--nproc=", "--max-restarts=", "--gpus-per-node=")):
            out.append(a)
    return out


def _check_outputs(config) -> None:
    """Where the run writes, checked before any launch."""
    if config.json_log:
        check_output(config.json_log, "--json-log")
    if config.checkpoint_dir and os.path.exists(config.checkpoint_dir) and not os.path.isdir(config.checkpoint_dir):
        raise InputError(f"--checkpoint-dir {config.checkpoint_dir}: is a file; give a folder")


def cmd_train(args) -> int:
    from ballonet.training import config as train_config
    from ballonet.training.launch import launch
    from ballonet.training.loop import preflight, train

    config = train_config.config_from_args(args)  # defaults < --config FILE < the flags given
    _check_outputs(config)
    if config.nproc is not None and "RANK" not in os.environ:
        if config.gpus_per_node and config.gpus_per_node * config.nodes != config.nproc:
            raise InputError(f"--nodes {config.nodes} x --gpus-per-node {config.gpus_per_node} != "
                             f"--nproc {config.nproc}")
        preflight(config, config.nproc)  # bad input fails before any launch
        argv = args.argv[args.argv.index("train") + 1:]
        return launch(_strip_launch_flags(argv), config.nproc, config.max_restarts)
    train(config)
    return 0
