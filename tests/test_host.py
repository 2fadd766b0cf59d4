"""`training.jobs.host`: how a CPU rank's process runs (its allocator settings are checked on
spawned ranks, here and in test_calibration.py, where a fresh process can take them)."""

import ctypes
import platform

import pytest
import torch

from ballonet.training.jobs import host
from ballonet.training.parallelism.model import Transformer
from tests.distributed import run_ranks
from tests.heap_accounting import mallinfo2
from tests.plans_by_hand import one_rank_plan
from tests.tiny_model import SPEC, batch


def test_without_glibc_mallopt_a_cpu_rank_still_runs_one_thread_and_says_the_allocator_refused(monkeypatch):
    def no_libc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    before = torch.get_num_threads()
    try:
        assert host.setup_cpu_rank() is False
        assert torch.get_num_threads() == host.THREADS_PER_CPU_RANK == 1
    finally:
        torch.set_num_threads(before)


def _heap_growth_of_steps(rank: int, world: int) -> tuple:
    """In a fresh process run as a CPU rank: the bytes the heap grew by in a step of the tiny
    model on 4,096 tokens after warming it for that many, then in one on 16,384."""
    took = host.setup_cpu_rank()
    model = Transformer(SPEC)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    warmed = host.warm_heap(host.step_heap_bytes(SPEC, 4096, param_bytes))
    grew = []
    for lengths in ((1024,) * 4, (2048,) * 8):
        ids, labels = batch(lengths)
        before = mallinfo2().arena
        model.loss(ids, labels, one_rank_plan(lengths), 0).backward()
        grew.append(mallinfo2().arena - before)
    return took, warmed - host.step_heap_bytes(SPEC, 4096, param_bytes), grew


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or mallinfo2() is None, reason="glibc 2.33+ (mallinfo2)")
def test_a_warmed_heap_serves_a_step_of_as_many_tokens_without_growing_and_a_larger_step_grows_it():
    took, short, (warm_step, larger_step) = run_ranks(1, _heap_growth_of_steps)[0]
    assert took and -host.HEAP_BLOCK < short <= 0  # whole blocks
    assert warm_step < 1 << 20, warm_step  # pages faulted in before the step, none in it
    assert larger_step > 32 << 20, larger_step  # what the warming did not cover comes afresh


def test_warm_heap_touches_whole_blocks_up_to_the_trim_threshold(monkeypatch):
    assert host.warm_heap(3 * host.HEAP_BLOCK + 5) == 3 * host.HEAP_BLOCK
    assert host.warm_heap(host.HEAP_BLOCK - 1) == 0
    monkeypatch.setattr(host, "TRIM_THRESHOLD", 2 * host.HEAP_BLOCK)  # beyond it glibc would trim the rest
    assert host.warm_heap(5 * host.HEAP_BLOCK) == 2 * host.HEAP_BLOCK
