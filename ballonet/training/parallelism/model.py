"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) run on a plan's two layouts.

Only the attention core (softmax(q k^T) v, per document and causal) runs on the attention
layout, through the runtime engine; everything else (embedding, norms, projections, MLP,
LM head and loss) runs on the token-balanced linear layout. The same code runs on one
process: with a one-rank plan the remaps are no-ops.

Where the two remaps sit: after the QKV projection (q, k and v go to the attention layout)
and before the output projection (the attention output comes back). The alternative moves
the hidden state before the QKV projection and after the output projection: fewer bytes
(h elements a token each way, instead of h + 2*kv_dim out and h back), but the rank that
holds surplus tokens in the attention layout then also runs their QKV and output
projections. Per 4096 surplus tokens and layer, forward, from `ballonet.cost`: QKV+O
compute is linear_time(4096) times the QKV+O share of the layer's weights; the extra
bytes are kv_bytes(4096), sent with p2p_time over NVLink or one GPU's share of a NIC
(latency left out):

    model      cluster    QKV+O compute   extra K,V bytes   over NVLink   over the NIC
    llama-7b   h800-8nic  0.74 ms         67 MB             0.42 ms       1.49 ms
    llama-7b   a800-4nic  2.36 ms         67 MB             0.42 ms       5.97 ms
    llama3-8b  h800-8nic  0.47 ms         17 MB             0.10 ms       0.37 ms
    llama3-8b  a800-4nic  1.47 ms         17 MB             0.10 ms       1.49 ms

(backward: twice the compute, the same bytes again). Moving K and V is cheaper on NVLink
(1.8-14x over the llama presets on h800, a800 and h200 nodes) and, with GQA and a NIC per
GPU, across nodes too; it loses for MHA tokens crossing nodes, and the remap planner sends
only net node imbalance across them. Remapping after QKV also keeps all linear work
balanced (QKV+O are 33% of llama-7b's linear FLOPs, 19% of llama3-8b's) and leaves the
residual stream on the linear layout, so the only other move is the token ids (and
labels) once per step, 8 bytes a token each.

With tensor parallelism (`tensor_parallel.parallelize_transformer`) the same code runs on
DTensors: the residual stream is sharded over the TP group's sequence, a block's head
counts are this TP rank's, and the remaps and the attention move and attend with its
heads only, over the plan-rank group of its TP index.

Legend: T tokens of this rank (T_lin linear layout, T_att attention layout), C hidden,
H query heads, K KV heads, D head dim, V vocabulary (with tensor parallelism, H and K
are this TP rank's heads).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ballonet import runtime
from ballonet.cost.memory import BELOW
from ballonet.plan import Plan
from ballonet.runtime.remapping import remap
from ballonet.specs import ModelSpec
from ballonet.training.config import TrainConfig
from ballonet.training.data.loader import IGNORE_INDEX
from ballonet.training.parallelism.parallel import local_box

ROPE_THETA = 10000.0
NORM_EPS = 1e-5
INIT_STD = 0.02

AttentionFn = Callable[..., torch.Tensor]
"""(q [T_att, H, D], k [T_att, K, D], v [T_att, K, D], plan, rank, group) -> [T_att, H, D]."""

Recompute = Literal["none", "selective", "linear", "full"]
"""Activation recomputation (`torch.utils.checkpoint`, non-reentrant), as the cost model
prices it (`cost.memory.activation_bytes`): "selective" keeps the MLP's input and reruns
its norm and SwiGLU in the backward (their 4 ffn_hidden + hidden elements a token are
the largest share of a layer's activations; the attention core keeps no scores anyway);
"linear" keeps the block's input, the attention's q, k, v and output, and the output
back on the linear layout, and reruns everything between them (norms, QKV and output
projections, rotary, the MLP), no exchange; "full" keeps only each block's input and
reruns the whole block, remaps and rings included."""


def rope(x_THD: torch.Tensor, pos_T: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, at positions within each document."""
    D, dtype = x_THD.shape[-1], torch.promote_types(x_THD.dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, D, 2, device=x_THD.device, dtype=dtype) / D)
    angles_TF = pos_T.to(dtype)[:, None] * inv_freq[None]  # pos_T on x's device (the step's metadata)
    cos_T1D = torch.cat([angles_TF.cos()] * 2, -1)[:, None]
    sin_T1D = torch.cat([angles_TF.sin()] * 2, -1)[:, None]
    x = x_THD.to(dtype)
    x1, x2 = x.chunk(2, -1)
    return (x * cos_T1D + torch.cat([-x2, x1], -1) * sin_T1D).to(x_THD.dtype)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, recompute: Recompute = "none"):
        super().__init__()
        C, D = spec.hidden, spec.head_dim
        self.recompute = recompute
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        self.attention_norm = nn.RMSNorm(C, eps=NORM_EPS)
        self.wq = nn.Linear(C, spec.num_heads * D, bias=False)
        self.wk = nn.Linear(C, spec.num_kv_heads * D, bias=False)
        self.wv = nn.Linear(C, spec.num_kv_heads * D, bias=False)
        self.wo = nn.Linear(spec.num_heads * D, C, bias=False)
        self.ffn_norm = nn.RMSNorm(C, eps=NORM_EPS)
        self.w1 = nn.Linear(C, spec.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(C, spec.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(spec.ffn_hidden, C, bias=False)  # down

    def forward(self, x_TC, pos_T, plan: Plan, rank: int, group, attention_fn: AttentionFn, counter=None,
                meta: runtime.StepMeta | None = None):
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x_TC, pos_T, plan, rank, group, attention_fn, counter, meta,
                              use_reentrant=False)
        return self._forward(x_TC, pos_T, plan, rank, group, attention_fn, counter, meta)

    def _forward(self, x_TC, pos_T, plan: Plan, rank: int, group, attention_fn: AttentionFn, counter=None,
                 meta: runtime.StepMeta | None = None):
        H, K = self.num_heads, self.num_kv_heads
        rerun = self.recompute == "linear" and torch.is_grad_enabled()  # the local pieces; not the exchanges
        qkv_THD = checkpoint(self._qkv, x_TC, pos_T, use_reentrant=False) if rerun else self._qkv(x_TC, pos_T)
        # One all-to-all for q, k and v together; the remaps' index maps come with the step's metadata.
        qkv_att = remap(qkv_THD, plan, rank, "linear", "attention", group, counter, verify_plan=False,
                        move=meta.to_attention if meta is not None else None)
        q_att, k_att, v_att = qkv_att.split([H, K, K], 1)
        o_att = attention_fn(q_att.contiguous(), k_att.contiguous(), v_att.contiguous(), plan, rank, group)
        o_THD = remap(o_att, plan, rank, "attention", "linear", group, counter, verify_plan=False,
                      move=meta.to_linear if meta is not None else None)
        if rerun:
            return checkpoint(self._output, x_TC, o_THD, use_reentrant=False)
        x_TC = x_TC + self.wo(o_THD.flatten(1))
        if self.recompute == "selective" and torch.is_grad_enabled():
            return x_TC + checkpoint(self._mlp, x_TC, use_reentrant=False)
        return x_TC + self._mlp(x_TC)

    def _qkv(self, x_TC, pos_T):
        """q, k and v of the block's input, rotated, as one [T, H + 2K, D] tensor."""
        T, H, K, D = x_TC.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        h_TC = self.attention_norm(x_TC)
        q_THD = rope(self.wq(h_TC).view(T, H, D), pos_T)
        k_TKD = rope(self.wk(h_TC).view(T, K, D), pos_T)
        v_TKD = self.wv(h_TC).view(T, K, D)
        return torch.cat([q_THD, k_TKD, v_TKD], 1)

    def _output(self, x_TC, o_THD):
        """The block's output from its input and the attention output [T, H, D]."""
        x_TC = x_TC + self.wo(o_THD.flatten(1))
        return x_TC + self._mlp(x_TC)

    def _mlp(self, x_TC):
        h_TC = self.ffn_norm(x_TC)
        return self.w2(F.silu(self.w1(h_TC)) * self.w3(h_TC))


class Transformer(nn.Module):
    """Built from a `ModelSpec`; weights drawn from `seed` alone, so every rank builds the
    same model. `attention_fn` replaces the runtime engine (`runtime.attention`), e.g. with
    a single-process reference in tests; `recompute` as in `Recompute` ("selective": on
    the first `spec.recompute_layers` layers, every layer when None).

    The plan is checked (every rank of the group runs the same plan, as its own rank:
    `runtime.check_plan`) once per call, before the first exchange."""

    def __init__(self, spec: ModelSpec, *, seed: int = 0, attention_fn: AttentionFn | None = None,
                 recompute: Recompute = "none"):
        super().__init__()
        self.spec = spec
        self.attention_fn = attention_fn
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.set_recompute(recompute, spec.recompute_layers)
        self.norm = nn.RMSNorm(spec.hidden, eps=NORM_EPS)
        self.head = nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        if self.head.weight.device.type != "meta":  # on meta: drawn after sharding (`training.parallelism.build`)
            self.reset_parameters(seed)

    def set_recompute(self, recompute: Recompute, layers: int | None = None) -> None:
        """Recompute as `recompute` from the next forward on ("selective": on the first
        `layers` blocks, every block when None, the others none; "linear": on the first
        `layers`, the others selective). Plan ranks may differ in these: a selective or
        linear block reruns only its own local work, no exchange between plan ranks (with
        tensor parallelism, its TP group's gathers, which all of the group choose alike:
        they hold the same plan rank); "full" reruns a block's remap and attention
        exchanges, so every rank must choose it alike."""
        if recompute not in typing.get_args(Recompute):
            raise ValueError(f"recompute must be one of {typing.get_args(Recompute)}, got {recompute!r}")
        first = len(self.layers) if layers is None else layers
        for i, block in enumerate(self.layers):
            block.recompute = BELOW[recompute] if recompute in BELOW and i >= first else recompute

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Norm weights 1, every other weight N(0, INIT_STD^2), drawn whole on the CPU in
        parameter order, one parameter at a time. A sharded parameter (a DTensor: FSDP2,
        tensor parallelism) keeps only its own shard of each draw: a model sharded on the
        meta device and materialised with `to_empty` gets the weights of one built whole,
        holding no more than its shards and one whole parameter."""
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if p.dim() == 1:
                local.fill_(1.0)
            else:
                local.copy_(torch.empty(p.shape).normal_(0.0, INIT_STD, generator=gen)[local_box(p)])

    def _hidden(self, ids_T, plan: Plan, rank: int, group, counter=None, outer_group=None,
                meta: runtime.StepMeta | None = None) -> torch.Tensor:
        """Token ids on the linear layout -> final normed hidden states [T_lin, C]."""
        attention_fn = self.attention_fn
        if attention_fn is None:  # the caller checked the plan: once per step, not per layer
            attention_fn = functools.partial(runtime.attention, counter=counter, verify_plan=False,
                                             outer_group=outer_group, meta=meta.attention)
        x_TC = self.embed(ids_T)
        for layer in self.layers:
            x_TC = layer(x_TC, meta.positions, plan, rank, group, attention_fn, counter, meta)
        return self.norm(x_TC)

    def forward(self, input_ids: torch.Tensor, plan: Plan, rank: int, group=None, outer_group=None, *,
                meta: runtime.StepMeta | None = None, verify_plan: bool = True) -> torch.Tensor:
        """input_ids [T_att]: this rank's tokens in the attention layout (the data loader's
        order). Returns logits [T_lin, V] on the linear layout, i.e. for the tokens at
        `runtime.token_index(plan, rank, "linear")`. Collective when the plan has ranks;
        `outer_group` as in `runtime.attention`; `meta` and `verify_plan` as in `loss`."""
        if verify_plan:
            _check_plan_first(plan, rank, group, input_ids.device)
        meta = _step_meta(meta, plan, rank, input_ids.device)
        ids_T = remap(input_ids, plan, rank, "attention", "linear", group, verify_plan=False, move=meta.to_linear)
        logits_TV = self.head(self._hidden(ids_T, plan, rank, group, outer_group=outer_group, meta=meta))
        return logits_TV.full_tensor() if isinstance(logits_TV, DTensor) else logits_TV

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, plan: Plan, rank: int, group=None,
             counter: runtime.ByteCounter | None = None, outer_group=None, *, meta: runtime.StepMeta | None = None,
             content: tuple[bytes, bytes] | None = None, verify_plan: bool = True) -> torch.Tensor:
        """Sum of token cross-entropies over labels != IGNORE_INDEX (the loss mask), both
        given [T_att] in the attention layout. Ids and labels move to the linear layout in
        one all-to-all; the caller divides by the global number of valid labels. `counter`
        (a `runtime.ByteCounter`) records the bytes every remap and ring transfer sends;
        `outer_group` as in `runtime.attention`; `meta`: `runtime.step_meta(plan, rank)` on
        the tokens' device (built here when not given: once per call, never per layer);
        `content`: the token digests the plan check compares (`runtime.check_plan`), which
        runs first unless `verify_plan=False` (a caller that ran it)."""
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
        if verify_plan:
            _check_plan_first(plan, rank, group, input_ids.device, content)
        meta = _step_meta(meta, plan, rank, input_ids.device)
        ids_labels_T2 = remap(torch.stack([input_ids, labels], 1), plan, rank, "attention", "linear", group, counter,
                              verify_plan=False, move=meta.to_linear)
        logits_TV = self.head(self._hidden(ids_labels_T2[:, 0], plan, rank, group, counter, outer_group, meta))
        logits_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
        loss = F.cross_entropy(logits_TV, ids_labels_T2[:, 1], ignore_index=IGNORE_INDEX, reduction="sum")
        # Replicated over the TP group; a copy, as FSDP2 warns of a view returned from its module.
        return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def _step_meta(meta, plan: Plan, rank: int, device) -> runtime.StepMeta:
    """The step's metadata, given (checked against the plan) or built and moved now."""
    if meta is None:
        return runtime.to_device(runtime.step_meta(plan, rank), device)
    meta.check(plan, rank)
    return meta


def _check_plan_first(plan: Plan, rank: int, group, device, content=None) -> None:
    """Every rank runs the same plan (and reads the same data, given `content`), checked
    before any exchange depends on it (a one-rank plan exchanges nothing)."""
    if plan.num_ranks > 1:
        runtime.check_plan(plan, rank, group, device, content=content)


def build_model(config: TrainConfig, spec: ModelSpec, device: torch.device) -> Transformer:
    """The model a training run trains (weights from `config.seed`, the same on every
    rank), whole, before sharding; on the meta device (`device` "meta") it holds no
    weights until `training.parallelism.build` shards it and draws them."""
    # --recompute auto starts with none; `loop._auto_recompute` sets it each step.
    recompute = "none" if config.recompute == "auto" else config.recompute
    if device.type == "meta":
        with torch.device("meta"):
            return Transformer(spec, seed=config.seed, recompute=recompute)
    return Transformer(spec, seed=config.seed, recompute=recompute).to(device)
