"""What a rank holds: activation bytes by recomputation mode, weights and optimizer states,
and the cap a plan may fill.

Activation memory after Korthikanti et al. 2022 ("Reducing Activation Recomputation"),
counted tensor by tensor for this Llama layer with a fused attention kernel (no score
matrix). Which mode a plan takes is `recompute.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ballonet.plan import RecomputeMode

if TYPE_CHECKING:
    from ballonet.cost.hardware import GPUType
    from ballonet.specs import ModelSpec

Tokens = float | np.ndarray
"""A token count, or an array of them (the functions here work on both)."""
MEMORY_RESERVE = 0.90
"""Share of a GPU's memory a plan may use; the rest is allocator and library slack."""
RECOMPUTE_MODES = tuple(m.value for m in RecomputeMode)
"""Activation recomputation, cheapest first: `ModelSpec.recompute`, None = the cheapest that fits."""
BELOW = {"selective": "none", "linear": "selective"}
"""What the other layers do when only the first ones recompute under a mode."""


def recompute_mode(model: ModelSpec) -> str:
    """The recomputation a model spec asks for; None (cheapest that fits) plans as "full"."""
    return model.recompute or "full"


def recompute_layer_count(model: ModelSpec, mode: str | None = None, layers: Tokens | None = None) -> Any:
    """Layers that recompute under `mode` (default the model's own, with its
    `recompute_layers`): `layers` when given, else every layer; none under "none"."""
    if mode is None:
        mode, layers = recompute_mode(model), model.recompute_layers if layers is None else layers
    if mode == "none":
        return 0
    return model.num_layers if layers is None else layers


def layer_activation_elements(model: ModelSpec) -> tuple[float, float]:
    """Elements one token saves for the backward of one layer without recomputation, as
    (on the linear layout, on the attention layout) (`training/parallelism/model.py`): the attention
    block's input, its normed input (QKV's input) and o (the output projection's input),
    the MLP block's input, normed input, gate, up, silu(gate) and their product; on the
    attention layout q, k, v and the attention output (flash attention keeps no scores)."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    return (3 * h) + (2 * h + 4 * f), 2 * h + 2 * kv


def activation_bytes(model: ModelSpec, linear_tokens: Tokens, attention_tokens: Tokens, mode: str | None = None,
                     layers: Tokens | None = None) -> Any:
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
    TP group (`training/parallelism/tensor_parallel.py`)."""
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


def activation_bytes_per_token(model: ModelSpec, mode: str | None = None, layers: float | None = None) -> float:
    """`activation_bytes` of a token held on both layouts (what a planner reserves per token)."""
    return activation_bytes(model, 1, 1, mode, layers)


def gathered_bytes(model: ModelSpec) -> float:
    """Weights a GPU holds whole under FSDP2 (`training.parallelism.parallel`), in the compute
    dtype, split by tp: the root's embedding and head from forward to backward (the root is not
    resharded after forward) and two blocks at once (FSDP2 prefetches the next)."""
    embed_head = 2 * model.vocab_size * model.hidden
    block = (model.num_params - embed_head) / model.num_layers
    return (embed_head + 2 * block) * model.dtype_bytes / model.tp


def static_bytes(model: ModelSpec, num_dp_ranks: int) -> float:
    """A GPU's weights, gradients and optimizer state as the runtime holds them (FSDP2, shard
    "full"): fp32 weights, gradients and Adam's two moments, 16 bytes a parameter, sharded over
    the data-parallel ranks (each holding 1/tp of every weight), plus `gathered_bytes`."""
    return model.num_params * 16 / (max(num_dp_ranks, 1) * model.tp) + gathered_bytes(model)


def memory_cap(model: ModelSpec, gpu: GPUType, num_dp_ranks: int) -> float:
    """Bytes of activations a GPU can hold."""
    return gpu.memory_bytes * MEMORY_RESERVE - static_bytes(model, num_dp_ranks)


def layer_mean(model: ModelSpec, per_layer: dict, mode: str | None, layers: float | None) -> float:
    """`per_layer[mode]` as a mean over all layers when only `layers` of them recompute
    under `mode` (`recompute_layer_count`), the others one mode below (`BELOW`)."""
    k = recompute_layer_count(model, mode, layers)
    mode, n = mode or recompute_mode(model), model.num_layers
    if k == n or mode not in BELOW:
        return per_layer[mode]
    return (k * per_layer[mode] + (n - k) * per_layer[BELOW[mode]]) / n
