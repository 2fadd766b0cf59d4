"""What compute costs on this device, timed with the runtime's own kernels and modules:
the parts of `ballonet calibrate` (`calibrate.py`, which documents the method) that time
attention, the model's GEMMs and elementwise work, the framework's work under FSDP2 and
the optimizer step. Each function returns raw rows; `calibrate.build_profile` turns them
into a profile."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from ballonet import runtime, specs
from ballonet.calibration.settings import Settings
from ballonet.cost import hardware
from ballonet.cost.flops import (
    ELEMENTWISE_BACKWARD_FACTOR,
    elementwise_bytes_per_token,
    head_flops_per_token,
    linear_flops_per_token,
    loss_bytes_per_token,
)
from ballonet.plan import Plan, Segment

SHAPES = {"cpu": ((4, 2, 16), (8, 8, 32)), "cuda": ((64, 4, 128), (32, 32, 128))}
"""(query heads, KV heads, head dim) timed per device type besides the model's own."""


def attention_shapes(s: Settings, device: torch.device) -> list[tuple[int, int, int]]:
    """The shapes timed: the calibrated model's own first (its curve is the profile's: a
    CPU kernel's efficiency differs by 20-50% between head shapes), then `SHAPES`'s others
    (kept in the measurements, for comparison)."""
    spec = specs.model(s.model)
    own = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    return [own] + [x for x in SHAPES["cuda" if device.type == "cuda" else "cpu"] if x != own]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn, device: torch.device, repeats: int, wall: bool = False, warm: bool = True) -> float:
    """Median seconds of `fn` after a warm-up: on a CPU the calling thread's CPU time (what
    a rank's compute costs whatever else shares the cores, as the training loop measures
    it), on a GPU (or with `wall`) wall time after a synchronize."""
    clock = time.perf_counter if wall or device.type == "cuda" else time.thread_time
    if warm:
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        sync(device)
        times.append(clock() - start)
    return statistics.median(times)


def paired_s(fn_a, fn_b, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(median seconds of `fn_a`, of `fn_b`, median of their paired differences a - b),
    the two timed alternately so that a change in the machine's speed (other jobs on a
    shared host) falls on both alike; CPU time on a CPU, as `median_s`."""
    fn_a(), fn_b()
    a, b = [], []
    for _ in range(repeats):
        a.append(median_s(fn_a, device, 1, warm=False))
        b.append(median_s(fn_b, device, 1, warm=False))
    return statistics.median(a), statistics.median(b), statistics.median(x - y for x, y in zip(a, b))


def lengths(max_length: int) -> list[int]:
    out, L = [], 64
    while L <= max_length:
        out.append(L)
        L *= 2
    return out


def measure_attention(s: Settings, device: torch.device, dtype: torch.dtype, progress=None) -> list[dict]:
    """One row per (shape, length): forward and backward seconds of a pack of documents
    through the runtime's attention engine on a one-rank plan (its kernel, index
    bookkeeping and merges: what a rank's local documents cost in training)."""
    rows = []
    peak = hardware.gpu(s.gpu).peak_flops
    own = attention_shapes(s, device)[0]
    for heads, kv_heads, dim in attention_shapes(s, device):
        for L in lengths(s.max_length):
            n = max(1, s.pack_tokens // L)
            plan = Plan(planner="calibrate", lengths=(L,) * n, node_of_rank=(0,), nic_of_rank=(0,),
                        attention=(tuple(Segment(d, 0, L) for d in range(n)),))
            q = torch.randn(n * L, heads, dim, device=device, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(n * L, kv_heads, dim, device=device, dtype=dtype, requires_grad=True)
                    for _ in range(2))
            with torch.no_grad():
                fwd = median_s(lambda: runtime.attention(q, k, v, plan, 0, verify_plan=False), device, s.repeats)
            out = runtime.attention(q, k, v, plan, 0, verify_plan=False)
            dout = torch.randn_like(out)
            bwd = median_s(lambda: torch.autograd.backward(out, dout, retain_graph=True), device, s.repeats)
            flops = 2.0 * heads * dim * L * (L + 1) * n
            rows.append({"heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                         "model_shape": (heads, kv_heads, dim) == own, "length": L, "num_docs": n,
                         "forward_s": fwd, "backward_s": bwd, "forward_efficiency": flops / (fwd * peak),
                         "backward_efficiency": 2.5 * flops / (bwd * peak)})
            if progress:
                progress()
    return rows


def _gemms(model, T: int, device, dtype):
    """fwd+bwd of every GEMM of `model` (each layer's QKV, O and MLP weights, the LM head)
    on T tokens, with input gradients as in training: a closure for `median_s`."""
    spec = model.spec
    inputs = {n: torch.randn(T, n, device=device, dtype=dtype, requires_grad=True)
              for n in {spec.hidden, spec.num_heads * spec.head_dim, spec.ffn_hidden}}
    calls = [(lin, inputs[lin.in_features]) for layer in model.layers
             for lin in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w1, layer.w3, layer.w2)]
    calls.append((model.head, inputs[spec.hidden]))
    grads = [torch.randn(T, lin.out_features, device=device, dtype=dtype) for lin, _ in calls]

    def run():
        torch.autograd.backward([lin(x) for lin, x in calls], grads)
    return run


def _model_step(model, ids, plan):
    def run():
        model.loss(ids, ids, plan, 0 if plan.num_ranks == 1 else dist.get_rank()).backward()
    return run


def measure_linear(s: Settings, device: torch.device, dtype: torch.dtype, progress=None) -> list[dict]:
    """One row per token count: forward+backward seconds of the model's GEMMs alone (each
    layer's QKV, O and MLP, the LM head) and of the model without its attention core
    (embedding, norms, RoPE, SwiGLU, residual adds, LM head and loss), at most 2 layers.
    GEMM efficiency = 3 * GEMM FLOPs / (seconds * peak); the rest of the model's seconds is
    its elementwise work, as achieved bytes/s over 3x the forward bytes (`cost.flops`)."""
    from ballonet.training.parallelism.model import Transformer

    spec = _calibration_model(s)
    model = Transformer(spec, attention_fn=lambda q, k, v, *_: q).to(device=device, dtype=dtype)  # no attention core
    peak = hardware.gpu(s.gpu).peak_flops
    flops_per_token = 3 * (spec.num_layers * linear_flops_per_token(spec)
                           + head_flops_per_token(spec))
    bytes_per_token = (1 + ELEMENTWISE_BACKWARD_FACTOR) * (
        spec.num_layers * elementwise_bytes_per_token(spec) + loss_bytes_per_token(spec))
    rows = []
    for T in s.linear_tokens:
        ids = torch.randint(0, spec.vocab_size, (T,), device=device)
        whole, gemm, rest = paired_s(_model_step(model, ids, _one_rank_plan(T)), _gemms(model, T, device, dtype),
                                      device, s.repeats)
        rest = max(rest, 0.01 * whole)  # noisy timings: the rest is never taken below 1%
        rows.append({"tokens": T, "gemm_s": gemm, "model_s": whole, "efficiency": flops_per_token * T / (gemm * peak),
                     "elementwise_s": rest, "elementwise_bytes_per_s": bytes_per_token * T / rest})
        if progress:
            progress()
    return rows


def measure_step(s: Settings, device: torch.device, dtype: torch.dtype) -> dict:
    """What a training step costs besides the model's kernels, on the world's ranks: the
    model without its attention core wrapped by FSDP2 as the training loop wraps it
    (`training.parallelism.parallel`) against the bare model, on the same tokens (framework seconds
    per layer), and AdamW's step over the parameters a rank holds (seconds per parameter).
    One process (no torchrun): no FSDP2 figure, the optimizer on the whole model."""
    from ballonet.training.parallelism import parallel
    from ballonet.training.parallelism.model import Transformer

    spec = _calibration_model(s)
    bare = Transformer(spec, attention_fn=lambda q, k, v, *_: q).to(device=device, dtype=dtype)
    T = s.linear_tokens[len(s.linear_tokens) // 2]
    ids = torch.randint(0, spec.vocab_size, (T,), device=device)
    bare_step = _model_step(bare, ids, _one_rank_plan(T))
    out = {"tokens": T}
    model = bare
    if dist.is_initialized() and dist.get_world_size() > 1:
        model = Transformer(spec, attention_fn=lambda q, k, v, *_: q).to(device=device, dtype=dtype)
        parallel.parallelize(model, parallel.device_mesh(dist.get_world_size(), "full", device))
        out["fsdp_s"], out["bare_s"], extra = paired_s(_model_step(model, ids, _one_rank_plan(T)), bare_step,
                                                        device, 2 * s.repeats)
        out["fsdp_extra_s"] = extra
        out["framework_s_per_layer"] = max(extra, 0.0) / spec.num_layers
    else:
        out["bare_s"] = median_s(bare_step, device, s.repeats)
    optimizer = torch.optim.AdamW(model.parameters())
    out["optimizer_s"] = median_s(optimizer.step, device, s.repeats)
    out["local_params"] = sum(_local(p).numel() for p in model.parameters())
    out["optimizer_s_per_param"] = out["optimizer_s"] / out["local_params"]
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _one_rank_plan(T: int) -> Plan:
    return Plan(planner="calibrate", lengths=(T,), node_of_rank=(0,), nic_of_rank=(0,),
                attention=((Segment(0, 0, T),),))


def _calibration_model(s: Settings) -> specs.ModelSpec:
    spec = specs.model(s.model)
    return dataclasses.replace(spec, num_layers=min(2, spec.num_layers))
