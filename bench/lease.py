"""How long a loan's end takes (issue 48): from the lease saying `reclaimed` to the loaned
ranks' processes gone, and what it is made of; then the same for `lent` (the job back on
every rank). CPU gloo ranks, the tiny model, a 4-rank job on two node groups of 2 ranks
(the second `loaned = true`), `ballonet train --lease` as a user runs it, and the same job
as the multi-node form runs it: two torchrun agents, one per node group.

    OMP_NUM_THREADS=1 python bench/lease.py [--repeats 3] [--out bench/results]

Each phase is timed from outside by polling (every 10 ms) what the job leaves: the JSON
log (a step's record), the checkpoint's `latest` pointer, the ranks' processes (children
of the launcher, by their RANK). Writes bench/results/lease.json and lease.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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


RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
"""The torchrun runs' rendezvous settings (torch's defaults: 30 s, 5 s x 3): re-rendezvous
waits for the departed node's heartbeats to be missed and then for the last call."""


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def one_torchrun_run(folder: str) -> list[dict]:
    """The multi-node form (docs/design.md): two torchrun agents on this machine, the
    training node's and the loaned node's (`--nnodes 1:2`); the lender writes `reclaimed`
    (the loaned agent leaves by itself once its ranks have saved), then `lent`, and starts
    the loaned agent again."""
    cluster, lease, log, ckpt = (os.path.join(folder, n) for n in ("two.toml", "lease", "log.jsonl", "ckpt"))
    with open(cluster, "w") as f:
        f.write(TWO_GROUPS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")

    def agent(group: int, address: str):
        cmd = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "bench", "--local-addr", address, "--rdzv-conf", RDZV_CONF,
               "--max-restarts", "3", "--monitor-interval", "0.2", "-m", "ballonet", "train", "--cluster", cluster,
               "--lease", lease, "--checkpoint-dir", ckpt, "--resume", "--json-log", log, "--steps", "1000", *TRAIN]
        env = dict(os.environ, OMP_NUM_THREADS="1", BALLONET_NODE_GROUP=str(group), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, f"agent{group}"), "a"))

    def on(world: int) -> bool:
        rs = _records(log)
        return bool(rs) and rs[-1]["world_size"] == world and len([r for r in rs if r["world_size"] == world]) >= 2

    training = agent(0, "127.0.0.2")  # hosts the rendezvous
    loaned = None
    try:
        _wait(lambda: _listening(port))
        loaned = agent(1, "127.0.0.1")
        _wait(lambda: on(4))
        ranks = list(_ranks(loaned.pid).values())
        logged, saved_before = len(_records(log)), _latest(ckpt)
        with open(lease, "w") as f:
            f.write("reclaimed\n")
        t0 = time.monotonic()
        t_step = _wait(lambda: len(_records(log)) > logged)
        step = _records(log)[logged]["step"]
        t_saved = _wait(lambda: _latest(ckpt) not in (None, saved_before))
        t_gone = _wait(lambda: not any(map(_alive, ranks)))
        loaned.wait(timeout=120)  # its ranks tell it to leave the rendezvous
        t_agent = time.monotonic()
        stop_step = int(_latest(ckpt).split("-")[1])
        t_first = _wait(lambda: any(r["world_size"] == 2 and r["step"] > stop_step for r in _records(log)))
        out = [{"to": "reclaimed", "written_after_step": step - 1, "stopped_after_step": stop_step,
                "step_in_flight_s": t_step - t0, "steps_after_change": stop_step - (step - 1), "to_saved_s": t_saved - t0,
                "to_loaned_ranks_gone_s": t_gone - t0, "to_loaned_agent_gone_s": t_agent - t0,
                "to_first_step_s": t_first - t0}]

        _wait(lambda: on(2))
        ranks = list(_ranks(training.pid).values())
        saved_before = _latest(ckpt)
        with open(lease, "w") as f:
            f.write("lent\n")
        t0 = time.monotonic()
        loaned = agent(1, "127.0.0.1")
        t_saved = _wait(lambda: _latest(ckpt) != saved_before)  # torchrun's scale-up: SIGTERM, the ranks save
        t_gone = _wait(lambda: not any(map(_alive, ranks)))
        stop_step = int(_latest(ckpt).split("-")[1])
        t_first = _wait(lambda: any(r["world_size"] == 4 and r["step"] > stop_step for r in _records(log)))
        out.append({"to": "lent", "stopped_after_step": stop_step, "to_saved_s": t_saved - t0,
                    "to_training_ranks_gone_s": t_gone - t0, "to_first_step_s": t_first - t0})
    finally:
        for p in (loaned, training):
            if p is not None and p.poll() is None:
                p.terminate()  # preempted: the ranks save and exit
        for p in (loaned, training):
            if p is not None:
                p.wait(timeout=300)
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


def torchrun_markdown(runs: list[list[dict]]) -> str:
    med = [{k: statistics.median(r[i][k] for r in runs) for k in runs[0][i] if k.endswith("_s")} for i in range(2)]
    most = max(r[0]["steps_after_change"] for r in runs)
    rec, lent = med
    return "\n".join([
        "## Under bare torchrun, one agent per node", "",
        "The multi-node form of docs/design.md on this machine: two torchrun agents (`--nnodes 1:2 "
        "--nproc-per-node 2`, c10d rendezvous on localhost, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, "
        f"`--rdzv-conf {RDZV_CONF}`), the training node's and the loaned node's (its address sorting first, so the "
        "ranks renumber), the same job. The lender writes `reclaimed` (the loaned node's ranks save, its local rank 0 "
        "sends its agent SIGTERM, and the agent leaves the rendezvous); later it writes `lent` and starts the loaned "
        "agent again. Seconds from the write "
        "(medians):", "",
        "| change | step in flight | saved | loaned ranks gone | loaned agent gone | running ranks gone | "
        "new members' first step logged | steps after the write (at most) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| reclaimed | {rec['step_in_flight_s']:.2f} | {rec['to_saved_s']:.2f} | {rec['to_loaned_ranks_gone_s']:.2f} | "
        f"{rec['to_loaned_agent_gone_s']:.2f} | - | {rec['to_first_step_s']:.2f} | {most} |",
        f"| lent (and the loaned agent started) | - | {lent['to_saved_s']:.2f} | - | - | "
        f"{lent['to_training_ranks_gone_s']:.2f} | {lent['to_first_step_s']:.2f} | - |", "",
        f"After `reclaimed` the job is back at work on the training node "
        f"{rec['to_first_step_s'] - rec['to_loaned_agent_gone_s']:.1f} s after the loaned agent is gone: the "
        "departed node's missed heartbeats (3 s here), the rendezvous's last call (5 s here; 15 s and 30 s by "
        "torch's defaults), then new processes, load, plan and a step. After `lent` the time is the new agent's "
        "start and torchrun's scale-up (the running agent sees a node waiting, stops its ranks with SIGTERM, which "
        "they turn into a save), then the same restart over both nodes.", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    t, load = time.perf_counter(), [os.getloadavg()[0]]
    runs, torchrun_runs = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="ballonet-lease-") as folder:
            runs.append(one_run(folder))
        with tempfile.TemporaryDirectory(prefix="ballonet-lease-") as folder:
            torchrun_runs.append(one_torchrun_run(folder))
        load.append(os.getloadavg()[0])
    cmd = command("lease.py", argv)
    data = record(cmd, {"runs": runs, "torchrun_runs": torchrun_runs, "seconds": time.perf_counter() - t,
                        "load_average": load}, os.path.join(args.out, "lease.json"))
    header = (f"{data['date']}, {data['machine']}, {data['seconds']:.0f} s; load average "
              f"{min(load):.0f}-{max(load):.0f} on its 2 cores, other work included")
    write_text(os.path.join(args.out, "lease.md"), markdown(runs, cmd, header) + "\n" + torchrun_markdown(torchrun_runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
