"""Local multi-rank launch: `ballonet train --nproc N` runs the loop under torchrun's agent.

The agent runs in this process (what `torchrun` does in its own), so a failed rank is an
exception we can read rather than torchrun's traceback: a rank stopped by bad input
writes its one-line message to `BALLONET_ERROR_DIR/<rank>` (see `report_rank_error`) and
exits 2; the launcher prints that line once and exits 2 too. A rank that dies (killed,
out of memory) is reported as "rank N died (signal S)", exit 1, rather than as the lost
connection its peers saw (`_failure_line`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile

ERROR_DIR_ENV = "BALLONET_ERROR_DIR"
"""Set by `launch` for its ranks: where a rank leaves the line of its bad-input error."""


def report_rank_error(line: str) -> bool:
    """Under `launch`, leave `line` for the launcher (instead of N ranks printing it) and
    return True; elsewhere return False."""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None or not os.path.isdir(folder):
        return False
    tmp = os.path.join(folder, f".{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(line)
    os.replace(tmp, os.path.join(folder, rank))
    return True


@contextlib.contextmanager
def _environ(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_agent():
    """torchrun's agent logs each failure with a traceback-like report: we report it ourselves."""
    logger = logging.getLogger("torch.distributed.elastic")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _failure_line(failures: dict, folder: str) -> tuple[str, int]:
    """The message and exit code to report for the failed ranks `failures` (rank ->
    ProcessFailure), in order of cause: a rank's own bad input (its line, exit 2); a rank
    that died by a signal (which its peers see as a lost connection: exit 1); a rank's
    own line of another failure (a timeout, a disagreement: exit 1); an exit code."""
    lines = {}
    for name in os.listdir(folder):
        if name.isdigit():
            with open(os.path.join(folder, name)) as f:
                lines[int(name)] = f.read().strip()
    # First failure first; within a timestamp (whole seconds) a death before the peers it cut
    # off, and before the ranks the agent then stopped with SIGTERM (which it records too).
    def cut_off(code: int) -> bool:
        return code >= 0 or code == -signal.SIGTERM

    order = sorted(failures, key=lambda r: (failures[r].timestamp, cut_off(failures[r].exitcode), r))
    for rank in order:
        if rank in lines and failures[rank].exitcode == 2:
            return lines[rank], 2
    first = order[0]
    if failures[first].exitcode < 0:
        return f"ballonet train: error: rank {first} died (signal {-failures[first].exitcode}); the others stopped", 1
    for rank in order + sorted(set(lines) - set(order)):
        if rank in lines:
            return lines[rank], 1
    return f"ballonet train: error: rank {order[0]} failed (exit code {failures[order[0]].exitcode})", 1


def launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Run `ballonet train argv` on `nproc` local ranks under torchrun's agent; returns the
    exit code (2 and the rank's one line when a rank stopped on bad input)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                                "--monitor-interval", "0.5", "-m", "ballonet", "train", *argv])
    with tempfile.TemporaryDirectory(prefix="ballonet-errors-") as folder:
        env = {ERROR_DIR_ENV: folder, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            with _environ(**env), _quiet_agent():
                config, cmd, cmd_args = torchrun.config_from_args(args)
                elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        except ChildFailedError as e:
            line, code = _failure_line(e.failures, folder)
            print(line, file=sys.stderr)
            return code
    return 0
