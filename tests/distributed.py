"""Start gloo ranks on CPU, run one function in each, collect what each returns.

    results = run_ranks(4, check_fn, arg1, arg2)   # [check_fn(rank, 4, arg1, arg2) per rank]

`fn` must be a module-level (picklable) function and its result must pickle. Each rank
runs with one thread, inside `init_process_group("gloo")` (default group = all ranks).
If any rank raises (or the ranks outlive `timeout`), the others are stopped and
`RankFailed` carries each failing rank's traceback. Ranks are not forked from the
caller (a pytest worker that has run torch, and may hold threads): they come from a
fork server, a fresh process that has only imported `PRELOAD`, so a rank starts as a
spawned one would without importing torch and Ballonet again (2-4 s a rank; the test
suite's wall time halved). A group still costs its process group's start: put many
checks in one function.
"""

from __future__ import annotations

import os
import queue as queue_lib
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRACE_S = 5.0
"""After the first failure, how long to wait for the other ranks to report theirs."""


class RankFailed(AssertionError):
    pass


def _entry(rank: int, world_size: int, init_file: str, fn, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD = ["torch", "torch.distributed", "numpy", "ballonet", "ballonet.training.loop", "ballonet.training.parallelism.model"]
"""What the fork server imports once. It runs no torch op, so it starts no OpenMP pool; with
OMP_NUM_THREADS=1 (the README's test command) it holds no thread at all, else only numpy's
OpenBLAS pool, which OpenBLAS shuts down before a fork."""


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0) -> list:
    """[fn(rank, world_size, *args) for rank in range(world_size)], each in its own process
    (from the fork server, see the module docstring). `timeout` is a hang guard, not a
    speed claim: callers give at least 5x their ranks' time on a loaded machine."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(rank, world_size, os.path.join(tmp, "store"), fn, args, results),
                             daemon=True) for rank in range(world_size)]
        for p in procs:
            p.start()
        done, failed = {}, {}
        deadline = time.monotonic() + timeout
        while len(done) + len(failed) < world_size:
            left = deadline - time.monotonic()
            if failed:
                left = min(left, GRACE_S)
            try:
                rank, ok, value = results.get(timeout=max(left, 0.01))
            except queue_lib.Empty:
                break
            (done if ok else failed)[rank] = value
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.terminate()
                p.join()
    missing = [r for r in range(world_size) if r not in done and r not in failed]
    if failed or missing:
        report = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())]
        if missing:
            report.append(f"ranks {missing} did not finish (timeout {timeout:.0f} s or stopped after a failure)")
        raise RankFailed(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(report))
    return [done[r] for r in range(world_size)]
