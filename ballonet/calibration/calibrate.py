"""`ballonet calibrate`: measure this machine with the runtime's own kernels and collectives
and write a calibration profile (`calibration.Profile`, JSON).

What is measured, on the device this process runs on:

1. Causal varlen attention, forward and backward timed separately, through the runtime's
   engine (`runtime.attention` on a one-rank plan, with the kernel `runtime.kernels.select`
   picks), for the calibrated model's head shape (the profile's curves) and `SHAPES`'s
   others (kept for comparison), at lengths 64 .. `max_length` (doubling); a length L runs
   as a pack of max(1, pack_tokens // L) documents, as a rank's local documents run. Efficiency = FLOPs / (seconds * peak), FLOPs
   2*H*D*L*(L+1) forward and 2.5x that backward (`cost.flops`).
2. By tokens per rank, forward and backward of the model's GEMMs alone (each layer's
   QKV/O/MLP weights and the LM head of `training.parallelism.model.Transformer` with at most 2
   layers): efficiency = 3 * GEMM FLOPs / (seconds * peak), the same for forward and
   backward (the backward's 2x FLOPs at the forward's efficiency is what the cost model
   assumes); and of the model without its attention core (embedding, norms, RoPE,
   SwiGLU, residual adds, LM head and loss): its seconds beyond the GEMMs are its
   elementwise work, priced as bytes (`cost.flops.elementwise_bytes_per_token`, the
   loss's `loss_bytes_per_token`, backward 2x) over an achieved bandwidth.
   On a CPU, seconds are the thread's CPU time (as the training loop measures compute),
   with one thread per rank, as `ballonet train` runs (the profile's `machine` says so).
   Then the step's other costs: with world > 1, the same model wrapped by FSDP2 as the
   training loop wraps it against the bare model (framework seconds per layer), and
   AdamW's step over a rank's parameters (seconds per parameter).
3. With world > 1 (torchrun): point-to-point between ranks 0 and 1 (half a round trip),
   all-to-all and all-reduce over the world, by message size; latency and bandwidth from a
   least-squares line t = a + bytes / bw. All ranks of one host: the NIC figures are these
   same transfers (the profile says so). Then the overlap slowdown: a GEMM loop timed
   alone and while the largest all-reduce runs beside it (compute seconds lost per second
   of overlapping communication).

Under torchrun every rank measures items 1 and 2 at the same time, and the profile takes
the median of the ranks' timings of each point (`median_rank`): on a shared host one
rank's point moves by 20-50% between runs. Each rank runs as `ballonet train` runs a CPU rank
(`training.jobs.host`).
Items 1 and 2 are `measure_compute.py`, item 3 `measure_links.py`; this module builds the
profile and runs the command. Peak FLOP/s and nominal link bandwidths are the GPU type's
(`cost.hardware.GPUS`) and the cluster preset's NIC rate, so efficiencies are fractions of
what the simulator assumes.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import platform
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from ballonet import calibration, specs
from ballonet.calibration.measure_compute import (
    attention_shapes,
    lengths,
    measure_attention,
    measure_linear,
    measure_step,
)
from ballonet.calibration.measure_links import link_figures, measure_comm
from ballonet.calibration.settings import Settings, quick
from ballonet.cost import hardware
from ballonet.runtime import kernels
from ballonet.training.jobs import host


def _curve(tokens, effs) -> calibration.Curve:
    """Measured points, made increasing in tokens and clipped to (0, 1]."""
    pairs = sorted(zip(tokens, effs))
    return calibration.Curve(tokens=[t for t, _ in pairs], efficiency=[min(1.0, max(e, 1e-6)) for _, e in pairs])


def build_profile(s: Settings, attention: list[dict], linear: list[dict], comm: dict | None,
                  device: torch.device, step: dict | None = None, ranks: int = 1) -> calibration.Profile:
    """The profile: attention curves of the model's head shape, the GEMM and elementwise curves,
    the framework and optimizer figures (`step`), link figures."""
    base = hardware.profile(s.gpu)
    by_len: dict = {}
    for r in attention:
        if r["model_shape"]:
            by_len.setdefault(r["length"], []).append(r)
    lengths = sorted(by_len)
    fwd = [statistics.mean(r["forward_efficiency"] for r in by_len[L]) for L in lengths]
    bwd = [statistics.mean(r["backward_efficiency"] for r in by_len[L]) for L in lengths]
    launch = min(min(r["forward_s"] / r["num_docs"], r["backward_s"] / r["num_docs"]) for r in attention
                 if r["model_shape"])
    notes = [f"attention efficiency beyond {lengths[-1]} tokens taken equal to the last measured length"]
    if device.type == "cpu":
        notes.append(f"measured with {torch.get_num_threads()} thread(s) per rank, as `ballonet train` runs each "
                     f"CPU rank ({host.THREADS_PER_CPU_RANK})")
    if ranks > 1:
        notes.append(f"compute timings: each point the median of {ranks} ranks measuring it at the same time")
    fields = dict(attention_forward=_curve(lengths, fwd), attention_backward=_curve(lengths, bwd),
                  attention_launch_s=launch,
                  linear=_curve([r["tokens"] for r in linear], [r["efficiency"] for r in linear]))
    rates = [r["elementwise_bytes_per_s"] for r in linear]
    memory_bw = max(base.memory_bw, *rates)  # a measured rate above the nominal one becomes the reference
    fields.update(memory_bw=memory_bw,
                  elementwise=_curve([r["tokens"] for r in linear], [b / memory_bw for b in rates]))
    if step:
        fields["optimizer_s_per_param"] = step["optimizer_s_per_param"]
        if "framework_s_per_layer" in step:
            fields["framework_s_per_layer"] = step["framework_s_per_layer"]
            notes.append("framework seconds per layer: the model without attention under FSDP2 on all ranks "
                         "against the bare model, same tokens")
        else:
            notes.append("framework seconds per layer not measured (one process): the built-in profile's figure")
    gpu = hardware.gpu(s.gpu)
    if comm:
        link_fields, link_notes = link_figures(s, comm, gpu)
        fields.update(link_fields)
        notes += link_notes
    else:
        notes += ["links not measured (one process): the built-in profile's figures",
                  "overlap slowdown not measured (one process): the built-in profile's figure"]
    return dataclasses.replace(
        base, **fields, gpu=s.gpu, assumptions=tuple(notes), machine=_machine(device), versions=_versions(),
        source=f"ballonet calibrate on {socket.gethostname()} ({_device_name(device)}, attention kernel "
               f"{kernels.select(device=device).name})")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _machine(device: torch.device) -> dict:
    return {"host": socket.gethostname(), "device": _device_name(device), "platform": platform.platform(),
            "threads_per_rank": torch.get_num_threads(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("ballonet")
    except PackageNotFoundError:  # run from a source tree (PYTHONPATH)
        ours = "source"
    return {"python": platform.python_version(), "torch": torch.__version__, "ballonet": ours,
            "cuda": torch.version.cuda or "", "date": time.strftime("%Y-%m-%d")}


def default_gpu(device: torch.device) -> str:
    """The GPU type of `device`: its name matched against `hardware.GPUS`, "cpu" on a CPU."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for key in sorted(hardware.GPUS, key=len, reverse=True):
        if key != "cpu" and key in name:
            return key
    return hardware.REFERENCE_GPU


def run(s: Settings, device: torch.device, progress_factory=None) -> tuple[calibration.Profile, dict]:
    """Measure and return (profile, raw measurements). Collective under torchrun."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    multi = dist.is_initialized() and dist.get_world_size() > 1
    total = (len(attention_shapes(s, device)) * len(lengths(s.max_length)) + len(s.linear_tokens)
             + (len(s.message_bytes) if multi else 0))
    advance = progress_factory(total) if progress_factory else None
    attention = measure_attention(s, device, dtype, advance)
    linear = measure_linear(s, device, dtype, advance)
    step = measure_step(s, device, dtype)
    comm = measure_comm(s, device, advance) if multi else None
    raw = {"attention": attention, "linear": linear, "step": step, "comm": comm, "settings": dataclasses.asdict(s)}
    if multi:
        raw.update(median_rank(attention, linear, step, _device_name(device)))
    return build_profile(s, raw["attention"], raw["linear"], comm, device, raw["step"], raw.get("ranks", 1)), raw


def median_rank(attention: list[dict], linear: list[dict], step: dict, device_name: str) -> dict:
    """Every rank measured the same points at the same time; each timing, and each figure
    derived from one, becomes the median of the ranks on this rank's device type (of an
    even number, the mean of the middle two): on a shared CPU host one rank's point moves
    by 20-50% between runs minutes apart, the median of the ranks much less. Collective;
    returns the rows (`attention`, `linear`, `step`), each rank's own (`per_rank`) and how
    many ranks they were taken over (`ranks`)."""
    mine = {"device": device_name, "attention": attention, "linear": linear, "step": step}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    alike = [{k: v for k, v in r.items() if k != "device"} for r in every if r["device"] == device_name]

    def median(values: list):
        first = values[0]
        if isinstance(first, dict):
            return {k: median([v[k] for v in values]) for k in first}
        if isinstance(first, list):
            return [median(list(v)) for v in zip(*values)]
        return statistics.median(values) if isinstance(first, float) else first  # counts, lengths, flags: alike

    return {**median(alike), "per_rank": alike, "ranks": len(alike)}


def init_distributed() -> torch.device:
    """Join torchrun's process group if launched by it; the device this rank measures."""
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


# ---- the command ---------------------------------------------------------------------------


def _progress_factory(enabled: bool):
    """A rich progress bar on stderr; returns advance() for `run`."""
    try:
        from rich.progress import Progress
    except ImportError:  # a bare GPU machine: no bar
        return None

    def factory(total: int):
        bar = Progress(transient=True, disable=not enabled)
        bar.start()
        task = bar.add_task("calibrating", total=total)

        def advance():
            bar.advance(task)
            if bar.tasks[task].completed >= total:
                bar.stop()
        return advance
    return factory


def plot(profile: calibration.Profile, raw: dict, path: str, format: str | None = None) -> None:
    """Measured efficiencies (points) and the profile's curves (lines), by tokens, as an
    image of `format` (default: `path`'s suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, curve, color in (("forward_efficiency", profile.attention_forward, "C0"),
                              ("backward_efficiency", profile.attention_backward, "C1")):
        pts = [(r["length"], r[key]) for r in raw["attention"]]
        ax.scatter(*zip(*pts), color=color, s=12, label=f"attention {key.split('_')[0]} (measured)")
        xs = np.geomspace(curve.tokens[0], curve.tokens[-1], 100)
        ax.plot(xs, curve.at(xs), color=color)
    lin = [(r["tokens"], r["efficiency"]) for r in raw["linear"]]
    ax.scatter(*zip(*lin), color="C2", marker="s", s=12, label="linear layers (measured)")
    xs = np.geomspace(profile.linear.tokens[0], profile.linear.tokens[-1], 100)
    ax.plot(xs, profile.linear.at(xs), color="C2")
    ax.set(xscale="log", xlabel="tokens per call", ylabel=f"fraction of {profile.gpu} peak", title=profile.source)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format=format)
    plt.close(fig)


def command(args) -> tuple[calibration.Profile, dict] | None:
    """`ballonet calibrate`: see the module docstring. Outputs are checked before anything
    is measured; rank 0 writes them and returns (profile, raw measurements), the other
    ranks None."""
    from ballonet.errors import InputError
    from ballonet.paths import OUTPUT_ROOM, check_output, plot_formats, write_atomic

    if args.max_length is not None and args.max_length < 64:
        raise InputError(f"--max-length must be at least 64, got {args.max_length}")
    if args.out:  # before measuring, not after
        check_output(args.out, "--out", min_free_bytes=OUTPUT_ROOM)
    if args.plot:
        check_output(args.plot, "--plot", plot_formats(), min_free_bytes=OUTPUT_ROOM)
    device = init_distributed()
    if device.type == "cpu":
        host.setup_cpu_rank()  # as `ballonet train` runs a CPU rank
    gpu = args.gpu or default_gpu(device)
    hardware.gpu(gpu)
    specs.model(args.model or ("llama-7b" if device.type == "cuda" else "tiny"))
    specs.cluster(args.cluster)
    s = Settings(gpu=gpu, model=args.model or ("llama-7b" if device.type == "cuda" else "tiny"), cluster=args.cluster)
    if device.type == "cuda":
        s = dataclasses.replace(s, max_length=131072, pack_tokens=65536, linear_tokens=(128, 512, 2048, 8192, 32768),
                                message_bytes=tuple(2**k for k in range(10, 31, 2)))
    if args.quick:
        s = quick(s)
    if args.max_length:
        s = dataclasses.replace(s, max_length=args.max_length)
    lead = not dist.is_initialized() or dist.get_rank() == 0
    profile, raw = run(s, device, _progress_factory(lead and not args.json))
    if not lead:
        return None
    if args.out:
        write_atomic(args.out, lambda tmp: pathlib.Path(tmp).write_text(profile.to_json()))
    if args.plot:
        suffix = os.path.splitext(args.plot)[1][1:].lower()
        write_atomic(args.plot, lambda tmp: plot(profile, raw, tmp, suffix))
    return profile, raw
