"""Tensor parallelism (`training/tensor_parallel.py`) against one process.

On 4 gloo ranks (tp 2 x 2 plan ranks) and on 8 (tp 2 x 4 plan ranks, two emulated
nodes), with FSDP2 over the plan ranks and TP inside (torchtitan's composition), the
built-in model's and Hugging Face Llama's and Qwen3's summed loss and every parameter's
gradient equal a one-process reference on the unsharded batch (every document whole,
attention per document) within 1e-4 relative, fp32, under zeppelin's and te_cp's plans
and hand plans with double rings across nodes and routed hops. The same ranks check what
a TP rank holds for the backward against the cost model's memory model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from helpers import batch, make_plan, model_reference, tp_groups

import ballonet
from ballonet import runtime
from ballonet.cost import memory
from ballonet.errors import InputError
from ballonet.plan import Plan, Route, Segment
from ballonet.training import parallel, tensor_parallel
from ballonet.training.model import Transformer

TP = 2
SPEC = ballonet.model("tiny")
RTOL = 1e-4
LENGTHS = (600,) + (20,) * 12  # a document long enough for zeppelin to split it


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
    parallel.parallelize(model, mesh["plan"])
    tokens, labels = batch(plan.lengths)
    index = runtime.token_index(plan, plan_rank)
    with tensor_parallel.loss_context(model):
        loss = model.loss(tokens[index], labels[index], plan, plan_rank, group, outer_group=outer)
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss, group=group)
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}  # collective
    return loss.item(), grads if dist.get_rank() == 0 else None


def _held(model, plan: Plan) -> dict[str, int]:
    """Per recomputation mode, bytes this rank holds for the backward (autograd's saved
    tensors, each storage once, parameters left out) of `plan`'s batch."""
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()}
    tokens, labels = batch(plan.lengths)
    out = {}
    for mode in memory.RECOMPUTE_MODES:
        model.set_recompute(mode)
        held = {}

        def pack(t):
            local = t.to_local() if hasattr(t, "to_local") else t
            local = getattr(local, "elem", local)  # an async collective's result
            ptr = local.untyped_storage().data_ptr()
            if ptr not in params:
                held[ptr] = local.untyped_storage().nbytes()
            return t

        with tensor_parallel.loss_context(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss(tokens, labels, plan, 0)
        out[mode] = sum(held.values())
    return out


def _memory(mesh) -> dict:
    """What one TP rank holds (parameters, and for the backward per layer: 3 layers less
    2) on a one-rank plan its TP group runs alone, and the same unsharded."""
    lengths = (300, 200, 12)
    plan = Plan(planner="hand", lengths=lengths, node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, n) for d, n in enumerate(lengths)),))
    out = {}
    for tp in (1, TP):
        held = {}
        for layers in (2, 3):
            model = Transformer(dataclasses.replace(SPEC, num_layers=layers), seed=3)
            if tp > 1:
                tensor_parallel.parallelize_transformer(model, mesh["tp"])
            held[layers] = _held(model, plan)
        out[tp] = {"params": parallel.local_parameter_bytes(model),
                   "layer": {m: held[3][m] - held[2][m] for m in held[2]}}
    return out


def _hf_steps(mesh, plan_rank, group, outer, plan: Plan, folders: dict) -> dict:
    from ballonet.integrations import hf_model

    out = {}
    for kind, folder in folders.items():
        model = tensor_parallel.parallelize_hf(hf_model.build_model(f"hf:{folder}", 5, torch.device("cpu")), mesh["tp"])
        out[kind] = _step(model, plan, mesh, plan_rank, group, outer)
    return out


def _ranks(rank: int, world: int, plans: dict[str, Plan], folders: dict, hf_plan: str, held: bool) -> dict:
    mesh, plan_rank, group, outer = tp_groups(world, TP)
    out = {}
    for name, plan in plans.items():
        model = tensor_parallel.parallelize_transformer(Transformer(SPEC, seed=3), mesh["tp"])
        out[name] = _step(model, plan, mesh, plan_rank, group, outer)
    out["hf"] = _hf_steps(mesh, plan_rank, group, outer, plans[hf_plan], folders)
    if held:
        out["memory"] = _memory(mesh)
    return out


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


def _check(results: list, plans: dict, folders: dict, hf_plan: str) -> None:
    first = results[0]
    sums = {name: sum(r[name][0] for r in results[::TP]) / (len(results) // TP) for name in plans}
    for name, plan in plans.items():
        assert all(r[name][0] == pytest.approx(first[name][0], rel=1e-6) for r in results), name
        _assert_close(name, (sums[name], first[name][1]), *_builtin_reference(plan))
    for kind, folder in folders.items():
        _assert_close(f"{kind} on {hf_plan}", first["hf"][kind], *_hf_reference(folder, plans[hf_plan]))


@pytest.mark.slow
def test_four_ranks_tp2_match_one_process(tmp_path):
    plans, folders = two_rank_plans(), _hf_folders(tmp_path)
    assert plans["zeppelin"].rings and plans["zeppelin"].remap and plans["te_cp"].rings
    results = run_ranks(4, _ranks, plans, folders, "zeppelin", True, timeout=600)
    _check(results, plans, folders, "zeppelin")
    _check_memory(results[0]["memory"])


@pytest.mark.slow
def test_eight_ranks_tp2_on_two_nodes_match_one_process(tmp_path):
    plans, folders = four_rank_plans(), _hf_folders(tmp_path)
    assert {r.kind for r in plans["te_cp"].rings} == {"inter"} and plans["double, routed"].routes
    results = run_ranks(8, _ranks, plans, folders, "double, routed", False, timeout=900)
    _check(results, plans, folders, "double, routed")


def _check_memory(holds: dict) -> None:
    """What a TP rank holds beyond 1/tp of what one process holds, for the backward per
    layer, is what the cost model says it holds beyond 1/tp: the normed inputs that
    sequence parallelism gathers (`cost.memory.activation_bytes`), and the rotary tables
    (cos and sin [T, 1, D] for q and for k), which the cost model leaves out at any tp,
    where they are held (not recomputed). Parameters: 1/tp of each but the norms'."""
    T, D, fp32 = 512, SPEC.head_dim, 4
    layer = {tp: dataclasses.replace(SPEC, tp=tp) for tp in (1, TP)}

    def model_per_layer(spec, mode):
        return (memory.activation_bytes(dataclasses.replace(spec, num_layers=3), T, T, mode)
                - memory.activation_bytes(dataclasses.replace(spec, num_layers=2), T, T, mode))

    for mode in memory.RECOMPUTE_MODES:
        held = holds[TP]["layer"][mode] - holds[1]["layer"][mode] / TP
        rope = 4 * D * T * fp32 * (1 - 1 / TP) if mode in ("none", "selective") else 0
        model = model_per_layer(layer[TP], mode) - model_per_layer(layer[1], mode) / TP
        assert held == pytest.approx(model + rope, abs=1e-6), (mode, held, model, rope)
    assert holds[TP]["layer"]["none"] < holds[1]["layer"]["none"] * 0.6
    norms = (2 * 3 + 1) * SPEC.hidden * fp32
    assert holds[TP]["params"] == (holds[1]["params"] - norms) / TP + norms


def test_heads_that_tp_does_not_divide_are_one_clear_error():
    tensor_parallel.check_heads("tiny", 4, 2, 2)
    for heads, kv in ((4, 1), (6, 2)):
        with pytest.raises(InputError, match=f"--tp 4 must divide its {heads} query heads and {kv} KV heads"):
            tensor_parallel.check_heads("m", heads, kv, 4)
