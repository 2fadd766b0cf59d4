"""Ranks that disagree on the plan, or a peer that never comes, fail every rank with one
clear line in seconds: the plan digest is compared before any exchange that depends on
it, in training (`loop._step`, `Transformer.loss`) and in the runtime API (`remap`,
`attention`). Ranks reading different data: tests/test_groups.py."""

import dataclasses
import os
import socket

import pytest
import torch
from distributed import run_ranks
from plans_by_hand import remap_plan

from ballonet import runtime
from ballonet.errors import InputError
from ballonet.training.loop import RankFailure, TrainConfig, train

HANG_S = 180.0
"""run_ranks' hang guard, not a speed claim: the whole 4-rank test (three failures per
rank, each after starting its ranks' training) took 4.8 s alone and 20 s on a loaded
2-core machine; ranks failing to check would wait out --timeout-minutes (5)."""
BASE = dict(model="tiny", corpus="stdlib", global_tokens=1536, max_doc_tokens=1024, seed=3, steps=2)


def _without_remap(plan):
    """The same attention layout with no remap transfers: a rank running it exchanges
    nothing in `remap`, so without the check first its peers would wait for it forever."""
    return dataclasses.replace(plan, remap=())


def _expect_failure(fn) -> str:
    try:
        fn()
    except (RuntimeError, InputError) as e:  # RankFailure, and the settings check's InputError
        return str(e)
    return ""


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
def test_disagreeing_ranks_fail_every_rank_with_one_line():
    for rank, results in enumerate(run_ranks(4, _disagree, timeout=HANG_S)):
        for where, message in results.items():
            # ranks started with different planners stop at the settings check, before any plan;
            # the message, not a timeout's, says the check stopped them (a hang would be
            # stopped by run_ranks' timeout and fail the test)
            expected = "disagree on the run's settings: --planner" if where == "training" else "disagree on the plan"
            assert expected in message, (rank, where, message)
            assert len(message.splitlines()) == 1, message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)  # a hang guard: it fails after its 3 s timeout, not the default 5 minutes
def test_a_peer_that_never_comes_fails_within_the_timeout(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(RankFailure, match="process group of 2 ranks") as e:
        train(TrainConfig(**BASE, timeout_minutes=0.05))
    assert len(str(e.value).splitlines()) == 1
    assert not torch.distributed.is_initialized()
    assert "LOCAL_RANK" not in os.environ
