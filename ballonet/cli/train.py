"""`ballonet train`: run the training loop under torchrun, or launch it with `--nproc N` (a
cluster file of several node groups: one rank per GPU of them; with `--lease`, over the
ranks the lease allows, started again at each change)."""

from __future__ import annotations

import os
import sys

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


def _ranks(config) -> tuple[int | None, int | None]:
    """(ranks to launch, or None for this process alone; with --lease, the ranks of the
    groups not loaned). A cluster of several node groups runs one rank per GPU of them."""
    from ballonet import specs
    from ballonet.training.jobs import lease

    cluster = specs.cluster(config.cluster)
    nproc = config.nproc if config.nproc is not None or len(cluster.groups) == 1 else cluster.num_ranks
    if not config.lease:
        return nproc, None
    if not cluster.has_loans:
        raise InputError(f"--lease {config.lease}: cluster {cluster.name!r} has no node group with loaned = true")
    lease.read_lease(config.lease)  # a file that is not a lease fails here
    if nproc not in (None, cluster.num_ranks):
        raise InputError(f"--lease: --nproc {nproc}, but cluster {cluster.name!r}'s node groups have "
                         f"{cluster.num_ranks} GPUs (the job runs on all of them while they are lent)")
    return cluster.num_ranks, cluster.without_loaned().num_ranks


def cmd_train(args) -> int:
    from ballonet.training import config as train_config
    from ballonet.training.jobs import lease
    from ballonet.training.jobs.launch import launch, report_rank_stop
    from ballonet.training.loop import preflight, train

    config = train_config.config_from_args(args)  # defaults < --config FILE < the flags given
    _check_outputs(config)
    if "RANK" not in os.environ:
        nproc, own = _ranks(config)
        if nproc is not None:
            if config.gpus_per_node and config.gpus_per_node * (config.nodes or 1) != nproc:
                raise InputError(f"--nodes {config.nodes or 1} x --gpus-per-node {config.gpus_per_node} != "
                                 f"--nproc {nproc}")
            for ranks in (nproc, own):  # bad input fails before any launch, on every membership
                if ranks:
                    preflight(config, ranks)
            argv = args.argv[args.argv.index("train") + 1:]
            return launch(_strip_launch_flags(argv), nproc, config.max_restarts, config.lease, own)
    try:
        train(config)
    except lease.Stopped as e:
        if report_rank_stop(e):
            return 0
        if e.reason == "lease" and e.leaves:
            lease.leave_rendezvous()
        if os.environ.get("RANK", "0") == "0":
            why = e.reason
            if e.reason == "preempted" and config.lease and "TORCHELASTIC_RUN_ID" in os.environ:
                why = "signalled: preempted, or torchrun's agent restarting for nodes the lease lends"
            print(f"ballonet train: stopped ({why}) after step {e.step}"
                  + (f", saved in {e.saved}" if e.saved else ", nothing saved (no --checkpoint-dir)"), file=sys.stderr)
        return e.exit_code
    return 0
