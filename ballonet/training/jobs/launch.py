"""Local multi-rank launch: `ballonet train --nproc N` runs the loop under torchrun's agent.

The agent runs in this process (what `torchrun` does in its own), so a failed rank is an
exception we can read rather than torchrun's traceback: a rank stopped by bad input
writes its one-line message to `BALLONET_ERROR_DIR/<rank>` (see `report_rank_error`) and
exits 2; the launcher prints that line once and exits 2 too. A rank that dies (killed,
out of memory) is reported as "rank N died (signal S)", exit 1, rather than as the lost
connection its peers saw (`_failure_line`).

Ranks start as `python -P -m ballonet` (Python's safe path: the working directory is
not on `sys.path`, so a `./ballonet/` folder there cannot stand in for the package).

A run that stops at a step boundary (`lease.py`) leaves its reason for the launcher
(`report_rank_stop`) and exits 0, so the agent does not spend a restart on it. A loan
that ends or begins starts the job again over the ranks the lease allows, resuming from
the step just saved; a preemption (SIGTERM or SIGINT to this process or to a rank: the
agent passes a signal on to the ranks and waits `SHUTDOWN_S` for them) is one line and
exit code `lease.PREEMPTED_EXIT`, for a scheduler to requeue on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile

from ballonet.training.jobs import lease

ERROR_DIR_ENV = "BALLONET_ERROR_DIR"
"""Set by `launch` for its ranks: where a rank leaves the line of its bad-input error."""
STOP = "stop"
"""The file in ERROR_DIR where rank 0 says why and after which step the run stopped."""
PREEMPT = "preempt"
"""The file in ERROR_DIR that tells the ranks the launcher got a signal (`_Preemption`)."""
SHUTDOWN_S = 120
"""How long the agent waits, after passing a signal on, for the ranks to finish their
step and save, before it kills them."""


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


def report_rank_stop(stopped: lease.Stopped) -> bool:
    """Under `launch`, rank 0 leaves why the run stopped for the launcher; returns whether
    the rank is under `launch` (then it exits 0)."""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None or not os.path.isdir(folder):
        return False
    if rank == "0":
        tmp = os.path.join(folder, f".{STOP}.tmp")
        with open(tmp, "w") as f:
            json.dump({"reason": stopped.reason, "step": stopped.step, "saved": stopped.saved}, f)
        os.replace(tmp, os.path.join(folder, STOP))
    return True


def stop_line(stop: dict | None, signal_name: str | None) -> str:
    """The launcher's one line after a preemption."""
    by = f" by {signal_name}" if signal_name else ""
    if stop is None:
        return (f"ballonet train: preempted{by} before the ranks reached a step boundary (or they took over "
                f"{SHUTDOWN_S} s to); the last checkpoint stands (exit {lease.PREEMPTED_EXIT})")
    saved = (f"saved it in {stop['saved']}; run again with --resume to continue" if stop["saved"]
             else "nothing saved (no --checkpoint-dir)")
    return f"ballonet train: preempted{by} after step {stop['step']}: {saved} (exit {lease.PREEMPTED_EXIT})"


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
    names = ["torch.distributed.elastic"] + [n for n in logging.root.manager.loggerDict
                                             if n.startswith("torch.distributed.elastic.")]
    loggers = [logging.getLogger(n) for n in names]  # each sets its own level (elastic's get_logger)
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
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


def _with_resume(argv: list[str]) -> list[str]:
    """`argv` resuming from the latest checkpoint (the one just saved), not a --resume-from."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--resume-from":
            skip = True
        elif not a.startswith("--resume-from="):
            out.append(a)
    return [*out, "--resume"]


class _Preemption:
    """SIGTERM or SIGINT to the launcher while torchrun's agent is not handling signals
    (before it starts the ranks, between two launches): noted here, and passed on to the
    ranks of the launch under way by a file they look for after every step
    (`preempt_file`)."""

    def __init__(self):
        self.signal: int | None = None
        self.folder: str | None = None

    def __call__(self, signum, frame) -> None:
        self.signal = signum
        if self.folder:
            open(os.path.join(self.folder, PREEMPT), "w").close()

    def install(self) -> dict:
        return {s: signal.signal(s, self) for s in lease.SIGNALS}


def preempt_file() -> str | None:
    """Under `launch`: the file whose presence tells a rank the job is preempted."""
    folder = os.environ.get(ERROR_DIR_ENV)
    return os.path.join(folder, PREEMPT) if folder else None


def launch(argv: list[str], nproc: int, max_restarts: int, lease_file: str | None = None,
           own_ranks: int | None = None) -> int:
    """Run `ballonet train argv` on `nproc` local ranks under torchrun's agent; returns the
    exit code (2 and the rank's one line when a rank stopped on bad input). With
    `lease_file`: on `nproc` ranks while it says lent, on `own_ranks` (the groups not
    loaned) while reclaimed, started again from the step saved at each change."""
    preemption = _Preemption()
    old = preemption.install()
    try:
        return _launch_all(argv, nproc, max_restarts, lease_file, own_ranks, preemption)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _launch_all(argv, nproc, max_restarts, lease_file, own_ranks, preemption: _Preemption) -> int:
    state, stop = lease.LENT, None
    while preemption.signal is None:
        if lease_file:
            state = lease.read_lease(lease_file) or state
        ranks = own_ranks if lease_file and state == lease.RECLAIMED and own_ranks else nproc
        code, stop, signal_name = _launch_once(argv, ranks, max_restarts, preemption)
        preemption.install()  # the agent's handlers raise in its own loop only
        if signal_name:
            preemption.signal = signal.Signals[signal_name]
        if preemption.signal is not None or (stop is not None and stop["reason"] == "preempted"):
            break
        if stop is None:
            return code
        print(f"ballonet train: the lease changed; step {stop['step']} saved, starting again", file=sys.stderr,
              flush=True)
        argv = _with_resume(argv)
    name = signal.Signals(preemption.signal).name if preemption.signal else None
    print(stop_line(stop, name), file=sys.stderr)
    return lease.PREEMPTED_EXIT


def _launch_once(argv: list[str], nproc: int, max_restarts: int,
                 preemption: _Preemption) -> tuple[int, dict | None, str | None]:
    """One run of the agent: (exit code, the ranks' stop record if they stopped, the
    signal the agent got if any)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                                "--monitor-interval", "0.5", "--shutdown-timeout", str(SHUTDOWN_S),
                                "-m", "ballonet", "train", *argv])
    code, signal_name = 0, None
    with tempfile.TemporaryDirectory(prefix="ballonet-errors-") as folder:
        preemption.folder = folder
        if preemption.signal is not None:  # noted while this launch was being set up
            preemption(preemption.signal, None)
        env = {ERROR_DIR_ENV: folder, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            with _environ(**env), _quiet_agent():
                config, cmd, cmd_args = torchrun.config_from_args(args)
                elastic_launch(config=config, entrypoint=cmd)("-P", *cmd_args)
        except ChildFailedError as e:
            line, code = _failure_line(e.failures, folder)
            print(line, file=sys.stderr)
        except SignalException as e:
            signal_name = signal.Signals(e.sigval).name
        preemption.folder = None
        stop = None
        if os.path.exists(os.path.join(folder, STOP)):
            with open(os.path.join(folder, STOP)) as f:
                stop = json.load(f)
    return code, stop, signal_name
