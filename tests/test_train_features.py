"""What a torchtitan user expects of the trainer, on 2 gloo ranks against a one-process
reference written here in plain PyTorch (no FSDP, no planner: every document whole on
one rank; the schedule from its definition, `torch.nn.utils.clip_grad_norm_`):

- warmup, cosine decay and clipping of the sharded gradients: losses, parameters, and
  every step's logged `lr` and `grad_norm` equal the reference's;
- keep-k checkpoints written in the background (DCP's async_save), the final step always
  saved, "resumed from step N" on resume, the resumed run exact;
- gradient accumulation: 3 micro-batches, each planned on its own, give the unaccumulated
  step (losses, gradient norms, parameters within 1e-4 in fp32);
- evaluation on held-out documents (with accumulation): `eval_loss` every N steps equals
  the reference model's mean token loss over the same documents at that step;
- a 2-rank `ballonet train --nproc 2 --config FILE` with a flag overriding the file logs
  all of it.
"""

import contextlib
import io
import json
import math
import os

import numpy as np
import pytest
import torch
from distributed import run_ranks

import ballonet
from ballonet.plan import Plan, Segment
from ballonet.training.checkpoints.checkpoint import prunable
from ballonet.training.data.corpus import load_corpus
from ballonet.training.data.loader import BalancedLoader
from ballonet.training.loop import TrainConfig, train_model
from ballonet.training.parallelism.model import Transformer

BASE = dict(model="tiny", corpus="stdlib", global_tokens=1536, max_doc_tokens=1024, lr=3e-3, seed=3)
SCHEDULE = dict(warmup_steps=2, lr_decay="cosine", min_lr=3e-4, max_grad_norm=0.5)
STEPS = 8
TOL = 1e-4


def _lr(step, steps, *, lr, warmup_steps, lr_decay, min_lr, **_):
    """The LR of step `step` (1-based) of a `steps`-step run, from the schedule's definition."""
    if step <= warmup_steps:
        return lr * step / (warmup_steps + 1)
    t = (step - warmup_steps - 1) / (steps - warmup_steps - 1)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * t)) / 2


def _whole_docs(lengths):
    return Plan(planner="ref", lengths=tuple(lengths), node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, n) for d, n in enumerate(lengths)),))


def _loader(source, shuffle=True, **config):
    return BalancedLoader(source, global_tokens=config["global_tokens"], plan_fn=_whole_docs, seed=config["seed"],
                          max_doc_tokens=config["max_doc_tokens"], prefetch=False, shuffle=shuffle,
                          max_epochs=None if shuffle else 1)


def _reference(lrs, max_grad_norm=math.inf, train_corpus=None, eval_corpus=None, eval_every=0, **config):
    """One process, plain PyTorch: AdamW at the given LR of each step, the gradient of the
    global batch's mean loss clipped by torch's clip_grad_norm_; every `eval_every` steps,
    the mean token loss over the first two batches of `eval_corpus` in its own order.
    -> (losses, gradient norms, parameters, {step: eval loss})."""
    model = Transformer(ballonet.model(config["model"]), seed=config["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.0)
    train_corpus = train_corpus or load_corpus(config["corpus"], seed=config["seed"])
    losses, norms, evals = [], [], {}
    for step, (lr, b) in enumerate(zip(lrs, _loader(train_corpus, **config)), 1):
        loss = model.loss(b.input_ids, b.labels, b.plan, 0) / b.num_valid_tokens_global
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if eval_every and step % eval_every == 0:
            with torch.no_grad():
                held = [e for _, e in zip(range(2), _loader(eval_corpus, shuffle=False, **config))]
                total = sum(model.loss(e.input_ids, e.labels, e.plan, 0).item() for e in held)
                evals[step] = total / sum(e.num_valid_tokens_global for e in held)
    return losses, norms, {n: p.detach().numpy() for n, p in model.named_parameters()}, evals


def _run(config: dict) -> tuple[list[dict], dict, str]:
    """(log records, full parameters, what rank 0 printed) of one run on these ranks."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        records, model = train_model(TrainConfig(**config))
    params = {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()}
    return records, params, out.getvalue()


EVAL = dict(steps=4, eval_every=2, grad_accum=2)


def _features(rank, world_size, tmp):
    ckpt = os.path.join(tmp, "ckpt")
    runs = [_run(dict(BASE, **SCHEDULE, steps=STEPS)), _run(dict(BASE, **SCHEDULE, steps=STEPS, grad_accum=3)),
            _run(dict(BASE, **EVAL))]
    keep = dict(BASE, **SCHEDULE, checkpoint_dir=ckpt, checkpoint_every=2, keep_checkpoints=2, async_checkpoint=True)
    runs.append(_run(dict(keep, steps=5)))  # saves 2, 4 and the final 5; keeps 4 and 5
    listing = sorted(os.listdir(ckpt)) if rank == 0 else None
    runs.append(_run(dict(keep, steps=STEPS, resume=True)))  # 6 and the final 8; keeps 5, resumed from
    return runs, listing, sorted(os.listdir(ckpt)) if rank == 0 else None


def _assert_matches(records, params, reference):
    losses, norms, ref_params, _ = reference
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=TOL)
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=TOL)
    for name, p in ref_params.items():
        assert np.abs(params[name] - p).max() <= TOL, name


@pytest.mark.slow
def test_schedule_clipping_and_keep_k_async_checkpoints_on_2_ranks(tmp_path):
    lrs = [_lr(s, STEPS, **BASE, **SCHEDULE) for s in range(1, STEPS + 1)]
    reference = _reference(lrs, SCHEDULE["max_grad_norm"], **BASE)
    assert max(reference[1]) > SCHEDULE["max_grad_norm"]  # clipping engages
    (straight, accumulated, evaluated, first, resumed), listing, final_listing = \
        run_ranks(2, _features, str(tmp_path))[0]

    records, params, _ = straight
    assert [r["lr"] for r in records] == pytest.approx(lrs, rel=1e-12)
    _assert_matches(records, params, reference)

    records, params, _ = accumulated  # the same steps as 3 micro-batches each
    assert [r.get("micro_batches", 1) for r in records] == [min(3, len(r["ledger"])) for r in records]
    assert max(r["micro_batches"] for r in records) == 3
    assert [sorted(r["ledger"]) for r in records] == [sorted(r["ledger"]) for r in straight[0]]
    _assert_matches(records, params, reference)

    records, params, _ = evaluated
    from ballonet.training.evaluation import hold_out

    train, held = hold_out(load_corpus("stdlib", seed=BASE["seed"]), 2 * BASE["global_tokens"], BASE["seed"])
    expected = _reference([BASE["lr"]] * EVAL["steps"], train_corpus=train, eval_corpus=held, eval_every=2, **BASE)
    _assert_matches(records, params, expected)
    assert [r.get("eval_loss") is not None for r in records] == [False, True, False, True]
    assert [r["eval_loss"] for r in records[1::2]] == pytest.approx([expected[3][2], expected[3][4]], rel=TOL)
    assert records[1]["eval_tokens"] > BASE["global_tokens"]

    # A 5-step run has its own schedule; resumed with --steps 8 it follows the 8-step one.
    lrs_resumed = [_lr(s, 5, **BASE, **SCHEDULE) for s in range(1, 6)] + lrs[5:]
    assert [r["lr"] for r in first[0] + resumed[0]] == pytest.approx(lrs_resumed, rel=1e-12)
    _assert_matches(first[0] + resumed[0], resumed[1], _reference(lrs_resumed, SCHEDULE["max_grad_norm"], **BASE))

    assert "resumed from step 5" in resumed[2] and "resumed from" not in first[2]
    assert listing == ["config.toml", "latest", "step-00000004", "step-00000005"]
    assert final_listing == ["config.toml", "latest", "step-00000005", "step-00000006", "step-00000008"]
    assert open(tmp_path / "ckpt" / "latest").read() == "step-00000008"


def test_pruning_keeps_the_newest_and_the_one_resumed_from(tmp_path):
    for step in (1, 2, 3, 4, 5, 9):
        (tmp_path / f"step-{step:08d}").mkdir()
    names = [f"step-{s:08d}" for s in range(10)]
    assert prunable(str(tmp_path), names[5], keep=2) == [names[9], names[1], names[2], names[3]]
    assert prunable(str(tmp_path), names[5], keep=2, protect=str(tmp_path / names[2])) == \
        [names[9], names[1], names[3]]
    assert prunable(str(tmp_path), names[5], keep=10) == [names[9]]  # a later step is an earlier run's


def test_micro_batches_hold_every_piece_once_with_even_tokens():
    from ballonet.training.data.accumulation import micro_batches

    lengths = [900, 30, 400, 400, 120, 50, 36, 10]
    groups = micro_batches(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)  # each in batch order
    # LPT: 900 alone; 400, 400 apart; then 120 -> 520, 50, 36, 30, 10 -> 526
    assert [sum(lengths[i] for i in g) for g in groups] == [900, 520, 526]
    assert micro_batches([5, 3], 4) == [[0], [1]]  # no empty micro-batch
    assert micro_batches([100, 1, 1], 3, min_tokens=2) == [[0], [1, 2]]  # the two 1-token ones joined
    assert micro_batches(lengths, 1) == [list(range(len(lengths)))]


def test_held_out_documents_are_a_fixed_seeded_slice_training_never_sees():
    from ballonet.training.evaluation import hold_out

    corpus = load_corpus("stdlib", seed=0)
    train, held = hold_out(corpus, 5000, seed=3)
    assert held.num_tokens >= 5000 > held.num_tokens - held.lengths.max()  # just enough whole documents
    assert train.num_docs + held.num_docs == corpus.num_docs
    assert set(train.names).isdisjoint(held.names) and set(train.names) | set(held.names) == set(corpus.names)
    names = list(corpus.names)
    for part in (train, held):
        for doc in (0, part.num_docs - 1):
            original = names.index(part.names[doc])
            assert np.array_equal(part.tokens(doc), corpus.tokens(original))
            assert np.array_equal(part.tokens_range(doc, 1, 3), corpus.tokens_range(original, 1, 3))
    assert hold_out(corpus, 5000, seed=3)[1].names == held.names  # the same on every rank and every resume
    assert hold_out(corpus, 5000, seed=4)[1].names != held.names
    with pytest.raises(ballonet.InputError, match="leaves nothing of corpus"):
        hold_out(corpus, corpus.num_tokens, seed=3)


@pytest.mark.slow
def test_a_2_rank_run_from_a_config_file_with_an_override_logs_what_it_should(tmp_path):
    """The issue's run: warmup, cosine decay, clipping, accumulation, evaluation on another
    corpus and keep-k checkpoints, from a TOML file whose --steps a flag overrides."""
    import subprocess
    import sys

    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20}) + "\n"
                               for i in range(8)))
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    (tmp_path / "run.toml").write_text(
        f'global_tokens = 1536\nmax_doc_tokens = 1024\nsteps = 50\nlr = 3e-3\nwarmup_steps = 1\n'
        f'lr_decay = "cosine"\nmin_lr = 1e-4\nmax_grad_norm = 1.0\ngrad_accum = 2\neval_every = 2\n'
        f'eval_corpus = "{evalset}"\ncheckpoint_dir = "{ckpt}"\ncheckpoint_every = 2\nkeep_checkpoints = 2\n'
        f'json_log = "{log}"\n')
    r = subprocess.run([sys.executable, "-m", "ballonet", "train", "--nproc", "2", "--config",
                        str(tmp_path / "run.toml"), "--steps", "5"], capture_output=True, text=True, check=False,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in records] == [1, 2, 3, 4, 5]  # the flag's 5 steps, not the file's 50
    assert [x["lr"] for x in records] == pytest.approx([1.5e-3, 3e-3] + [_lr(s, 5, lr=3e-3, warmup_steps=1,
                                                        lr_decay="cosine", min_lr=1e-4) for s in (3, 4, 5)])
    assert all(x["grad_norm"] > 0 and math.isfinite(x["grad_norm"]) for x in records)
    assert [("eval_loss" in x) for x in records] == [False, True, False, True, False]
    assert all(math.isfinite(x["eval_loss"]) and x["eval_tokens"] > 0 for x in records[1::2][:2])
    assert any(x.get("micro_batches") == 2 for x in records)
    assert "eval loss" in r.stdout
    assert sorted(os.listdir(ckpt)) == ["config.toml", "latest", "step-00000004", "step-00000005"]
    assert "steps = 5\n" in (ckpt / "config.toml").read_text()  # the resolved config, override included
