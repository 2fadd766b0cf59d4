"""Every plan of `bench/paper.py`'s main grid, by digest, with its simulated step.

    OMP_NUM_THREADS=1 python bench/investigations/plan_digests.py [--steps 2] [--extra] [--out bench/results/plan_digests.json]

The main grid is 36 configurations (3 clusters x 4 models x 3 workloads, 4 nodes, 16K
tokens a GPU, 64K context); each of `--steps` batches is planned by 11 planners: the 9 of
`ballonet.PLANNERS`, TE CP over the whole cluster (`te_cp_whole`, paper.py's stress case)
and zeppelin without double rings (`zeppelin single`, its pricing ablation's third row):
36 x 2 x 11 = 792 plans. `--extra` adds the other zeppelin variants paper.py plans (its
pricing ablation's first two rows, and no remap: its ablation ladder). Each row is the
plan's digest over the fields a Plan had before `Plan.recompute` (`FIELDS`: SHA-256 of
the canonical JSON of those, so equal to `Plan.digest` of a plan of then), its
`recompute` (per rank, mode and layers), and `repr` of the simulated step and lower
bound, or the one-line reason it is infeasible: two runs of this script on two versions
of the code give identical files when both make the same plans and simulate them alike
(a refactoring check; rows are compared with `cmp`, or `--against` an earlier run's file:
a row matches when every field the earlier row has is equal, so a field added since, such
as `recompute`, is not compared).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, BENCH)  # after this folder: bench/ (_common)

from _common import RESULTS, write_text

from ballonet import PLANNERS, InfeasiblePlan, plan_batch, simulate, specs, workloads

CLUSTERS = {"A": "a800-4nic", "B": "h800-8nic", "C": "h200-8nic"}
MODELS = [("llama-3b", 1), ("llama-7b", 1), ("llama-13b", 2), ("llama-30b", 4)]
WORKLOADS = ["wlbllm", "prolong", "shortmix"]
EXTRA = {"zeppelin attention only": {"price_linear": False, "price_recompute": False, "double": False},
         "zeppelin + linear": {"price_recompute": False, "double": False},
         "zeppelin no remap": {"remap": False}}
"""The `--extra` variants: name -> zeppelin options."""
FIELDS = ("planner", "lengths", "node_of_rank", "nic_of_rank", "attention", "rings", "remap", "routes", "memory_bytes",
          "memory_cap", "attention_engine", "meta")
"""The Plan's fields at de0c3d4, before `Plan.recompute`: the digest is over these."""


def digest(plan) -> str:
    """SHA-256 of the canonical JSON of `FIELDS` of `plan` (`Plan.to_json`'s form)."""
    d = {k: v for k, v in plan.to_dict().items() if k in FIELDS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def variants(cluster: specs.ClusterSpec, model: specs.ModelSpec, extra: bool) -> dict[str, tuple[str, dict]]:
    """name -> (planner, options): the 11 of the main grid, then the `EXTRA` ones."""
    out = {name: (name, {}) for name in PLANNERS}
    out["te_cp_whole"] = ("te_cp", {"cp_size": cluster.num_ranks // model.tp})
    out["zeppelin single"] = ("zeppelin", {"double": False})
    if extra:
        out.update({name: ("zeppelin", options) for name, options in EXTRA.items()})
    return out


def row(lengths, cluster, model, planner: str, options: dict) -> dict:
    try:
        plan = plan_batch(lengths, cluster, model, planner, **options)
    except InfeasiblePlan as e:
        return {"infeasible": str(e)}
    res = simulate(plan, cluster, model)
    out = {"digest": digest(plan), "step_time_s": repr(res.step_time_s), "lower_bound_s": repr(res.lower_bound_s)}
    if getattr(plan, "recompute", ()):
        out["recompute"] = [[str(m), k] for m, k in plan.recompute]
    return out


def digests(steps: int, extra: bool) -> list[dict]:
    rows = []
    for cl, preset in CLUSTERS.items():
        c = specs.cluster(preset, num_nodes=4)
        for name, tp in MODELS:
            m = specs.model(name, tp=tp)
            for wl in WORKLOADS:
                batches = list(workloads.get(wl).batches(16384 * c.num_ranks, 0, steps, 65536))
                t = time.perf_counter()
                for v, (planner, options) in variants(c, m, extra).items():
                    for step, lengths in enumerate(batches):
                        rows.append({"cluster": cl, "model": name, "tp": tp, "workload": wl, "step": step,
                                     "planner": v, **row(lengths, c, m, planner, options)})
                print(f"  {cl} {name} {wl}: {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="batches per configuration")
    ap.add_argument("--extra", action="store_true", help="also the other zeppelin variants paper.py plans")
    ap.add_argument("--out", default=os.path.join(RESULTS, "plan_digests.json"))
    ap.add_argument("--against", metavar="FILE", help="an earlier run's file: count the rows that differ from it")
    args = ap.parse_args(argv)
    rows = digests(args.steps, args.extra)
    # No date or machine in the file (not `record`): two runs on two versions compare with `cmp`.
    write_text(args.out, "[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]\n")
    feasible = sum("digest" in r for r in rows)
    print(f"{len(rows)} plans ({feasible} feasible) -> {args.out}")
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        differ = [(a, b) for a, b in zip(before, rows) if any(b.get(k) != v for k, v in a.items())]
        differ += [(a, None) for a in before[len(rows):]]
        print(f"against {args.against}: {len(before) - len(differ)} of {len(before)} rows identical")
        for a, b in differ[:5]:
            print(f"  {a}\n  {b}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
