"""FLOPs, bytes, memory and seconds of the pieces of a training step.

Closed forms first, calibration second: FLOP and byte counts are exact functions of the
model shape; seconds come from a GPU's peak times an efficiency from its calibration
profile (`hardware.profile`: built in, or measured by `ballonet calibrate`), and from an
alpha-beta model of each link. All FLOPs are per layer and forward unless a name says
otherwise; with tensor parallelism a GPU does 1/tp of them.

Sources: causal attention FLOPs as in FlashAttention's benchmark (2 matmuls of 2*D FLOPs
per (query, key) pair and head; backward 2.5x, 5 matmuls); linear FLOPs as in
Megatron-LM's `num_floating_point_operations` (2 FLOPs per weight per token); activation
memory after Korthikanti et al. 2022 ("Reducing Activation Recomputation"), counted
tensor by tensor for this Llama layer with a fused attention kernel (no score matrix).
Bytes moved are what the runtime sends (`training/model.py`, `runtime/routing.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ballonet import hardware
from ballonet.specs import ClusterSpec, ModelSpec, NodeGroup

ATTENTION_BACKWARD_FACTOR = 2.5
"""Backward attention FLOPs / forward (FlashAttention recomputes P; 5 matmuls vs 2)."""
LINEAR_BACKWARD_FACTOR = 2.0
"""Backward GEMM FLOPs / forward (input and weight gradients)."""
ELEMENTWISE_BACKWARD_FACTOR = 2.0
"""Backward elementwise bytes / forward (each op reads its saved input and the output's
gradient and writes the input's: about twice the forward's traffic)."""
LOSS_DTYPE_BYTES = 4
"""The loss runs on fp32 logits (`training/model.py` upcasts them)."""
MEMORY_RESERVE = 0.90
"""Share of a GPU's memory a plan may use; the rest is allocator and library slack."""
GRAD_BYTES = 2
"""Bytes per gradient element in the data-parallel all-reduce (bf16)."""
KV_GRAD_BYTES = 4
"""Bytes per dK/dV element sent back around a ring: fp32 partial sums (`runtime.comm.GRAD_DTYPE`)."""
RECOMPUTE_MODES = ("none", "selective", "linear", "full")
"""Activation recomputation, cheapest first: `ModelSpec.recompute`, None = the cheapest that fits."""
BELOW = {"selective": "none", "linear": "selective"}
"""What the other layers do when only the first ones recompute under a mode."""


# ---- FLOPs ---------------------------------------------------------------------------


def attention_flops(model: ModelSpec, lengths):
    """Causal self-attention of documents of `lengths` tokens (all heads), forward: a
    float for one length, an array for an array."""
    L = np.asarray(lengths, dtype=float)
    flops = 2.0 * model.num_heads * model.head_dim * L * (L + 1)
    return float(flops) if flops.ndim == 0 else flops


def attention_work(model: ModelSpec, lengths, gpu=None) -> np.ndarray:
    """[D] forward attention cost of each whole document in peak-FLOP units per GPU: its
    FLOPs over the kernel efficiency at its length (of `gpu`'s profile; default the
    reference GPU's), so seconds on a GPU = work / its peak."""
    L = np.asarray(lengths, dtype=float)
    return attention_flops(model, L) / model.tp / hardware.attention_efficiency_array(L, gpu)


def block_flops(model: ModelSpec, q_len: int, k_len: int, causal: bool = False) -> float:
    """One (query chunk, key chunk) block: full, or causal on the diagonal (q_len == k_len)."""
    if causal:
        return attention_flops(model, q_len)
    return 4.0 * model.num_heads * model.head_dim * q_len * k_len


def linear_flops_per_token(model: ModelSpec) -> float:
    """QKV (GQA-aware), output projection and SwiGLU MLP of one layer, per token."""
    h = model.hidden
    weights = h * (h + 2 * model.kv_dim) + h * h + 3 * h * model.ffn_hidden
    return 2.0 * weights


def mlp_flops_per_token(model: ModelSpec) -> float:
    """The SwiGLU MLP's share of `linear_flops_per_token` (what selective recomputation redoes)."""
    return 2.0 * 3 * model.hidden * model.ffn_hidden


def head_flops_per_token(model: ModelSpec) -> float:
    """LM head, forward."""
    return 2.0 * model.vocab_size * model.hidden


def zigzag_flops(model: ModelSpec, bounds: tuple[int, ...]) -> np.ndarray:
    """[g] forward attention FLOPs of each ring position i of a zig-zag split document
    (2g chunks cut at `bounds`): its query chunks i and 2g-1-i against every earlier key
    token of the document."""
    b = np.asarray(bounds, dtype=float)
    q = np.diff(b)
    chunk = 4.0 * model.num_heads * model.head_dim * q * b[:-1] + attention_flops(model, q)  # [2g]
    g = len(q) // 2
    return chunk[:g] + chunk[::-1][:g]


def zigzag_rank_flops(model: ModelSpec, bounds: tuple[int, ...], position: int) -> float:
    """`zigzag_flops` of ring position `position`."""
    return float(zigzag_flops(model, bounds)[position])


# ---- bytes -----------------------------------------------------------------------------


def kv_bytes(model: ModelSpec, rows: int) -> float:
    """K and V of `rows` tokens held by one GPU (its tp shard of the KV heads)."""
    return 2.0 * rows * model.kv_dim * model.dtype_bytes / model.tp


def kv_grad_bytes(model: ModelSpec, rows: int) -> float:
    """dK and dV of `rows` tokens as the runtime returns them (fp32 partial sums)."""
    return 2.0 * rows * model.kv_dim * KV_GRAD_BYTES / model.tp


def hidden_bytes(model: ModelSpec, rows: int) -> float:
    """Hidden states of `rows` tokens."""
    return float(rows * model.hidden * model.dtype_bytes)


def remap_bytes(model: ModelSpec, tokens: int, toward_attention: bool) -> float:
    """What the runtime's remap moves for `tokens` tokens in one layer, one way
    (`training/model.py`): q, k and v (h + 2 kv_dim elements a token) toward the attention
    layout, the attention output o (h) back. The backward moves the gradients of the
    same tensors the other way, so the same bytes each way."""
    per_token = model.hidden + 2 * model.kv_dim if toward_attention else model.hidden
    return float(tokens * per_token * model.dtype_bytes / model.tp)


def grad_bytes(model: ModelSpec) -> float:
    """Gradients one GPU all-reduces per step."""
    return model.num_params * GRAD_BYTES / model.tp


# ---- memory ----------------------------------------------------------------------------


def recompute_mode(model: ModelSpec) -> str:
    """The recomputation a model spec asks for; None (cheapest that fits) plans as "full"."""
    return model.recompute or "full"


def recompute_layer_count(model: ModelSpec, mode: str | None = None, layers: int | None = None) -> int:
    """Layers that recompute under `mode` (default the model's own, with its
    `recompute_layers`): `layers` when given, else every layer; none under "none"."""
    if mode is None:
        mode, layers = recompute_mode(model), model.recompute_layers if layers is None else layers
    if mode == "none":
        return 0
    return model.num_layers if layers is None else layers


def layer_activation_elements(model: ModelSpec) -> tuple[float, float]:
    """Elements one token saves for the backward of one layer without recomputation, as
    (on the linear layout, on the attention layout) (`training/model.py`): the attention
    block's input, its normed input (QKV's input) and o (the output projection's input),
    the MLP block's input, normed input, gate, up, silu(gate) and their product; on the
    attention layout q, k, v and the attention output (flash attention keeps no scores)."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    return (3 * h) + (2 * h + 4 * f), 2 * h + 2 * kv


def activation_bytes(model: ModelSpec, linear_tokens: float, attention_tokens: float, mode: str | None = None,
                     layers: int | None = None) -> float:
    """Activation bytes a rank holds at the peak of the backward, all layers, with
    `linear_tokens` on the linear layout and `attention_tokens` on the attention layout,
    by recomputation `mode` (default the model's) on `layers` of them
    (`recompute_layer_count`; the others one mode below, `BELOW`): "none" keeps every
    layer's tensors; "selective" recomputes the MLP's intermediates (keeps its input);
    "linear" keeps the layer's input, the attention output back on the linear layout and
    q, k, v and the attention output on the attention layout; "full" keeps each layer's
    input plus one layer's tensors while it is recomputed.

    With tensor parallelism a GPU holds 1/tp of each tensor (its heads, its FFN columns,
    its shard of the sequence), except the two normed inputs: sequence parallelism
    all-gathers them before the projections, which keep them whole on every GPU of the
    TP group (`training/tensor_parallel.py`)."""
    k = recompute_layer_count(model, mode, layers)
    mode = mode or recompute_mode(model)
    h, f, n, tp = model.hidden, model.ffn_hidden, model.num_layers, model.tp
    lin, att = layer_activation_elements(model)
    normed = 2 * h  # of `lin`: the attention's and the MLP's normed inputs
    one_layer = ((lin - normed) * linear_tokens + att * attention_tokens) / tp + normed * linear_tokens
    if mode == "full":
        return (n * h * linear_tokens / tp + one_layer) * model.dtype_bytes
    kept = {"none": one_layer, "selective": one_layer - (h + 4 * f / tp) * linear_tokens,
            "linear": (2 * h * linear_tokens + att * attention_tokens) / tp}
    elements = n * kept[mode] if mode not in BELOW else k * kept[mode] + (n - k) * kept[BELOW[mode]]
    return elements * model.dtype_bytes


def activation_bytes_per_token(model: ModelSpec, mode: str | None = None, layers: int | None = None) -> float:
    """`activation_bytes` of a token held on both layouts (what a planner reserves per token)."""
    return activation_bytes(model, 1, 1, mode, layers)


def _layer_mean(model: ModelSpec, per_layer: dict, mode: str | None, layers: int | None) -> float:
    """`per_layer[mode]` as a mean over all layers when only `layers` of them recompute
    under `mode` (`recompute_layer_count`), the others one mode below (`BELOW`)."""
    k = recompute_layer_count(model, mode, layers)
    mode, n = mode or recompute_mode(model), model.num_layers
    if k == n or mode not in BELOW:
        return per_layer[mode]
    return (k * per_layer[mode] + (n - k) * per_layer[BELOW[mode]]) / n


def recompute_flops_per_token(model: ModelSpec, mode: str | None = None, layers: int | None = None) -> float:
    """Linear FLOPs per token and layer (a mean over layers when only `layers` of them
    recompute) run again in the backward by recomputation `mode` (full recomputation also
    reruns the attention forward: `recompute_attention`)."""
    per_layer = {"none": 0.0, "selective": mlp_flops_per_token(model), "linear": linear_flops_per_token(model),
                 "full": linear_flops_per_token(model)}
    return _layer_mean(model, per_layer, mode, layers)


def recompute_per_rank(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int, attention_tokens=None,
                       mode: str = "linear") -> list[tuple[str, int]] | None:
    """[R] (mode, layers) of the least each rank must recompute to hold its own tokens
    (`cheapest_recompute`'s arguments), of the modes up to `mode` that ranks may choose
    apart ("none", "selective", "linear": `BELOW`): the cheapest under which it holds
    them, on as few of the first layers as it needs, the others one mode below.
    ("none", 0) where nothing needs to; None when not even `mode` on every layer is
    enough on some rank."""
    att = tokens_per_rank if attention_tokens is None else attention_tokens
    by_type = {g: memory_cap(model, g, num_dp_ranks) for g in set(gpus)}  # (a memory_gb override is its own type)
    caps = np.array([by_type[g] for g in gpus])
    lin, att = np.asarray(tokens_per_rank, dtype=float), np.asarray(att, dtype=float)
    over = np.nonzero(activation_bytes(model, lin, att, "none") > caps)[0]  # ranks that do not hold their tokens
    lin, att, caps = lin[over], att[over], caps[over]
    out = [("none", 0)] * len(tokens_per_rank)
    todo, n = np.ones(len(over), dtype=bool), model.num_layers
    for m in [m for m in BELOW if RECOMPUTE_MODES.index(m) <= RECOMPUTE_MODES.index(mode)]:
        keep, drop = activation_bytes(model, lin, att, BELOW[m]), activation_bytes(model, lin, att, m)
        here = np.nonzero(todo & (drop <= caps))[0]
        # The fewest layers k whose recomputation frees keep - cap, each freeing (keep - drop) / n,
        # checked against float rounding as `activation_bytes` counts them.
        k = np.clip(np.ceil(n * (keep[here] - caps[here]) / (keep[here] - drop[here])), 1, n)
        for _ in range(n):
            short = (activation_bytes(model, lin[here], att[here], m, k) > caps[here]) & (k < n)
            if not short.any():
                break
            k[short] += 1
        for i, layers in zip(over[here].tolist(), k.astype(int).tolist()):
            out[i] = (m, layers)
        todo[here] = False
    return None if todo.any() else out


def selective_layers_needed(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int,
                            attention_tokens=None) -> int | None:
    """The fewest layers (the first ones) that must recompute selectively for every rank
    to hold its tokens: the most of `recompute_per_rank` under "selective" (0 when none
    need to, None when not even every layer is enough)."""
    found = recompute_per_rank(model, tokens_per_rank, gpus, num_dp_ranks, attention_tokens, "selective")
    return None if found is None else max((k for _, k in found), default=0)


def recompute_attention(mode: str) -> bool:
    return mode == "full"


def static_bytes(model: ModelSpec, num_dp_ranks: int) -> float:
    """bf16 weights and gradients, plus fp32 Adam states sharded over data-parallel ranks
    (Megatron's distributed optimizer / ZeRO-1)."""
    return model.num_params * (2 + 2 + 12 / max(num_dp_ranks, 1)) / model.tp


def memory_cap(model: ModelSpec, gpu: hardware.GPUType, num_dp_ranks: int) -> float:
    """Bytes of activations a GPU can hold."""
    return gpu.memory_bytes * MEMORY_RESERVE - static_bytes(model, num_dp_ranks)


def cheapest_recompute(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int,
                       attention_tokens=None) -> str | None:
    """The cheapest recomputation under which every rank holds its tokens (`model.recompute`
    when set): `tokens_per_rank` on the linear layout and `attention_tokens` (default the
    same) on the attention layout. None if not even full recomputation fits."""
    att = tokens_per_rank if attention_tokens is None else attention_tokens
    modes = (model.recompute,) if model.recompute else RECOMPUTE_MODES
    for mode in modes:
        if all(activation_bytes(model, n, a, mode, model.recompute_layers if model.recompute else None)
               <= memory_cap(model, g, num_dp_ranks)
               for n, a, g in zip(tokens_per_rank, att, gpus)):
            return mode
    return None


def cheapest_recomputation(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int,
                           attention_tokens=None) -> tuple[str, int] | None:
    """(mode, layers that recompute under it on the rank that recomputes most):
    `recomputation_per_rank`. None if nothing fits."""
    found = recomputation_per_rank(model, tokens_per_rank, gpus, num_dp_ranks, attention_tokens)
    return None if found is None else (found[0], most_layers(*found))


def most_layers(mode: str, per_rank) -> int:
    """The most layers any rank recomputes under `mode` itself (`recomputation_per_rank`)."""
    return max((k for m, k in per_rank if m == mode), default=0)


def recomputation_per_rank(model: ModelSpec, tokens_per_rank, gpus, num_dp_ranks: int,
                           attention_tokens=None) -> tuple[str, tuple[tuple[str, int], ...]] | None:
    """(mode, [R] (mode, layers) of each rank): the cheapest mode under which every rank
    holds its tokens on every layer (`cheapest_recompute`) and, unless the model fixes
    its recomputation, what each rank then needs of it (`recompute_per_rank`): ranks may
    differ there, as a selective or linear layer reruns only its own local work, no
    collective (`training/model.py`); full recomputation reruns the layer's remap and
    ring, so every rank does it or none. None if nothing fits."""
    mode = cheapest_recompute(model, tokens_per_rank, gpus, num_dp_ranks, attention_tokens)
    if mode is None:
        return None
    if mode not in BELOW or model.recompute:
        k = recompute_layer_count(model, mode, model.recompute_layers if model.recompute else None)
        return mode, ((mode, k),) * len(tokens_per_rank)
    return mode, tuple(recompute_per_rank(model, tokens_per_rank, gpus, num_dp_ranks, attention_tokens, mode))


# ---- seconds ---------------------------------------------------------------------------


def attention_seconds(model: ModelSpec, gpu: hardware.GPUType, flops, length, backward: bool = False):
    """Seconds of attention kernels doing `flops` (whole-model forward count, array-like)
    on sequences or chunks of about `length` tokens each, forward or backward (2.5x the
    FLOPs at the backward's own efficiency); no launch floor (`attention_time` adds it)."""
    eff = hardware.attention_efficiency_array(length, gpu, backward)
    factor = ATTENTION_BACKWARD_FACTOR if backward else 1.0
    return np.asarray(flops, dtype=float) * factor / model.tp / (gpu.peak_flops * eff)


def attention_time(model: ModelSpec, gpu: hardware.GPUType, flops: float, length: float,
                   backward: bool = False) -> float:
    """Seconds of one attention kernel call doing `flops` (forward count) on chunks of
    about `length` tokens, at least the profile's launch floor."""
    if flops <= 0:
        return 0.0
    seconds = float(attention_seconds(model, gpu, flops, length, backward))
    return max(hardware.profile(gpu).attention_launch_s, seconds)


def linear_time(model: ModelSpec, gpu: hardware.GPUType, num_tokens: float, flops_per_token: float | None = None) -> float:
    """Seconds of one layer's forward GEMMs (or `flops_per_token` of them) over
    `num_tokens` tokens on one GPU (an array of token counts gives an array)."""
    per_token = linear_flops_per_token(model) if flops_per_token is None else flops_per_token
    return _per_call(per_token * np.asarray(num_tokens, dtype=float) / model.tp / gpu.peak_flops,
                     hardware.profile(gpu).linear, num_tokens)


def _per_call(ideal: np.ndarray, curve, num_tokens):
    """`ideal` seconds over `curve`'s efficiency at `num_tokens` (0 for no tokens): a float
    for a number, an array for an array."""
    n = np.asarray(num_tokens, dtype=float)
    out = np.where(n > 0, ideal / curve.at(n), 0.0)
    return float(out) if out.ndim == 0 else out


def elementwise_bytes_per_token(model: ModelSpec) -> float:
    """Bytes one layer's elementwise work reads and writes per token, forward, one pass per
    op over its tensors (`training/model.py`): two RMSNorms (read and write h), rotary on q
    and k (read and write h + kv_dim), silu(gate) * up (read 2 ffn, write ffn) and two
    residual adds (read 2h, write h)."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    return (2 * 2 * h + 2 * (h + kv) + 3 * f + 2 * 3 * h) * model.dtype_bytes / model.tp


def loss_bytes_per_token(model: ModelSpec) -> float:
    """Bytes of the LM head's elementwise work per token, forward: the final RMSNorm (read
    and write h), the logits cast to fp32 (read V, write V fp32), log-softmax (read and
    write V) and the target's pick (a negligible read)."""
    V, fp32 = model.vocab_size, LOSS_DTYPE_BYTES
    return (2 * model.hidden * model.dtype_bytes + V * (model.dtype_bytes + fp32) + 2 * V * fp32) / model.tp


def recompute_elementwise_bytes_per_token(model: ModelSpec, mode: str | None = None,
                                          layers: int | None = None) -> float:
    """Elementwise bytes per token and layer (a mean over layers when only `layers` of
    them recompute) run again in the backward by recomputation `mode`: "selective" reruns
    the MLP's norm and silu(gate) * up, "linear" and "full" the layer's."""
    mlp = (2 * model.hidden + 3 * model.ffn_hidden) * model.dtype_bytes / model.tp
    every = elementwise_bytes_per_token(model)
    per_layer = {"none": 0.0, "selective": mlp, "linear": every, "full": every}
    return _layer_mean(model, per_layer, mode, layers)


def elementwise_time(model: ModelSpec, gpu: hardware.GPUType, num_tokens: float,
                     bytes_per_token: float | None = None) -> float:
    """Seconds of one layer's forward elementwise work (or `bytes_per_token` of it) over
    `num_tokens` tokens on one GPU: bytes over the profile's memory bandwidth times its
    elementwise efficiency at that many tokens (an array of token counts gives an array)."""
    per_token = elementwise_bytes_per_token(model) if bytes_per_token is None else bytes_per_token
    p = hardware.profile(gpu)
    return _per_call(per_token * np.asarray(num_tokens, dtype=float) / p.memory_bw, p.elementwise, num_tokens)


def linear_layer_seconds(model: ModelSpec, gpu: hardware.GPUType, tokens: float, mode: str,
                         framework: bool = True, layers: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a rank's linear layers in one layer over `tokens`
    tokens: GEMMs, the elementwise work around them and (with `framework`) the framework's
    per-layer work (half in each pass); the backward reruns what recomputation `mode` drops
    (a mean over layers when only `layers` of them recompute). An array of token counts
    gives a pair of arrays."""
    gemm = linear_time(model, gpu, tokens)
    elt = elementwise_time(model, gpu, tokens)
    redo = (linear_time(model, gpu, tokens, recompute_flops_per_token(model, mode, layers))
            + elementwise_time(model, gpu, tokens, recompute_elementwise_bytes_per_token(model, mode, layers)))
    half = hardware.profile(gpu).framework_s_per_layer / 2 if framework else 0.0
    return gemm + elt + half, gemm * LINEAR_BACKWARD_FACTOR + elt * ELEMENTWISE_BACKWARD_FACTOR + redo + half


def framework_time(model: ModelSpec, gpu: hardware.GPUType) -> float:
    """Seconds a step costs one rank's compute thread in the training framework outside
    the model's kernels (FSDP2's gathers, copies and gradient hooks): per layer, calibrated."""
    return model.num_layers * hardware.profile(gpu).framework_s_per_layer


def optimizer_time(model: ModelSpec, gpu: hardware.GPUType, num_dp_ranks: int) -> float:
    """Seconds of one rank's optimizer step: its shard of the parameters (sharded over the
    data-parallel ranks, as `static_bytes` holds them) at the profile's seconds per parameter."""
    return model.num_params / model.tp / max(num_dp_ranks, 1) * hardware.profile(gpu).optimizer_s_per_param


def p2p_time(num_bytes: float, bandwidth: float, nic: bool = False, gpu: hardware.GPUType | None = None) -> float:
    """One point-to-point transfer over a link of `bandwidth` bytes/s (nominal)."""
    if num_bytes <= 0:
        return 0.0
    p = hardware.profile(gpu)
    if nic:
        return p.nic_latency_s + num_bytes / (bandwidth * p.nic_efficiency)
    return p.p2p_latency_s + num_bytes / (bandwidth * p.p2p_efficiency)


def collective_time(op: str, num_bytes: float, num_ranks: int, bandwidth: float,
                    gpu: hardware.GPUType | None = None) -> float:
    """NCCL ring collective over `num_ranks` GPUs of one node; `num_bytes` is the full
    buffer (nccl-tests' "size"): bus bytes are (n-1)/n of it, twice that for all_reduce."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    p = hardware.profile(gpu)
    return p.collective_latency_s + bus_bytes(op, num_bytes, num_ranks) / (bandwidth * p.collective_efficiency[op])


def bus_bytes(op: str, num_bytes: float, num_ranks: int) -> float:
    """Bytes each of `num_ranks` GPUs sends in a ring collective of a `num_bytes` buffer
    (nccl-tests' bus bytes): (n-1)/n of it, twice that for all_reduce."""
    return (2 if op == "all_reduce" else 1) * (num_ranks - 1) * num_bytes / num_ranks


# ---- tensor parallelism ------------------------------------------------------------------


TP_RERUN = {"none": (0, 0), "selective": (1, 0), "linear": (2, 1), "full": (2, 1)}
"""(all-gathers, reduce-scatters) of the hidden states a layer's backward runs again under
each recomputation (`training/tensor_parallel.py`): the checkpointed pieces rerun their
gathers, and `torch.utils.checkpoint` stops a rerun after the last tensor the backward
needs, before the piece's last reduce-scatter."""


def tp_buffer_bytes(model: ModelSpec, tokens: int) -> float:
    """The [T, C] hidden states of one tensor-parallel all-gather or reduce-scatter: T =
    `tokens` padded up to a multiple of tp (DTensor pads uneven shards)."""
    return hidden_bytes(model, -(-int(tokens) // model.tp) * model.tp)


def tp_layer_seconds(model: ModelSpec, tokens: int, bandwidth: float, gpu: hardware.GPUType,
                     mode: str = "none") -> tuple[float, float]:
    """(forward, backward) seconds of one layer's tensor-parallel collectives on a GPU of a
    TP group whose plan rank holds `tokens` on the linear layout: two all-gathers and two
    reduce-scatters of the hidden states a pass (sequence parallelism; the backward scatters
    what the forward gathered and gathers what it scattered), and the backward's reruns
    under recomputation `mode` (`TP_RERUN`)."""
    if model.tp == 1:
        return 0.0, 0.0
    buf = tp_buffer_bytes(model, tokens)
    ag, rs = (collective_time(op, buf, model.tp, bandwidth, gpu) for op in ("all_gather", "reduce_scatter"))
    rerun_ag, rerun_rs = TP_RERUN[mode]
    return 2 * (ag + rs), (2 + rerun_ag) * ag + (2 + rerun_rs) * rs


def tp_step_collectives(model: ModelSpec, tokens: int) -> list[tuple[str, str, float]]:
    """(phase, op, buffer bytes) of the tensor-parallel collectives a step runs outside its
    layers, on a GPU whose plan rank holds `tokens` on the linear layout: the embedding's
    reduce-scatter to the sequence shard and the head's all-gather (the backward the other
    way round), the loss's three all-reduces of [T] fp32 over the vocabulary shards
    (`loss_parallel`: the max, the sum of exponentials, the target logits) and, backward,
    one all-reduce of each norm weight's gradient (two a layer and the final norm)."""
    if model.tp == 1:
        return []
    buf, T = tp_buffer_bytes(model, tokens), float(tokens)
    out = [(phase, op, buf) for phase in ("forward", "backward") for op in ("all_gather", "reduce_scatter")]
    out += [("forward", "all_reduce", T * LOSS_DTYPE_BYTES)] * 3
    return out + [("backward", "all_reduce", float(model.hidden * model.dtype_bytes))] * (2 * model.num_layers + 1)


def tp_sent_bytes(model: ModelSpec, tokens: int, mode: str = "none", layers: int | None = None) -> dict:
    """{phase: {op: bytes}} one GPU of a TP group sends in a step's tensor-parallel
    collectives (`tp_layer_seconds`' and `tp_step_collectives`'), its plan rank holding
    `tokens` on the linear layout and recomputing under `mode` on its first `layers`
    layers (the others one mode below, as `recompute_layer_count`)."""
    out = {"forward": {}, "backward": {}}
    if model.tp == 1:
        return out
    n, L, buf = model.tp, model.num_layers, tp_buffer_bytes(model, tokens)
    for i, op in enumerate(("all_gather", "reduce_scatter")):
        rerun = _layer_mean(model, {m: float(r[i]) for m, r in TP_RERUN.items()}, mode, layers)
        out["forward"][op] = 2 * L * bus_bytes(op, buf, n)
        out["backward"][op] = (2 + rerun) * L * bus_bytes(op, buf, n)
    for phase, op, nbytes in tp_step_collectives(model, tokens):
        out[phase][op] = out[phase].get(op, 0.0) + bus_bytes(op, nbytes, n)
    return out


def grad_allreduce_parts(model: ModelSpec, group: NodeGroup, num_nodes: int) -> tuple[float, float]:
    """A GPU's share of the hierarchical gradient all-reduce: (seconds of the intra-node
    reduce-scatter and all-gather, bytes its NIC sends and receives across nodes). Each
    GPU's 1/n shard is all-reduced over the nodes by a ring: 2(k-1)/k of it each way."""
    total, n, gpu = grad_bytes(model), group.gpus_per_node, group.gpu_type
    intra = sum(collective_time(op, total, n, group.intra_bw, gpu) for op in ("reduce_scatter", "all_gather"))
    k = num_nodes
    return intra, (2 * (k - 1) / k * total / n if k > 1 else 0.0)


def grad_allreduce_time(model: ModelSpec, cluster: ClusterSpec) -> float:
    """Hierarchical all-reduce of one GPU's gradients alone on the links: reduce-scatter
    inside each node, all-reduce of each shard across nodes over the NICs (a NIC shared
    by m GPUs carries m shards), all-gather inside the node. The slowest group sets it."""
    worst = 0.0
    for g in cluster.groups:
        intra, nic = grad_allreduce_parts(model, g, cluster.num_nodes)
        if nic:
            intra += p2p_time(nic * g.gpus_per_nic, g.nic_bw, nic=True, gpu=g.gpu_type)
        worst = max(worst, intra)
    return worst


# ---- break-even ------------------------------------------------------------------------


def breakeven_chunk_tokens(model: ModelSpec, gpu: hardware.GPUType, bandwidth: float, nic: bool = False) -> int:
    """Chunk length c above which one ring step's compute (c queries against c keys)
    hides the transfer of c rows of K and V over a link of `bandwidth` bytes/s; about
    c* = F * h_kv * bytes / (2 * h * BW) (docs/design.md, section 3) with F the calibrated FLOP/s.
    Tiny chunks are latency-bound on both sides, so the search runs down from long chunks
    to the last length that is not hidden."""
    def hidden(c: int) -> bool:
        compute = attention_time(model, gpu, block_flops(model, c, c), c)
        return compute >= p2p_time(kv_bytes(model, c), bandwidth, nic, gpu)

    hi = 1 << 24
    if not hidden(hi):
        return hi
    lo = hi
    while lo > 1 and hidden(lo):
        lo //= 2
    if hidden(lo):
        return 1
    while hi - lo > 1:  # hidden(hi), not hidden(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi


@dataclass(frozen=True, kw_only=True)
class SequenceCost:
    """What one document costs on one GPU of a node group (per layer unless stated)."""
    length: int
    attention_flops_fwd: float
    linear_flops_fwd: float
    attention_time_s: float
    attention_backward_time_s: float
    linear_time_s: float
    elementwise_time_s: float
    step_time_s: float
    """Forward plus backward of all layers (attention, GEMMs, elementwise), with recomputation, on one GPU."""
    recompute: str
    activation_bytes: float
    breakeven_chunk_tokens: dict
    recompute_layers: int = 0
    """How many layers (the first ones) recompute under `recompute`."""


def sequence_cost(model: ModelSpec, group: NodeGroup, length: int) -> SequenceCost:
    """One document alone on one GPU of `group`, with the cheapest recomputation that holds it."""
    gpu = group.gpu_type
    mode, layers = cheapest_recomputation(model, [length], [gpu], group.num_nodes * group.gpus_per_node // model.tp) \
        or ("full", model.num_layers)
    att_flops = attention_flops(model, length)
    att = attention_time(model, gpu, att_flops, length)
    att_bwd = attention_time(model, gpu, att_flops, length, backward=True)
    lin = linear_time(model, gpu, length)
    elt = elementwise_time(model, gpu, length)
    redo = linear_time(model, gpu, length, recompute_flops_per_token(model, mode, layers))
    redo += elementwise_time(model, gpu, length, recompute_elementwise_bytes_per_token(model, mode, layers))
    redo += att if recompute_attention(mode) else 0.0
    step = model.num_layers * (att + att_bwd + lin * (1 + LINEAR_BACKWARD_FACTOR)
                               + elt * (1 + ELEMENTWISE_BACKWARD_FACTOR) + redo)
    return SequenceCost(
        length=length,
        attention_flops_fwd=att_flops,
        linear_flops_fwd=linear_flops_per_token(model) * length,
        attention_time_s=att,
        attention_backward_time_s=att_bwd,
        linear_time_s=lin,
        elementwise_time_s=elt,
        step_time_s=step,
        recompute=mode,
        recompute_layers=layers,
        activation_bytes=activation_bytes_per_token(model, mode, layers) * length,
        breakeven_chunk_tokens={
            "intra": breakeven_chunk_tokens(model, gpu, group.intra_bw),
            "inter": breakeven_chunk_tokens(model, gpu, group.nic_bw / group.gpus_per_nic, nic=True),
        },
    )


# ---- a bound on the batch ----------------------------------------------------------------


def _best(curve, upto) -> np.ndarray:
    """The best efficiency of `curve` at any token count up to each of `upto`."""
    x = np.asarray(upto, dtype=float)
    knots = np.asarray(curve.tokens)
    eff = np.asarray(curve.efficiency)
    best_knot = np.array([eff[knots <= v].max(initial=0.0) for v in np.ravel(x)]).reshape(x.shape)
    return np.maximum(best_knot, curve.at(x))


def batch_recompute(lengths, cluster: ClusterSpec, model: ModelSpec) -> str:
    """The cheapest recomputation under which the cluster could hold the batch at all
    (total token capacity): no plan of the batch recomputes less."""
    return batch_recomputation(lengths, cluster, model)[0]


def batch_recomputation(lengths, cluster: ClusterSpec, model: ModelSpec) -> tuple[str, float]:
    """(`batch_recompute`, the layers that must recompute under it for the cluster's total
    capacity to hold the batch, or the model's `recompute_layers`). Selective or linear
    layers left to the plan are a mean over the batch's tokens, not a whole number: ranks
    recompute on as few layers as their own tokens need (`recomputation_per_rank`), so
    the least any plan recomputes is the total shortfall over what a layer's
    recomputation frees (each mode frees its bytes at a higher cost per byte than the one
    below it, so the cheapest plan climbs the modes in order)."""
    gpus = [cluster.gpu_of(r) for r in range(0, cluster.num_ranks, model.tp)]
    num_dp = cluster.num_ranks // model.tp
    capacity = sum(max(0.0, memory_cap(model, g, num_dp)) for g in gpus)
    tokens = float(sum(lengths))
    modes = (model.recompute,) if model.recompute else RECOMPUTE_MODES
    fixed = model.recompute_layers if model.recompute else None
    for mode in modes:
        if capacity / activation_bytes_per_token(model, mode, fixed) >= tokens:
            break
    if mode not in BELOW or model.recompute:
        return mode, recompute_layer_count(model, mode, fixed)
    keep, drop = activation_bytes_per_token(model, BELOW[mode]), activation_bytes_per_token(model, mode)
    return mode, model.num_layers * min(1.0, (tokens * keep - capacity) / (tokens * (keep - drop)))


def _best_elementwise_units(profiles_by_type, upto: float) -> float:
    """Peak-FLOP units per byte of elementwise work on the GPU type that does it cheapest
    relative to its peak: peak / (bandwidth * best efficiency at up to `upto` tokens)."""
    return min(g.peak_flops / (p.memory_bw * float(_best(p.elementwise, upto)))
               for g, p in profiles_by_type)


def batch_lower_bound(lengths, cluster: ClusterSpec, model: ModelSpec, communication: bool = True) -> float:
    """Seconds no plan of the batch can beat on `cluster`: every FLOP and elementwise byte
    of the step (attention forward and backward, GEMMs, LM head and loss, the
    recomputation the batch needs at least) at the best efficiency any split or packing
    could give it, on all GPUs busy together, plus what each rank pays whatever the plan
    (the framework's per-layer work, its optimizer shard). Attention of a document of L
    tokens runs on chunks of at most L tokens, GEMMs and elementwise work on at most the
    batch's tokens; the GPU type best at each kind of work (relative to its peak) sets its
    cost, and the work is spread over the sum of the GPUs' peaks. Two collectives no plan
    escapes are added (`communication`; off: the compute alone): every token's
    tensor-parallel all-gathers and reduce-scatters at their bandwidth on the cheapest
    group, which the simulator runs on the compute stream, and the last layer's gradient
    bucket, which nothing is left to hide (`grad_allreduce_time` / layers). The same for
    every planner."""
    L = np.asarray(lengths, dtype=float)
    T = float(L.sum())
    types = {g.gpu_type.name: g.gpu_type for g in cluster.groups}
    by_type = [(t, hardware.profile(t)) for t in types.values()]
    profiles = [p for _, p in by_type]
    fwd = np.max([_best(p.attention_forward, L) for p in profiles], axis=0)
    bwd = np.max([_best(p.attention_backward, L) for p in profiles], axis=0)
    lin = max(float(_best(p.linear, T)) for p in profiles)
    mode, layers = batch_recomputation(lengths, cluster, model)
    att = attention_flops(model, L)
    att_work = np.sum(att / fwd + ATTENTION_BACKWARD_FACTOR * att / bwd + (att / fwd if recompute_attention(mode) else 0))
    lin_flops = (linear_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR)
                 + recompute_flops_per_token(model, mode, layers))
    elt_bytes = model.num_layers * (elementwise_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
                                    + recompute_elementwise_bytes_per_token(model, mode, layers))
    elt_bytes += loss_bytes_per_token(model) * (1 + ELEMENTWISE_BACKWARD_FACTOR)
    work = model.num_layers * (att_work + lin_flops * T / lin) + head_flops_per_token(model) * (1 + LINEAR_BACKWARD_FACTOR) * T / lin
    work += elt_bytes * model.tp * T * _best_elementwise_units(by_type, T)  # bytes per GPU: all of a TP group
    gpus = [cluster.gpu_of(r) for r in range(cluster.num_ranks)]
    num_dp = cluster.num_ranks // model.tp
    work += sum(g.peak_flops * (framework_time(model, g) + optimizer_time(model, g, num_dp)) for g in gpus)
    peak = sum(g.peak_flops for g in gpus)
    if not communication:
        return float(work / peak)
    work += _best_tp_units(cluster, model) * T
    return float(work / peak) + grad_allreduce_time(model, cluster) / model.num_layers


def tp_seconds_per_token(model: ModelSpec, group: NodeGroup) -> float:
    """Seconds of tensor-parallel collectives per token on each GPU of a TP group, per
    pass of all layers (two all-gathers and two reduce-scatters of its hidden states a
    layer, sequence parallelism), latency aside: what `collective_time` charges a byte."""
    if model.tp <= 1:
        return 0.0
    p = hardware.profile(group.gpu_type)
    per_token = hidden_bytes(model, 1) * (model.tp - 1) / model.tp / group.intra_bw
    return model.num_layers * 2 * sum(per_token / p.collective_efficiency[op] for op in ("all_gather", "reduce_scatter"))


def _best_tp_units(cluster: ClusterSpec, model: ModelSpec) -> float:
    """Peak-FLOP-seconds of tensor-parallel collectives a token costs at least, forward and
    backward, on the group where they cost least: every token crosses its TP group's
    collectives whatever the plan, and they run on the compute stream (the simulator's
    "tp" tasks), so all of a TP group's GPUs wait for them."""
    return min(2 * model.tp * g.gpu_type.peak_flops * tp_seconds_per_token(model, g) for g in cluster.groups)
