"""When a run stops at a step boundary to be started again: a loan that ends or begins
(`--lease FILE`) and preemption (SIGTERM or SIGINT).

A cluster file may mark node groups `loaned` (inference nodes lent to training). The
lease FILE, written by whoever lends them, holds `reclaimed` (the lender wants them back)
or `lent` (absent: lent). The ranks a job runs on are what torch's rendezvous formed:
every group's GPUs, or, while reclaimed, the other groups' (`specs.job_cluster`). After
every step each rank reads the lease and notes any signal; one all-reduce makes the
answer the same on every rank, so all of them stop after the same step, save it (DCP,
resharded on load) and exit. Then the job starts again over the ranks the lease allows
(our launcher, `launch.py`, or torchrun's elastic agent: `docs/design.md`), resumes from
that save on the new world size, and trains the same global batches in the same order.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading

from ballonet.errors import InputError

LENT, RECLAIMED = "lent", "reclaimed"
PREEMPTED_EXIT = 75
"""The exit code of a job preempted after saving (EX_TEMPFAIL: try again), for a
scheduler to requeue on."""
LEASE_EXIT = 76
"""A rank's exit code under bare torchrun when the lease changes the job's members: its
agent restarts the workers (`--max-restarts`) over the nodes then in the rendezvous."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_MAX_BYTES = 64


def read_lease(path: str) -> str | None:
    """`lent` or `reclaimed` (an absent file: lent); None while the file is empty or holds
    the start of one of them (being written). Anything else, or a file that is not a
    regular file, is one line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return LENT
    except OSError as e:
        raise InputError(f"--lease {path}: cannot read it ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"--lease {path}: not a regular file")
        data = os.read(fd, _MAX_BYTES + 1)
    except OSError as e:
        raise InputError(f"--lease {path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > _MAX_BYTES:
        raise InputError(f"--lease {path}: over {_MAX_BYTES} bytes; it must say {LENT!r} or {RECLAIMED!r}")
    text = data.decode("utf-8", "replace").strip()
    if not text or (LENT.startswith(text) or RECLAIMED.startswith(text)) and text not in (LENT, RECLAIMED):
        return None  # being written
    if text not in (LENT, RECLAIMED):
        raise InputError(f"--lease {path}: holds {text[:32]!r}; it must say {LENT!r} or {RECLAIMED!r}")
    return text


def shared_store_problem(lease: str | None, agent_hosts_store: bool) -> str | None:
    """Under bare torchrun: `--lease` changes the rendezvous's members, which torch 2.13's
    store shared by the agents does not survive (a node keeps the master address and the
    restart count of the round it joined in: pytorch#135712); so it needs a store per
    round, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's environment."""
    if lease and agent_hosts_store:
        return (f"--lease {lease} under torchrun: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's torchrun "
                "environment (the nodes' rendezvous store, shared by default, does not survive members that leave "
                "and join: pytorch#135712)")
    return None


def members_state(cluster) -> str:
    """The lease state a job over `cluster` (`specs.job_cluster`'s answer) runs under: its
    loaned groups are members only while lent."""
    return LENT if cluster.has_loans else RECLAIMED


class Stopped(Exception):
    """Every rank stopped after step `step` and saved it (if it has a checkpoint folder)."""

    def __init__(self, reason: str, step: int, saved: str | None, leaves: bool = False):
        super().__init__(f"{reason} after step {step}")
        self.reason, self.step, self.saved, self.leaves = reason, step, saved, leaves

    @property
    def exit_code(self) -> int:
        """Under bare torchrun: a rank of a reclaimed group exits 0 (its agent finishes,
        its node goes back), the others 76 (their agents restart them over the nodes in the
        next rendezvous); a preempted rank 75."""
        if self.reason == "lease":
            return 0 if self.leaves else LEASE_EXIT
        return PREEMPTED_EXIT


def leave_rendezvous() -> None:
    """Under bare torchrun, on a rank of a reclaimed group that has saved and is leaving:
    take its node out of the rendezvous. An agent whose ranks all exit 0 waits in torchrun's
    exit barrier for agents that never come, still a member of the finished round (the
    training nodes' next round waits for it), and after 300 s shuts the rendezvous down for
    every node; an agent stopped by a signal leaves it open and its heartbeats stop (torch
    2.13's launcher/api.py: its way for a node to leave). So local rank 0 sends its agent
    SIGTERM while the agent still watches its ranks: it passes it on (the node's ranks have
    saved; one still saving notes it), waits for them, and exits."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_RANK") == "0":
        print("ballonet train: this node's group is reclaimed and its ranks have saved; its torchrun agent leaves the "
              "rendezvous (SIGTERM: torchrun reports it) and the other nodes go on", file=sys.stderr, flush=True)
        os.kill(os.getppid(), signal.SIGTERM)


class Signals:
    """While open: SIGTERM and SIGINT only note which came (`signal`); `close` puts the old
    handlers back. Opened as a rank starts, so a signal during the set-up waits for the
    first step boundary too."""

    def __init__(self):
        self.signal: int | None = None
        self._old: dict = {}
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._note)

    def _note(self, signum, frame) -> None:
        self.signal = signum

    def close(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}


class StepBoundary:
    """After each step: stop here? The same answer on every rank of `group` (an all-reduce
    of what each rank saw: a signal (`signals`, or `preempt_file`, the launcher's), a
    lease that reclaims loaned members, or, under our launcher (`preempt_file` given: it
    starts the loaned ranks itself), one that lends them while they are not members. Under
    bare torchrun the loaned nodes' agents joining the rendezvous are what brings them back
    (torchrun's scale-up: their agents stop the running ranks with SIGTERM, which the ranks
    turn into a save): a `lent` lease alone would stop the job over and over until they come."""

    def __init__(self, signals: Signals, lease: str | None, members: str, group, device,
                 preempt_file: str | None = None):
        self.signals, self.lease, self.members, self.group, self.device = signals, lease, members, group, device
        self.preempt_file = preempt_file

    def check(self) -> str | None:
        """Collective: "preempted", "lease" or None."""
        import torch
        import torch.distributed as dist

        state, error = None, None
        try:
            state = read_lease(self.lease) if self.lease else None
        except InputError as e:  # raised on every rank together, below
            error = e
        signalled = self.signals.signal is not None or bool(self.preempt_file and os.path.exists(self.preempt_file))
        grows = self.preempt_file is not None
        changed = state == RECLAIMED and self.members == LENT or grows and state == LENT and self.members == RECLAIMED
        seen = torch.tensor([signalled, changed, error is not None], dtype=torch.float32,
                            device=self.device)
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        preempted, lease, failed = seen.tolist()
        if failed:
            raise error or InputError(f"--lease {self.lease}: another rank could not read it")
        return "preempted" if preempted else "lease" if lease else None
