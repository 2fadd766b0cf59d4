"""Loans and preemption: a job whose loaned node group is reclaimed goes on over the other
group and takes it back when lent again; a job preempted by a signal saves the step it was
on and exits for a requeue; in every case the steps are those of one process on the same
global batches (losses within 1e-4, the same documents in the same order)."""

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from distributed import run_ranks
from launching import free_port, lent_cluster_toml
from training_reference import BASE, ledger_reference, reference_run

from ballonet.training.jobs.lease import (LEASE_EXIT, PREEMPTED_EXIT, Signals, StepBoundary, Stopped, read_lease,
                                          shared_store_problem)
from ballonet.training.loop import TrainConfig, train

TWO_GROUPS = lent_cluster_toml("lent-two", lent_nodes=1, lent_gpus_per_node=2)
"""Two GPU types (emulated on CPU ranks: the plans give the H800 ranks more work)."""


def _log(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _when(log, condition, action, timeout=240.0):
    """In the background: once the JSON log's records satisfy `condition`, run
    `action()` and note the last step logged then."""
    seen = {}

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = _log(log)
            if condition(records):
                seen["step"] = records[-1]["step"]
                action()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, seen


def _train(*args, cwd):
    """`ballonet train ARGS` as a user runs it (the installed command), from `cwd`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = os.path.join(os.path.dirname(sys.executable), "ballonet")
    return subprocess.Popen([command, "train", *args], env=env, text=True, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.slow
def test_a_reclaimed_group_leaves_and_comes_back_and_a_preempted_job_resumes_exactly(tmp_path):
    cluster, lease, log = tmp_path / "two.toml", tmp_path / "lease", tmp_path / "log.jsonl"
    cluster.write_text(TWO_GROUPS)
    fake = tmp_path / "ballonet"  # the ranks start as `python -P`: a folder of the working directory is not imported
    fake.mkdir()
    (fake / "__init__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    (fake / "__main__.py").write_text("raise SystemExit(3)\n")
    steps = 12
    args = ["--cluster", str(cluster), "--lease", str(lease), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--steps", str(steps), "--json-log", str(log), "--global-tokens", str(BASE["global_tokens"]),
            "--max-doc-tokens", str(BASE["max_doc_tokens"]), "--seed", str(BASE["seed"]), "--log-every", "100"]

    # 4 ranks; reclaimed after step 2; then SIGTERM to the launcher (what a scheduler sends) on 2 ranks
    job = _train(*args, cwd=tmp_path)
    reclaim, reclaimed = _when(log, lambda rs: len(rs) >= 2, lambda: lease.write_text("reclaimed\n"))
    preempt, preempted = _when(log, lambda rs: rs and rs[-1]["world_size"] == 2, lambda: job.send_signal(signal.SIGTERM))
    out, err = job.communicate(timeout=300)  # a hang guard: about 20 s alone on a loaded 2-core machine
    reclaim.join(), preempt.join()
    assert job.returncode == PREEMPTED_EXIT, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    stopped_at = _log(log)[-1]["step"]
    assert last.startswith(f"ballonet train: preempted by SIGTERM after step {stopped_at}: saved it in"), last
    assert stopped_at <= preempted["step"] + 2 < steps

    # requeued: --resume on 2 ranks (still reclaimed), lent again after one more step: 4 ranks to the end
    job = _train(*args, "--resume", cwd=tmp_path)
    lend, lent = _when(log, lambda rs: rs[-1]["step"] > stopped_at, lambda: lease.write_text("lent\n"))
    out, err = job.communicate(timeout=300)
    lend.join()
    assert job.returncode == 0, err[-3000:]

    assert not (tmp_path / "imported").exists()
    records = _log(log)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    sizes = [r["world_size"] for r in records]
    first_two, back = sizes.index(2) + 1, len(sizes) - sizes[::-1].index(2) + 1  # steps, 1-based
    assert sizes == [4] * (first_two - 1) + [2] * (back - first_two) + [4] * (steps - back + 1), sizes
    assert first_two <= reclaimed["step"] + 3  # the loaned ranks left within two steps of the lease saying so
    assert back <= lent["step"] + 3 and back <= steps  # and came back within two steps of `lent`
    assert [r["ledger"] for r in records] == ledger_reference(steps, **BASE)  # nothing lost, nothing twice
    reference = reference_run(steps, **BASE)[0]
    losses = [r["loss"] for r in records]
    assert all(abs(x - y) <= 1e-4 * y for x, y in zip(losses, reference, strict=True)), (losses, reference)


def _preempt_a_rank(rank, world_size, tmp):
    """Rank 1 gets SIGTERM once step 2 is logged; every rank stops after the same step and
    saves it; then a resumed run finishes the job."""
    log = os.path.join(tmp, "log.jsonl")
    config = dict(BASE, steps=6, checkpoint_dir=os.path.join(tmp, "ckpt"), json_log=log)
    if rank == 1:
        _when(log, lambda rs: len(rs) >= 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        train(TrainConfig(**config))
        stopped = None
    except Stopped as e:
        stopped = (e.reason, e.step, e.exit_code)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run's handler is gone
    rest = train(TrainConfig(**config, resume=True))
    # a lease only rank 1 cannot read fails both ranks at the same boundary, not rank 1 alone
    lease = os.path.join(tmp, f"lease{rank}")
    with open(lease, "w") as f:
        f.write("lent" if rank == 0 else "borrowed")
    signals = Signals()
    try:
        StepBoundary(signals, lease, "lent", torch.distributed.group.WORLD, torch.device("cpu")).check()
        failed = None
    except ValueError as e:
        failed = str(e)
    # `lent` while reclaimed stops the ranks under our launcher (it starts the loaned ranks), not
    # under bare torchrun (the loaned nodes' agents joining do); `reclaimed` while lent stops both
    lent, reclaimed = os.path.join(tmp, f"lent{rank}"), os.path.join(tmp, f"reclaimed{rank}")
    for path, text in ((lent, "lent"), (reclaimed, "reclaimed")):
        with open(path, "w") as f:
            f.write(text)
    launcher = os.path.join(tmp, "no-preempt-file")
    answers = [StepBoundary(signals, path, members, torch.distributed.group.WORLD, torch.device("cpu"), p).check()
               for path, members, p in ((lent, "reclaimed", None), (lent, "reclaimed", launcher),
                                        (reclaimed, "lent", None), (reclaimed, "lent", launcher),
                                        (reclaimed, "reclaimed", launcher))]
    signals.close()
    return stopped, [r["step"] for r in rest], failed, answers


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_and_resume_is_exact(tmp_path):
    results = run_ranks(2, _preempt_a_rank, str(tmp_path))
    (reason, step, code), rest, failed, _ = results[0]
    assert results[1][:2] == results[0][:2] and reason == "preempted" and code == PREEMPTED_EXIT
    assert failed == "--lease: another rank could not read it".replace("--lease", f"--lease {tmp_path}/lease0")
    assert results[1][2].endswith("lease1: holds 'borrowed'; it must say 'lent' or 'reclaimed'")
    assert results[0][3] == results[1][3] == [None, "lease", "lease", "lease", None]
    assert 2 <= step <= 4 and rest == list(range(step + 1, 7))
    records = _log(tmp_path / "log.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7)) and {r["world_size"] for r in records} == {2}
    assert [r["ledger"] for r in records] == ledger_reference(6, **BASE)
    reference = reference_run(6, **BASE)[0]
    assert all(abs(r["loss"] - y) <= 1e-4 * y for r, y in zip(records, reference, strict=True))


def test_a_lease_needs_a_loaned_group(tmp_path):
    with pytest.raises(ValueError, match="cluster 'cpu' has no node group with loaned = true"):
        train(TrainConfig(**BASE, steps=1, lease=str(tmp_path / "lease"), checkpoint_dir=str(tmp_path / "ck")))


def test_the_lease_file_is_read_strictly(tmp_path):
    path = tmp_path / "lease"
    assert read_lease(str(path)) == "lent"  # no file: lent
    for text, state in (("reclaimed\n", "reclaimed"), (" lent ", "lent"), ("", None), ("recl", None)):
        path.write_text(text)
        assert read_lease(str(path)) == state
    path.write_text("maybe")
    with pytest.raises(ValueError, match="must say 'lent' or 'reclaimed'"):
        read_lease(str(path))
    os.remove(path)
    os.mkfifo(path)  # never opened for a blocking read
    with pytest.raises(ValueError, match="not a regular file"):
        read_lease(str(path))
    assert LEASE_EXIT != PREEMPTED_EXIT
    assert shared_store_problem(None, True) is None and shared_store_problem("lease", False) is None
    assert shared_store_problem("lease", True) == (
        "--lease lease under torchrun: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's torchrun environment "
        "(the nodes' rendezvous store, shared by default, does not survive members that leave and join: pytorch#135712)")


def _children(agent) -> list[int]:
    """The running ranks a torchrun agent started (its children)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent.pid and fields[0] != "Z":
            out.append(int(pid))
    return out


def _until(condition, what, timeout=240.0):
    deadline = time.monotonic() + timeout  # a hang guard, not a speed claim
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.02)


@pytest.mark.slow
def test_bare_torchrun_nodes_in_any_order_lend_and_reclaim_a_node_group(tmp_path):
    """The multi-node deployment of docs/design.md on one machine: one torchrun agent per
    node (`--nnodes 1:2`, c10d rendezvous), the training node's and the loaned node's, each
    told its group (BALLONET_NODE_GROUP); the rendezvous numbers the loaned node first (its
    address sorts first), and the ranks renumber themselves in the file's group order.
    `reclaimed`: the loaned node's ranks leave within two steps, its agent leaves the
    rendezvous, the training node goes on; `lent` and a new agent there: they train together
    again."""
    cluster, lease, log = tmp_path / "two.toml", tmp_path / "lease", tmp_path / "log.jsonl"
    cluster.write_text(TWO_GROUPS)
    max_steps = 1000  # never reached: the job is preempted once both nodes train again
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")

    def agent(group: int, address: str):
        command = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lent", "--local-addr", address,
                   "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3",
                   "--max-restarts", "2", "--monitor-interval", "0.2",
                   "-m", "ballonet", "train", "--cluster", str(cluster), "--lease", str(lease),
                   "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", "--steps", str(max_steps),
                   "--json-log", str(log), "--log-every", "1000", *[f"--{k.replace('_', '-')}={v}" for k, v in BASE.items()]]
        # torch 2.13 keeps the first round's master address on a node that is no longer rank 0
        # (pytorch#135712); a store per round avoids it, as docs/design.md says
        env = dict(os.environ, OMP_NUM_THREADS="1", BALLONET_NODE_GROUP=str(group), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"agent{group}", "a"),
                                cwd=tmp_path)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    training = agent(0, "127.0.0.2")  # hosts the rendezvous (a training node must: the store lives in its agent)
    loaned = None
    try:
        _until(listening, "the training agent's rendezvous")
        loaned = agent(1, "127.0.0.1")  # sorts first: the rendezvous makes it node 0
        _until(lambda: [r["world_size"] for r in _log(log)][-2:] == [4, 4], "two steps on both nodes")
        lease.write_text("reclaimed\n")
        reclaimed = _log(log)[-1]["step"]
        _until(lambda: not _children(loaned), "the loaned ranks to leave")
        left = _log(log)[-1]["step"]
        loaned.wait(timeout=60)  # its agent leaves the rendezvous by itself (its ranks signal it)
        _until(lambda: [r["world_size"] for r in _log(log)][-2:] == [2, 2], "two steps on the training node")
        assert training.poll() is None
        lease.write_text("lent\n")
        loaned = agent(1, "127.0.0.1")
        _until(lambda: [r["world_size"] for r in _log(log)][-2:] == [4, 4], "two steps on both nodes again")
        for p in (training, loaned):  # the scheduler preempts the job: every rank saves the step it is on
            p.send_signal(signal.SIGTERM)
        for p in (training, loaned):
            p.wait(timeout=240)
    finally:
        for p in (training, loaned):
            if p is not None and p.poll() is None:
                p.kill()

    records = _log(log)
    steps = len(records)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert f"ballonet train: stopped (signalled: preempted, or torchrun's agent restarting for nodes the lease lends) after step {steps}, saved in" in (tmp_path / "agent0").read_text()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{steps:08d}"
    sizes = [r["world_size"] for r in records]
    runs = [(size, len(list(same))) for size, same in itertools.groupby(sizes)]
    # 4, 2, 4 ranks (and 2 first where the loaned agent came after the first round's last call: it joins by scale-up)
    assert [size for size, _ in runs] in ([4, 2, 4], [2, 4, 2, 4]), runs
    stopped = sum(n for _, n in runs[:-2])  # the last step on 4 ranks before the loan ended
    assert stopped == left <= reclaimed + 2  # the loaned ranks left after a step within two of `reclaimed`
    assert "ranks renumbered" in (tmp_path / "agent0").read_text()  # the training node was rendezvous node 1
    assert [r["ledger"] for r in records] == ledger_reference(steps, **BASE)
    reference = reference_run(steps, **BASE)[0]
    losses = [r["loss"] for r in records]
    assert all(abs(x - y) <= 1e-4 * y for x, y in zip(losses, reference, strict=True)), (losses, reference)
