"""Zeppelin against wlb_llm on the steps of wlb_llm's outlier delay, one step at a time.

    OMP_NUM_THREADS=1 python bench/investigations/wlb_order.py [--parts grid,scale,held]
        [--max-gpus N] [--against EARLIER.json] [--out DIR]

`bench/paper.py` prices zeppelin "in wlb_llm's order" (`Row.step_in_wlb_order_s`) as the
weighted sum of its steps on the steps wlb_llm's outlier delay trains
(`wlb_llm.outlier_steps`) at wlb_llm's tuned CP degree. Its release steps are batches
the grids never plan: one outlier per CP group (several long documents of about one
length), filled with short ones. This plans and simulates each of those steps apart, at
the degree `bench/results/paper.json` records for wlb_llm: zeppelin's simulated and
estimated step, wlb_llm's simulated step and the bound, so that a step where zeppelin is
slower, or its estimate off, shows which documents it holds. Configurations whose degree
delays no document are left out. With `--against`, another run's JSON (another tree,
PYTHONPATH=TREE) is set beside this one. Writes OUT/wlb_order.json and wlb_order.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import RESULTS, command, record, write_text
from estimate import PARTS
from paper import TOKENS_PER_GPU
from paper_report import CLUSTERS

from ballonet import plan_batch, simulate, specs, workloads
from ballonet.cost.bounds import batch_lower_bound
from ballonet.planning.wlb_llm import num_groups, outlier_steps

KEY = ("part", "cluster", "gpus", "model", "workload", "context", "seed")


def degrees() -> dict:
    """wlb_llm's tuned CP degree per configuration of the last paper run."""
    with open(os.path.join(RESULTS, "paper.json")) as f:
        data = json.load(f)
    out = {}
    for part in ("grid", "scale", "held"):
        for row in data.get(part, []):
            key = (row["cluster"], row["gpus"], row["model"], row["workload"], row["max_length"], row.get("seed", 0))
            out[key] = (row["results"].get("wlb_llm", {}).get("options") or {}).get("cp_size")
    return out


def run(cfg: tuple, cp: int) -> list[dict]:
    """Every step of the first batch's outlier delay at CP degree `cp` ([] where there is one)."""
    part, cl, nodes, mdl, tp, wl, ctx, seed = cfg
    c = specs.cluster(CLUSTERS[cl], num_nodes=nodes)
    m = specs.model(mdl, tp=tp)
    w = workloads.get(wl)
    total = TOKENS_PER_GPU * c.num_ranks
    batch = next(iter(w.batches(total, seed, 1, ctx)))
    filler = (L for k in range(1, 5) for L in w.sample_batch(total, (seed, 0, k), ctx))  # as `compare` fills
    groups = num_groups(c, m, cp)
    steps = outlier_steps(batch, groups, filler) if groups > 1 else [(1.0, batch)]
    if len(steps) == 1:
        return []
    rows = []
    for i, (weight, docs) in enumerate(steps):
        z = plan_batch(docs, c, m, "zeppelin")
        zs = simulate(z, c, m).step_time_s
        ws = simulate(plan_batch(docs, c, m, "wlb_llm", cp_size=cp), c, m).step_time_s
        row = {"part": part, "cluster": cl, "gpus": c.num_ranks, "model": mdl, "workload": wl, "context": ctx,
               "seed": seed, "cp": cp, "step": i, "weight": weight, "docs": len(docs),
               "longest": sorted(docs, reverse=True)[:groups], "zeppelin_s": zs,
               "estimate_s": z.meta["estimated_step_s"], "wlb_llm_s": ws, "bound_s": batch_lower_bound(docs, c, m)}
        rows.append(row)
        print(f"{part} {cl} {c.num_ranks} {mdl} {wl} {ctx} s{seed} cp{cp} step {i} (w {weight:.2f}): zeppelin "
              f"{zs:.3f} (est {row['estimate_s']:.3f}) wlb_llm {ws:.3f} -> {zs / ws:.3f}", file=sys.stderr, flush=True)
    return rows


def _weighted(rows: list[dict]) -> dict:
    """Per configuration: (zeppelin's, wlb_llm's) weighted step sums."""
    out: dict = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        k = tuple(r[x] for x in KEY)
        out[k][0] += r["weight"] * r["zeppelin_s"]
        out[k][1] += r["weight"] * r["wlb_llm_s"]
    return out


def _summary(rows: list[dict]) -> str:
    weighted = _weighted(rows)
    slower = [r for r in rows if r["zeppelin_s"] > r["wlb_llm_s"] * (1 + 1e-9)]
    within = sum(abs(r["estimate_s"] / r["zeppelin_s"] - 1) <= 0.05 for r in rows)
    over = sum(z > w * (1 + 1e-9) for z, w in weighted.values())
    worst = max(rows, key=lambda r: r["zeppelin_s"] / r["wlb_llm_s"])
    return (f"{len(rows)} steps of {len(weighted)} configurations: zeppelin slower than wlb_llm on {len(slower)} steps "
            f"(worst {worst['zeppelin_s'] / worst['wlb_llm_s']:.3f}x, {worst['part']} {worst['cluster']} "
            f"{worst['gpus']} {worst['model']} {worst['workload']} {worst['context']} step {worst['step']}) and on "
            f"{over} configurations weighted as `paper.py` weighs them; estimate within 5% of the simulated step "
            f"on {within} of {len(rows)} steps")


def report(data: dict, against: dict | None) -> str:
    rows = data["rows"]
    lines = ["# Zeppelin on the steps of wlb_llm's outlier delay", "",
             f"Command: `{data['command']}` ({data['date']}, {data['machine']}, {data['seconds']:.0f} s).", "",
             __doc__.split("\n\n")[2].replace("\n", " "), "", _summary(rows) + "."]
    before = {tuple(r[k] for k in (*KEY, "step")): r for r in against["rows"]} if against else {}
    if against:
        lines += ["", f"Before (`{against['command']}`, {against['date']}): {_summary(against['rows'])}."]
    lines += ["", "| part | cluster | GPUs | model | workload | context | seed | cp | step | weight | longest | "
              "zeppelin s | estimate / step | wlb_llm s | zeppelin / wlb_llm | bound s |"
              + (" zeppelin before s | estimate / step before |" if against else ""),
              "| --- " * (16 + 2 * bool(against)) + "|"]
    for r in rows:
        b = before.get(tuple(r[k] for k in (*KEY, "step")))
        lines.append(
            f"| {r['part']} | {r['cluster']} | {r['gpus']} | {r['model']} | {r['workload']} | {r['context']} | "
            f"{r['seed']} | {r['cp']} | {r['step']} | {r['weight']:.2f} | {max(r['longest'])} | {r['zeppelin_s']:.3f} | "
            f"{r['estimate_s'] / r['zeppelin_s']:.3f} | {r['wlb_llm_s']:.3f} | {r['zeppelin_s'] / r['wlb_llm_s']:.3f} | "
            f"{r['bound_s']:.3f} |" + (f" {b['zeppelin_s']:.3f} | {b['estimate_s'] / b['zeppelin_s']:.3f} |"
                                      if b else (" - | - |" if against else "")))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="grid,scale,held", help="comma-separated: grid, scale, held")
    parser.add_argument("--max-gpus", type=int, default=1024, help="leave out larger configurations")
    parser.add_argument("--against", help="another run's wlb_order.json, set beside this one")
    parser.add_argument("--out", default=RESULTS, help="folder of wlb_order.json and wlb_order.md")
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))} (choose from {', '.join(PARTS)})")
    against = None
    if args.against:
        with open(args.against) as f:
            against = json.load(f)
    cps, rows, t = degrees(), [], time.perf_counter()
    for part in args.parts.split(","):
        for cfg in PARTS[part]():
            _, cl, nodes, mdl, tp, wl, ctx, seed = cfg
            cp = cps.get((cl, nodes * 8, mdl, wl, ctx, seed))
            if cp and nodes * 8 <= args.max_gpus:
                rows += run(cfg, cp)
    data = record(command("investigations/wlb_order.py", argv), {"rows": rows, "seconds": time.perf_counter() - t},
                  os.path.join(args.out, "wlb_order.json"))
    write_text(os.path.join(args.out, "wlb_order.md"), report(data, against))
    return 0


if __name__ == "__main__":
    sys.exit(main())
