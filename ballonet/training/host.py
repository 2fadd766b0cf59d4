"""How a CPU rank's process runs, the same under `ballonet train` and `ballonet calibrate`
(so that a calibration prices the process that trains): one compute thread, and the host
allocator told to keep freed memory for the next step."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

THREADS_PER_CPU_RANK = 1
"""Compute threads of a CPU rank: more would oversubscribe the cores the other ranks use
(and a calibration with more would price kernels the ranks never run)."""

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's upper limit for M_MMAP_THRESHOLD on 64-bit hosts (4 * 1024 * 1024 * sizeof(long))."""
TRIM_THRESHOLD = 1 << 30


def setup_cpu_rank() -> bool:
    """One compute thread, and freed memory kept: True where the allocator took the settings.

    Why: glibc's malloc returns the top of its heap to the system once more than its trim
    threshold is free, and serves blocks above its mmap threshold (both adjusted as the
    process runs) with fresh mappings. A rank whose batches change shape every step then
    faults its activations in again each step, which a calibration repeating one shape
    never pays: on the lightly loaded ranks of a 4-rank long-document run, 5,200-6,200
    minor faults and 9-18 ms of system time per forward and backward with the defaults,
    7-423 faults with these settings (bench/results/host_allocator.md). Tensors up to 32
    MiB now come from the heap, and up to 1 GiB of freed heap stays mapped. Other C
    libraries: threads only."""
    torch.set_num_threads(THREADS_PER_CPU_RANK)
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no libc found, or not glibc (musl, macOS)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
