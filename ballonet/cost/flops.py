"""FLOPs and bytes of the pieces of a training step: exact functions of the model shape.

All FLOPs are per layer and forward unless a name says otherwise; with tensor parallelism
a GPU does 1/tp of them. Sources: causal attention FLOPs as in FlashAttention's benchmark
(2 matmuls of 2*D FLOPs per (query, key) pair and head; backward 2.5x, 5 matmuls); linear
FLOPs as in Megatron-LM's `num_floating_point_operations` (2 FLOPs per weight per token).
Bytes moved are what the runtime sends (`training/parallelism/model.py`, `runtime/routing.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ballonet.specs import ModelSpec

ATTENTION_BACKWARD_FACTOR = 2.5
"""Backward attention FLOPs / forward (FlashAttention recomputes P; 5 matmuls vs 2)."""
LINEAR_BACKWARD_FACTOR = 2.0
"""Backward GEMM FLOPs / forward (input and weight gradients)."""
ELEMENTWISE_BACKWARD_FACTOR = 2.0
"""Backward elementwise bytes / forward (each op reads its saved input and the output's
gradient and writes the input's: about twice the forward's traffic)."""
LOSS_DTYPE_BYTES = 4
"""The loss runs on fp32 logits (`training/parallelism/model.py` upcasts them)."""
GRAD_BYTES = 2
"""Bytes per gradient element in the data-parallel all-reduce (bf16)."""
KV_GRAD_BYTES = 4
"""Bytes per dK/dV element sent back around a ring: fp32 partial sums (`runtime.comm.GRAD_DTYPE`)."""
LSE_BYTES = 4
"""Bytes per log-sum-exp element (fp32, one per row and head)."""


def attention_flops(model: ModelSpec, lengths):
    """Causal self-attention of documents of `lengths` tokens (all heads), forward: a
    float for one length, an array for an array."""
    L = np.asarray(lengths, dtype=float)
    flops = 2.0 * model.num_heads * model.head_dim * L * (L + 1)
    return float(flops) if flops.ndim == 0 else flops


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


def kv_bytes(model: ModelSpec, rows: float) -> float:
    """K and V of `rows` tokens held by one GPU (its tp shard of the KV heads)."""
    return 2.0 * rows * model.kv_dim * model.dtype_bytes / model.tp


def kv_grad_bytes(model: ModelSpec, rows):
    """dK and dV of `rows` tokens as the runtime returns them (fp32 partial sums): a float
    for a number, an array for an array."""
    return 2.0 * rows * model.kv_dim * KV_GRAD_BYTES / model.tp


def heads_divide(model: ModelSpec, members: int) -> bool:
    """Whether a "heads" document can have `members` members: each takes a whole share of
    the K/V heads on its GPU (their tp shard) and as many query heads for each."""
    return members >= 1 and (model.num_kv_heads // model.tp) % members == 0


def message_bytes(model: ModelSpec, payload: str, rows, members: int = 1):
    """Bytes of a split document's message (`plan.RingMessage`) of `rows` rows on one GPU
    (its tp shard of the heads): "kv" `kv_bytes`, "grad" `kv_grad_bytes`; a "heads"
    document of `members` members: "qkv" and "dqkv" q, k and v of 1/members of the heads
    (dtype of q), "out" o of them and its fp32 log-sum-exp (the backward's "dout" sends it
    back: nothing is kept across the passes), "dout" o, dO and the log-sum-exp."""
    if payload == "kv":
        return kv_bytes(model, rows)
    if payload == "grad":
        return kv_grad_bytes(model, rows)
    width = {"qkv": (model.hidden + 2 * model.kv_dim) * model.dtype_bytes,
             "dqkv": (model.hidden + 2 * model.kv_dim) * model.dtype_bytes,
             "out": model.hidden * model.dtype_bytes + model.num_heads * LSE_BYTES,
             "dout": 2 * model.hidden * model.dtype_bytes + model.num_heads * LSE_BYTES}[payload]
    return rows * width / (members * model.tp)


def hidden_bytes(model: ModelSpec, rows: int) -> float:
    """Hidden states of `rows` tokens."""
    return float(rows * model.hidden * model.dtype_bytes)


def remap_bytes(model: ModelSpec, tokens: int, toward_attention: bool) -> float:
    """What the runtime's remap moves for `tokens` tokens in one layer, one way
    (`training/parallelism/model.py`): q, k and v (h + 2 kv_dim elements a token) toward the attention
    layout, the attention output o (h) back. The backward moves the gradients of the
    same tensors the other way, so the same bytes each way."""
    per_token = model.hidden + 2 * model.kv_dim if toward_attention else model.hidden
    return float(tokens * per_token * model.dtype_bytes / model.tp)


def grad_bytes(model: ModelSpec) -> float:
    """Gradients one GPU all-reduces per step."""
    return model.num_params * GRAD_BYTES / model.tp


def elementwise_bytes_per_token(model: ModelSpec) -> float:
    """Bytes one layer's elementwise work reads and writes per token, forward, one pass per
    op over its tensors (`training/parallelism/model.py`): two RMSNorms (read and write h), rotary on q
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
