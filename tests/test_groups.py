"""Training's process groups and its check before the first exchange, on 2 gloo ranks:
the plan's traffic (rings, remaps, the plan check) runs on a group of its own, not on
the default group FSDP2 uses, every group made for it is warmed up by a collective of
all its ranks before its first use; ranks given the same document lengths but different
tokens fail together with one line (issue 33), the same tokens train."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch.distributed as dist
from distributed import run_ranks

from ballonet.training.loop import RankFailure, TrainConfig, train


def _groups_used(rank: int, world: int, corpora: list[str]) -> dict:
    events = []  # (what, group) in call order
    originals = {name: getattr(dist, name) for name in ("batch_isend_irecv", "all_to_all_single", "all_gather",
                                                         "all_reduce", "new_group")}

    def wrap(name):
        def call(*args, **kwargs):
            if name == "batch_isend_irecv":
                events.extend(("p2p", op.group) for op in args[0])
            elif name == "new_group":
                group = originals[name](*args, **kwargs)
                events.append(("new_group", group))
                return group
            else:
                events.append((name, kwargs.get("group")))
            return originals[name](*args, **kwargs)
        return call

    import ballonet.training.loop as loop

    agree = loop.agree

    def agree_marked(*args, **kwargs):  # the settings check: a world collective, not the plan's traffic
        first = len(events)
        try:
            return agree(*args, **kwargs)
        finally:
            events[first:] = [("settings", g) for _, g in events[first:]]

    for name in originals:
        setattr(dist, name, wrap(name))
    loop.agree = agree_marked
    start, failure = time.monotonic(), ""
    try:
        # Every rank names the same corpus, data.jsonl, in a folder of its own: the settings
        # agree, and only the data check can see that the tokens differ.
        os.chdir(corpora[rank])
        train(TrainConfig(model="tiny", corpus="data.jsonl", global_tokens=1024, seed=3, steps=2, nodes=2,
                          planner="distca"))
    except RankFailure as e:
        failure = str(e)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        loop.agree = agree
    made = [g for what, g in events if what == "new_group"]
    first_use = {id(g): next((what for what, h in events if h is g and what != "new_group"), None) for g in made}
    plan_traffic = [(what, g) for what, g in events if what in ("p2p", "all_to_all_single", "all_gather")]
    return {"failure": failure, "seconds": time.monotonic() - start, "made": len(made),
            "first_use": sorted(first_use.values()),
            "kinds": sorted({what for what, _ in plan_traffic}),
            "on_world": sum(g is None or g is dist.group.WORLD for _, g in plan_traffic),
            "groups": len({id(g) for _, g in plan_traffic}),
            "ranks": sorted({tuple(dist.get_process_group_ranks(g)) for _, g in plan_traffic if g is not None})}


def _corpora(folder) -> list[str]:
    """Two folders holding a JSON Lines corpus `data.jsonl` each, with the same document
    lengths, every token of the second one higher than the first's."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n).tolist() for n in (300, 120, 500, 260, 90, 410, 333, 150)]
    paths = []
    for name, shift in (("a", 0), ("b", 1)):
        (folder / name).mkdir()
        path = folder / name / "data.jsonl"
        path.write_text("".join(json.dumps({"input_ids": [(t + shift) % 256 for t in d]}) + "\n" for d in docs))
        paths.append(str(path.parent))
    return paths


@pytest.mark.slow
def test_the_plans_traffic_has_its_own_warmed_up_group_and_ranks_must_read_the_same_data(tmp_path):
    a, b = _corpora(tmp_path)
    for rank, res in enumerate(run_ranks(2, _groups_used, [a, a])):
        assert res["failure"] == "", res
        assert res["kinds"] == ["all_gather", "all_to_all_single", "p2p"], res  # plan check, remaps, rings
        assert res["on_world"] == 0 and res["groups"] == 1 and res["ranks"] == [(0, 1)], (rank, res)
        assert res["made"] == 2 and res["first_use"] == ["all_reduce", "all_reduce"], (rank, res)
    for rank, res in enumerate(run_ranks(2, _groups_used, [a, b])):
        message = res["failure"]
        assert "disagree on the step's tokens" in message and "read different data" in message, (rank, message)
        # res["seconds"] < 60: a hang guard (under 1.5 s alone: 3 s for the whole test, two runs), not
        # a speed claim; ranks that read on would wait out --timeout-minutes (5).
        assert len(message.splitlines()) == 1 and res["seconds"] < 60, (rank, res)
        assert res["kinds"] == ["all_gather"], res  # nothing exchanged before the check failed
