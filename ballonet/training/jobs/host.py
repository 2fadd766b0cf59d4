"""How a CPU rank's process runs, the same under `ballonet train` and `ballonet calibrate`
(so that a calibration prices the process that trains): one compute thread, the host
allocator told to keep freed memory for the next step, and (training) its heap faulted in
before the first step."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from ballonet.cost import memory
from ballonet.specs import ModelSpec

THREADS_PER_CPU_RANK = 1
"""Compute threads of a CPU rank: more would oversubscribe the cores the other ranks use
(and a calibration with more would price kernels the ranks never run)."""

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's upper limit for M_MMAP_THRESHOLD on 64-bit hosts (4 * 1024 * 1024 * sizeof(long))."""
TRIM_THRESHOLD = 1 << 30
HEAP_BLOCK = 8 << 20
"""`warm_heap`'s blocks: below MMAP_THRESHOLD_MAX, so they come from the heap."""


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


def step_heap_bytes(model: ModelSpec, tokens: int, param_bytes: int) -> int:
    """The heap a training step on `tokens` tokens may take, with a margin: 3x the
    activation bytes it keeps without recomputation (`cost.memory`; a cold step of the tiny
    model took 1.8-2.2x: the activations, their gradients in the backward, the kernels'
    temporaries) and 3x `param_bytes` (the parameters' gradients, AdamW's two moments)."""
    return int(3 * memory.activation_bytes_per_token(model, "none") * tokens + 3 * param_bytes)


def warm_heap(num_bytes: int) -> int:
    """Touch `num_bytes` of heap (at most TRIM_THRESHOLD) and free it, kept mapped under
    `setup_cpu_rank`'s settings: -> the bytes touched.

    Why: with the settings a rank faults a page in once, but does so in every step whose
    batch needs more memory than any step before it, and a rank's first step (the one the
    fidelity bench leaves out) may be its smallest. flops_dp's lighter rank on 2 ranks
    (bench/fidelity.py's long batches) faulted 31,000 pages in step 2, 79 ms of system
    time in a 0.67 s forward and backward, a one-off cost of the process that no
    calibration repeating one shape sees; warmed, 2-8 faults."""
    count = min(num_bytes, TRIM_THRESHOLD) // HEAP_BLOCK
    blocks = [torch.zeros(HEAP_BLOCK, dtype=torch.uint8) for _ in range(count)]  # zeroed: every page written
    del blocks
    return count * HEAP_BLOCK
