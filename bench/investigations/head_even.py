"""What the LM head on evened tokens would buy: zeppelin's plan simulated as it is, and
again with every rank's LM head and loss over the mean token count of the plan's ranks
(no transfer priced: an upper bound on what moving the head's hidden states could gain).

    OMP_NUM_THREADS=1 python bench/investigations/head_even.py [--out bench/results/head_even.md]

The simulator runs the head on each rank's linear-layout tokens (`simulate`:
`head_seconds`), and the bound at the mean (`bounds.busiest_head_seconds`); where zeppelin
keeps tokens in place (`plan.meta['keep_tokens']`) a rank of short documents may hold
1.8x the mean (bench/results/held_gap.md). A hypothetical head, monkeypatched here only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import RESULTS, command, machine, write_text
from estimate import grid_configs, held_configs, scale_configs
from first_batch import first_batch

import ballonet.simulation.simulator as sim
from ballonet import plan_batch
from ballonet.cost.bounds import batch_lower_bound

HEAD = sim.head_seconds


def one(cfg: tuple) -> list:
    part, cl, nodes, mdl, tp, wl, ctx, seed = cfg
    c, m, batch = first_batch(cl, nodes, mdl, tp, wl, ctx, seed)
    plan = plan_batch(batch, c, m, "zeppelin")
    bound = batch_lower_bound(batch, c, m)
    as_is = sim.simulate(plan, c, m)
    mean = sum(batch) / plan.num_ranks
    sim.head_seconds = lambda model, gpu, n: HEAD(model, gpu, mean)
    try:
        even = sim.simulate(plan, c, m)
    finally:
        sim.head_seconds = HEAD
    name = f"{part} {cl} {c.num_ranks} {mdl} {os.path.basename(wl)} {ctx // 1024}K s{seed}"
    print(name, f"{as_is.step_time_s / bound:.3f} -> {even.step_time_s / bound:.3f}", file=sys.stderr, flush=True)
    return [name, "keep" if plan.meta["keep_tokens"] else "remap", as_is.head_s, even.head_s,
            as_is.step_time_s, even.step_time_s, as_is.step_time_s / bound, even.step_time_s / bound]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "head_even.md"))
    args = ap.parse_args(argv)
    start = time.time()
    rows = [one(cfg) for cfg in grid_configs() + scale_configs() + held_configs()]
    within = [sum(r[k] <= 1.15 for r in rows if r[0].startswith(p)) for p in ("grid", "scale", "held")
              for k in (6, 7)]
    gains = [r[5] / r[4] for r in rows]
    lines = ["# The LM head on evened tokens (an upper bound)", "",
             f"Command: `{command('investigations/head_even.py', argv)}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}, {time.time() - start:.0f} s).", "",
             __doc__.split("\n\n")[0].replace("\n", " "), "",
             f"Within 1.15x of the bound, as is -> head evened: main grid {within[0]} -> {within[1]}, "
             f"scale grid {within[2]} -> {within[3]}, held-out {within[4]} -> {within[5]}; the step "
             f"{100 * (1 - sum(gains) / len(gains)):.1f}% shorter on average, {100 * (1 - min(gains)):.1f}% at most.", "",
             "| configuration | linear layout | head s | head s, evened | step s | step s, evened | step/bound | evened |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r[0]} | {r[1]} | " + " | ".join(f"{x:.3f}" for x in r[2:]) + " |" for r in rows]
    write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
