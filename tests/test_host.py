"""`training.host`: how a CPU rank's process runs (its allocator effect is checked on spawned
ranks in test_calibration.py, where a fresh process can take the settings)."""

import ctypes

import torch

from ballonet.training import host


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
