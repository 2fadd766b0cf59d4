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


def times_s(fn, device: torch.device, repeats: int, wall: bool = False, warm: bool = True) -> list[float]:
    """Seconds of `repeats` calls of `fn` (after a warm-up call with `warm`): on a CPU the
    calling thread's CPU time (what a rank's compute costs whatever else shares the cores,
    as the training loop measures it), on a GPU (or with `wall`) wall time after a
    synchronize."""
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
    return times


def median_s(fn, device: torch.device, repeats: int, wall: bool = False, warm: bool = True) -> float:
    """Median of `times_s`."""
    return statistics.median(times_s(fn, device, repeats, wall, warm))


def paired_times(fn_a, fn_b, device: torch.device, repeats: int, warm: bool = True) -> tuple[list, list]:
    """Seconds of `fn_a` and of `fn_b`, timed alternately `repeats` times each, so that a
    change in the machine's speed (other jobs on a shared host) falls on both alike; CPU
    time on a CPU, as `times_s`."""
    if warm:
        fn_a(), fn_b()
    a, b = [], []
    for _ in range(repeats):
        a += times_s(fn_a, device, 1, warm=False)
        b += times_s(fn_b, device, 1, warm=False)
    return a, b


def paired_s(fn_a, fn_b, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(median seconds of `fn_a`, of `fn_b`, median of their paired differences a - b)
    from `paired_times`."""
    a, b = paired_times(fn_a, fn_b, device, repeats)
    return statistics.median(a), statistics.median(b), statistics.median(x - y for x, y in zip(a, b))


def in_passes(points: list, passes: int) -> list[tuple[int, object]]:
    """(pass, point) in the order a calibration times them: every point once per pass, the
    passes alternately forward and backward over `points`. On a shared host the machine's
    speed drifts by tens of percent over tens of seconds (bench/results/fidelity_paired.md),
    longer than one point takes: a point timed in one go carries the speed of its moment,
    while its timings spread over `passes` sweeps of the whole calibration sample the
    machine over the calibration's whole span (`over_passes` averages them)."""
    return [(p, x) for p in range(passes) for x in (points if p % 2 == 0 else points[::-1])]


def over_passes(times: list[float], passes: int) -> float:
    """A point's figure from its timings in pass order (as many a pass): the mean over the
    passes of each pass's median. The median drops a single slow call; the mean over the
    passes keeps the slow spells at their share of the time, as a training step, which
    sums its kernels' times, meets them (the median of all timings would price the
    machine's fast spells only)."""
    per = len(times) // passes
    return statistics.fmean(statistics.median(times[p * per:(p + 1) * per]) for p in range(passes))


def lengths(max_length: int) -> list[int]:
    out, L = [], 64
    while L <= max_length:
        out.append(L)
        L *= 2
    return out


def measure_attention(s: Settings, device: torch.device, dtype: torch.dtype, progress=None) -> list[dict]:
    """One row per (shape, length): forward and backward seconds (`s.repeats` timings
    over `s.passes` sweeps, `in_passes`, averaged by `over_passes`) of a pack of documents through the
    runtime's attention engine on a one-rank plan (its kernel, index bookkeeping and
    merges: what a rank's local documents cost in training)."""
    peak = hardware.gpu(s.gpu).peak_flops
    own = attention_shapes(s, device)[0]
    points = [(shape, L) for shape in attention_shapes(s, device) for L in lengths(s.max_length)]
    times: dict = {x: ([], []) for x in points}
    for p, ((heads, kv_heads, dim), L) in in_passes(points, s.passes):
        n = max(1, s.pack_tokens // L)
        plan = Plan(planner="calibrate", lengths=(L,) * n, node_of_rank=(0,), nic_of_rank=(0,),
                    attention=(tuple(Segment(d, 0, L) for d in range(n)),))
        q = torch.randn(n * L, heads, dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(n * L, kv_heads, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        fwd, bwd = times[(heads, kv_heads, dim), L]
        with torch.no_grad():
            fwd += times_s(lambda: runtime.attention(q, k, v, plan, 0, verify_plan=False), device, s.per_pass,
                           warm=p == 0)
        out = runtime.attention(q, k, v, plan, 0, verify_plan=False)
        dout = torch.randn_like(out)
        bwd += times_s(lambda: torch.autograd.backward(out, dout, retain_graph=True), device, s.per_pass,
                       warm=p == 0)
        if progress:
            progress()
    rows = []
    for (heads, kv_heads, dim), L in points:
        n = max(1, s.pack_tokens // L)
        fwd, bwd = (over_passes(t, s.passes) for t in times[(heads, kv_heads, dim), L])
        flops = 2.0 * heads * dim * L * (L + 1) * n
        rows.append({"heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                     "model_shape": (heads, kv_heads, dim) == own, "length": L, "num_docs": n,
                     "forward_s": fwd, "backward_s": bwd, "forward_efficiency": flops / (fwd * peak),
                     "backward_efficiency": 2.5 * flops / (bwd * peak)})
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
    """One row per token count: forward+backward seconds (`s.passes` sweeps, `in_passes`,
    each timing the two alternately; `over_passes`) of the model's GEMMs alone (each
    layer's QKV, O and MLP, the LM head) and of the model without its attention core
    (embedding, norms, RoPE, SwiGLU, residual adds, LM head and loss), at most 2 layers.
    GEMM efficiency = 3 * GEMM FLOPs / (seconds * peak); the rest of the model's seconds is
    its elementwise work, as achieved bytes/s over 3x the forward bytes (`cost.flops`)."""
    from ballonet.training.model import Transformer

    spec = _calibration_model(s)
    model = Transformer(spec, attention_fn=lambda q, k, v, *_: q).to(device=device, dtype=dtype)  # no attention core
    peak = hardware.gpu(s.gpu).peak_flops
    flops_per_token = 3 * (spec.num_layers * linear_flops_per_token(spec)
                           + head_flops_per_token(spec))
    bytes_per_token = (1 + ELEMENTWISE_BACKWARD_FACTOR) * (
        spec.num_layers * elementwise_bytes_per_token(spec) + loss_bytes_per_token(spec))
    times: dict = {T: ([], []) for T in s.linear_tokens}
    for p, T in in_passes(list(s.linear_tokens), s.passes):
        ids = torch.randint(0, spec.vocab_size, (T,), device=device)
        whole, gemm = paired_times(_model_step(model, ids, _one_rank_plan(T)), _gemms(model, T, device, dtype),
                                   device, s.per_pass, warm=p == 0)
        times[T][0].extend(whole)
        times[T][1].extend(gemm)
        if progress:
            progress()
    rows = []
    for T in s.linear_tokens:
        a, b = times[T]
        whole, gemm = over_passes(a, s.passes), over_passes(b, s.passes)
        rest = over_passes([x - y for x, y in zip(a, b)], s.passes)
        rest = max(rest, 0.01 * whole)  # noisy timings: the rest is never taken below 1%
        rows.append({"tokens": T, "gemm_s": gemm, "model_s": whole, "efficiency": flops_per_token * T / (gemm * peak),
                     "elementwise_s": rest, "elementwise_bytes_per_s": bytes_per_token * T / rest})
    return rows


def measure_step(s: Settings, device: torch.device, dtype: torch.dtype) -> dict:
    """What a training step costs besides the model's kernels, on the world's ranks: the
    model without its attention core wrapped by FSDP2 as the training loop wraps it
    (`training.parallel`) against the bare model, on the same tokens (framework seconds
    per layer), and AdamW's step over the parameters a rank holds (seconds per parameter).
    One process (no torchrun): no FSDP2 figure, the optimizer on the whole model."""
    from ballonet.training import parallel
    from ballonet.training.model import Transformer

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
