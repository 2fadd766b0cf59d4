"""Hugging Face transformers models on Ballonet's balanced, distributed attention, with
the remap: every linear layer runs token-balanced, the model unmodified.

Importing this module registers the attention implementation "ballonet" with
transformers' `AttentionInterface`. A model built with `attn_implementation="ballonet"`
runs every attention layer through `ballonet.runtime.attention`, on the plan and rank set
by `plan_context` (a context variable, so nothing leaks between runs or threads):

    model = LlamaForCausalLM._from_config(config, attn_implementation="ballonet")
    with plan_context(batch.plan, rank, group):
        loss = loss_sum(model, batch) / batch.num_valid_tokens_global
        loss.backward()

The model is fed this rank's tokens in the plan's linear (token-balanced) layout as one
sequence (a batch of one), with each token's position within its own document, so its
embedding, projections, MLP, norms and LM head all run token-balanced and RoPE restarts
at every document. The attention interface receives q, k and v right after the
projections (and RoPE) and returns o right before the output projection: there
`attention_forward` moves q, k and v to the attention layout in one all-to-all, runs the
engine (which keeps attention inside documents), and moves o back. This is where
`ballonet.training.parallelism.model` remaps too. transformers builds no attention mask for it.

Layers recomputed in the backward (`torch.utils.checkpoint`) need the plan there too:
checkpoint them with `context_fn=recompute_context` (`hf_model.enable_recompute` does).

Before the first collective of a step, the ranks compare plan digests
(`runtime.check_plan`): ranks holding different plans fail together instead of hanging.
What the layers need (`runtime.step_meta`) is built once per context (or given, as the
training loader builds it) and moved to the device in one copy; the layers copy nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ballonet import runtime
from ballonet.plan import Plan
from ballonet.runtime.remapping import remap
from ballonet.training.data.loader import IGNORE_INDEX, RankBatch

try:
    from transformers import AttentionInterface
except ImportError as e:  # transformers is an optional extra
    raise ImportError("ballonet.integrations.hf needs transformers: pip install 'ballonet[hf]'") from e

ATTENTION = "ballonet"
"""The `attn_implementation` name this module registers."""


@dataclass
class _Step:
    plan: Plan
    rank: int
    group: dist.ProcessGroup | None
    kernel: str | None
    counter: runtime.ByteCounter | None
    outer_group: dist.ProcessGroup | None = None
    checked: list[torch.device] = field(default_factory=list)
    """Where the ranks' plan digests were compared (once per context)."""
    num_pad: int = 0
    """Padding tokens after this rank's own (see `linear_logits`)."""
    meta: runtime.StepMeta | None = None
    """The step's metadata on the device (made at first use when not given)."""

    def check(self, device: torch.device, content: tuple[bytes, bytes] | None = None) -> None:
        """Compare plan digests (and `content`, token digests) over the group once,
        before this context's first collective."""
        if not self.checked:
            runtime.check_plan(self.plan, self.rank, self.group, device, content=content)
            self.checked.append(device)

    def meta_on(self, device: torch.device) -> runtime.StepMeta:
        if self.meta is None:
            self.meta = runtime.to_device(runtime.step_meta(self.plan, self.rank), device)
        else:
            self.meta.check(self.plan, self.rank)
        return self.meta


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("ballonet_hf_step", default=None)


@contextlib.contextmanager
def plan_context(plan: Plan, rank: int, group: dist.ProcessGroup | None = None, *, kernel: str | None = None,
                 counter: runtime.ByteCounter | None = None, outer_group: dist.ProcessGroup | None = None,
                 meta: runtime.StepMeta | None = None) -> Iterator[_Step]:
    """Run "ballonet" attention layers on `plan` as `rank` of `group` (None: the default
    group) inside the block. `kernel`, `counter` and `outer_group` go to `runtime.attention`;
    `meta`: `runtime.step_meta(plan, rank)` on the model's device (made once here if not)."""
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} outside the plan's {plan.num_ranks} ranks")
    with _entered(_Step(plan, rank, group, kernel, counter, outer_group, meta=meta)) as step:
        yield step


@contextlib.contextmanager
def _entered(step: _Step) -> Iterator[_Step]:
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint` (non-reentrant) around layers
    of a "ballonet" model: the forward runs as it is; its recomputation in the backward
    runs in the plan context of that forward, captured now (with its padding) and entered
    again then. The backward runs after `plan_context` has exited, and on CUDA in
    autograd's device threads, which do not see this thread's context variables."""
    step = _STEP.get()
    if step is None:  # the layer's attention raises its own error
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _entered(dataclasses.replace(step))


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key and value [1, H_kv, T, D]
    (T: this rank's tokens in the plan's linear layout) -> ([1, T, H, D], no weights).
    Collective over the plan's ranks: q, k, v go to the attention layout and o comes back."""
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
    step.check(query.device)
    meta = step.meta_on(query.device)
    H, K, T = query.shape[1], key.shape[1], query.shape[2] - step.num_pad
    qkv_THD = torch.cat([query[0, :, :T], key[0, :, :T], value[0, :, :T]], 0).transpose(0, 1)
    # One all-to-all for q, k and v together (layout: runtime.layout).
    qkv_att = remap(qkv_THD, step.plan, step.rank, "linear", "attention", step.group, step.counter,
                    verify_plan=False, move=meta.to_attention)  # step.check compared the digest once
    q_att, k_att, v_att = (x.contiguous() for x in qkv_att.split([H, K, K], 1))
    o_att = runtime.attention(q_att, k_att, v_att, step.plan, step.rank, step.group, kernel=step.kernel,
                              counter=step.counter, scale=scaling, verify_plan=False, outer_group=step.outer_group,
                              meta=meta.attention)
    o_THD = remap(o_att, step.plan, step.rank, "attention", "linear", step.group, step.counter, verify_plan=False,
                  move=meta.to_linear)
    if step.num_pad:  # padding attends to nothing: zeros, through which no gradient flows
        o_THD = torch.cat([o_THD, o_THD.new_zeros(step.num_pad, *o_THD.shape[1:])])
    return o_THD[None], None


def linear_inputs(batch: RankBatch, group: dist.ProcessGroup | None = None,
                  counter: runtime.ByteCounter | None = None, move=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, position_ids) of this rank in the plan's linear layout, each
    [T_lin]: as read by a loader in the linear layout, or moved there (one all-to-all;
    `move` as in `runtime.remap`, on the CPU like the batch)."""
    if batch.layout == "linear":
        return batch.input_ids, batch.labels, batch.position_ids
    stacked_T3 = torch.stack([batch.input_ids, batch.labels, batch.position_ids], 1)
    moved_T3 = remap(stacked_T3, batch.plan, batch.rank, "attention", "linear", group, counter,
                     move=move if move is not None and move.keep_src.device == stacked_T3.device else None)
    return moved_T3[:, 0], moved_T3[:, 1], moved_T3[:, 2]


def linear_logits(forward, ids_T: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    """`forward(input_ids=[1, T], position_ids=[1, T], use_cache=False).logits` as [T, V]
    (fp32 at least), for this rank's tokens in the linear layout; call inside
    `plan_context`. A rank with no token runs one padding token instead (transformers
    cannot reshape an empty sequence, and the rank must still join every exchange and
    produce every gradient): the attention drops it before the remap, its logits are cut."""
    step = _STEP.get()
    step.num_pad = 1 if ids_T.numel() == 0 else 0
    if step.num_pad:
        ids_T, pos_T = ids_T.new_zeros(1), pos_T.new_zeros(1)
    try:
        logits_1TV = forward(input_ids=ids_T[None], position_ids=pos_T[None], use_cache=False).logits
    finally:
        num_pad, step.num_pad = step.num_pad, 0
    logits_TV = logits_1TV[0, : logits_1TV.shape[1] - num_pad]
    return logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))


def loss_sum(model: torch.nn.Module, batch: RankBatch) -> torch.Tensor:
    """Sum of next-token cross-entropies over this rank's valid labels, for a causal LM
    built with attn_implementation="ballonet" and a `loader.RankBatch` (either layout);
    call inside `plan_context(batch.plan, ...)`. Divide by `batch.num_valid_tokens_global`
    and sum gradients over ranks for the global mean. Collective.

    The labels come from the loader (the next token of the same document, also where it
    lives on another rank), not from the model's own shift, which would cross documents."""
    step = _STEP.get()
    if step is None or (step.plan is not batch.plan and step.plan.digest != batch.plan.digest):
        raise RuntimeError("loss_sum: call it inside plan_context(batch.plan, rank)")
    if batch.rank != step.rank:
        raise ValueError(f"loss_sum: the batch is rank {batch.rank}'s, the plan context rank {step.rank}'s")
    device = next(model.parameters()).device
    step.check(device, batch.content if batch.content[0] else None)
    meta = step.meta_on(device)  # before the layers: recomputation captures the context with it
    ids_T, labels_T, pos_T = (x.to(device) for x in linear_inputs(batch, step.group, step.counter, meta.to_linear))
    logits_TV = linear_logits(model, ids_T, pos_T)
    loss = F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss  # tensor parallel: replicated over its group


AttentionInterface.register(ATTENTION, attention_forward)
