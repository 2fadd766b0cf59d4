import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from plans_by_hand import one_rank_plan, remap_plan
from tiny_model import SPEC, assert_grads_close, batch, model_reference, rank_outputs

import ballonet
from ballonet import runtime
from ballonet.plan import Plan
from ballonet.training.parallelism.model import IGNORE_INDEX, Transformer

# ---- an independent model_reference: one document at a time ------------------------------


# ---- attention seams for tests --------------------------------------------------------


def local_attention(q, k, v, plan: Plan, rank: int, group=None):
    """Per-document causal SDPA over this rank's segments; every document must be whole."""
    outs, cursor = [], 0
    for s in plan.attention[rank]:
        assert s.num_tokens == plan.lengths[s.doc], "local_attention needs whole documents"
        sl = slice(cursor, cursor + s.num_tokens)
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        cursor += s.num_tokens
    return torch.cat(outs)


class _GatherAll(torch.autograd.Function):
    """[T_att, ...] per rank -> the whole batch [N, ...] on every rank (global order);
    backward sums every rank's gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, plan, rank, group):
        ctx.index, ctx.group = runtime.token_index(plan, rank), group
        T_max = max(plan.attention_tokens(r) for r in range(plan.num_ranks))
        padded = torch.cat([x, x.new_zeros((T_max - x.shape[0], *x.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in range(plan.num_ranks)]
        dist.all_gather(parts, padded, group=group)
        out = x.new_empty((plan.num_tokens, *x.shape[1:]))
        for r, part in enumerate(parts):
            index = runtime.token_index(plan, r)
            out[index] = part[: index.shape[0]]
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.index], None, None, None


def gathered_attention(q, k, v, plan: Plan, rank: int, group=None):
    """A distributed oracle independent of the engine: gather q, k, v of the whole batch,
    attend per document, keep this rank's rows."""
    q_N, k_N, v_N = (_GatherAll.apply(t, plan, rank, group) for t in (q, k, v))
    docs = list(plan.lengths)
    o_N = torch.cat([F.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1),
                                                    is_causal=True, enable_gqa=True).transpose(0, 1)
                     for a, b, c in zip(q_N.split(docs), k_N.split(docs), v_N.split(docs))])
    return o_N[runtime.token_index(plan, rank)]


# ---- one process ----------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["local", "engine"])
def test_one_process_matches_reference(attention):
    plan = one_rank_plan((5, 9, 4), order=(2, 0, 1))
    dtype, tol = (torch.float64, dict(rtol=1e-9, atol=1e-10)) if attention == "local" else \
        (torch.float32, dict(rtol=1e-4, atol=1e-5))
    model = Transformer(SPEC, seed=3, attention_fn=local_attention if attention == "local" else None).to(dtype)
    ref_model = copy.deepcopy(model)
    tokens, labels = batch(plan.lengths)
    ref_logits, ref_loss = model_reference(ref_model, plan.lengths, tokens, labels)
    ti = runtime.token_index(plan, 0)
    assert ti.tolist()[:4] == [14, 15, 16, 17]  # document 2 first
    assert torch.allclose(model(tokens[ti], plan, 0), ref_logits[ti], **tol)
    loss = model.loss(tokens[ti], labels[ti], plan, 0)
    assert torch.allclose(loss, ref_loss, **tol)
    # Small random weights: close to a uniform guess over the vocabulary.
    assert abs(loss.item() / int((labels != IGNORE_INDEX).sum()) - math.log(SPEC.vocab_size)) < 0.1
    loss.backward()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, ref_model, **tol)


def test_weights_come_from_the_seed():
    a, b, c = Transformer(SPEC, seed=1), Transformer(SPEC, seed=1), Transformer(SPEC, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].wq.weight, c.layers[0].wq.weight)
    assert sum(p.numel() for p in a.parameters()) == SPEC.num_params


def test_model_rejects_bad_input():
    model = Transformer(SPEC, attention_fn=local_attention)
    with pytest.raises(ValueError, match="labels"):
        model.loss(torch.zeros(18, dtype=torch.long), torch.zeros(17, dtype=torch.long), one_rank_plan((5, 9, 4)), 0)


# ---- 4 gloo ranks as 2 nodes x 2 ------------------------------------------------------


def planner_plan() -> Plan:
    """The zeppelin planner's plan for a batch with one long document (if it splits it)."""
    return ballonet.plan_batch((200, 3, 5, 8, 12, 6, 30, 2), ballonet.cluster("cpu"), SPEC).validate()


SCENARIOS = [  # (name, plan, attention, dtype)
    ("remap_plan/gathered", remap_plan, "gathered", torch.float64),
    ("remap_plan/engine", remap_plan, "engine", torch.float32),
    ("planner/engine", planner_plan, "engine", torch.float32),
]


def _model_rank(rank: int, world_size: int) -> list:
    out = []
    for _, make_plan, attention, dtype in SCENARIOS:
        plan = make_plan()
        model = Transformer(SPEC, seed=3, attention_fn=gathered_attention if attention == "gathered" else None)
        out.append(rank_outputs(model.to(dtype), plan, rank))
    return out


@pytest.mark.slow
def test_four_ranks_match_one_process_reference():
    results = run_ranks(4, _model_rank)
    for i, (name, make_plan, _, dtype) in enumerate(SCENARIOS):
        plan = make_plan()
        assert plan.remap, name
        tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-5)
        ref_model = Transformer(SPEC, seed=3).to(dtype)
        tokens, labels = batch(plan.lengths)
        ref_logits, ref_loss = model_reference(ref_model, plan.lengths, tokens, labels)
        per_rank = [(torch.from_numpy(loss), {n: torch.from_numpy(g) for n, g in grads.items()}, torch.from_numpy(lg))
                    for loss, grads, lg in (r[i] for r in results)]
        assert torch.allclose(sum(loss for loss, _, _ in per_rank), ref_loss, **tol), name
        grads = {n: sum(g[n] for _, g, _ in per_rank) for n, _ in ref_model.named_parameters()}
        assert_grads_close(grads, ref_model, **tol)
        for rank, (_, _, logits) in enumerate(per_rank):
            assert torch.allclose(logits, ref_logits[runtime.token_index(plan, rank, "linear")], **tol), name
