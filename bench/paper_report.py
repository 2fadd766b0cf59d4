"""The report of `bench/paper.py`: targets, tables and paper.md, from paper.json's data.

    python bench/paper_report.py [bench/results/paper.json]   # rewrite paper.md from the data
"""

from __future__ import annotations

import json
import os
import statistics
import sys

PLANNERS = ["zeppelin", "te_cp", "llama_cp", "hybrid_dp", "wlb_llm", "megatron_hcp", "distca", "magi", "packed_dp",
            "flops_dp"]
CLUSTERS = {"A": "a800-4nic", "B": "h800-8nic", "C": "h200-8nic"}
WORKLOADS = ["wlbllm", "prolong", "shortmix"]
BOUND_TARGET = 1.15
"""The issue's target: zeppelin's step within this of the batch lower bound."""
LEAD_TARGET = 1.2
"""The issue's target: mean (best baseline's step / zeppelin's) over a grid."""
SHORT = 4096
"""A document is short below this many tokens (for the short-share trend)."""
MEMORY_HEADROOM = 1.3
"""The counterfactual of `paper.more_memory`: every GPU with this much more memory."""


def speedup(cfg: dict, planner: str = "zeppelin", over: str = "te_cp") -> float:
    """NaN when either planner is infeasible on the configuration."""
    r = cfg["results"]
    if r[over].get("feasible") is False or r[planner].get("feasible") is False:
        return float("nan")
    return r[over]["step_time_s"] / r[planner]["step_time_s"]


def best_baseline(cfg: dict) -> str:
    """The fastest baseline of a configuration (te_cp_whole, the stress case, left out)."""
    r = cfg["results"]
    return min((p for p in PLANNERS if p != "zeppelin" and p in r and r[p].get("feasible", True)),
               key=lambda p: r[p]["step_time_s"])


def over_best(cfg: dict) -> float:
    return speedup(cfg, over=best_baseline(cfg))


def in_wlb_order(cfg: dict) -> float | None:
    """Zeppelin's step in wlb_llm's training order (its outlier delay's steps, planned by
    zeppelin: `Row.step_in_wlb_order_s`) over wlb_llm's step; None where not applicable."""
    r = cfg["results"]
    z = r.get("zeppelin", {}).get("step_in_wlb_order_s")
    if z is None or r.get("wlb_llm", {}).get("feasible", True) is False:
        return None
    return z / r["wlb_llm"]["step_time_s"]


def at_or_below_in_order(cfg: dict) -> bool:
    """Zeppelin at or below every baseline, counting it at or below wlb_llm also where its
    step in wlb_llm's training order is (`in_wlb_order`), every other baseline as given."""
    r = cfg["results"]
    z, order = r["zeppelin"]["step_time_s"], in_wlb_order(cfg)
    return all(z <= r[p]["step_time_s"] or (p == "wlb_llm" and order is not None and order <= 1)
               for p in PLANNERS if p != "zeppelin" and p in r and r[p].get("feasible", True))


def _in_order_count(g: list[dict]) -> str:
    """The at-or-below count with zeppelin in wlb_llm's order against wlb_llm, where any
    configuration of `g` has that figure."""
    if all(in_wlb_order(c) is None for c in g):
        return ""
    return (f"; {sum(at_or_below_in_order(c) for c in g)} with zeppelin in wlb_llm's training order against "
            "wlb_llm (`ballonet train --outlier-delay G`)")


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def _name(c: dict) -> str:
    return (f"{c['cluster']} {c['gpus']} GPUs {c['model']} {os.path.basename(c['workload'])} "
            f"{c['max_length'] // 1024}K")


def _grid_targets(g: list[dict], label: str, why_bound: str = "") -> list[tuple[str, bool, str, str]]:
    """At or below every baseline, the mean lead over the best, and the bound target on grid `g`."""
    out = []
    best = [over_best(c) for c in g]
    losses = [c for c in g if over_best(c) < 1]
    in_order = _in_order_count(g)
    out.append((f"zeppelin at or below every baseline's step (each at its tuned degree) on every configuration of "
                f"the {label}", not losses,
                f"mean {_mean(best):.3f}x over the best baseline (min {min(best):.3f}x, max {max(best):.3f}x); "
                f"zeppelin loses in {len(losses)} of {len(g)} configurations; at or below every baseline in "
                f"{len(g) - len(losses)}" + (" as given" + in_order if in_order else ""),
                "; ".join(f"{_name(c)} {over_best(c):.3f}x vs {best_baseline(c)} ({_breakdown(c)})"
                          for c in sorted(losses, key=over_best)[:8]) + (" ..." if len(losses) > 8 else "")
                + (_wlb_delay(losses) if any(best_baseline(c) == "wlb_llm" for c in losses) else "")))
    out.append((f"mean over the {label} of (best baseline's step / zeppelin's step) at least {LEAD_TARGET}x",
                _mean(best) >= LEAD_TARGET, f"{_mean(best):.3f}x",
                f"short by {LEAD_TARGET / _mean(best):.3f}x: the lead is smallest on " + "; ".join(
                    f"{_name(c)} {over_best(c):.3f}x vs {best_baseline(c)}" for c in sorted(g, key=over_best)[:4])))
    bound = [c["results"]["zeppelin"]["ratio_to_lower_bound"] for c in g]
    far = sorted((c for c in g if c["results"]["zeppelin"]["ratio_to_lower_bound"] > BOUND_TARGET),
                 key=lambda c: -c["results"]["zeppelin"]["ratio_to_lower_bound"])
    out.append((f"zeppelin's step within {BOUND_TARGET}x of the batch lower bound on every configuration of the "
                f"{label}", not far,
                f"{len(g) - len(far)} of {len(g)} within; worst {max(bound):.3f}x, median "
                f"{statistics.median(bound):.3f}x",
                "over: " + "; ".join(f"{_name(c)} {c['results']['zeppelin']['ratio_to_lower_bound']:.3f}x "
                                     f"({_breakdown(c)}{_traced(c)})" for c in far) + ". " + why_bound))
    return out


def _wlb_delay(losses: list[dict]) -> str:
    """Why zeppelin loses to wlb_llm where it does, and which of `losses` the same training
    order wins (docs/design.md, section 10)."""
    text = (". wlb_llm's row is the steps of its outlier delay, which train the batch's documents in other steps "
            "than the batch (its attention imbalance summed over them, not a step's)")
    lost = [c for c in losses if in_wlb_order(c) is not None
            and c["results"]["zeppelin"]["step_time_s"] > c["results"]["wlb_llm"]["step_time_s"]]
    if not lost:
        return text
    need = [c for c in lost if at_or_below_in_order(c)]
    return (text + "; zeppelin planning those same steps (the order `ballonet train --outlier-delay G` trains in), "
            "its step over wlb_llm's: " + ", ".join(f"{_name(c)} {in_wlb_order(c):.3f}" for c in lost)
            + f". In that order against wlb_llm, zeppelin is at or below every baseline on {len(need)} of these "
            f"{len(losses)}" + (" (the configurations that need it: " + ", ".join(_name(c) for c in need) + ")"
                                 if need else ""))



def _breakdown(c: dict) -> str:
    """Zeppelin's exposed-communication share and attention imbalance against the best baseline's."""
    z, b = c["results"]["zeppelin"], c["results"][best_baseline(c)]
    return (f"zeppelin exposed communication {z['exposed_comm_share']:.0%} of the step, attention imbalance "
            f"{z['attention_imbalance']:.2f}; {best_baseline(c)} {b['exposed_comm_share']:.0%}, "
            f"{b['attention_imbalance']:.2f}")


def _traced(c: dict) -> str:
    """Where the configuration's trace is and what it shows (`paper_traces.over_bound`)."""
    t = c.get("over_bound")
    if not t:
        return ""
    return (f"; first batch: busiest rank's compute {t['compute_max_s']:.2f} s, mean {t['compute_mean_s']:.2f} s, "
            f"exposed communication {t['exposed_mean_s']:.2f} s and idle {t['idle_mean_s']:.2f} s on the mean rank, "
            f"recomputation {t['recompute']} (the bound: {t['batch_recompute']}), trace `{t['trace']}`")


def _why_bound(data: dict) -> str:
    w = data["worst"]
    return (f"The worst main-grid configuration (trace: `{w['trace']}`): step {w['step_time_s']:.2f} s, bound "
            f"{w['lower_bound_s']:.2f} s; busiest rank's compute {w['compute_max_s']:.2f} s (mean "
            f"{w['compute_mean_s']:.2f} s), exposed communication {w['exposed_mean_s']:.2f} s and idle "
            f"{w['idle_mean_s']:.2f} s on the mean rank; recomputation {w['recompute']} where the bound assumes "
            f"{w['batch_recompute']}. The bound counts every FLOP at its best efficiency on all GPUs at once and, "
            "of communication, only every token's tensor-parallel collectives, the last gradient bucket and the "
            "compute every rank's FSDP collectives slow beside its layers (`cost.bounds.overlap_bound`): the "
            "step adds the recomputation the plan's memory needs, kernels on blocks shorter than whole documents, "
            "ranks waiting on a ring's slowest member or on a partial dK/dV sum (the runtime's order, "
            "docs/design.md section 7), and the transfers compute does not hide. " + _why_full(data)
            + _why_memory(data))


def targets(data: dict) -> list[tuple[str, bool, str, str]]:
    """(target, met, figures, reason where not met) for each claim."""
    g, out = data["grid"], []
    mean = _mean(speedup(c) for c in g)
    whole = [speedup(c, over="te_cp_whole") for c in g]
    out.append(("mean speedup of zeppelin over te_cp in [2.2, 3.4] (paper 2.80x)", 2.2 <= mean <= 3.4,
                f"{mean:.2f}x over {len(g)} configurations (min {min(speedup(c) for c in g):.2f}x, max "
                f"{max(speedup(c) for c in g):.2f}x) against TE CP at its fastest degree; "
                f"{_mean(whole):.2f}x against CP over all {g[0]['gpus']} GPUs (stress case)",
                "TE CP at a degree that fits the context keeps most rings inside a node, so it is not "
                "communication-bound; only CP over the whole cluster (every rank's K/V through a NIC at every step) "
                f"comes near the paper's gains ({_mean(whole):.2f}x). The paper's TE CP degree is not known."))
    out += _grid_targets(g, "main grid", _why_bound(data))
    if data.get("scale"):
        out += _grid_targets(data["scale"], "scale grid")
    if data.get("mixed"):
        m = data["mixed"]
        far = [c for c in m if c["results"]["zeppelin"]["ratio_to_lower_bound"] > BOUND_TARGET]
        out.append((f"zeppelin within {BOUND_TARGET}x of the bound on the mixed-GPU presets", not far,
                    ", ".join(f"{_name(c)} {c['results']['zeppelin']['ratio_to_lower_bound']:.3f}x" for c in m),
                    "the bound spreads work over the GPUs by their speed for each kind of work at once; "
                    + "; ".join(f"{_name(c)}: {_breakdown(c)}{_traced(c)}" for c in far)))
    by_cluster = {cl: _mean(speedup(c) for c in g if c["cluster"] == cl) for cl in CLUSTERS}
    te_by_cluster = {cl: _mean(c["results"]["te_cp"]["exposed_comm_share"] for c in g if c["cluster"] == cl)
                     for cl in CLUSTERS}
    out.append(("larger on cluster A than on B", by_cluster["A"] > by_cluster["B"],
                ", ".join(f"{k} {v:.2f}x" for k, v in by_cluster.items()),
                "te_cp's exposed communication share is " + ", ".join(
                    f"{k} {v:.0%}" for k, v in te_by_cluster.items()) + ": the A800 has 3.2x less compute "
                "than the H800 while its NICs are only 2x slower, so te_cp is no more communication-bound on A."))
    stats = data["length_stats"]
    by_wl = sorted(((stats[w]["short_share"], _mean(speedup(c) for c in g if c["workload"] == w), w)
                    for w in WORKLOADS))
    grows = all(a[1] < b[1] for a, b in zip(by_wl, by_wl[1:]))
    by_len = sorted((stats[w]["weighted_length"], x, w) for _, x, w in by_wl)
    follows = all(a[1] > b[1] for a, b in zip(by_len, by_len[1:]))
    out.append((f"speedup grows with the share of tokens in documents under {SHORT} tokens", grows,
                ", ".join(f"{w} ({s:.0%} short) {x:.2f}x" for s, x, w in by_wl),
                f"the speedup {'falls' if follows else 'does not fall either'} as the token-weighted mean "
                "document length rises (sum L^2 / sum L: " + ", ".join(f"{w} {n:.0f}" for n, _, w in by_len) +
                "), i.e. with attention work per token; the short-token share orders the workloads differently "
                "because shortmix's few documents around 12K tokens hold most of its tokens."))
    sc = data["scaling"]
    first, last = sc[0]["results"], sc[-1]["results"]
    growth = {p: last[p]["tokens_per_s"] / first[p]["tokens_per_s"] for p in first}
    flat = 0.67 <= growth["te_cp_whole"] <= 1.5
    best = max(growth, key=growth.get)
    out.append((f"TE CP over the whole cluster nearly flat in throughput from {sc[0]['gpus']} to {sc[-1]['gpus']} "
                "GPUs (within 0.67x-1.5x) while zeppelin scales best", flat and best == "zeppelin",
                ", ".join(f"{p} {v:.2f}x" for p, v in sorted(growth.items(), key=lambda kv: -kv[1])),
                f"best scaling: {best}" + ("" if flat else "; te_cp_whole is not flat")))
    ab = data["ablation"]["speedup"]
    ladder = list(ab.values())
    ordered = all(a <= b for a, b in zip(ladder, ladder[1:]))
    near = abs(ab["routing"] / 1.6 - 1) <= 0.3
    out.append(("ablation: routing alone ~1.6x (within 30%), then engine + partitioning (paper 3.51x), "
                "all three highest (paper 3.64x)", ordered and near and ladder[-1] == max(ladder),
                ", ".join(f"{k} {v:.2f}x" for k, v in ab.items()) + f"; ordered as in the paper: "
                f"{'yes' if ordered else 'no'}",
                "routing alone gains more than the paper's 1.6x: te_cp's step is set by its inter-node hops, and "
                "routing spreads each over the node's 4 NICs, which te_cp leaves idle (see the hop below)."))
    h = data["hop"]
    ok = abs(h["te_cp_ms"] / 2.18 - 1) <= 0.3 and abs(h["routed_ms"] / 0.41 - 1) <= 0.3
    k = len(h["proxies"])
    floor = h["mbytes"] * 1e6 / (k * h["nic_bw"]) * 1e3
    out.append((f"64K-token inter-node hop ~2.18 ms under te_cp, ~0.41 ms routed (within 30%): cluster "
                f"{h['cluster']}, {h['model']}, {h['gpus']} GPUs, {h['mbytes']:.1f} MB", ok,
                f"te_cp {h['te_cp_ms']:.2f} ms (met), routed over {k} NICs {h['routed_ms']:.2f} ms",
                f"0.41 ms is below what cluster A allows: {k} NICs at line rate need {floor:.2f} ms for "
                f"{h['mbytes']:.1f} MB before any NVLink dispatch and combine; the paper's routed figure likely "
                "comes from another cluster or message size."))
    return out


def _why_full(data: dict) -> str:
    """The configurations over the bound target whose batch nearly fills what the cluster
    holds under the bound's recomputation and that more memory brings within it."""
    full = [r for r in data.get("more_memory") or [] if r["memory_fill"] >= 0.9
            and r["more_memory_ratio"] <= BOUND_TARGET]
    if not full:
        return ""
    return ", ".join(f"{r['cluster']} {r['model']} {r['workload']}" for r in full) + " fill" + (
        "s" if len(full) == 1 else "") + " " + ", ".join(f"{r['memory_fill']:.0%}" for r in full) + (
        " of what the cluster holds under the recomputation the bound assumes, on every layer: every rank "
        "ends near its cap, so work cannot move to where it would even the step (the bound spreads it "
        "freely). ")


def _why_memory(data: dict) -> str:
    rows = data.get("more_memory") or []
    freed = [r for r in rows if r["more_memory_ratio"] <= BOUND_TARGET]
    if not rows:
        return ""
    which = ("it comes" if len(freed) == 1 else "it does not come") if len(rows) == 1 else (
        f"{len(freed)} of these {len(rows)} {'comes' if len(freed) == 1 else 'come'}")
    return (f" On GPUs with {MEMORY_HEADROOM}x the memory (same batches, section 'Over the bound target'), "
            f"{which} within {BOUND_TARGET}x ("
            + ", ".join(
                f"{r['cluster']} {r['model']} {r['workload']} {r['more_memory_ratio']:.3f}x" for r in freed)
            + "): there the batch nearly fills memory, so the plan recomputes more than the bound assumes (each "
            "rank recomputes as little as its own tokens need, the bound only the cluster's total shortfall), "
            "or keeps caps that bind.")


def _degrees(r: dict) -> str:
    """The tuned degrees of a configuration: te_cp/llama_cp/wlb_llm/magi cp sizes."""
    return " ".join(f"{p.split('_')[0]}{r[p]['options']['cp_size']}" for p in PLANNERS
                    if r.get(p, {}).get("options", {}).get("cp_size"))


def _table(configs: list[dict], key: str) -> list[str]:
    whole = all("te_cp_whole" in c["results"] for c in configs)
    lines = [f"| {key} | GPUs | model | workload | context | tuned degrees | " + " | ".join(PLANNERS) +
             (" | zeppelin over te_cp whole cluster" if whole else "") +
             " | zeppelin over the best baseline | zeppelin in wlb_llm's order / wlb_llm | zeppelin MFU | "
             "zeppelin step/bound | zeppelin plan s |",
             "|" + " --- |" * (len(PLANNERS) + 11 + whole)]
    for c in configs:
        r = c["results"]
        cells = [_degrees(r)] + [f"{speedup(c, p):.2f}" if r[p].get("feasible", True) else "infeasible"
                                 for p in PLANNERS]
        if whole:
            cells.append(f"{speedup(c, over='te_cp_whole'):.2f}")
        cells.append(f"{over_best(c):.3f} ({best_baseline(c)})")
        order = in_wlb_order(c)
        cells.append("-" if order is None else f"{order:.3f}")
        z = r["zeppelin"]
        plan_s = f"{z['plan_seconds']:.3f}" if z.get("plan_seconds") is not None else "-"
        lines.append(f"| {c['cluster']} | {c['gpus']} | {c['model']} (tp {c['tp']}) | "
                     f"{os.path.basename(c['workload'])} | {c['max_length']} | " + " | ".join(cells) +
                     f" | {z['mfu']:.1%} | {z['ratio_to_lower_bound']:.3f} | {plan_s} |")
    return lines


def _steps(configs: list[dict], key: str) -> list[str]:
    """Mean simulated step seconds of every planner, the best baseline's and the batch's
    lower bound, side by side."""
    lines = [f"| {key} | GPUs | model | workload | context | " + " | ".join(PLANNERS) + " | best baseline | "
             "lower bound |", "|" + " --- |" * (len(PLANNERS) + 7)]
    for c in configs:
        r = c["results"]
        cells = [f"{r[p]['step_time_s']:.3f}" if r[p].get("feasible", True) else "infeasible" for p in PLANNERS]
        best = best_baseline(c)
        lines.append(f"| {c['cluster']} | {c['gpus']} | {c['model']} (tp {c['tp']}) | "
                     f"{os.path.basename(c['workload'])} | {c['max_length']} | " + " | ".join(cells) +
                     f" | {r[best]['step_time_s']:.3f} ({best}) | {r['zeppelin']['lower_bound_s']:.3f} |")
    return lines


def _summary(g: list[dict], label: str) -> str:
    bound = [c["results"]["zeppelin"]["ratio_to_lower_bound"] for c in g]
    best = [over_best(c) for c in g]
    return (f"{label} ({len(g)} configurations): zeppelin {_mean(best):.3f}x over the best baseline of each "
            f"configuration (min {min(best):.3f}x), at or below it in {sum(x >= 1 for x in best)}"
            + (f" ({sum(at_or_below_in_order(c) for c in g)} with zeppelin in wlb_llm's training order against "
               "wlb_llm)" if _in_order_count(g) else "") + "; step/bound worst "
            f"{max(bound):.3f}x, {sum(x <= BOUND_TARGET for x in bound)} within {BOUND_TARGET}x; "
            f"{_mean(speedup(c) for c in g):.2f}x over te_cp at its tuned degree.")


def headline(data: dict) -> list[str]:
    """The README's headline: a table of zeppelin against the best baseline, TE CP and the
    batch's lower bound, over the main grid and the scale grid (copy it to README.md after
    a rerun), every planner under the simulator's one setting."""
    out = ["| zeppelin, every planner under one simulator setting (the engine on) | configurations | mean | min | "
           "max | at or below / within |", "| --- | --- | --- | --- | --- | --- |"]
    for label, g in (("main grid, 32 GPUs", data["grid"]), ("scale grid, 64-1024 GPUs", data.get("scale") or [])):
        if not g:
            continue
        bound = [c["results"]["zeppelin"]["ratio_to_lower_bound"] for c in g]
        best = [over_best(c) for c in g]
        te = [speedup(c) for c in g]
        out += [f"| {label}: speedup over the best baseline of each configuration | {len(g)} | {_mean(best):.3f}x | "
                f"{min(best):.3f}x | {max(best):.3f}x | {sum(x >= 1 for x in best)} at or below"
                + (" as given" + _in_order_count(g) if _in_order_count(g) else "") + " |",
                f"| {label}: speedup over TE CP at its fastest degree | {len(g)} | {_mean(te):.2f}x | {min(te):.2f}x | "
                f"{max(te):.2f}x | |",
                f"| {label}: step over the batch's lower bound | {len(g)} | {_mean(bound):.3f}x | {min(bound):.3f}x | "
                f"{max(bound):.3f}x | {sum(x <= BOUND_TARGET for x in bound)} within {BOUND_TARGET}x |"]
    return out


def report(data: dict) -> str:
    load = data.get("load")
    lines = ["# The Zeppelin paper's evaluation, simulated", "",
             f"Command: `{data['command']}` ({data['date']}, {data['machine']}, {data['seconds']:.0f} s"
             + (f"; load average {load[0]:.1f} at the start, {data['load_after'][0]:.1f} at the end" if load else "")
             + (", by part: " + ", ".join(f"{k} {v:.0f} s" for k, v in data['seconds_by_part'].items())
                if data.get("seconds_by_part") else "") + ").", "",
             "Every planner is simulated under the same settings, the runtime's (docs/design.md, section 7): the "
             "attention engine on (a transfer starts once its data is there), each rank's kernels in the runtime's "
             "host order with its waits for partial dK/dV sums, FSDP2's collectives beside each layer on their own "
             "process group. `distca` and `magi` are priced as their own systems send K/V (prefixes, once) and "
             "`distca` with its ping-pong of two nano-batches, which our runtime does not run (a courtesy to "
             "them). Baselines with a CP degree (te_cp, llama_cp, wlb_llm, magi) run at their fastest power of two "
             "on the configuration's batches (column 'tuned degrees'). "
             f"Speedup = te_cp's mean simulated step / the planner's, on the same sampled batches ({data['steps']} "
             f"per configuration, {data.get('scale_steps', data['steps'])} on the scale grid, seed 0, 16K tokens "
             "per GPU unless said). `step/bound` is zeppelin's step over "
             "`lower_bound_s`, the bound on the batch no plan can beat; `plan s` is zeppelin's CPU seconds to plan "
             "one batch on this machine. wlb_llm's step is the steps of its outlier delay (docs/design.md, section "
             "10); 'zeppelin in wlb_llm's order / wlb_llm' is zeppelin planning those same steps, weighted as "
             "wlb_llm's row (the order `ballonet train --outlier-delay G` trains in), over wlb_llm's step, '-' where "
             "wlb_llm's tuned degree delays no document; zeppelin's own figures are of the batch as given.", "",
             "## Targets", "", "| target | met | measured | why not |", "| --- | --- | --- | --- |"]
    lines += [f"| {t} | {'yes' if ok else 'no'} | {m} |" + (f" {why} |" if not ok else " |")
              for t, ok, m, why in targets(data)]
    g = data["grid"]
    lines += ["", "## Headline (the README's table)", ""] + headline(data)
    lines += ["", _summary(g, "Main grid") + " " + (_summary(data["scale"], "Scale grid") if data.get("scale") else "")
              + f" CP over the whole cluster (stress case, main grid): "
              f"{_mean(speedup(c, over='te_cp_whole') for c in g):.2f}x."]
    lines += ["", "Mean speedup of zeppelin over each planner (main grid): " + ", ".join(
        f"{p} {_mean(speedup(c, over=p) for c in g):.2f}x" for p in PLANNERS[1:] + ["te_cp_whole"])]
    lines += ["", "## Main grid (4 nodes, 64K context): speedup over te_cp", ""] + _table(g, "cluster")
    lines += ["", "Step times (s) of the main grid:", ""] + _steps(g, "cluster")
    if data.get("scale"):
        sc = data["scale"]
        lines += ["", "## Scale grid: 64 to 1024 GPUs, 32K to 256K contexts, speedup over te_cp", "",
                  "Longest document of each configuration's batches: " + ", ".join(
                      f"{_name(c)} {c['longest']}" for c in sc) + ".", ""] + _table(sc, "cluster")
        lines += ["", "Step times (s) of the scale grid:", ""] + _steps(sc, "cluster")
    lines += ["", "## Scaling: LLaMA-3B on cluster A", ""] + _table(data["scaling"], "cluster")
    lines += ["", "Throughput (tokens/s): " + "; ".join(
        f"{c['gpus']} GPUs: " + ", ".join(f"{p} {c['results'][p]['tokens_per_s']:.3g}" for p in ("zeppelin", "te_cp"))
        for c in data["scaling"])]
    lines += ["", "Step times (s):", ""] + _steps(data["scaling"], "cluster")
    lines += ["", "## Context windows: LLaMA-7B on cluster B, prolong, half a window of tokens per GPU", ""]
    lines += _table(data["contexts"], "cluster") + ["", "Step times (s):", ""] + _steps(data["contexts"], "cluster")
    lines += ["", "## Mixed GPU types: LLaMA-7B, 2 training nodes + 2 loaned inference nodes", "",
              "te_cp and the other baselines are speed-blind, as the systems they reproduce.", ""]
    lines += _table(data["mixed"], "cluster") + ["", "Step times (s):", ""] + _steps(data["mixed"], "cluster")
    lines += ["", "## Simulator settings: the same for every planner, changed one at a time (main grid)", "",
              "| setting | zeppelin's step / its default's | mean best baseline / zeppelin | min | at or below the "
              f"best | within {BOUND_TARGET}x of the bound (worst) |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| default (engine on, separate process groups) | 1.000 | {_mean(over_best(c) for c in g):.3f}x | "
              f"{min(over_best(c) for c in g):.3f}x | {sum(over_best(c) >= 1 for c in g)} of {len(g)} | "
              f"{sum(c['results']['zeppelin']['ratio_to_lower_bound'] <= BOUND_TARGET for c in g)} of {len(g)} "
              f"({max(c['results']['zeppelin']['ratio_to_lower_bound'] for c in g):.3f}x) |"]
    lines += [f"| {r['setting']} | {r['zeppelin_slowdown']:.3f} | {r['mean_over_best']:.3f}x | {r['min_over_best']:.3f}x "
              f"| {r['wins']} of {r['configurations']} | {r['within_bound']} of {r['configurations']} "
              f"({r['worst_to_bound']:.3f}x) |" for r in data.get("settings", [])]
    lines += ["", "## What each pricing term buys (main grid, same batches)", "",
              "| partitioner prices | mean best baseline / zeppelin | min | configurations where zeppelin "
              f"is at or below the best baseline | within {BOUND_TARGET}x of the lower bound (worst) |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['pricing']} | {r['mean_over_best']:.2f}x | {r['min_over_best']:.2f}x | {r['wins']} of "
              f"{r['configurations']} | {r['within_bound']} of {r['configurations']} ({r['worst_to_bound']:.3f}x) |"
              for r in data["pricing"]]
    lines += ["", f"## Over the bound target: the same batches on GPUs with {MEMORY_HEADROOM}x the memory", "",
              "Zeppelin planned again with `memory_gb` set to that much of each GPU's memory; step over the real "
              "cluster's lower bound (which already assumes the least recomputation the memory allows).", "",
              "Memory fill: the batch's tokens over what the cluster holds under the recomputation the bound "
              "assumes, on every layer (the larger of the batches).", "",
              "| cluster | model | workload | memory fill | step/bound | recomputation | step/bound, more memory | "
              "recomputation |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['cluster']} | {r['model']} | {r['workload']} | {r['memory_fill']:.0%} | "
              f"{r['ratio_to_lower_bound']:.3f}x | "
              f"{r['recompute']} | {r['more_memory_ratio']:.3f}x | {r['more_memory_recompute']} |"
              for r in data.get("more_memory", [])]
    ab = data["ablation"]
    lines += ["", f"## Ablation: LLaMA-3B, cluster A, {ab['gpus']} GPUs, {ab['workload']}", "",
              "| configuration | speedup over te_cp |", "| --- | --- |"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ab["speedup"].items()]
    from paper_estimate import estimate_section, held_section  # (it imports this module)

    for section in (estimate_section(data), held_section(data)):
        lines += [""] + section if section else []
    lines += ["", "## Notes", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


NOTES = [
    "te_cp_whole is one CP group over the whole cluster, where every step passes each rank's whole K/V (main "
    "grid only).",
    "Attention is priced from the H200 run (bench/results/gpu_kernels.json): forward ~34% of H100-class peak "
    "from 8K tokens, backward with its own efficiency; Ampere from FlashAttention-2's A100 figures. The "
    "simulator moves what the runtime moves (q/k/v out and o back in the remap, fp32 dK/dV), recomputes only "
    "when memory requires it, and lets FSDP2's collectives share the links.",
    "shortmix is a synthetic stand-in for ArXiv/GitHub/ProLong64k; the paper's datasets are not available.",
    "Speedups depend on the planners in ballonet/planning/ as they stand; constants were not tuned to hit targets.",
]


def main(argv=None) -> int:
    path = (argv if argv is not None else sys.argv[1:]) or [os.path.join(os.path.dirname(__file__), "results",
                                                                         "paper.json")]
    with open(path[0]) as f:
        data = json.load(f)
    text = report(data)
    with open(os.path.splitext(path[0])[0] + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
