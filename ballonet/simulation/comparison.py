"""Planners compared on the same sampled batches, through the simulator.

Every planner sees the same `steps` batches (`Workload.batches`); figures are averaged
over them. Speedup over TE CP is the ratio of mean step times, measured on the same
batches (TE CP is simulated as a reference even when not asked for). A planner that
cannot plan one of the batches (`InfeasiblePlan`) is a row with `feasible=False` and the
one-line reason; the others carry on. WLB-LLM defers outlier documents to later steps
(its outlier delay): each of its batches is priced as the weighted steps that train the
batch's documents in the long run (`wlb_llm.outlier_steps`), so every row's step time
is the time to train one batch's tokens (docs/design.md, section 10). Where that delay
applies to wlb_llm's chosen run, zeppelin is also priced on the same delay steps
(`Row.step_in_wlb_order_s`): the training order `ballonet train --outlier-delay G` gives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ballonet import workloads
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.cost.bounds import batch_lower_bound
from ballonet.planning import PLANNERS, plan_batch
from ballonet.planning.wlb_llm import num_groups, outlier_steps
from ballonet.simulation.result import SimResult
from ballonet.simulation.simulator import simulate
from ballonet.specs import ClusterSpec, ModelSpec

REFERENCE = "te_cp"

TUNABLE = {"te_cp": "cp_size", "llama_cp": "cp_size", "wlb_llm": "cp_size", "magi": "cp_size",
           "hybrid_dp": "rank_tokens", "megatron_hcp": "rank_tokens"}
"""Baselines with a setting their users fix per job: a CP degree, or a rank's token budget
(Megatron-Core's `max_seqlen_per_dp_cp_rank`, ByteScale's per-rank capacity). With
`tune`, the comparison runs each at the fastest of its grid (`grid`: mean simulated step
over the same batches; in the grid's order, stopping after two in a row slower than the
best), as a user tuning the job would."""
MAX_DEGREE = 64
"""The largest CP degree tried (context-parallel groups beyond 64 GPUs are not used in practice)."""
MIN_BUDGET = 1024
"""The smallest per-rank token budget tried."""


def degrees(num_ranks: int) -> list[int]:
    """CP degrees tried when tuning: the powers of two that divide the ranks, up to `MAX_DEGREE`."""
    return [d for d in (1 << k for k in range(num_ranks.bit_length())) if num_ranks % d == 0 and d <= MAX_DEGREE]


def budgets(batches: list) -> list[int]:
    """Per-rank token budgets tried when tuning, largest first: the powers of two from the
    one that holds the batches' longest document whole (no document split: as CP degree 1)
    down to `MIN_BUDGET` (more documents split over more ranks, as higher degrees)."""
    top = max(1, max((max(b) for b in batches if len(b)), default=1) - 1).bit_length()
    return [1 << k for k in range(top, MIN_BUDGET.bit_length() - 2, -1)]


def grid(name: str, batches: list, num_ranks: int) -> list[int]:
    """The values of `TUNABLE[name]` tried, in the order a user would try them."""
    return degrees(num_ranks) if TUNABLE[name] == "cp_size" else budgets(batches)


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
    options: dict = field(default_factory=dict)
    """Planner options the row ran with (with `tune`, the degree found fastest)."""
    plan_seconds: float | None = None
    """Mean CPU seconds of planning one batch (at the chosen options)."""
    compute_share: float | None = None
    """Compute's share of the step, the mean over ranks; with `exposed_comm_share` and
    `idle_share` it makes the whole step."""
    idle_share: float | None = None
    step_in_wlb_order_s: float | None = None
    """Zeppelin's only: its step on wlb_llm's outlier-delay steps (the same G, filler,
    weights and token scaling as wlb_llm's row), where wlb_llm is compared and its chosen
    run delays outliers; None elsewhere, or where zeppelin cannot plan those steps."""
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
                "ratio_to_lower_bound": self.ratio_to_lower_bound, "options": self.options,
                "plan_seconds": self.plan_seconds, "step_in_wlb_order_s": self.step_in_wlb_order_s}


def _run(name: str, batches: list, cluster: ClusterSpec, model: ModelSpec, popts: dict, sopts: dict,
         progress, plan_seconds: list | None = None, filler=None, groups: int | None = None
         ) -> list[SimResult] | str:
    """Simulations of every batch, or why the planner cannot plan one of them; the CPU
    seconds of each plan go to `plan_seconds`. With `filler` (step -> more documents of
    the workload), each batch is trained in the steps of the outlier delay with `groups`
    CP groups (`wlb_llm.outlier_steps`), priced as their weighted sum; `groups` defaults
    to wlb_llm's own at its `cp_size`, 1 (no delay) for other planners."""
    out = []
    if not filler:
        groups = 1
    elif groups is None:
        groups = num_groups(cluster, model, popts.get("cp_size")) if name == "wlb_llm" else 1
    for step, lengths in enumerate(batches):
        steps = outlier_steps(lengths, groups, filler(step)) if groups > 1 else [(1.0, lengths)]
        results, seconds = [], 0.0
        for weight, docs in steps:
            t = time.process_time()
            try:
                plan = plan_batch(docs, cluster, model, name, **popts)
            except InfeasiblePlan as e:
                if progress:
                    progress(len(batches) - step)
                return f"batch {step}: {e}" if len(batches) > 1 else str(e)
            seconds += weight * (time.process_time() - t)
            results.append(simulate(plan, cluster, model, **sopts))
        if plan_seconds is not None:
            plan_seconds.append(seconds)
        if len(steps) == 1:
            out.append(results[0])
        else:  # scaled to the batch's tokens: time per token trained, times the batch's tokens
            scale = sum(lengths) / sum(w * sum(docs) for w, docs in steps)
            out.append(SimResult.weighted(results, [w * scale for w, _ in steps], num_tokens=sum(lengths),
                                          lower_bound_s=batch_lower_bound(lengths, cluster, model)))
        if progress:
            progress(1)
    return out


def _tuned(name: str, batches: list, cluster: ClusterSpec, model: ModelSpec, sopts: dict,
           progress, plan_seconds: list, filler=None) -> tuple[list[SimResult] | str, dict]:
    """The planner at the values of its `grid`, in order, until two in a row are slower
    than the best so far (a user's search): the fastest feasible by mean step, with its
    options."""
    best, best_opts, reason, worse = None, {}, "", 0
    for d in grid(name, batches, cluster.num_ranks // model.tp):
        opts = {TUNABLE[name]: d}
        seconds: list = []
        res = _run(name, batches, cluster, model, opts, sopts, None, seconds, filler)
        if isinstance(res, str):
            reason = reason or res
            continue
        if best is None or sum(r.step_time_s for r in res) < sum(r.step_time_s for r in best):
            best, best_opts, worse = res, opts, 0
            plan_seconds[:] = seconds
        else:
            worse += 1
            if worse == 2:
                break
    if progress:
        progress(len(batches))
    return (best, best_opts) if best is not None else (reason or f"{name}: no {TUNABLE[name]} plans the batches", {})


def compare(cluster: ClusterSpec, model: ModelSpec, workload: str, tokens_per_gpu: int, planners: list[str], *,
            steps: int = 1, seed: int = 0, max_length: int | None = None, planner_options: dict | None = None,
            sim_options: dict | None = None, tune: bool = False, progress=None) -> list[Row]:
    """One Row per planner. `planner_options` apply to "zeppelin" only (its ablations),
    `sim_options` (`simulate`'s keywords) to every planner alike; with `tune`, the
    baselines of `TUNABLE` run at their fastest setting; `progress(advance)` is called
    after each planner's batches."""
    wl = workloads.get(workload)
    batches = list(wl.batches(tokens_per_gpu * cluster.num_ranks, seed, steps, max_length))
    names = planners + ([REFERENCE] if REFERENCE not in planners and REFERENCE in planner_names() else [])
    total = tokens_per_gpu * cluster.num_ranks

    def filler(step: int):
        """More documents of the workload, for the normal steps of WLB-LLM's outlier delay."""
        return (L for k in range(1, 5) for L in wl.sample_batch(total, (seed, step, k), max_length))

    runs: dict[str, list[SimResult] | str] = {}  # the simulations, or why the planner is infeasible
    chosen: dict[str, dict] = {}
    timing: dict[str, list] = {}
    for name in names:
        sopts = sim_options or {}
        timing[name] = []
        if tune and name in TUNABLE:
            runs[name], chosen[name] = _tuned(name, batches, cluster, model, sopts, progress, timing[name], filler)
        else:
            popts = (planner_options or {}) if name == "zeppelin" else {}
            runs[name] = _run(name, batches, cluster, model, popts, sopts, progress, timing[name], filler)
    in_order = _in_wlb_order(runs, chosen, batches, cluster, model, planner_options or {}, sim_options or {}, filler)
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
            exposed_comm_share=sum(r.exposed_comm_share for r in res) / steps, options=chosen.get(name, {}),
            plan_seconds=sum(timing[name]) / len(timing[name]) if timing[name] else None,
            compute_share=sum(_mean_share(r, r.compute_s) for r in res) / steps,
            idle_share=sum(_mean_share(r, r.idle_s) for r in res) / steps, first=res[0],
            step_in_wlb_order_s=in_order if name == "zeppelin" else None))
    return rows


def _in_wlb_order(runs: dict, chosen: dict, batches: list, cluster: ClusterSpec, model: ModelSpec, popts: dict,
                  sopts: dict, filler) -> float | None:
    """Zeppelin's mean step on the steps of wlb_llm's outlier delay at wlb_llm's chosen CP
    degree, priced as `_run` prices wlb_llm's; None where either is infeasible, that degree
    makes one group, no batch has outliers, or zeppelin cannot plan those steps."""
    if not isinstance(runs.get("wlb_llm"), list) or not isinstance(runs.get("zeppelin"), list):
        return None
    groups = num_groups(cluster, model, chosen.get("wlb_llm", {}).get("cp_size"))
    if groups < 2 or all(len(outlier_steps(b, groups, ())) == 1 for b in batches):
        return None
    res = _run("zeppelin", batches, cluster, model, popts, sopts, None, None, filler, groups)
    return None if isinstance(res, str) else sum(r.step_time_s for r in res) / len(batches)


def _mean_share(result: SimResult, per_rank: tuple[float, ...]) -> float:
    return sum(per_rank) / len(per_rank) / result.step_time_s


def num_simulations(planners: list[str], steps: int) -> int:
    return (len(planners) + (REFERENCE not in planners and REFERENCE in planner_names())) * steps
