"""Planners compared on the same sampled batches, through the simulator.

Every planner sees the same `steps` batches (`Workload.batches`); figures are averaged
over them. Speedup over TE CP is the ratio of mean step times, measured on the same
batches (TE CP is simulated as a reference even when not asked for). A planner that
cannot plan one of the batches (`InfeasiblePlan`) is a row with `feasible=False` and the
one-line reason; the others carry on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ballonet import workloads
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.planning import PLANNERS, plan_batch
from ballonet.simulation.simulator import SimResult, simulate
from ballonet.specs import ClusterSpec, ModelSpec

REFERENCE = "te_cp"


def planner_names() -> list[str]:
    return list(PLANNERS)


def parse_planners(text: str) -> list[str]:
    """"all" or a comma-separated list of known planner names."""
    known = planner_names()
    if text == "all":
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in known:
            raise InputError(f"unknown planner {n!r}; known: {', '.join(known)}")
    if not names:
        raise InputError("--planners is empty")
    return names


@dataclass(frozen=True, kw_only=True)
class Row:
    """One planner's figures, averaged over the batches; None when it is infeasible."""

    planner: str
    feasible: bool = True
    reason: str = ""
    """Why the planner could not plan a batch (the InfeasiblePlan message), if it could not."""
    step_time_s: float | None = None
    lower_bound_s: float | None = None
    speedup_vs_te_cp: float | None = None
    mfu: float | None = None
    attention_imbalance: float | None = None
    exposed_comm_share: float | None = None
    compute_share: float | None = None
    """Compute's share of the step, the mean over ranks; with `exposed_comm_share` and
    `idle_share` it makes the whole step."""
    idle_share: float | None = None
    first: SimResult | None = field(default=None, repr=False, compare=False)
    """The simulation of the first batch (for traces)."""

    @property
    def ratio_to_lower_bound(self) -> float | None:
        return self.step_time_s / self.lower_bound_s if self.feasible else None

    def to_dict(self) -> dict:
        return {"planner": self.planner, "feasible": self.feasible, **({"reason": self.reason} if self.reason else {}),
                "step_time_s": self.step_time_s, "lower_bound_s": self.lower_bound_s,
                "speedup_vs_te_cp": self.speedup_vs_te_cp, "mfu": self.mfu,
                "attention_imbalance": self.attention_imbalance, "exposed_comm_share": self.exposed_comm_share,
                "compute_share": self.compute_share, "idle_share": self.idle_share,
                "ratio_to_lower_bound": self.ratio_to_lower_bound}


def compare(cluster: ClusterSpec, model: ModelSpec, workload: str, tokens_per_gpu: int, planners: list[str], *,
            steps: int = 1, seed: int = 0, max_length: int | None = None, planner_options: dict | None = None,
            sim_options: dict | None = None, progress=None) -> list[Row]:
    """One Row per planner. `planner_options` and `sim_options` apply to "zeppelin" only
    (the ablations); `progress(advance)` is called after each simulation."""
    wl = workloads.get(workload)
    batches = list(wl.batches(tokens_per_gpu * cluster.num_ranks, seed, steps, max_length))
    names = planners + ([REFERENCE] if REFERENCE not in planners and REFERENCE in planner_names() else [])
    runs: dict[str, list[SimResult] | str] = {}  # the simulations, or why the planner is infeasible
    for name in names:
        popts = (planner_options or {}) if name == "zeppelin" else {}
        sopts = (sim_options or {}) if name == "zeppelin" else {}
        runs[name] = []
        for step, lengths in enumerate(batches):
            try:
                plan = plan_batch(lengths, cluster, model, name, **popts)
            except InfeasiblePlan as e:
                runs[name] = f"batch {step}: {e}" if steps > 1 else str(e)
                if progress:
                    progress(len(batches) - step)
                break
            runs[name].append(simulate(plan, cluster, model, **sopts))
            if progress:
                progress(1)
    ref = sum(r.step_time_s for r in runs[REFERENCE]) if isinstance(runs.get(REFERENCE), list) else None
    rows = []
    for name in planners:
        res = runs[name]
        if isinstance(res, str):
            rows.append(Row(planner=name, feasible=False, reason=res))
            continue
        step = sum(r.step_time_s for r in res)
        rows.append(Row(
            planner=name, step_time_s=step / steps, lower_bound_s=sum(r.lower_bound_s for r in res) / steps,
            speedup_vs_te_cp=ref / step if ref else None, mfu=sum(r.mfu for r in res) / steps,
            attention_imbalance=sum(r.attention_imbalance for r in res) / steps,
            exposed_comm_share=sum(r.exposed_comm_share for r in res) / steps,
            compute_share=sum(_mean_share(r, r.compute_s) for r in res) / steps,
            idle_share=sum(_mean_share(r, r.idle_s) for r in res) / steps, first=res[0]))
    return rows


def _mean_share(result: SimResult, per_rank: tuple[float, ...]) -> float:
    return sum(per_rank) / len(per_rank) / result.step_time_s


def num_simulations(planners: list[str], steps: int) -> int:
    return (len(planners) + (REFERENCE not in planners and REFERENCE in planner_names())) * steps
