"""The attention engine against a single-process reference: the reference itself
(`attention_reference`), the engine on one rank's rows (`run_attention`), and the checks
the attention tests run per rank (`check_attention_plan`: fp32 and bf16 errors, bytes sent
against the plan's prediction)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ballonet.runtime import ByteCounter, attention, token_index
from ballonet.runtime.routing import predicted_bytes

H, H_KV, D = 4, 2, 8
"""Attention tests' heads, KV heads and head dim."""


def attention_reference(q, k, v, dout, lengths, math: bool):
    """out, dq, dk, dv of causal per-document attention on the whole batch: in float64
    plain math (`math`), or torch SDPA in the inputs' dtype (the bf16 yardstick: what one
    process computes on the unsharded batch in bf16)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs, start = [], 0
    for n in lengths:
        qd, kd, vd = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        if math:
            kd, vd = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=0) for x in (kd, vd))
            s = (qd @ kd.transpose(1, 2)) / q.shape[2] ** 0.5
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            outs.append((torch.softmax(s, dim=-1) @ vd).transpose(0, 1))
        else:
            # 4-d, so SDPA runs its bf16 flash kernel (3-d inputs take the fp32 math path).
            out = F.scaled_dot_product_attention(qd[None], kd[None], vd[None], is_causal=True, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        start += n
    out = torch.cat(outs)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_attention(plan, rank, inputs, dtype=None, kernel=None, counter=None, outer_group=None):
    """(this rank's rows of the batch, its out, dq, dk, dv) of the engine on the global
    q, k, v, dout `inputs` (in `dtype`; default theirs)."""
    idx = token_index(plan, rank)
    q, k, v, dout = (x[idx] if dtype is None else x[idx].to(dtype) for x in inputs)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, plan, rank, kernel=kernel, counter=counter, outer_group=outer_group)
    out.backward(dout)
    return idx, (out.detach(), q.grad, k.grad, v.grad)


def total_bytes(counter: ByteCounter, world: int) -> ByteCounter:
    """Every rank's `counter`, summed (collective)."""
    everyone = [None] * world
    dist.all_gather_object(everyone, counter)
    total = ByteCounter()
    for c in everyone:
        total = total.merge(c)
    return total


def check_attention_plan(name, plan, rank, world, outer_group=None, heads=(H, H_KV)):
    """[(check, error, tolerance)] for one plan on this rank (`outer_group`: as in
    `attention`; `heads`: query and key/value heads)."""
    gen = torch.Generator().manual_seed(len(name) + plan.num_tokens)
    N, (h, h_kv) = plan.num_tokens, heads
    inputs = [torch.randn(N, n, D, generator=gen) for n in (h, h_kv, h_kv, h)]  # q, k, v, dout
    rows = []
    ref32 = attention_reference(*(x.double() for x in inputs), plan.lengths, math=True)
    counter = ByteCounter()
    for kernel in ("cpu", "reference"):
        idx, got = run_attention(plan, rank, inputs, torch.float32, kernel, counter if kernel == "cpu" else None,
                                 outer_group)
        for what, a, b in zip("out dq dk dv".split(), got, ref32):
            rows.append((f"{name} fp32 {kernel} {what}", _max_err(a, b[idx]), 1e-5))
    # bf16: no worse than twice the error of the unsharded computation in bf16.
    bf = [x.bfloat16() for x in inputs]
    ref_bf = attention_reference(*(x.double() for x in bf), plan.lengths, math=True)
    yard = attention_reference(*bf, plan.lengths, math=False)
    idx, got = run_attention(plan, rank, bf, torch.bfloat16, outer_group=outer_group)
    for what, a, b, y in zip("out dq dk dv".split(), got, ref_bf, yard):
        rows.append((f"{name} bf16 {what}", _max_err(a, b[idx]), 2 * _max_err(y, b)))
    # Bytes: every rank's sends, summed, equal the plan's prediction exactly.
    total = total_bytes(counter, world)
    predicted = predicted_bytes(plan, h_kv, D, torch.float32, num_heads=h)
    for phase in ("forward", "backward"):
        got_bytes, want = getattr(total, phase), getattr(predicted, phase)
        rows.append((f"{name} bytes {phase} {dict(got_bytes)} vs {dict(want)}", float(got_bytes != want), 0.0))
    return rows
