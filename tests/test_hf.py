"""The "ballonet" attention implementation for Hugging Face models (needs transformers).

Reference: the same `LlamaForCausalLM` with its default attention, run in one process on
each document separately (no packing, no plan), loss summed over documents.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import ballonet  # noqa: E402
from ballonet.integrations import hf  # noqa: E402
from ballonet.plan import Plan, Ring, Segment, chunk_bounds  # noqa: E402
from ballonet.training.corpus import from_lengths  # noqa: E402
from ballonet.training.loader import Batch, Piece, build_batch, rank_view  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

RTOL = 1e-4


def _model(attn_implementation: str, state: dict | None = None) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                         vocab_size=256, num_hidden_layers=2, attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


def _reference(batch: Batch, state: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean loss and gradients of the default-attention model, one document at a time."""
    model = _model("sdpa", state)
    total = 0.0
    for doc, (start, end) in enumerate(zip(batch.plan.doc_offsets, batch.plan.doc_offsets[1:])):
        logits = model(input_ids=batch.tokens[None, start:end], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits, batch.labels[start:end], ignore_index=-100, reduction="sum")
    num_valid = int((batch.labels != -100).sum())
    (total / num_valid).backward()
    return total.item() / num_valid, {n: p.grad for n, p in model.named_parameters()}


def _ring_plan(lengths: tuple[int, ...]) -> Plan:
    """Document 0 zig-zag split over ranks 0 and 1, document 1 on rank 0, the rest on rank 1."""
    bounds = chunk_bounds(lengths[0], 4)
    ring = Ring(doc=0, kind="intra", ranks=(0, 1), bounds=bounds)
    attention = (ring.chunks_of(0) + (Segment(1, 0, lengths[1]),),
                 ring.chunks_of(1) + tuple(Segment(d, 0, n) for d, n in enumerate(lengths) if d >= 2))
    return Plan(planner="test", lengths=lengths, node_of_rank=(0, 0), nic_of_rank=(0, 1), attention=attention,
                rings=(ring,)).validate()


def _zeppelin_plan(lengths: tuple[int, ...]) -> Plan:
    return ballonet.plan_batch(lengths, ballonet.cluster("cpu", num_nodes=1, gpus_per_node=2),
                               ballonet.model("tiny"), planner="zeppelin")


def _batch(lengths, plan_fn) -> Batch:
    corpus = from_lengths(lengths, seed=3)
    pieces = [Piece(0, doc, 0, n) for doc, n in enumerate(lengths)]
    return build_batch(corpus, pieces, 0, plan_fn)


def _relative_errors(batch: Batch, state: dict, loss: float, grads: dict) -> dict[str, float]:
    ref_loss, ref_grads = _reference(batch, state)
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for name, ref in ref_grads.items():
        errors[name] = float((grads[name] - ref).norm() / ref.norm())
    return errors


def _check_ranks(rank: int, world_size: int, state: dict, cases: list) -> list[dict[str, float]]:
    out = []
    for lengths, plan_fn in cases:
        batch = _batch(lengths, plan_fn)
        view = rank_view(batch, rank)
        model = _model(hf.ATTENTION, state)
        with hf.plan_context(batch.plan, rank):
            loss = hf.loss_sum(model, view) / view.num_valid_tokens_global
            loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss)
        grads = {}
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            grads[name] = p.grad
        out.append({"rings": len(batch.plan.rings), **_relative_errors(batch, state, loss.item(), grads)})
    return out


def test_two_ranks_match_single_process_default_attention():
    state = _model("sdpa").state_dict()
    cases = [((37, 11, 20), _ring_plan), ((600, 40, 17, 90, 5), _zeppelin_plan)]
    for (lengths, plan_fn), errors in zip(cases, run_ranks(2, _check_ranks, state, cases)[0]):
        assert errors.pop("rings") >= 1, f"{plan_fn.__name__}{lengths}: no document is split over the ranks"
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RTOL, f"{plan_fn.__name__}{lengths}: {worst} off by {errors[worst]:.2e} relative"


def test_one_rank_packed_documents_match_default_attention():
    lengths = (9, 1, 16, 4)
    batch = _batch(lengths, lambda ls: Plan(planner="test", lengths=ls, node_of_rank=(0,), nic_of_rank=(0,),
                                            attention=(tuple(Segment(d, 0, n) for d, n in enumerate(ls)),)))
    state = _model("sdpa").state_dict()
    model = _model(hf.ATTENTION, state)
    view = rank_view(batch, 0)
    with hf.plan_context(batch.plan, 0):
        loss = hf.loss_sum(model, view) / view.num_valid_tokens_global
    loss.backward()  # the engine keeps what backward needs: no context required
    errors = _relative_errors(batch, state, loss.item(), {n: p.grad for n, p in model.named_parameters()})
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"{worst} off by {errors[worst]:.2e} relative"


def test_plan_context_is_scoped_and_required():
    model = _model(hf.ATTENTION)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="plan_context"):
        model(input_ids=ids)
    plan = Plan(planner="test", lengths=(4,), node_of_rank=(0,), nic_of_rank=(0,), attention=((Segment(0, 0, 4),),))
    with hf.plan_context(plan, 0):
        assert model(input_ids=ids, use_cache=False).logits.shape == (1, 4, 256)
        with pytest.raises(ValueError, match="attention_mask"):
            model(input_ids=ids, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), use_cache=False)
    with pytest.raises(RuntimeError, match="plan_context"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="rank 1"):
        with hf.plan_context(plan, 1):
            pass


@pytest.mark.slow
def test_example_trains_on_two_ranks():
    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "hf_llama.py")
    done = subprocess.run([sys.executable, example, "--steps", "3", "--global-tokens", "2048"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], done.stdout
