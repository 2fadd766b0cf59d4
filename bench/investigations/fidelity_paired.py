"""The simulator against the runtime with this machine's drift taken out: each round
calibrates and trains in the same processes, within two minutes.

    OMP_NUM_THREADS=1 python bench/investigations/fidelity_paired.py [--ranks 2] [--planners flops_dp ...]
        [--rounds 5] [--steps 6]

bench/fidelity.py, the fidelity record, compares `ballonet train` runs against a profile
`ballonet calibrate` measured minutes before in other processes. On this shared VM that
comparison carries two errors of the machine's besides the simulator's: its speed drifts
(the same work in the same processes takes 25-50% longer for tens of seconds at a time,
both cores alike, steal time near 0) and a fresh process can run some 10% slower than
another started beside it. Here --ranks gloo ranks (`tests.distributed.run_ranks`) stay up for the whole bench,
and each round

1. calibrates compute as `ballonet calibrate` does (`calibration.measure_compute`:
   attention, the model's GEMMs and elementwise work, FSDP2's framework work and the
   optimizer; each timing the median of the ranks), links left at the preset's figures;
2. for each planner, in an order rotated from round to round: plans bench/fidelity.py's
   long batches, as `ballonet train` takes them (`host_allocator.batches`), with that
   profile, and trains --steps steps of the tiny model as the training loop does (FSDP2,
   AdamW, gradients set to None; `training.jobs.host.setup_cpu_rank`), timing each rank's
   forward and backward (CPU time of its thread), the first step left out;
3. simulates each plan under the same profile, as bench/fidelity.py does.

Per planner and rank: each round's error (predicted / measured - 1, over its steps) and
their median. What is not `ballonet train`: no loader (no prefetch thread), no plan check
(about 1 ms a step), and link figures not measured, so a planner that weighs links may
plan otherwise than in bench/fidelity.py. Writes bench/results/fidelity_paired.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[1:1] = [ROOT, BENCH]  # after this folder: the checkout (ballonet, tests), bench/ (_common, fidelity)

import torch

import ballonet
from _common import command, record, write_text
from fidelity import KINDS, PLANNERS, TARGETS, as_run, long_lengths, rotated, run_config
from host_allocator import batches
from ballonet import calibration
from ballonet.calibration import measure_compute
from ballonet.calibration.calibrate import build_profile, median_rank
from ballonet.calibration.settings import Settings
from ballonet.simulation import simulate
from ballonet.training.preflight import preflight
from tests.distributed import run_ranks


def rank_fn(rank: int, world: int, cluster, spec, planners: list[str], rounds: int, lengths: list[list[int]]) -> list:
    from ballonet.training.jobs import host
    from ballonet.training.parallelism import parallel
    from ballonet.training.parallelism.model import Transformer

    host.setup_cpu_rank()  # as `ballonet train` runs a CPU rank
    torch.manual_seed(0)
    device = torch.device("cpu")
    settings = Settings(gpu="cpu", model="tiny", max_length=KINDS["long"]["max_doc_tokens"])
    measure_compute.SHAPES["cpu"] = ()  # the model's own head shape only: the one the profile uses
    model = Transformer(spec)
    parallel.parallelize(model, parallel.device_mesh(world, "full", device))
    optimizer = torch.optim.AdamW(model.parameters())
    out = []
    for r in range(rounds):
        rows = median_rank(measure_compute.measure_attention(settings, device, torch.float32),
                           measure_compute.measure_linear(settings, device, torch.float32),
                           measure_compute.measure_step(settings, device, torch.float32), "cpu")
        profile = build_profile(settings, rows["attention"], rows["linear"], None, device, rows["step"],
                                ranks=rows["ranks"])
        runs = {}
        for planner in rotated(planners, r * len(planners) // rounds):
            with calibration.use(profile):
                plans = [ballonet.plan_batch(b, cluster, spec, planner=planner) for b in lengths]
            predicted, measured = [], []
            for i, plan in enumerate(plans):
                ids = torch.randint(0, spec.vocab_size, (sum(s.num_tokens for s in plan.attention[rank]),))
                torch.distributed.barrier()
                start = time.thread_time()
                model.loss(ids, ids, plan, rank).backward()
                seconds = time.thread_time() - start
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if i:  # the first step warms up
                    with calibration.use(profile):
                        res = simulate(as_run(plan), cluster, spec)
                    predicted.append(res.compute_s[rank] - res.optimizer_s)
                    measured.append(seconds)
            runs[planner] = {"predicted": predicted, "measured": measured}
        out.append({"runs": runs, "gemm_efficiency": dict(zip(profile.linear.tokens, profile.linear.efficiency)),
                    "attention_efficiency": dict(zip(profile.attention_forward.tokens,
                                                     profile.attention_forward.efficiency))})
    return out


def summarize(per_rank: list[list[dict]], planners: list[str]) -> list[dict]:
    """Per planner: each rank's error in each round (over its steps) and their medians."""
    rows = []
    for planner in planners:
        errors = [[sum(rd["runs"][planner]["predicted"]) / sum(rd["runs"][planner]["measured"]) - 1 for rd in rounds]
                  for rounds in per_rank]
        medians = [statistics.median(e) for e in errors]
        predicted = [statistics.median(statistics.mean(rd["runs"][planner]["predicted"]) for rd in rounds)
                     for rounds in per_rank]
        measured = [statistics.median(statistics.mean(rd["runs"][planner]["measured"]) for rd in rounds)
                    for rounds in per_rank]
        rows.append({"planner": planner, "errors": errors, "median_errors": medians, "predicted_s": predicted,
                     "measured_s": measured})
    return rows


def report(rows: list[dict], per_rank: list[list[dict]], args, cmd: str, seconds: float) -> str:
    target = TARGETS["compute"]
    gemm = [rd["gemm_efficiency"][4096.0] for rd in per_rank[0]]
    attn = [rd["attention_efficiency"][1024.0] for rd in per_rank[0]]
    lines = ["# Fidelity with the drift taken out: calibration and training in the same processes", "",
             f"Command: `{cmd}` ({seconds:.0f} s, load average {args.load:.1f} at the start). {args.ranks} gloo ranks, "
             f"{args.rounds} rounds, {args.steps} steps per planner and round (the first left out) on "
             "bench/fidelity.py's long batches (16384 tokens a step, documents cut at 12288). Each round calibrates "
             "compute in the ranks that then train, planners in a rotated order; see the script's docstring for "
             "what differs from `ballonet train`. Error = predicted / measured - 1 of a rank's forward and backward "
             "CPU time over a round's steps; median over the rounds. The calibrations themselves moved: GEMM "
             f"efficiency at 4,096 tokens {min(gemm):.4f}-{max(gemm):.4f}, attention forward at 1,024 tokens "
             f"{min(attn):.4f}-{max(attn):.4f} over the rounds.", "",
             "| planner | per-rank compute pred / meas (s, medians) | median errors | within "
             f"{target:.0%} | each round's errors (rank by rank) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = ", ".join(f"{p:.3f}/{m:.3f}" for p, m in zip(r["predicted_s"], r["measured_s"]))
        errs = ", ".join(f"{e:+.0%}" for e in r["median_errors"])
        met = "yes" if max(abs(e) for e in r["median_errors"]) <= target else "no"
        each = "; ".join(" ".join(f"{e:+.0%}" for e in rank_errors) for rank_errors in r["errors"])
        lines.append(f"| {r['planner']} | {cells} | {errs} | {met} | {each} |")
    within = sum(max(abs(e) for e in r["median_errors"]) <= target for r in rows)
    every = [e for r in rows for e in r["median_errors"]]
    lines += ["", f"Every rank within {target:.0%}: {within} of {len(rows)} planners. Median of the ranks' median "
              f"errors: {statistics.median(every):+.1%} ({len(every)} ranks)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, choices=[2, 4], help="gloo ranks: 2 on one node, 4 on two")
    p.add_argument("--planners", nargs="+", default=PLANNERS, choices=PLANNERS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fidelity_paired"))
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        p.error(f"--rounds must be at least 1 and --steps at least 2 (the first step is left out), got "
                f"{args.rounds} and {args.steps}")
    args.load, t0 = os.getloadavg()[0], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        lengths_file = os.path.join(tmp, "long_lengths.txt")
        long_lengths(lengths_file, 0)
        kind = {**KINDS["long"], "corpus": lengths_file}
        args.seed = 0
        cluster, spec, _ = preflight(run_config(args.ranks, args.planners[0], kind, args, None), args.ranks)
    per_rank = run_ranks(args.ranks, rank_fn, cluster, spec, args.planners, args.rounds, batches(args.steps),
                         timeout=7200)
    rows = summarize(per_rank, args.planners)
    cmd, seconds = command("investigations/fidelity_paired.py", argv), time.time() - t0
    record(cmd, {"rows": rows, "per_rank": per_rank, "load": args.load, "seconds": seconds}, args.out + ".json")
    text = report(rows, per_rank, args, cmd, seconds)
    write_text(args.out + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
