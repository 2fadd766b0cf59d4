"""Ranks that disagree on the plan, or a peer that never comes, fail every rank with one
clear line in seconds: the plan digest is compared before any exchange that depends on
it, in training (`loop._step`, `Transformer.loss`) and in the runtime API (`remap`,
`attention`). Ranks reading different data: tests/test_groups.py."""

import dataclasses
import os
import socket
import time

import pytest
import torch
from distributed import run_ranks
from helpers import remap_plan

from ballonet import runtime
from ballonet.errors import InputError
from ballonet.training.loop import RankFailure, TrainConfig, train

LIMIT_S = 60.0
BASE = dict(model="tiny", corpus="stdlib", global_tokens=1536, max_doc_tokens=1024, seed=3, steps=2)


def _without_remap(plan):
    """The same attention layout with no remap transfers: a rank running it exchanges
    nothing in `remap`, so without the check first its peers would wait for it forever."""
    return dataclasses.replace(plan, remap=())


def _expect_failure(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
    except (RuntimeError, InputError) as e:  # RankFailure, and the settings check's InputError
        return str(e), time.monotonic() - start
    return "", time.monotonic() - start


def _disagree(rank, world_size):
    plan = remap_plan() if rank < 2 else _without_remap(remap_plan())
    x = torch.randn(plan.attention_tokens(rank), 3)
    q = torch.randn(plan.attention_tokens(rank), 4, 8)
    kv = torch.randn(plan.attention_tokens(rank), 2, 8)
    results = {
        "remap": _expect_failure(lambda: runtime.remap(x, plan, rank, "attention", "linear")),
        "attention": _expect_failure(lambda: runtime.attention(q, kv, kv.clone(), plan, rank)),
    }
    planner = "zeppelin" if rank % 2 == 0 else "packed_dp"
    results["training"] = _expect_failure(lambda: train(TrainConfig(**BASE, nodes=2, planner=planner)))
    return results


@pytest.mark.slow
def test_disagreeing_ranks_fail_every_rank_in_seconds():
    for rank, results in enumerate(run_ranks(4, _disagree, timeout=3 * LIMIT_S)):
        for where, (message, seconds) in results.items():
            # ranks started with different planners stop at the settings check, before any plan
            expected = "disagree on the run's settings: --planner" if where == "training" else "disagree on the plan"
            assert expected in message, (rank, where, message)
            assert len(message.splitlines()) == 1, message
            assert seconds < LIMIT_S, (rank, where, seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_that_never_comes_fails_within_the_timeout(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    start = time.monotonic()
    with pytest.raises(RankFailure, match="process group of 2 ranks") as e:
        train(TrainConfig(**BASE, timeout_minutes=0.05))
    assert time.monotonic() - start < 30
    assert len(str(e.value).splitlines()) == 1
    assert not torch.distributed.is_initialized()
    assert "LOCAL_RANK" not in os.environ
