"""Tensor parallelism (`training/parallelism/tensor_parallel.py`) against one process.

On 4 gloo ranks (tp 2 x 2 plan ranks) and on 8 (tp 2 x 4 plan ranks, two emulated
nodes), with FSDP2 over the plan ranks and TP inside (torchtitan's composition), fp32,
within 1e-4 relative:

* one step: the built-in model's, Hugging Face Llama's and Qwen3's summed loss and every
  parameter's gradient equal a one-process reference on the unsharded batch (every
  document whole, attention per document), under zeppelin's and te_cp's plans and hand
  plans with double rings across nodes and routed hops;
* training (`train_model`, as `ballonet train --tp 2` runs it): the losses of 2 steps and
  the parameters after them equal the same run in one process, under zeppelin and te_cp
  (4 ranks), sharded or replicated weights, with recomputation, for the built-in model,
  Llama (4 ranks) and Qwen3 (8 ranks).

On 8 ranks the Hugging Face step is Qwen3's alone (Llama's runs on 4).

Each spawned group runs all its checks (a spawn of 8 ranks costs about a minute on 2
cores). What TP sends and holds is checked against the cost model in
tests/test_sim_truth.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from plans_by_hand import make_plan
from tiny_model import batch, model_reference
from tp_mesh import tp_groups

import ballonet
from ballonet import runtime
from ballonet.errors import InputError
from ballonet.plan import Plan, Route
from ballonet.training.parallelism import parallel, tensor_parallel
from ballonet.training.loop import TrainConfig, train_model
from ballonet.training.parallelism.model import Transformer

TP = 2
SPEC = ballonet.model("tiny")
RTOL = 1e-4
LENGTHS = (600,) + (20,) * 12  # a document long enough for zeppelin to split it
STEPS = 2
TRAIN = dict(corpus="stdlib", global_tokens=1536, max_doc_tokens=1024, lr=3e-3, seed=3, steps=STEPS, log_every=STEPS)
"""Training runs: the built-in tiny model (or a Hugging Face one of its shape) on the
standard library's text, as tests/test_train.py trains it."""


def two_rank_plans() -> dict[str, Plan]:
    """Plans of 2 plan ranks: zeppelin's (a ring and a remap) and te_cp's on one node of 4
    GPUs at tp 2, and a "double" ring over two nodes (one plan rank each)."""
    cluster, spec = ballonet.cluster("cpu", num_nodes=1, gpus_per_node=2 * TP), ballonet.model("tiny", tp=TP)
    double = make_plan([37, 13, 5, 20, 9], [(0, 1), 0, 1, (1, 0), 1], (0, 1), groups={0: 2, 3: 2})
    return {"zeppelin": ballonet.plan_batch(LENGTHS, cluster, spec, "zeppelin", price_linear=False),
            "te_cp": ballonet.plan_batch(LENGTHS, cluster, spec, "te_cp"),
            "double": double}


def four_rank_plans() -> dict[str, Plan]:
    """Plans of 4 plan ranks on two nodes of 4 GPUs at tp 2: zeppelin's, te_cp's, and
    double rings beside an all-gather ring and a ring whose hops across nodes are routed."""
    cluster, spec = ballonet.cluster("cpu", num_nodes=2, gpus_per_node=2 * TP), ballonet.model("tiny", tp=TP)
    lengths = [37, 13, 5, 20, 9, 7, 3, 11, 6]
    placement = [(0, 1, 2, 3), (0, 2), (2, 3, 0, 1), (0, 1, 2, 3), (2, 3), 1, 3, (3, 1), (1, 2)]
    mixed = make_plan(lengths, placement, (0, 0, 1, 1), comms={8: "allgather"}, seed=3, groups={0: 2, 1: 2, 2: 2, 7: 2})
    routes = (Route(doc=3, src=1, dst=2, proxies=((0, 2), (1, 3))), Route(doc=3, src=3, dst=0, proxies=((2, 0), (3, 1))))
    return {"zeppelin": ballonet.plan_batch(LENGTHS, cluster, spec, "zeppelin"),
            "te_cp": ballonet.plan_batch(LENGTHS, cluster, spec, "te_cp"),
            "double, routed": dataclasses.replace(mixed, routes=routes).validate()}


# ---- the ranks -------------------------------------------------------------------------------


def _step(model, plan: Plan, mesh, plan_rank: int, group, outer) -> tuple:
    """One forward and backward of `model` (sharded here: TP, then FSDP2 over the plan
    ranks) on this rank's tokens of `plan`'s batch -> (summed loss over the plan ranks,
    full gradients on global rank 0, else None)."""
    parallel.parallelize(model, mesh)
    tokens, labels = batch(plan.lengths)
    index = runtime.token_index(plan, plan_rank)
    with tensor_parallel.loss_context(model):
        loss = model.loss(tokens[index], labels[index], plan, plan_rank, group, outer_group=outer)
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss, group=group)
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}  # collective
    return loss.item(), grads if dist.get_rank() == 0 else None


def _hf_steps(mesh, plan_rank, group, outer, plan: Plan, folders: dict) -> dict:
    from ballonet.integrations import hf_model

    out = {}
    for kind, folder in folders.items():
        model = tensor_parallel.parallelize_hf(hf_model.build_model(f"hf:{folder}", 5, torch.device("cpu")), mesh["tp"])
        out[kind] = _step(model, plan, mesh, plan_rank, group, outer)
    return out


def _trained(configs: list[dict]) -> list:
    """Per config: the losses of `train_model` and its parameters after them, unsharded
    (numpy: tensors would cross to the parent as shared memory that dies with the rank)."""
    out = []
    for c in configs:
        records, model = train_model(TrainConfig(**c))
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
                  for n, p in model.named_parameters()}  # collective
        out.append(([r["loss"] for r in records], params))
    return out


def _ranks(rank: int, world: int, plans: dict[str, Plan], folders: dict, hf_plan: str, configs: list[dict]) -> dict:
    mesh, plan_rank, group, outer = tp_groups(world, TP)
    out = {}
    for name, plan in plans.items():
        model = tensor_parallel.parallelize_transformer(Transformer(SPEC, seed=3), mesh["tp"])
        out[name] = _step(model, plan, mesh, plan_rank, group, outer)
    out["hf"] = _hf_steps(mesh, plan_rank, group, outer, plans[hf_plan], folders)
    out["trained"] = _trained(configs)
    return out if rank == 0 else {k: v for k, v in out.items() if k != "trained"}


# ---- the references ----------------------------------------------------------------------


def _relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def _assert_close(name: str, got: tuple, ref_loss: float, ref_grads: dict) -> None:
    loss, grads = got
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (name, loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), name
    worst = max((_relative(grads[n], g), n) for n, g in ref_grads.items())
    assert worst[0] <= RTOL, (name, worst)


def _builtin_reference(plan: Plan) -> tuple[float, dict]:
    model = Transformer(SPEC, seed=3)
    tokens, labels = batch(plan.lengths)
    _, loss = model_reference(model, plan.lengths, tokens, labels)
    return loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def _hf_folders(tmp_path) -> dict:
    from transformers import LlamaConfig, Qwen3Config

    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176, vocab_size=256,
              num_hidden_layers=2, tie_word_embeddings=False)
    folders = {"llama": tmp_path / "llama", "qwen3": tmp_path / "qwen3"}
    LlamaConfig(**kw).save_pretrained(folders["llama"])
    Qwen3Config(head_dim=16, **kw).save_pretrained(folders["qwen3"])  # Qwen3: per-head q_norm and k_norm
    return {k: str(v) for k, v in folders.items()}


def _hf_reference(folder: str, plan: Plan) -> tuple[float, dict]:
    """transformers' own attention ("sdpa") on each document alone, the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ballonet.integrations import hf_model

    state = hf_model.build_model(f"hf:{folder}", 5, torch.device("cpu")).state_dict()
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict(state)
    tokens, labels = batch(plan.lengths)
    loss = sum(F.cross_entropy(model(input_ids=doc[None], use_cache=False).logits[0], lab, ignore_index=-100,
                               reduction="sum")
               for doc, lab in zip(tokens.split(list(plan.lengths)), labels.split(list(plan.lengths))))
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def _check(results: list, plans: dict, folders: dict, hf_plan: str, configs: list[dict]) -> None:
    """Each rank's summed loss and rank 0's gradients against the references; the trained
    runs' losses and parameters against the same run in this one process."""
    first = results[0]
    for name, plan in plans.items():
        assert all(r[name][0] == pytest.approx(first[name][0], rel=1e-6) for r in results), name
        _assert_close(name, first[name], *_builtin_reference(plan))
    for kind, folder in folders.items():
        _assert_close(f"{kind} on {hf_plan}", first["hf"][kind], *_hf_reference(folder, plans[hf_plan]))
    for config, (losses, params) in zip(configs, first["trained"], strict=True):
        ref_losses, ref_params = _trained([dict(config, tp=1, nodes=1)])[0]
        assert len(losses) == len(ref_losses) == STEPS and ref_losses[-1] < ref_losses[0], config
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert worst <= RTOL, (config, losses, ref_losses)
        worst = max((_relative(params[n], p), n) for n, p in ref_params.items())
        assert worst[0] <= RTOL, (config, worst)


@pytest.mark.slow
def test_four_ranks_tp2_match_one_process(tmp_path):
    plans, folders = two_rank_plans(), _hf_folders(tmp_path)
    assert plans["zeppelin"].rings and plans["zeppelin"].remap and plans["te_cp"].rings
    run = dict(TRAIN, tp=TP)
    configs = [dict(run, planner="zeppelin", shard="none"), dict(run, planner="te_cp", nodes=2, recompute="full"),
               dict(run, model=f"hf:{folders['llama']}", recompute="selective")]
    results = run_ranks(4, _ranks, plans, folders, "zeppelin", configs, timeout=900)
    _check(results, plans, folders, "zeppelin", configs)


@pytest.mark.slow
def test_eight_ranks_tp2_on_two_nodes_match_one_process(tmp_path):
    plans, folders = four_rank_plans(), {"qwen3": _hf_folders(tmp_path)["qwen3"]}
    assert {r.kind for r in plans["te_cp"].rings} == {"inter"} and plans["double, routed"].routes
    run = dict(TRAIN, tp=TP, nodes=2)
    configs = [dict(run, planner="zeppelin"), dict(run, model=f"hf:{folders['qwen3']}")]
    results = run_ranks(8, _ranks, plans, folders, "double, routed", configs, timeout=1200)
    _check(results, plans, folders, "double, routed", configs)


def test_heads_that_tp_does_not_divide_are_one_clear_error():
    tensor_parallel.check_heads("tiny", 4, 2, 2)
    for heads, kv in ((4, 1), (6, 2)):
        with pytest.raises(InputError, match=f"--tp 4 must divide its {heads} query heads and {kv} KV heads"):
            tensor_parallel.check_heads("m", heads, kv, 4)


def test_bad_tp_combinations_are_one_line_and_exit_2(tmp_path, capsys):
    from transformers import LlamaConfig

    from ballonet.cli import main

    mqa = tmp_path / "mqa"  # one KV head: tp 2 cannot split it
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, intermediate_size=176, vocab_size=256,
                num_hidden_layers=2).save_pretrained(mqa)
    cases = [
        (["--nproc", "4", "--tp", "3"], "4 ranks (the world size) are not a multiple of --tp 3"),
        (["--tp", "2"], "1 rank (the world size) is not a multiple of --tp 2"),
        (["--nproc", "4", "--nodes", "2", "--tp", "4"], "--tp 4 does not divide the 2 ranks of a node (--nodes 2)"),
        (["--nproc", "8", "--tp", "8"], "--tp 8 must divide its 4 query heads and 2 KV heads"),
        (["--nproc", "4", "--tp", "2", "--model", f"hf:{mqa}"], "--tp 2 must divide its 4 query heads and 1 KV heads"),
        (["--tp", "0"], "--tp must be positive"),
    ]
    for argv, message in cases:
        code = main(["train", *argv, "--steps", "1", "--global-tokens", "256"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and len(err.splitlines()) == 1, (argv, code, err)


def test_plan_schedule_check_passes_with_tensor_parallelism(capsys, tmp_path):
    import json

    from ballonet.cli import main

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([400_000] + [2048] * 100))
    for tp, ranks in ((2, 16), (4, 8)):
        args = ["plan", "--cluster", "a800-4nic", "--nodes", "4", "--model", "llama-13b", "--tp", str(tp),
                "--lengths", str(lengths), "--check-schedule", "--json"]
        assert main(args) == 0
        check = json.loads(capsys.readouterr().out)["schedule_check"]
        assert check["completes"] is True and check["messages"] > 0 and check["ranks"] == ranks, (tp, check)
