"""Does `ballonet calibrate --quick` price the linear layers as a 2-rank training step runs them?

    python bench/investigations/calibration_threads.py [--repeats 3] [--global-tokens 1024] [--source DIR]

1. `python -m ballonet calibrate --quick --out P.json`, `--repeats` times, in the
   environment as given (no OMP_NUM_THREADS: the README's command), from the source tree
   `--source` (default this one; a checkout of an older commit measures the code before
   calibrate ran one thread per rank): the profile's linear efficiency at the tokens of
   one call in training (`Curve.at`), and the threads the profile says it ran with.
2. `--repeats` runs of `ballonet train` on 2 gloo ranks (`training.loop.train_model`,
   one thread a rank, as the command sets; the tiny model, `--global-tokens` a batch,
   4 steps). Global forward hooks time every `nn.Linear` call of the step, and hooks on
   its autograd node (which computes both GEMMs of its backward) the backward, in thread
   CPU time (what calibrate and the loop's `compute_s` count): the
   linear efficiency of training = 3 * 2 * tokens * in * out FLOPs of each call (forward
   plus a backward of twice its FLOPs, the cost model's count and calibrate's) over those
   seconds and the `cpu` GPU type's peak, over steps 2-4 (the first warms up), per rank.

Reports each side's median and their ratio; the target is agreement within 25%. Writes
bench/results/calibration_threads.md and .json (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, BENCH)  # after this folder: bench/ (_common)

from _common import HERE, ROOT, record, write_text

STEPS = 4


def calibrate_once(source: str, tokens: int) -> dict:
    """One `calibrate --quick`: linear efficiency at `tokens`, the threads it ran with."""
    from ballonet import calibration

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = source
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p.json")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ballonet", "calibrate", "--quick", "--out", out], cwd=tmp, env=env,
                       check=True, capture_output=True, timeout=900)
        seconds = time.perf_counter() - start
        with open(out) as f:
            raw = json.load(f)
        profile = calibration.load(out)
    machine = raw.get("machine", {})
    return {"linear_efficiency": float(profile.linear.at(tokens)), "seconds": seconds,
            "threads": machine.get("threads_per_rank", machine.get("cpu_threads")),
            "curve": {"tokens": list(profile.linear.tokens), "efficiency": list(profile.linear.efficiency)}}


def _timed_training(rank: int, world_size: int, global_tokens: int) -> dict:
    """Runs in each rank: train STEPS steps, timing every nn.Linear call (thread CPU time)."""
    import torch
    from torch.nn.modules import module as nn_module

    from ballonet.cost import hardware
    from ballonet.training.loop import TrainConfig, train_model

    calls, starts = [], {}

    def forward_pre(mod, args):
        if isinstance(mod, torch.nn.Linear):
            starts[id(mod)] = time.thread_time()

    def forward_post(mod, args, out):
        if not isinstance(mod, torch.nn.Linear):
            return
        shape = (args[0].numel() // mod.in_features, mod.in_features, mod.out_features)
        calls.append(("forward", *shape, time.thread_time() - starts.pop(id(mod))))
        node = out.grad_fn  # MmBackward0 / AddmmBackward0: both GEMMs of the backward in one node
        if node is not None:
            begin = []
            node.register_prehook(lambda grads: begin.append(time.thread_time()))
            node.register_hook(lambda grads_in, grads_out: calls.append(
                ("backward", *shape, time.thread_time() - begin.pop())))

    handles = [nn_module.register_module_forward_pre_hook(forward_pre),
               nn_module.register_module_forward_hook(forward_post)]
    try:
        records, _ = train_model(TrainConfig(model="tiny", global_tokens=global_tokens, steps=STEPS))
    finally:
        for h in handles:
            h.remove()
    per_step = len(calls) // STEPS
    timed = calls[per_step:]  # step 1 warms up
    flops = sum(2.0 * t * i * o * (1 if kind == "forward" else 2) for kind, t, i, o, _ in timed)
    seconds = sum(s for *_, s in timed)
    tokens = statistics.median(t for kind, t, *_ in timed if kind == "forward")
    return {"rank": rank, "threads": torch.get_num_threads(), "calls_per_step": per_step, "tokens_per_call": tokens,
            "linear_seconds": seconds, "linear_efficiency": flops / (seconds * hardware.gpu("cpu").peak_flops),
            "compute_s_mean": statistics.mean(r["compute_s_mean"] for r in records[1:])}


def train_once(global_tokens: int) -> list[dict]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from distributed import run_ranks

    return run_ranks(2, _timed_training, global_tokens)


def _stamp(command: str, seconds: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"Command: `{command}` ({now}, {platform.machine()}, {os.cpu_count()} cores shared, load average "
            f"{load:.1f} at the end, Python {platform.python_version()}, {seconds:.0f} s).")


def report(result: dict) -> str:
    out = ["# Calibration under training's threading", "", result["stamp"], "",
           "`calibrate --quick` (the README's command, no OMP_NUM_THREADS) against the linear layers of a 2-rank "
           "training step (`bench/investigations/calibration_threads.py`, see its docstring for the method). Efficiency: FLOPs "
           "(forward + 2x backward) over thread CPU seconds and the `cpu` type's nominal peak "
           f"({result['peak'] / 1e12:g} TFLOP/s), at {result['tokens']:.0f} tokens per call.", "",
           "| source | calibrate threads | calibrate linear eff. (median) | training linear eff. (median of ranks x "
           "runs) | calibrate / training | within 25% |", "| --- | --- | --- | --- | --- | --- |"]
    for name, side in result["sources"].items():
        effs = [r["linear_efficiency"] for r in side["calibrate"]]
        cal = statistics.median(effs)
        ratio = cal / result["training_median"]
        out.append(f"| {name} | {side['calibrate'][0]['threads']} | {cal:.4f} "
                   f"({', '.join(f'{e:.4f}' for e in effs)}) | "
                   f"{result['training_median']:.4f} | {ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.25 else 'no'} |")
    runs = ", ".join(f"{r['linear_efficiency']:.4f}" for run in result["training"] for r in run)
    out += ["", f"Training linear efficiency per rank and run: {runs} (one thread a rank, "
                f"{result['training'][0][0]['calls_per_step']} timed Linear calls a step)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--global-tokens", type=int, default=1024)
    p.add_argument("--source", action="append", default=[],
                   help="NAME=DIR: also run calibrate from this source tree (repeatable); this tree is 'this branch'")
    p.add_argument("--out", default=os.path.join(HERE, "results", "calibration_threads"))
    args = p.parse_args(argv)
    from ballonet.cost import hardware

    start = time.perf_counter()
    training = [train_once(args.global_tokens) for _ in range(args.repeats)]
    tokens = training[0][0]["tokens_per_call"]
    sources = {"this branch": ROOT, **dict(s.split("=", 1) for s in args.source)}
    result = {"tokens": tokens, "peak": hardware.gpu("cpu").peak_flops, "training": training,
              "training_median": statistics.median(r["linear_efficiency"] for run in training for r in run),
              "sources": {name: {"path": path, "calibrate": [calibrate_once(path, tokens) for _ in range(args.repeats)]}
                          for name, path in sources.items()}}
    # quoted (not `_common.command`): --source values hold spaces
    cmd = "python " + shlex.join(["bench/investigations/calibration_threads.py",
                                  *(sys.argv[1:] if argv is None else argv)])
    result["stamp"] = _stamp(cmd, time.perf_counter() - start)
    text = report(result)
    record(cmd, result, args.out + ".json")
    write_text(args.out + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
