"""A day of loans, simulated: tokens trained over a schedule of hours in which a cluster's
loaned node groups are lent or reclaimed, against its own groups alone, each change of
members priced as `ballonet train --lease` runs it (`training/jobs/lease.py`).

A change waits for the step in flight (on average half a step: the lender's wait, not
lost to training), then the job saves (DCP: fp32 weights and AdamW's two states, 12 bytes
a parameter, written by every member at once), restarts (processes, rendezvous: an
assumption, `restart_s`), loads the save on its new members and plans its first batch
there. The global batch is the same on either membership, so the tokens of a step are
too; only the step time differs. Shards are assumed to move at the members' NIC line
rate (a parallel file system that keeps up): the cluster's bandwidth, as the issue asks.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ballonet import specs
from ballonet.errors import InputError
from ballonet.planning import plan_batch
from ballonet.simulation.simulator import simulate
from ballonet.specs import ClusterSpec, ModelSpec

RESTART_S = 60.0
"""Assumed seconds from the last rank's exit to the new members' first step, less the
load and the plan: processes and CUDA started, the rendezvous, NCCL's communicators, the
model built (CPU gloo ranks of the tiny model took 8-12 s on a loaded 2-core machine:
`bench/results/lease.md`)."""
CHECKPOINT_BYTES_PER_PARAM = 12


MAX_HOURS = 8784
"""The longest period a schedule may cover (a leap year): its tokens and prices stay finite."""
MAX_SPANS = 1000
"""The most lent spans a schedule may hold (each is a row of the report and two changes priced)."""


@dataclass(frozen=True, kw_only=True)
class LoanSchedule:
    """Hours of a period (`hours`, a day by default) in which the loaned groups are lent:
    [start, end) intervals; the rest of the period they are reclaimed."""

    lent: tuple[tuple[float, float], ...]
    hours: float = 24.0

    def __post_init__(self):
        if not (isinstance(self.hours, (int, float)) and 1 / 60 <= self.hours <= MAX_HOURS):
            raise InputError(f"loan schedule: hours must be a number from 1/60 (a minute) to {MAX_HOURS} (a year), "
                             f"got {self.hours!r}")
        if len(self.lent) > MAX_SPANS:
            raise InputError(f"loan schedule: {len(self.lent)} lent spans, at most {MAX_SPANS}")
        spans = sorted(tuple(s) for s in self.lent)
        for start, end in spans:
            if not 0 <= start < end <= self.hours:
                raise InputError(f"loan schedule: lent span [{start}, {end}) is not inside [0, {self.hours:g}) "
                                 f"hours, or is empty")
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                raise InputError(f"loan schedule: lent spans overlap at hour {start:g}")
        object.__setattr__(self, "lent", tuple(spans))

    def lent_hours(self) -> float:
        return sum(end - start for start, end in self.lent)

    def changes(self) -> list[tuple[float, str]]:
        """(hour, "lent" or "reclaimed") of every change of the period, the period repeating
        (a span that ends at the period's end and one that starts at 0 are one)."""
        out = []
        for start, end in self.lent:
            if not (start == 0 and any(e == self.hours for _, e in self.lent)):
                out.append((start, "lent"))
            if not (end == self.hours and any(s == 0 for s, _ in self.lent)):
                out.append((end, "reclaimed"))
        return sorted(out)


def read_schedule(path: str) -> LoanSchedule:
    """A TOML loan schedule: `lent = [[0, 8], [20, 24]]` (hours) and optionally `hours = 24`."""
    data = specs.load_toml(path, "loan schedule")
    unknown = sorted(set(data) - {"lent", "hours"})
    if unknown:
        raise InputError(f"{path}: unknown field {unknown[0]!r}; a loan schedule has lent (and hours)")
    lent = data.get("lent")
    if not isinstance(lent, list) or not all(isinstance(s, list) and len(s) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in s) for s in lent):
        raise InputError(f"{path}: lent must be a list of [start, end] hours, such as [[0, 8], [20, 24]]")
    hours = data.get("hours", 24.0)
    if isinstance(hours, bool) or not isinstance(hours, (int, float)):
        raise InputError(f"{path}: hours must be a number, got {hours!r}")
    try:
        return LoanSchedule(lent=tuple((float(a), float(b)) for a, b in lent), hours=float(hours))
    except InputError as e:
        raise InputError(f"{path}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Membership:
    """A job's figures on one set of members: its cluster, mean step time and plan time."""

    cluster: ClusterSpec
    step_s: float
    plan_s: float


@dataclass(frozen=True, kw_only=True)
class Transition:
    hour: float
    to: str
    step_in_flight_s: float
    save_s: float
    restart_s: float
    load_s: float
    plan_s: float

    @property
    def downtime_s(self) -> float:
        """Seconds without training: from the stop after the step in flight to the new members' first step."""
        return self.save_s + self.restart_s + self.load_s + self.plan_s

    @property
    def lender_wait_s(self) -> float:
        """From the lease's change to the loaned ranks gone (a reclaim): the step in flight and the save."""
        return self.step_in_flight_s + self.save_s


def nic_bandwidth(cluster: ClusterSpec) -> float:
    """Bytes/s all of a cluster's NICs move at once, one direction."""
    return sum(g.num_nodes * (g.gpus_per_node // g.gpus_per_nic) * g.nic_bw for g in cluster.groups)


def transition(hour: float, to: str, model: ModelSpec, before: Membership, after: Membership,
               restart_s: float = RESTART_S) -> Transition:
    size = CHECKPOINT_BYTES_PER_PARAM * model.num_params
    return Transition(hour=hour, to=to, step_in_flight_s=before.step_s / 2, save_s=size / nic_bandwidth(before.cluster),
                      restart_s=restart_s, load_s=size / nic_bandwidth(after.cluster), plan_s=after.plan_s)


@dataclass(frozen=True, kw_only=True)
class Day:
    schedule: LoanSchedule
    full: Membership
    own: Membership
    tokens_per_step: int
    transitions: tuple[Transition, ...]

    @property
    def tokens_with_loans(self) -> float:
        lent_s = self.schedule.lent_hours() * 3600 - sum(t.downtime_s for t in self.transitions if t.to == "lent")
        own_s = ((self.schedule.hours - self.schedule.lent_hours()) * 3600
                 - sum(t.downtime_s for t in self.transitions if t.to == "reclaimed"))
        return self.tokens_per_step * (max(lent_s, 0) / self.full.step_s + max(own_s, 0) / self.own.step_s)

    @property
    def tokens_alone(self) -> float:
        return self.tokens_per_step * self.schedule.hours * 3600 / self.own.step_s

    def to_dict(self) -> dict:
        return {"hours": self.schedule.hours, "lent": [list(s) for s in self.schedule.lent],
                "lent_hours": self.schedule.lent_hours(), "tokens_per_step": self.tokens_per_step,
                "full": {"gpus": self.full.cluster.num_ranks, "step_s": self.full.step_s, "plan_s": self.full.plan_s},
                "own": {"gpus": self.own.cluster.num_ranks, "step_s": self.own.step_s, "plan_s": self.own.plan_s},
                "transitions": [dict(vars(t), downtime_s=t.downtime_s, lender_wait_s=t.lender_wait_s)
                                for t in self.transitions],
                "tokens_with_loans": self.tokens_with_loans, "tokens_alone": self.tokens_alone,
                "gain": self.tokens_with_loans / self.tokens_alone - 1}


def day(schedule: LoanSchedule, model: ModelSpec, full: Membership, own: Membership, tokens_per_step: int,
        restart_s: float = RESTART_S) -> Day:
    """The period's tokens with the loans and the training groups alone (pure: the step
    times are given)."""
    changes = [transition(h, to, model, own if to == "lent" else full, full if to == "lent" else own, restart_s)
               for h, to in schedule.changes()]
    return Day(schedule=schedule, full=full, own=own, tokens_per_step=tokens_per_step, transitions=tuple(changes))


def membership(cluster: ClusterSpec, model: ModelSpec, batches: list, planner: str = "zeppelin",
               **options) -> Membership:
    """Mean simulated step time and planning time of `batches` (lists of document lengths)
    on `cluster`."""
    steps, plans = [], []
    for lengths in batches:
        start = time.perf_counter()
        plan = plan_batch(lengths, cluster, model, planner, **options)
        plans.append(time.perf_counter() - start)
        steps.append(simulate(plan, cluster, model).step_time_s)
    return Membership(cluster=cluster, step_s=statistics.mean(steps), plan_s=statistics.mean(plans))
