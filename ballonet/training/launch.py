"""Local multi-rank launch: `ballonet train --nproc N` runs the loop under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys


def launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Run `ballonet train argv` on `nproc` local ranks under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           "--monitor-interval", "0.5", "-m", "ballonet", "train", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode
