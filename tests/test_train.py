"""Training end to end with FSDP2: the same losses and parameters on 2 and 4 ranks as an
independent one-process reference, under every planner, sharding, recomputation mode;
exact resume from sharded checkpoints on the same and another world size; recovery from
a killed rank under torchrun; clear errors."""

import functools
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from distributed import run_ranks
from training_reference import BASE, ledger_reference, reference_loader, reference_run

import ballonet
from ballonet.training.data.corpus import load_corpus
from ballonet.training.data.loader import BalancedLoader
from ballonet.training.loop import TrainConfig, train, train_model
from ballonet.training.parallelism.model import Transformer

STEPS = 5
def _first_step_grads(config: dict, rank: int, world_size: int, recompute_of_rank=None) -> dict:
    """Gradients of the first batch's mean loss, unsharded, as the loop computes them
    (`recompute_of_rank`: each rank's (mode, layers) for `Transformer.set_recompute`)."""
    from ballonet.training.parallelism import parallel
    from ballonet.training.loop import preflight
    from ballonet.training.parallelism.model import build_model

    tc = TrainConfig(**config)
    cluster, spec, corpus = preflight(tc, world_size)
    plan_fn = functools.partial(ballonet.plan_batch, cluster=cluster, model=spec, planner=tc.planner)
    batch = next(iter(BalancedLoader(corpus, global_tokens=tc.global_tokens, plan_fn=plan_fn, rank=rank,
                                     world_size=world_size, seed=tc.seed, max_doc_tokens=tc.max_doc_tokens)))
    model = build_model(tc, spec, torch.device("cpu"))
    if recompute_of_rank:
        model.set_recompute(*recompute_of_rank[rank])
    if world_size > 1:
        parallel.parallelize(model, parallel.device_mesh(world_size, tc.shard, torch.device("cpu")))
    loss = model.loss(batch.input_ids, batch.labels, batch.plan, rank, torch.distributed.group.WORLD if world_size > 1
                      else None)
    (loss / batch.num_valid_tokens_global).backward()
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).numpy()
            for n, p in model.named_parameters()}


def _reference_grads(**config) -> dict:
    """First-batch gradients of the plain one-process model (`reference_run`'s first step)."""
    model = Transformer(ballonet.model(config["model"]), seed=config["seed"])
    b = next(iter(reference_loader(**config)))
    (model.loss(b.input_ids, b.labels, b.plan, 0) / b.num_valid_tokens_global).backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters()}


def _train_on_ranks(rank, world_size, configs):
    out = [_first_step_grads(configs[0], rank, world_size)]
    for c in configs:
        records, model = train_model(TrainConfig(**c))
        # full_tensor is collective; numpy, as tensors would cross to the parent by file descriptor
        params = {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()}
        out.append(([r["loss"] for r in records], params, records[-1]))
    return out


def _assert_matches(run, reference, tol=1e-4):
    (losses, params, _), (ref_losses, ref_params) = run, reference
    assert all(abs(x - y) <= tol * abs(y) for x, y in zip(losses, ref_losses, strict=True)), (losses, ref_losses)
    for name, p in ref_params.items():
        assert params[name].dtype == np.float32, name  # fp32 master weights
        assert np.abs(params[name] - p.numpy()).max() <= tol, name


@pytest.mark.slow
def test_fsdp_losses_and_parameters_match_one_process_on_2_and_4_ranks():
    # On 4 ranks, full sharding (the default) also holds about a quarter of the weights
    # per rank that replicated weights (shard "none") hold.
    reference = reference_run(STEPS, **BASE)
    assert reference[0][-1] < reference[0][0]  # it learns
    run = dict(BASE, steps=STEPS, log_every=STEPS)
    four = [dict(run, nodes=2, planner="zeppelin"), dict(run, nodes=2, planner="te_cp", recompute="full"),
            dict(run, nodes=2, planner="packed_dp", shard="none")]
    two = [dict(run, planner="zeppelin", recompute="selective"), dict(run, planner="zeppelin", recompute="linear")]
    reference_grads = _reference_grads(**BASE)
    for world_size, configs in ((4, four), (2, two)):
        for rank_runs in run_ranks(world_size, _train_on_ranks, configs, timeout=1800):
            grads, rank_runs = rank_runs[0], rank_runs[1:]
            for name, g in reference_grads.items():  # the sum over ranks, not their mean
                assert np.abs(grads[name] - g).max() <= 1e-5 * np.abs(g).max(), name
            for config, run in zip(configs, rank_runs):
                _assert_matches(run, reference), config
                assert 0 < run[2]["mfu"] < 1 and run[2]["memory_peak_bytes_max"] > 0
            if world_size == 4:
                full, none = rank_runs[0][2]["param_bytes_max"], rank_runs[2][2]["param_bytes_max"]
                assert 0.2 < full / none < 0.35, (full, none)


def test_bf16_trains_close_to_fp32_with_fp32_master_weights():
    records, model = train_model(TrainConfig(**BASE, steps=3, dtype="bf16", recompute="full"))
    reference = reference_run(3, **BASE)[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert abs(records[0]["loss"] - reference[0]) < 2e-2 * reference[0]
    assert records[-1]["loss"] < records[0]["loss"]


def test_recompute_layers_reach_the_model():
    records, model = train_model(TrainConfig(**BASE, steps=1, recompute="selective", recompute_layers=1))
    assert [block.recompute for block in model.layers] == ["selective", "none"]
    assert abs(records[0]["loss"] - reference_run(1, **BASE)[0][0]) <= 1e-4 * records[0]["loss"]


def _mixed_recompute_grads(rank, world_size, config, recompute_of_rank):
    return _first_step_grads(config, rank, world_size, recompute_of_rank)


@pytest.mark.slow
def test_ranks_recomputing_differently_get_the_reference_gradients():
    """On 2 ranks (zeppelin: remap and a ring), rank 0 recomputes the linear layers of its
    first block (the second selectively) and rank 1 only its first block's MLP: selective
    and linear blocks exchange nothing in their recomputation, so the ranks need not
    agree; the gradients are the one-process reference's."""
    config = dict(BASE, planner="zeppelin")
    reference = _reference_grads(**BASE)
    for grads in run_ranks(2, _mixed_recompute_grads, config, [("linear", 1), ("selective", 1)]):
        for name, g in reference.items():
            assert np.abs(grads[name] - g).max() <= 1e-5 * np.abs(g).max(), name


def _auto_runs(rank, world_size, config):
    records, model = train_model(TrainConfig(**config))
    params = {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()}
    return [r["loss"] for r in records], params, records, [block.recompute for block in model.layers]


@pytest.mark.slow
def test_auto_recompute_chooses_per_rank_and_trains_exactly(tmp_path):
    """--recompute auto on 2 ranks whose memory (a cluster file's memory_gb) holds 759 of
    the tiny model's tokens without recomputation: zeppelin's plans hold 728/808, 777/759
    and 728/808 tokens, so in each step the rank with more than 759 recomputes its first
    layer's MLP and the other nothing (`cost.recompute.cheapest_per_rank`); losses and
    parameters still match the one-process reference. Ranks recomputing differently must
    not deadlock: a selective layer exchanges nothing."""
    cluster = tmp_path / "tight.toml"
    cluster.write_text('[[node_groups]]\ngpu = "cpu"\nnum_nodes = 1\ngpus_per_node = 2\nnics_per_node = 2\n'
                       'nic_gbps = 10\nmemory_gb = 0.0096\n')
    config = dict(BASE, steps=3, planner="zeppelin", recompute="auto", cluster=str(cluster))
    runs = run_ranks(2, _auto_runs, config)
    reference = reference_run(3, **BASE)
    for losses, params, records, _ in runs:
        _assert_matches((losses, params, None), reference)
        assert [(r["recompute"], r["recompute_layers_max"]) for r in records] == \
            [("selective", 1)] * 3, records
    assert sorted(run[3] for run in runs) == [["none", "none"], ["selective", "none"]]  # after step 3


# ---- checkpoints -----------------------------------------------------------------------


def _resume_runs(rank, world_size, tmp):
    straight = train(TrainConfig(**BASE, steps=10, json_log=os.path.join(tmp, "a.jsonl")))
    ckpt = os.path.join(tmp, "ckpt")
    first = train(TrainConfig(**BASE, steps=5, checkpoint_dir=ckpt, checkpoint_every=5,
                              json_log=os.path.join(tmp, "b.jsonl")))
    if rank == 0:  # a run killed mid-write leaves a torn last line
        with open(os.path.join(tmp, "b.jsonl"), "a") as f:
            f.write('{"step": 6, "lo')
    second = train(TrainConfig(**BASE, steps=10, checkpoint_dir=ckpt, resume=True,
                               json_log=os.path.join(tmp, "b.jsonl")))
    return straight, first + second


def _read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_resume_gives_identical_losses_and_ledger(tmp_path):
    straight, resumed = run_ranks(2, _resume_runs, str(tmp_path))[0]
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["ledger"] for r in resumed] == [r["ledger"] for r in straight]
    assert [r["ledger"] for r in straight] == ledger_reference(10, **BASE)
    assert [r["plan_digest"] for r in resumed] == [r["plan_digest"] for r in straight]
    for r in straight:  # each rank's compute, summed into one list; its largest is compute_s_max
        assert len(r["compute_s"]) == 2 and max(r["compute_s"]) == pytest.approx(r["compute_s_max"])
    def key(r):
        return r["step"], r["loss"], r["ledger"]
    assert [key(r) for r in _read_log(tmp_path / "b.jsonl")] == [key(r) for r in _read_log(tmp_path / "a.jsonl")]
    # the final step is saved too; the one resumed from stays
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.toml", "latest", "step-00000005", "step-00000010"]


def _train_configs(rank, world_size, configs):
    return [train(TrainConfig(**c)) for c in configs]


@pytest.mark.slow
def test_resume_on_another_world_size_continues_the_ledger(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = dict(BASE, nodes=1, checkpoint_dir=ckpt)
    first = run_ranks(4, _train_configs, [dict(common, steps=3, checkpoint_every=3)])[0][0]
    second = run_ranks(2, _train_configs, [dict(common, steps=6, resume=True)])[0][0]
    assert [r["step"] for r in first + second] == list(range(1, 7))
    ledger = [r["ledger"] for r in first + second]
    assert ledger == ledger_reference(6, **BASE)  # nothing lost, nothing twice
    reference = reference_run(6, **BASE)[0]
    losses = [r["loss"] for r in first + second]
    assert all(abs(x - y) <= 1e-4 * y for x, y in zip(losses, reference, strict=True)), (losses, reference)


def _checkpoint(tmp_path, steps=2):
    ckpt = tmp_path / "ckpt"
    train(TrainConfig(**BASE, steps=steps, checkpoint_dir=str(ckpt), checkpoint_every=steps))
    return ckpt, ckpt / f"step-{steps:08d}"


def test_interrupted_save_leaves_the_last_checkpoint_and_no_stray_files(tmp_path):
    ckpt, step2 = _checkpoint(tmp_path)
    (ckpt / ".tmp-step-00000004").mkdir()  # what a save killed midway leaves
    (ckpt / ".tmp-step-00000004" / "__0_0.distcp").write_bytes(b"partial")
    (ckpt / "latest.tmp").write_text("step-000")
    records = train(TrainConfig(**BASE, steps=3, checkpoint_dir=str(ckpt), resume=True))
    assert [r["step"] for r in records] == [3]
    assert sorted(os.listdir(ckpt)) == ["config.toml", "latest", step2.name, "step-00000003"]


def test_loading_a_checkpoint_never_runs_its_code(tmp_path):
    import pickle

    ckpt, step2 = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (step2 / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ballonet.InputError, match=r"\.metadata|corrupt or foreign"):
        train(TrainConfig(**BASE, steps=3, checkpoint_dir=str(ckpt), resume=True))
    assert not marker.exists()


def _cli(*args, env=None, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "ballonet", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300, check=False)


@pytest.mark.slow
def test_killed_rank_restarts_from_checkpoint_without_losing_documents(tmp_path):
    log = tmp_path / "log.jsonl"
    args = ["train", "--nproc", "2", "--max-restarts", "1", "--steps", "4", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", "--json-log", str(log),
            "--global-tokens", str(BASE["global_tokens"]), "--max-doc-tokens", str(BASE["max_doc_tokens"]),
            "--seed", str(BASE["seed"])]
    r = _cli(*args, env={"BALLONET_FAULT": "3:1"})  # rank 1 dies at step 3; checkpoint at step 2
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    records = _read_log(log)
    assert [x["step"] for x in records] == [1, 2, 3, 4]
    ledger = [x["ledger"] for x in records]
    assert ledger == ledger_reference(4, **BASE)
    pieces = [tuple(p) for batch in ledger for p in batch]
    assert len(pieces) == len(set(pieces))


# ---- bad input -------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    # Through the command line: a corpus line, a check on the ranks, a checkpoint file
    # (the configuration's own checks are the next test's, in this process).
    not_jsonl = tmp_path / "notes.jsonl"
    not_jsonl.write_text('{"text": "fine"}\nthis is not json\n')
    ckpt, step2 = _checkpoint(tmp_path)
    data = sorted(step2.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:20])  # truncated
    cases = [
        (["train", "--corpus", str(not_jsonl)], "notes.jsonl:2"),
        (["train", "--nproc", "4", "--global-tokens", "3"], "smaller than one token per rank"),
        (["train", "--checkpoint-dir", str(ckpt), "--resume", "--steps", "3"], str(step2)),
    ]
    for args, message in cases:
        r = _cli(*args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bad_configs_are_refused_with_one_line_before_any_work(tmp_path):
    from ballonet.training.loop import preflight

    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "checkpoint.pt").write_bytes(b"\x80\x04K\x01.")
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "latest").write_text("step-00000009")
    cases = [
        (dict(corpus=str(empty)), "empty"),
        (dict(planner="magic"), "magic"),
        (dict(max_doc_tokens=0), "--max-doc-tokens"),
        (dict(weight_decay=-1.0), "--weight-decay"),
        (dict(seed=-1), "--seed"),
        (dict(recompute_layers=1), "--recompute-layers needs --recompute selective"),
        (dict(recompute="selective", recompute_layers=0), "--recompute-layers must be positive"),
        (dict(no_double=True, planner="te_cp"), "--no-double needs --planner zeppelin"),
        (dict(recompute="selective", recompute_layers=3), "--recompute-layers 3: model 'tiny' has 2 layers"),
        (dict(max_restarts=-1), "--max-restarts"),
        (dict(timeout_minutes=0), "--timeout-minutes"),
        (dict(shard="half"), "--shard"),
        (dict(json_log=str(empty)), "is a folder"),
        (dict(json_log=str(tmp_path / "nodir" / "log.jsonl")), "does not exist"),
        (dict(checkpoint_dir=str(a_file)), "is a file"),
        (dict(global_tokens=8_000_000), "--global-tokens 8000000"),
        (dict(checkpoint_dir=str(foreign), resume=True), "not a ballonet checkpoint"),
        (dict(checkpoint_dir=str(dangling), resume=True), "not a complete checkpoint"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ballonet.InputError, match=message) as e:
            preflight(TrainConfig(**kwargs), 1)
        assert "\n" not in str(e.value)


def test_budget_is_checked_before_any_batch_is_built(monkeypatch):
    from ballonet.training import preflight as module
    from ballonet.training.loop import preflight

    def never(*args, **kwargs):
        raise AssertionError("the corpus was read or a batch planned before the budget was checked")

    monkeypatch.setattr(module, "load_corpus", never)
    monkeypatch.setattr(ballonet, "plan_batch", never)
    with pytest.raises(ballonet.InputError, match="--global-tokens 8000000"):
        preflight(TrainConfig(global_tokens=8_000_000), 1)


def test_flags_are_generated_from_the_config_fields():
    import argparse
    import dataclasses

    from ballonet.training import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--shard", "none", "--recompute", "selective", "--lr", "0.01", "--resume",
                              "--checkpoint-dir", "ckpt"])
    parsed = config.config_from_args(args)
    assert (parsed.shard, parsed.recompute, parsed.lr, parsed.resume) == ("none", "selective", 0.01, True)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {a.dest for a in parser._actions} - {"help", "config"} == fields
    docs = config.field_docs()
    assert set(docs) == fields and all(docs.values())  # every field documented


def test_tensorboard_is_optional(tmp_path):
    config = TrainConfig(**BASE, steps=1, tensorboard=str(tmp_path / "tb"))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ballonet.InputError, match="tensorboard"):
            train(config)
        return
    train(config)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


def test_an_unplannable_batch_names_the_step_and_the_corpus_document():
    from ballonet.training.loop import _unplannable

    config = TrainConfig(**BASE)
    corpus = load_corpus(config.corpus, seed=config.seed)
    fourth = list(itertools.islice(reference_loader(**BASE), 4))[3].pieces
    loader = reference_loader(**BASE)
    batches = iter(loader)
    for _ in range(3):
        next(batches)  # the loader now stands before batch 4, as when planning it fails
    error = ballonet.InputError("packed_dp: document 1 (900 tokens) fits no single GPU")
    message = str(_unplannable(error, 4, loader, corpus))
    piece = fourth[1]
    assert message == ("step 4: cannot plan the batch: packed_dp: document 1 (corpus document "
                       f"{corpus.names[piece.doc]}, tokens {piece.start}-{piece.end}) (900 tokens) fits no single GPU")


def test_mfu_peak_follows_a_calibration_profile(tmp_path):
    from ballonet.cost import hardware
    from ballonet.training import metrics

    cluster = ballonet.cluster("cpu", num_nodes=1, gpus_per_node=2)
    assert metrics.peak_flops(cluster) == 2 * hardware.gpu("cpu").peak_flops
    profile = tmp_path / "h200.json"
    profile.write_text(hardware.profile("h200").to_json())
    assert metrics.peak_flops(cluster, str(profile)) == 2 * hardware.gpu("h200").peak_flops
    with pytest.raises(ballonet.InputError, match="nothing.json"):
        metrics.peak_flops(cluster, str(tmp_path / "nothing.json"))


def test_non_tensor_checkpoint_items_load_weights_only(tmp_path):
    """DCP's default planner unpickles non-tensor items without the weights-only guard;
    ours must refuse a pickled object and still read plain values."""
    import io
    import pickle
    from types import SimpleNamespace

    from ballonet.training.checkpoints.checkpoint import SafeLoadPlanner

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optimizer.param_groups.0.lr"))
    evil = io.BytesIO()
    torch.save(Payload(), evil)
    evil.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, evil)
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save({"lr": 0.25, "betas": (0.9, 0.95)}, plain)
    plain.seek(0)
    planner.load_bytes(item, plain)
    assert planner.state_dict["optimizer.param_groups.0.lr"] == {"lr": 0.25, "betas": (0.9, 0.95)}


def test_the_run_plans_with_its_calibration_profile(tmp_path):
    """`--calibration FILE` prices the plans the run trains on (on the loader's prefetch
    thread, which does not inherit `calibration.use`); a profile of another GPU type
    than the cluster's is refused in one line."""
    import dataclasses
    import threading

    from ballonet import calibration
    from ballonet.calibration import Curve
    from ballonet.cost import hardware
    from ballonet.training import loop, metrics

    base = hardware.profile("cpu")
    faster = dataclasses.replace(base, attention_forward=Curve(
        tokens=base.attention_forward.tokens, efficiency=tuple(10 * e for e in base.attention_forward.efficiency)))
    path = tmp_path / "cpu.json"
    path.write_text(faster.to_json())
    cluster, model = ballonet.cluster("cpu", num_nodes=1, gpus_per_node=2), ballonet.model("tiny")
    lengths = [1500, 700, 300, 100]
    with calibration.use(faster):
        want = ballonet.plan_batch(lengths, cluster, model).digest
    assert want != ballonet.plan_batch(lengths, cluster, model).digest  # the profile changes the plan
    got = {}
    profile = metrics.plan_profile(cluster, str(path))
    thread = threading.Thread(target=lambda: got.update(
        digest=loop._plan(profile, lengths, cluster=cluster, model=model, planner="zeppelin").digest))
    thread.start()
    thread.join()
    assert got["digest"] == want
    other = tmp_path / "h200.json"
    other.write_text(hardware.profile("h200").to_json())
    with pytest.raises(ballonet.InputError, match="h200.json: measures a h200 GPU, the cluster has cpu"):
        metrics.plan_profile(cluster, str(other))
