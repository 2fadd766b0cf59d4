"""Training end to end: the same losses on 1, 2 and 4 ranks and under every planner,
exact resume, recovery from a killed rank under torchrun, and clear errors."""

import json
import os
import subprocess
import sys

import pytest
from distributed import run_ranks

from ballonet.training.corpus import load_corpus
from ballonet.training.loader import BalancedLoader
from ballonet.training.loop import TrainConfig, train

STEPS = 5
BASE = dict(model="tiny", corpus="stdlib", global_tokens=1536, max_doc_tokens=1024, lr=3e-3, seed=3)


def _train_on_ranks(rank, world_size, configs):
    return [[r["loss"] for r in train(TrainConfig(**c))] for c in configs]


def _close(a, b, rel=1e-4):
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


def _ledger_reference(num_batches, **config):
    """The pieces the first `num_batches` batches must hold, read straight off the loader
    with a trivial one-rank plan (no planner, no model)."""
    from ballonet.plan import Plan, Segment

    def whole_docs(lengths):
        return Plan(planner="ref", lengths=tuple(lengths), node_of_rank=(0,), nic_of_rank=(0,),
                    attention=(tuple(Segment(d, 0, n) for d, n in enumerate(lengths)),))

    loader = BalancedLoader(load_corpus(config["corpus"], seed=config["seed"]),
                                 global_tokens=config["global_tokens"], plan_fn=whole_docs,
                                 seed=config["seed"], max_doc_tokens=config["max_doc_tokens"], prefetch=False)
    out = []
    for i, b in enumerate(loader):
        if i == num_batches:
            break
        out.append([list(p) for p in b.pieces])
    return out


def test_losses_match_one_process_on_2_and_4_ranks_and_every_planner():
    single = [r["loss"] for r in train(TrainConfig(**BASE, steps=STEPS))]
    assert single[-1] < single[0]  # it learns
    four = run_ranks(4, _train_on_ranks, [dict(BASE, steps=STEPS, nodes=2, planner=p)
                                          for p in ("zeppelin", "te_cp", "packed_dp")])
    two = run_ranks(2, _train_on_ranks, [dict(BASE, steps=STEPS, planner="zeppelin")])
    for rank_losses in four + two:
        for losses in rank_losses:
            assert _close(losses, single), (losses, single)


def _resume_runs(rank, world_size, tmp):
    straight = train(TrainConfig(**BASE, steps=10, json_log=os.path.join(tmp, "a.jsonl")))
    ckpt = os.path.join(tmp, "ckpt")
    first = train(TrainConfig(**BASE, steps=5, checkpoint_dir=ckpt, checkpoint_every=5,
                              json_log=os.path.join(tmp, "b.jsonl")))
    second = train(TrainConfig(**BASE, steps=10, checkpoint_dir=ckpt, resume=True,
                               json_log=os.path.join(tmp, "b.jsonl")))
    return straight, first + second


def _read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_resume_gives_identical_losses_and_ledger(tmp_path):
    straight, resumed = run_ranks(2, _resume_runs, str(tmp_path))[0]
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["ledger"] for r in resumed] == [r["ledger"] for r in straight]
    assert [r["ledger"] for r in straight] == _ledger_reference(10, **BASE)
    key = lambda r: (r["step"], r["loss"], r["ledger"])  # noqa: E731
    assert [key(r) for r in _read_log(tmp_path / "b.jsonl")] == [key(r) for r in _read_log(tmp_path / "a.jsonl")]


def _cli(*args, env=None, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "ballonet", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_killed_rank_restarts_from_checkpoint_without_losing_documents(tmp_path):
    log = tmp_path / "log.jsonl"
    args = ["train", "--nproc", "2", "--max-restarts", "1", "--steps", "6", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", "--json-log", str(log),
            "--global-tokens", str(BASE["global_tokens"]), "--max-doc-tokens", str(BASE["max_doc_tokens"]),
            "--seed", str(BASE["seed"])]
    r = _cli(*args, env={"BALLONET_FAULT": "5:1"})  # rank 1 dies at step 5; checkpoint at step 4
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    records = _read_log(log)
    assert [x["step"] for x in records] == [1, 2, 3, 4, 5, 6]
    ledger = [x["ledger"] for x in records]
    assert ledger == _ledger_reference(6, **BASE)
    pieces = [tuple(p) for batch in ledger for p in batch]
    assert len(pieces) == len(set(pieces))


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    not_jsonl = tmp_path / "notes.jsonl"
    not_jsonl.write_text('{"text": "fine"}\nthis is not json\n')
    cases = [
        (["train", "--corpus", str(empty)], "empty"),
        (["train", "--corpus", str(not_jsonl)], "notes.jsonl:2"),
        (["train", "--nproc", "4", "--global-tokens", "3"], "smaller than one token per rank"),
        (["train", "--planner", "magic"], "magic"),
    ]
    for args, message in cases:
        r = _cli(*args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
