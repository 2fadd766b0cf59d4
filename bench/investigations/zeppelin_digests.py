"""Zeppelin's plans by digest, without simulating them: a quick check that a speed-up left plans as they were.

    OMP_NUM_THREADS=1 python bench/investigations/zeppelin_digests.py OUT.json [--against EARLIER.json]

258 plans: `plan_digests.py`'s main grid (36 configurations, its two batches each, with and
without double rings, and its `--extra` variants on the first), `bench/planner.py`'s
wlbllm batch at 128 and 1024 GPUs, and four scale configurations (256-GPU h800 llama-7b
prolong, 512-GPU a800 llama-13b wlbllm, 128-GPU h800 llama-13b wlbllm, 256-GPU h200
llama-7b shortmix; one batch each). Each row is the configuration and `plan_digests.digest`
of its plan (its meta holds every candidate's estimated step, so a float that moves shows),
or the reason it is infeasible. Run it on two trees (PYTHONPATH=TREE) and compare with
`--against`; exit 1 where a row differs. About 10 s of planning.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))  # bench/ (_common), after this folder

from plan_digests import CLUSTERS, EXTRA, MODELS, WORKLOADS, digest

from ballonet import InfeasiblePlan, plan_batch, specs, workloads

SCALE = [(256, "h800-8nic", "llama-7b", "prolong"), (512, "a800-4nic", "llama-13b", "wlbllm"),
         (128, "h800-8nic", "llama-13b", "wlbllm"), (256, "h200-8nic", "llama-7b", "shortmix")]


def rows() -> list[list[str]]:
    out: list[list[str]] = []

    def one(tag: str, lengths, cluster, model, **options) -> None:
        try:
            out.append([tag, digest(plan_batch(lengths, cluster, model, "zeppelin", **options))])
        except InfeasiblePlan as e:
            out.append([tag, f"infeasible: {e}"])

    for cl, preset in CLUSTERS.items():
        c = specs.cluster(preset, num_nodes=4)
        for name, tp in MODELS:
            m = specs.model(name, tp=tp)
            for wl in WORKLOADS:
                for step, lengths in enumerate(workloads.get(wl).batches(16384 * c.num_ranks, 0, 2, 65536)):
                    one(f"{cl} {name} {wl} {step}", lengths, c, m)
                    one(f"{cl} {name} {wl} {step} single", lengths, c, m, double=False)
                    if step == 0:
                        for variant, options in EXTRA.items():
                            one(f"{cl} {name} {wl} {variant}", lengths, c, m, **options)
    for g in (128, 1024):
        one(f"planner.py {g}", workloads.get("wlbllm").sample_batch(16384 * g, 0),
            specs.cluster("h200-8nic", num_nodes=g // 8), specs.model("llama-7b"))
    for g, preset, name, wl in SCALE:
        one(f"scale {g} {preset} {name} {wl}", workloads.get(wl).sample_batch(16384 * g, 0),
            specs.cluster(preset, num_nodes=g // 8), specs.model(name))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="where to write this tree's rows (JSON)")
    ap.add_argument("--against", metavar="FILE", help="an earlier run's rows: count those that differ")
    args = ap.parse_args(argv)
    got = rows()
    with open(args.out, "w") as f:
        json.dump(got, f, indent=0)
    print(f"{len(got)} plans -> {args.out}")
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        differ = [a[0] for a, b in zip(before, got) if a != b] + [a[0] for a in before[len(got):]]
        print(f"against {args.against}: {len(before) - len(differ)} of {len(before)} identical")
        for tag in differ[:10]:
            print(f"  differs: {tag}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
