"""How long a loan's end takes (issue 48): from the lease saying `reclaimed` to the loaned
ranks' processes gone, and what it is made of; then the same for `lent` (the job back on
every rank). CPU gloo ranks, the tiny model, a 4-rank job on two node groups of 2 ranks
(the second `loaned = true`), `ballonet train --lease` as a user runs it.

    OMP_NUM_THREADS=1 python bench/lease.py [--repeats 3] [--out bench/results]

Each phase is timed from outside by polling (every 10 ms) what the job leaves: the JSON
log (a step's record), the checkpoint's `latest` pointer, the ranks' processes (children
of the launcher, by their RANK). Writes bench/results/lease.json and lease.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import RESULTS, command, record, write_text

TWO_GROUPS = """name = "lent-two"
[[node_groups]]
gpu = "cpu"
gpus_per_node = 2
nics_per_node = 2
nic_gbps = 10
[[node_groups]]
gpu = "cpu"
gpus_per_node = 2
nics_per_node = 2
nic_gbps = 10
loaned = true
"""
TRAIN = ["--model", "tiny", "--global-tokens", "4096", "--max-doc-tokens", "1024", "--seed", "3", "--log-every", "1000"]
POLL_S = 0.01


def _records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f.read().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def _ranks(parent: int) -> dict[int, int]:
    """RANK -> pid of `parent`'s children that are ranks."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(pid)
    return out


def _alive(pid: int) -> bool:
    """Running (an exited process its parent has not reaped yet is a zombie: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(condition, timeout: float = 600.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(POLL_S)
    raise TimeoutError("the job did not get there in time")


def _latest(ckpt: str) -> str | None:
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _change(job, log: str, lease: str, ckpt: str, to: str, world_before: int, world_after: int) -> dict:
    """Write `to` into the lease once the job has logged a step on `world_before` ranks;
    time what follows."""
    _wait(lambda: (rs := _records(log)) and rs[-1]["world_size"] == world_before and len(
        [r for r in rs if r["world_size"] == world_before]) >= 2)
    ranks = _ranks(job.pid)
    loaned = [pid for r, pid in ranks.items() if r >= min(world_before, world_after)]
    logged, saved_before = len(_records(log)), _latest(ckpt)
    with open(lease, "w") as f:
        f.write(to + "\n")
    t0 = time.monotonic()
    t_step = _wait(lambda: len(_records(log)) > logged)
    step = _records(log)[logged]["step"]
    t_saved = _wait(lambda: _latest(ckpt) not in (None, saved_before))
    t_gone = _wait(lambda: not any(map(_alive, loaned)))
    t_all_gone = _wait(lambda: not any(map(_alive, ranks.values())))
    stop_step = int(_latest(ckpt).split("-")[1])
    t_first = _wait(lambda: any(r["world_size"] == world_after and r["step"] > stop_step for r in _records(log)))
    return {"to": to, "written_after_step": step - 1, "stopped_after_step": stop_step,
            "step_in_flight_s": t_step - t0, "steps_after_change": stop_step - (step - 1),
            "to_saved_s": t_saved - t0, "to_loaned_ranks_gone_s": t_gone - t0, "to_all_ranks_gone_s": t_all_gone - t0,
            "to_first_step_s": t_first - t0}


def one_run(folder: str) -> list[dict]:
    cluster, lease, log, ckpt = (os.path.join(folder, n) for n in ("two.toml", "lease", "log.jsonl", "ckpt"))
    with open(cluster, "w") as f:
        f.write(TWO_GROUPS)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "ballonet"), "train", "--cluster", cluster, "--lease", lease,
           "--checkpoint-dir", ckpt, "--json-log", log, "--steps", "1000", *TRAIN]
    with open(os.path.join(folder, "stderr"), "w") as err:
        job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            out = [_change(job, log, lease, ckpt, "reclaimed", 4, 2), _change(job, log, lease, ckpt, "lent", 2, 4)]
        finally:
            job.terminate()  # preempted: it saves and exits
            job.wait(timeout=300)
    if job.returncode != 75:
        with open(os.path.join(folder, "stderr")) as f:
            raise RuntimeError(f"the job exited {job.returncode}: {f.read()[-3000:]}")
    return out


KEYS = ["step_in_flight_s", "to_saved_s", "to_loaned_ranks_gone_s", "to_all_ranks_gone_s", "to_first_step_s"]


def markdown(runs: list[list[dict]], cmd: str, header: str) -> str:
    lines = ["# A loan's end and start, measured on CPU ranks", "", f"Command: `{cmd}` ({header}).", "",
             "A 4-rank job (`ballonet train --nproc` by the cluster file, gloo on CPU, the tiny model, 4096 tokens a "
             "step) on two node groups of 2 ranks, the second `loaned = true`; its `--lease` file is written after "
             "the job has logged two steps on its current members. Seconds from the write (medians over the "
             "repeats; each repeat's figures in lease.json). What each span is: the step in flight (the first step "
             "logged after the write: the ranks check the lease after every step and all stop after the same one); "
             "then the save of that step (DCP, every rank its shards; `latest` points at it); then the ranks exit "
             "(the loaned ranks' processes gone); then the restart on the new members (the launcher starts them, "
             "torchrun's c10d rendezvous, imports, the model built, the checkpoint loaded and resharded, the first "
             "batch planned and trained). This machine runs other work too (the load average above): the figures are noisy, and the "
             "restart (process start-up, imports, on CPUs that other work shares) is most of it.", "",
             "| change | step in flight | saved | loaned ranks gone | all ranks gone | new members' first step logged |"
             " steps after the write (at most) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, to in enumerate(("reclaimed", "lent")):
        rows = [r[i] for r in runs]
        med = {k: statistics.median(r[k] for r in rows) for k in KEYS}
        gone = f"{med['to_loaned_ranks_gone_s']:.2f}" if to == "reclaimed" else "-"
        lines.append(f"| {to} | {med['step_in_flight_s']:.2f} | {med['to_saved_s']:.2f} | {gone} | "
                     f"{med['to_all_ranks_gone_s']:.2f} | {med['to_first_step_s']:.2f} | "
                     f"{max(r['steps_after_change'] for r in rows)} |")
    rows = [r[0] for r in runs]
    parts = {"the step in flight": statistics.median(r["step_in_flight_s"] for r in rows),
             "the save": statistics.median(r["to_saved_s"] - r["step_in_flight_s"] for r in rows),
             "the exit": statistics.median(r["to_loaned_ranks_gone_s"] - r["to_saved_s"] for r in rows)}
    restart = statistics.median(r["to_first_step_s"] - r["to_all_ranks_gone_s"] for r in rows)
    lines += ["", "`reclaimed` to the loaned ranks gone, in parts (medians): "
              + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
              + f". The job is then back at work on 2 ranks {restart:.1f} s after its last rank exited (the restart: "
              "new processes, re-rendezvous, load, plan, one step); `ballonet simulate --loan-schedule` prices that "
              "restart with `--restart-s` (60 s assumed for GPUs).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    t, load = time.perf_counter(), [os.getloadavg()[0]]
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="ballonet-lease-") as folder:
            runs.append(one_run(folder))
        load.append(os.getloadavg()[0])
    cmd = command("lease.py", argv)
    data = record(cmd, {"runs": runs, "seconds": time.perf_counter() - t, "load_average": load},
                  os.path.join(args.out, "lease.json"))
    header = (f"{data['date']}, {data['machine']}, {data['seconds']:.0f} s; load average "
              f"{min(load):.0f}-{max(load):.0f} on its 2 cores, other work included")
    write_text(os.path.join(args.out, "lease.md"), markdown(runs, cmd, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
