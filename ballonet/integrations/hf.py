"""Hugging Face transformers models on Ballonet's balanced, distributed attention.

Importing this module registers the attention implementation "ballonet" with
transformers' `AttentionInterface`. A model built with `attn_implementation="ballonet"`
runs every attention layer through `ballonet.runtime.attention`, on the plan and rank set
by `plan_context` (a context variable, so nothing leaks between runs or threads):

    model = LlamaForCausalLM._from_config(config, attn_implementation="ballonet")
    with plan_context(batch.plan, rank, group):
        loss = loss_sum(model, batch) / batch.num_valid_tokens_global
        loss.backward()

The model sees this rank's tokens in the attention layout as one sequence (a batch of one)
with each token's position within its own document (`runtime.position_ids`), so RoPE
restarts at every document and the engine keeps attention inside documents; transformers
builds no attention mask for it. What the model cannot do unmodified is remap: its
embedding, projections, MLP and LM head run on the attention layout, where a rank that
holds many short documents holds more tokens than one holding part of a long one (see
bench/results/hf.md for what that costs against `ballonet.training.model`, which remaps).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ballonet import runtime
from ballonet.plan import Plan
from ballonet.training.loader import IGNORE_INDEX, RankBatch

try:
    from transformers import AttentionInterface
except ImportError as e:  # transformers is an optional extra
    raise ImportError("ballonet.integrations.hf needs transformers: pip install 'ballonet[hf]'") from e

ATTENTION = "ballonet"
"""The `attn_implementation` name this module registers."""


@dataclass(frozen=True)
class _Step:
    plan: Plan
    rank: int
    group: dist.ProcessGroup | None
    kernel: str | None
    counter: runtime.ByteCounter | None


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("ballonet_hf_step", default=None)


@contextlib.contextmanager
def plan_context(plan: Plan, rank: int, group: dist.ProcessGroup | None = None, *, kernel: str | None = None,
                 counter: runtime.ByteCounter | None = None) -> Iterator[None]:
    """Run "ballonet" attention layers on `plan` as `rank` of `group` (None: the default
    group) inside the block. `kernel` and `counter` go to `runtime.attention`."""
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} outside the plan's {plan.num_ranks} ranks")
    token = _STEP.set(_Step(plan, rank, group, kernel, counter))
    try:
        yield
    finally:
        _STEP.reset(token)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key and value [1, H_kv, T, D]
    (T: this rank's tokens in the plan's attention layout) -> ([1, T, H, D], no weights)."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError('attn_implementation="ballonet" needs a plan: call the model inside '
                           "`with ballonet.integrations.hf.plan_context(plan, rank):`")
    if query.shape[0] != 1:
        raise ValueError(f"ballonet attention takes one rank's tokens as a batch of one, got batch {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("ballonet attention takes document boundaries from the plan: pass no attention_mask")
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap") or not getattr(module, "is_causal", True):
        raise NotImplementedError("ballonet attention is causal full attention without dropout, sliding window "
                                  "or softcap")
    q_THD, k_TKD, v_TKD = (x[0].transpose(0, 1) for x in (query, key, value))
    out_THD = runtime.attention(q_THD, k_TKD, v_TKD, step.plan, step.rank, step.group, kernel=step.kernel,
                                counter=step.counter, scale=scaling)
    return out_THD[None], None


def loss_sum(model: torch.nn.Module, batch: RankBatch) -> torch.Tensor:
    """Sum of next-token cross-entropies over this rank's valid labels, for a causal LM
    built with attn_implementation="ballonet" and a `data.RankBatch` in the attention
    layout; call inside `plan_context(batch.plan, ...)`. Divide by
    `batch.num_valid_tokens_global` and sum gradients over ranks for the global mean.

    The labels come from the loader (the next token of the same document, also where it
    lives on another rank), not from the model's own shift, which would cross documents."""
    step = _STEP.get()
    if step is None or (step.plan is not batch.plan and step.plan.digest != batch.plan.digest):
        raise RuntimeError("loss_sum: call it inside plan_context(batch.plan, rank)")
    if batch.rank != step.rank:
        raise ValueError(f"loss_sum: the batch is rank {batch.rank}'s, the plan context rank {step.rank}'s")
    device = next(model.parameters()).device
    logits_1TV = model(input_ids=batch.input_ids[None].to(device), position_ids=batch.position_ids[None].to(device),
                       use_cache=False).logits
    logits_TV = logits_1TV[0].to(torch.promote_types(logits_1TV.dtype, torch.float32))
    return F.cross_entropy(logits_TV, batch.labels.to(logits_TV.device), ignore_index=IGNORE_INDEX, reduction="sum")


AttentionInterface.register(ATTENTION, attention_forward)
