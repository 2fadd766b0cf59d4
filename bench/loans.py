"""A day of loans on `h800+h20`, simulated (issue 48): tokens trained over 24 hours in which
the H20 nodes are lent at off-peak hours and reclaimed the rest, against the H800 nodes
alone, each change of members priced (`ballonet.simulation.loans`: the step in flight, a
save and a load at the checkpoint's size and the members' NIC rate, the restart, the new
plan). The same question for one's own cluster: `ballonet simulate --loan-schedule FILE`.

    OMP_NUM_THREADS=1 python bench/loans.py [--steps K] [--out bench/results]

Writes bench/results/loans.json (every figure) and loans.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import RESULTS, command, record, write_text

from ballonet import specs, workloads
from ballonet.simulation import loans

CLUSTER, MODEL, TOKENS_PER_GPU, MAX_LENGTH = "h800+h20", "llama-7b", 16384, 65536
WORKLOADS = ["wlbllm", "prolong"]
SCHEDULES = {  # name -> hours lent in a day
    "nights (20:00-08:00)": ((0, 8), (20, 24)),
    "nights and lunch": ((0, 8), (12, 14), (20, 24)),
    "choppy: every other hour": tuple((h, h + 1) for h in range(0, 24, 2)),
}
RESTARTS_S = (30.0, 60.0, 300.0)


def run(steps: int) -> list[dict]:
    cluster, model = specs.cluster(CLUSTER), specs.model(MODEL)
    own = cluster.without_loaned()
    out = []
    for workload in WORKLOADS:
        batches = [workloads.get(workload).sample_batch(TOKENS_PER_GPU * cluster.num_ranks, seed, MAX_LENGTH)
                   for seed in range(steps)]
        full_m, own_m = loans.membership(cluster, model, batches), loans.membership(own, model, batches)
        for name, lent in SCHEDULES.items():
            for restart_s in RESTARTS_S:
                day = loans.day(loans.LoanSchedule(lent=lent), model, full_m, own_m, sum(batches[0]), restart_s)
                out.append({"workload": workload, "schedule": name, "restart_s": restart_s, **day.to_dict()})
    return out


def markdown(runs: list[dict], cmd: str, header: str) -> str:
    first = runs[0]
    lines = [f"# A day of loans on `{CLUSTER}`, simulated", "", f"Command: `{cmd}` ({header}).", "",
             f"{MODEL}, {TOKENS_PER_GPU} tokens per GPU of the whole cluster in every global batch "
             f"({first['tokens_per_step']:,} tokens; the same batches on either membership), {MAX_LENGTH} context, "
             f"zeppelin. `{CLUSTER}`: 2 nodes of 8 H800 (the training nodes) + 2 nodes of 8 H20 (`loaned = true`). "
             "Each change of members costs the downtime below (the save, the restart, the load, the new plan); the "
             "step in flight when the lease changes is finished (training, not lost) and is what the lender waits "
             "for, with the save. The save and the load move 12 bytes a parameter (fp32 weights, AdamW's two "
             "states) at the members' NIC line rate (an assumption: storage that keeps up); the restart "
             "(processes, rendezvous, NCCL, the model built) is an assumption, given in three sizes. "
             "`bench/results/lease.md` measures the same transitions on CPU ranks.", "",
             "| workload | schedule | lent h | changes | restart s | downtime per change s | lender waits s | "
             "tokens with loans | H800 alone | gain | gain without transitions |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        changes = r["transitions"]
        down = max((t["downtime_s"] for t in changes), default=0.0)
        wait = max((t["lender_wait_s"] for t in changes if t["to"] == "reclaimed"), default=0.0)
        ideal = r["tokens_per_step"] * 3600 * (r["lent_hours"] / r["full"]["step_s"]
                                               + (r["hours"] - r["lent_hours"]) / r["own"]["step_s"])
        lines.append(f"| {r['workload']} | {r['schedule']} | {r['lent_hours']:g} | {len(changes)} | "
                     f"{r['restart_s']:g} | {down:.1f} | {wait:.2f} | {r['tokens_with_loans']:.4g} | "
                     f"{r['tokens_alone']:.4g} | {r['gain']:+.2%} | {ideal / r['tokens_alone'] - 1:+.2%} |")
    lines += ["", "Step times (s, mean over the sampled batches): " + "; ".join(
        f"{w}: {r['full']['step_s']:.2f} on {r['full']['gpus']} GPUs, {r['own']['step_s']:.2f} on the "
        f"{r['own']['gpus']} H800" for w, r in {r['workload']: r for r in runs}.items()) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="sampled batches per workload")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    t = time.perf_counter()
    runs = run(args.steps)
    cmd = command("loans.py", argv)
    data = record(cmd, {"runs": runs, "seconds": time.perf_counter() - t}, os.path.join(args.out, "loans.json"))
    header = f"{data['date']}, {data['machine']}, {data['seconds']:.0f} s"
    write_text(os.path.join(args.out, "loans.md"), markdown(runs, cmd, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
