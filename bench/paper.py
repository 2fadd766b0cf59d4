"""Reproduce the Zeppelin paper's evaluation in simulation, and a scale grid (docs/design.md, section 9).

    OMP_NUM_THREADS=1 python bench/paper.py [--quick] [--steps K] [--scale-gpus 64,128,...] [--jobs N]
        [--workload FILE] [--held MAX_GPUS] [--only PARTS --out DIR] [--out bench/results]

Writes bench/results/paper.json (every figure) and paper.md (tables and the targets, each
met or not, with the reason; `bench/paper_report.py` writes the report). Every planner sees
the same sampled batches and runs under the same simulator settings (the attention engine
on, as the runtime runs every plan; docs/design.md, section 7); speedups are ratios of
mean simulated step times. The baselines with a CP degree (te_cp, llama_cp, wlb_llm, magi)
run at the fastest degree on the configuration's batches (`compare(tune=True)`), as their
users tuning the job would. The main grid is the paper's as far as it is known: clusters A
(A800, 4x200 Gb/s NICs per node), B (H800, 8x400), C (H200, 8x400); LLaMA 3B/7B and
13B/30B with tensor parallelism (tp 2 and 4); the `wlbllm` and `prolong` presets and
`shortmix` (short-heavy, standing in for ArXiv/GitHub/ProLong64k). The scale grid: 64 to
1024 GPUs, contexts 32K to 256K, the three clusters, llama-7b, llama3-8b and llama-13b,
each GPU count at every context, cluster and model taking turns, on the presets
(`prolong`, `wlbllm` in turn) or on the lengths file `--workload` names.

CP over the whole cluster (`te_cp_whole`, main grid only) is reported beside the tuned
te_cp as a stress case, and every speedup is also given over the best baseline of each
configuration. wlb_llm is priced over its outlier delay; where that delay applies, zeppelin
is priced in the same order too (`Row.step_in_wlb_order_s`), set beside the figures of the
batch as given. Zeppelin's estimated step is set beside its simulated one on every
configuration, each over 5% named with why (`bench/paper_estimate.py`). `--held N` adds
the held-out configurations of bench/estimate.py up to N GPUs (lengths and pairings the
grids never plan), every planner at its tuned degree; `--only` runs some parts alone into
another folder, a short check of the report.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import RESULTS, command, record, write_text
from paper_estimate import partial_report
from paper_traces import over_bound, worst
from paper_report import (
    BOUND_TARGET,
    CLUSTERS,
    MEMORY_HEADROOM,
    NOTES,
    PLANNERS,
    SHORT,
    WORKLOADS,
    best_baseline,
    over_best,
    report,
)

from ballonet import InfeasiblePlan, plan_batch, specs, workloads
from ballonet.cost.bounds import batch_lower_bound, batch_recomputation
from ballonet.cost.flops import kv_bytes
from ballonet.cost.memory import activation_bytes_per_token, memory_cap
from ballonet.plan.recompute import heaviest
from ballonet.planning.routing import plan_routes
from ballonet.simulation.comparison import compare
from ballonet.simulation.fabric import Fabric
from ballonet.simulation.simulator import simulate
from ballonet.simulation.timeline import Timeline

MIXED = ["h800+h20", "a800+l40s"]
"""Mixed-GPU presets (`ballonet/specs/presets.py`): training nodes plus loaned inference nodes."""
MODELS = [("llama-3b", 1), ("llama-7b", 1), ("llama-13b", 2), ("llama-30b", 4)]
SCALE_GPUS = (64, 128, 256, 512, 1024)
SCALE_CONTEXTS = (32768, 65536, 131072, 262144)
SCALE_MODELS = [("llama-7b", 1), ("llama3-8b", 1), ("llama-13b", 2)]
SCALE_WORKLOADS = ["prolong", "wlbllm"]
TOKENS_PER_GPU = 16384


def config(cluster: str, nodes: int | None, model: str, tp: int, workload: str, tokens: int, max_length, steps: int,
           planners=PLANNERS, whole: bool = True, seed: int = 0) -> dict:
    """Every planner on `steps` batches of one configuration (the CP baselines at their
    fastest degree); with `whole`, TE CP over the whole cluster too (the stress case);
    zeppelin's estimated step beside its simulated one (`estimate`)."""
    c = specs.cluster(CLUSTERS.get(cluster, cluster), num_nodes=nodes)
    m = specs.model(model, tp=tp)
    t = time.perf_counter()
    rows = compare(c, m, workload, tokens, planners, steps=steps, seed=seed, max_length=max_length, tune=True)
    results = {r.planner: {**r.to_dict(), "tokens_per_s": tokens * c.num_ranks / r.step_time_s if r.feasible else None}
               for r in rows}
    if results["te_cp"].get("feasible", True):
        results["te_cp"]["cp_size"] = results["te_cp"]["options"]["cp_size"]
    batches = list(workloads.get(workload).batches(tokens * c.num_ranks, seed, steps, max_length))
    if "zeppelin" in results and results["zeppelin"].get("feasible", True):
        results["zeppelin"].update(estimate(batches, c, m))
    if whole:  # the stress case: one CP group over the whole cluster
        n = c.num_ranks // tp
        try:
            step = statistics.mean(simulate(plan_batch(b, c, m, "te_cp", cp_size=n), c, m).step_time_s
                                   for b in batches)
        except InfeasiblePlan:
            step = float("nan")
        results["te_cp_whole"] = {"planner": f"te_cp (cp {n})", "cp_size": n, "step_time_s": step,
                                  "tokens_per_s": tokens * c.num_ranks / step}
    out = {"cluster": cluster, "gpus": c.num_ranks, "model": model, "tp": tp, "workload": workload,
           "tokens_per_gpu": tokens, "max_length": max_length, "steps": steps, "seed": seed, "results": results,
           "longest": max(max(b) for b in batches), "seconds": time.perf_counter() - t}
    print(f"  {cluster} {c.num_ranks:4d} GPUs {model:9s} tp{tp} {os.path.basename(workload):8s} ctx {max_length}: "
          f"zeppelin x{results['zeppelin']['speedup_vs_te_cp']:.2f} over te_cp, x{over_best(out):.2f} over the best "
          f"({best_baseline(out)}), step/bound {results['zeppelin']['ratio_to_lower_bound']:.3f} "
          f"({out['seconds']:.0f}s)", file=sys.stderr, flush=True)
    return out


def estimate(batches, c, m) -> dict:
    """Zeppelin's estimated step (its chosen plan's, `plan.meta["estimated_step_s"]`) against the
    simulated one on `batches`, means over them, and the rings across nodes of its plans
    (what the estimate prices least surely: `ring_facts`)."""
    est, sim, rings = [], [], []
    for b in batches:
        plan = plan_batch(b, c, m, "zeppelin")
        est.append(plan.meta["estimated_step_s"])  # the chosen plan's (not always the least compared)
        sim.append(simulate(plan, c, m).step_time_s)
        rings += ring_facts(plan)
    return {"estimate_s": statistics.mean(est), "estimate_ratio": statistics.mean(e / s for e, s in zip(est, sim)),
            "inter_rings": rings}


def ring_facts(plan) -> list[dict]:
    """Each ring across nodes of `plan`: "ring" (single, crossing hops routed) or "double",
    its members, its nodes and its document's length."""
    return [{"comm": r.comm, "members": len(r.ranks), "nodes": len({plan.node_of_rank[x] for x in r.ranks}),
             "length": plan.lengths[r.doc]} for r in plan.rings if r.kind == "inter"]


JOBS = 1
"""Processes the grid, the scale grid and the held-out part run their configurations in
(`--jobs`): each configuration is deterministic, so the figures do not depend on it."""


def _configs(calls: list[tuple[tuple, dict]]) -> list[dict]:
    """`config(*args, **kwargs)` for each call, in order, over `JOBS` processes."""
    if JOBS == 1:
        return [config(*a, **k) for a, k in calls]
    with concurrent.futures.ProcessPoolExecutor(JOBS, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_config, calls))


def _config(call: tuple[tuple, dict]) -> dict:
    return config(*call[0], **call[1])


def held(max_gpus: int, steps: int) -> list[dict]:
    """Held-out configurations (`bench/estimate.py`'s `held_configs`: shortmix at scale,
    and seed 1), every planner at its tuned degree, up to `max_gpus` GPUs; each with the
    seconds it took."""
    from estimate import held_configs  # (estimate.py imports this module)

    return _configs([((cl, nodes, mdl, tp, wl, TOKENS_PER_GPU, ctx, steps), {"whole": False, "seed": seed})
                     for _, cl, nodes, mdl, tp, wl, ctx, seed in held_configs() if nodes * 8 <= max_gpus])


def length_stats(workload: str) -> dict:
    """Share of tokens in documents under SHORT tokens, and the token-weighted mean length
    (sum L^2 / sum L, the length of the document a random token sits in)."""
    lengths = workloads.get(workload).sample_batch(4 << 20, 1, max_length=65536)  # as in the main grid
    total = sum(lengths)
    return {"short_share": sum(n for n in lengths if n < SHORT) / total,
            "weighted_length": sum(n * n for n in lengths) / total}


def ablation(nodes: int, workload: str, steps: int) -> dict:
    """LLaMA-3B on cluster A: TE CP, then Zeppelin's three parts added one by one, as in the
    paper: the routing layer alone (TE CP's plan with Zeppelin's routes for its inter-node
    hops), plus the attention engine with its hierarchical partitioning (no remap), plus
    the remapping layer (all three)."""
    c, m = specs.cluster(CLUSTERS["A"], num_nodes=nodes), specs.model("llama-3b")
    local_index = tuple(c.local_index(r * m.tp) // m.tp for r in range(c.num_ranks // m.tp))

    whole = c.num_ranks // m.tp  # the paper's TE CP rings cross nodes: CP over the whole cluster

    def te_cp_routed(lengths):
        plan = plan_batch(lengths, c, m, "te_cp", cp_size=whole)
        return dataclasses.replace(plan, routes=plan_routes(plan, c, m, local_index)).validate()

    ladder = {"te_cp": lambda b: simulate(plan_batch(b, c, m, "te_cp", cp_size=whole), c, m),
              "routing": lambda b: simulate(te_cp_routed(b), c, m, engine=False),
              "routing + engine/partitioning": lambda b: simulate(
                  plan_batch(b, c, m, "zeppelin", remap=False), c, m, engine=True),
              "all three (+ remapping)": lambda b: simulate(plan_batch(b, c, m, "zeppelin"), c, m, engine=True)}
    times = {name: [] for name in ladder}
    for lengths in workloads.get(workload).batches(16384 * c.num_ranks, 0, steps):
        for name, run in ladder.items():
            times[name].append(run(lengths).step_time_s)
    base = statistics.mean(times["te_cp"])
    return {"gpus": c.num_ranks, "workload": workload,
            "speedup": {name: base / statistics.mean(v) for name, v in times.items()}}


PRICING = {  # ablation of what the partitioner prices: name -> zeppelin options
    "attention only (remap across the cluster, recomputation of the model)": {
        "price_linear": False, "price_recompute": False, "double": False},
    "+ linear work (nodes balanced on attention + linear, remap inside nodes, inter-node when it pays)":
        {"price_recompute": False, "double": False},
    "+ recomputation (plans for each mode that fits, keeps the best)": {"double": False},
    "+ double rings (the default: where pricing a ring across nodes as a ring in each node with rounds "
    "between rail peers sends any document across nodes, those plans compared too)": {},
}


def pricing_ablation(grid_data: list[dict], steps: int) -> list[dict]:
    """Zeppelin with each pricing term switched on in turn, on every main-grid configuration:
    its mean step against the configuration's best baseline (same batches)."""
    rows = []
    for name, options in PRICING.items():
        ratios, bounds = [], []
        for cfg in grid_data:
            c = specs.cluster(CLUSTERS.get(cfg["cluster"], cfg["cluster"]), num_nodes=cfg["gpus"] // 8)
            m = specs.model(cfg["model"], tp=cfg["tp"])
            batches = workloads.get(cfg["workload"]).batches(cfg["tokens_per_gpu"] * c.num_ranks, 0, steps,
                                                              cfg["max_length"])
            res = [simulate(plan_batch(b, c, m, "zeppelin", **options), c, m) for b in batches]
            step = statistics.mean(r.step_time_s for r in res)
            ratios.append(cfg["results"][best_baseline(cfg)]["step_time_s"] / step)
            bounds.append(step / statistics.mean(r.lower_bound_s for r in res))
        rows.append({"pricing": name, "options": options, "mean_over_best": _mean(ratios), "min_over_best": min(ratios),
                     "wins": sum(x >= 1 for x in ratios), "configurations": len(ratios),
                     "within_bound": sum(x <= BOUND_TARGET for x in bounds), "worst_to_bound": max(bounds)})
    return rows


def _batches(cfg: dict):
    c = specs.cluster(CLUSTERS.get(cfg["cluster"], cfg["cluster"]), num_nodes=cfg["gpus"] // 8)
    m = specs.model(cfg["model"], tp=cfg["tp"])
    return c, m, list(workloads.get(cfg["workload"]).batches(cfg["tokens_per_gpu"] * c.num_ranks, 0, cfg["steps"],
                                                              cfg["max_length"]))


SETTINGS = {"no engine (every send behind the kernels queued before it)": {"engine": False},
            "one process group (CP traffic behind the layer's FSDP collectives)": {"cp_group": False}}
"""The simulator settings `sensitivity` changes, for every planner alike."""


def sensitivity(grid_data: list[dict]) -> list[dict]:
    """Every planner of every main-grid configuration (at its tuned options) simulated under
    each setting of `SETTINGS` instead of the default: zeppelin's lead over the best
    baseline and its bound ratio, when every planner loses the engine or the separate
    process groups."""
    rows = []
    for name, settings in SETTINGS.items():
        over, bounds, slow = [], [], []
        for cfg in grid_data:
            c, m, batches = _batches(cfg)
            steps = {}
            for p, r in cfg["results"].items():
                if p not in PLANNERS or r.get("feasible") is False:
                    continue
                res = [simulate(plan_batch(b, c, m, p, **r.get("options", {})), c, m, **settings) for b in batches]
                steps[p] = statistics.mean(x.step_time_s for x in res)
                if p == "zeppelin":
                    bounds.append(steps[p] / statistics.mean(x.lower_bound_s for x in res))
                    slow.append(steps[p] / r["step_time_s"])
            over.append(min(v for p, v in steps.items() if p != "zeppelin") / steps["zeppelin"])
        rows.append({"setting": name, "options": settings, "mean_over_best": _mean(over), "min_over_best": min(over),
                     "wins": sum(x >= 1 for x in over), "within_bound": sum(x <= BOUND_TARGET for x in bounds),
                     "worst_to_bound": max(bounds), "zeppelin_slowdown": _mean(slow), "configurations": len(over)})
    return rows


def _memory_fill(batch, c, m) -> float:
    """The batch's tokens over what the cluster's memory holds under the recomputation the
    bound assumes (`cost.bounds.batch_recomputation`) on every layer."""
    gpus = [c.gpu_of(r) for r in range(0, c.num_ranks, m.tp)]
    capacity = sum(memory_cap(m, g, len(gpus)) for g in gpus)
    return sum(batch) / (capacity / activation_bytes_per_token(m, batch_recomputation(batch, c, m)[0]))


def more_memory(grid_data: list[dict], steps: int) -> list[dict]:
    """Every main-grid configuration over the bound target planned again on GPUs with
    `MEMORY_HEADROOM` times their memory (`NodeGroup.memory_gb`, same batches), its step
    over the real cluster's bound: where memory caps are what keeps zeppelin from it."""
    rows = []
    for cfg in grid_data:
        z = cfg["results"]["zeppelin"]
        if z["ratio_to_lower_bound"] <= BOUND_TARGET:
            continue
        c = specs.cluster(CLUSTERS[cfg["cluster"]], num_nodes=cfg["gpus"] // 8)
        roomy = specs.cluster(CLUSTERS[cfg["cluster"]], num_nodes=cfg["gpus"] // 8,
                              memory_gb=c.groups[0].gpu_type.memory_bytes * MEMORY_HEADROOM / 1e9)
        m = specs.model(cfg["model"], tp=cfg["tp"])
        batches = list(workloads.get(cfg["workload"]).batches(cfg["tokens_per_gpu"] * c.num_ranks, 0, steps,
                                                               cfg["max_length"]))
        res = [simulate(plan_batch(b, roomy, m, "zeppelin"), roomy, m) for b in batches]
        bound = statistics.mean(batch_lower_bound(b, c, m) for b in batches)
        rows.append({"cluster": cfg["cluster"], "model": cfg["model"], "tp": cfg["tp"], "workload": cfg["workload"],
                     "ratio_to_lower_bound": z["ratio_to_lower_bound"],
                     "recompute": "/".join(sorted({heaviest(plan_batch(b, c, m, "zeppelin").recompute).mode.value
                                                 for b in batches})),
                     "memory_fill": max(_memory_fill(b, c, m) for b in batches),
                     "more_memory_ratio": statistics.mean(r.step_time_s for r in res) / bound,
                     "more_memory_recompute": "/".join(sorted({r.recompute for r in res}))})
    return rows


def mixed(steps: int) -> list[dict]:
    """LLaMA-7B on the mixed-GPU presets (2 training nodes + 2 loaned inference nodes)."""
    return [config(name, None, "llama-7b", 1, wl, TOKENS_PER_GPU, 65536, steps)
            for name in MIXED for wl in ("wlbllm", "prolong")]


def hop(cluster: str, nodes: int, model: str, length: int) -> dict:
    """One forward K/V ring hop of a `length`-token document split zig-zag over every GPU
    (TE CP: a rank's two chunks, length/num_gpus rows), from the last GPU of node 0 to the
    first of node 1: direct over the sender's NIC, and routed over rail-aligned proxy
    pairs, one per NIC, as many as Zeppelin's planner uses for this document."""
    c, m = specs.cluster(CLUSTERS[cluster], num_nodes=nodes), specs.model(model)
    g = c.groups[0]
    src, dst = g.gpus_per_node - 1, g.gpus_per_node
    plan = plan_batch([length], c, m, "zeppelin")
    k = max((len(r.proxies) for r in plan.routes), default=g.nics_per_node)
    proxies = [(j * g.gpus_per_nic, g.gpus_per_node + j * g.gpus_per_nic) for j in range(k)]
    nbytes = kv_bytes(m, length / c.num_ranks)
    fab = Fabric(c, c.num_ranks, m.tp)
    times = {}
    for name, routed in (("te_cp_ms", False), ("routed_ms", True)):
        tl = Timeline(num_streams=c.num_ranks)
        task = fab.send_routed(tl, src, dst, nbytes, [], name, proxies) if routed else \
            fab.send(tl, src, dst, nbytes, [], name)
        times[name] = tl.run()[1][task] * 1e3
    return {"cluster": cluster, "gpus": c.num_ranks, "model": model, "length": length, "mbytes": nbytes / 1e6,
            "nic_bw": g.nic_bw, "proxies": proxies, **times}


def grid(quick: bool, steps: int) -> list[dict]:
    """The main grid: every cluster, model and workload at 32 GPUs (4 nodes), 64K context."""
    models = MODELS[:2] if quick else MODELS
    return _configs([((cl, 4, mdl, tp, wl, 16384, 65536, steps), {})
                     for cl in CLUSTERS for mdl, tp in models for wl in WORKLOADS])


def scaling(quick: bool, steps: int) -> list[dict]:
    """LLaMA-3B on cluster A, 16 to 128 GPUs (the paper's scaling study)."""
    return [config("A", n, "llama-3b", 1, "wlbllm", 16384, 65536, steps) for n in ((2, 16) if quick else (2, 4, 8, 16))]


def contexts(quick: bool, steps: int) -> list[dict]:
    """LLaMA-7B on cluster B, 32 GPUs, context windows 16K to 128K: documents are cut to
    the window and each GPU holds half a window of tokens."""
    return [config("B", 4, "llama-7b", 1, "prolong", ctx // 2, ctx, steps)
            for ctx in ((16384, 131072) if quick else (16384, 32768, 65536, 131072))]


def scale_grid(steps: int, gpus, workloads_in_turn: list[str]) -> list[dict]:
    """Every GPU count of `gpus` at every context of `SCALE_CONTEXTS`, 16K tokens per GPU;
    (cluster, model) and the workload take turns over the configurations."""
    combos = [(cl, mdl) for mdl in SCALE_MODELS for cl in CLUSTERS]
    calls, i = [], 0
    for n in gpus:
        for ctx in SCALE_CONTEXTS:
            cl, (mdl, tp) = combos[i % len(combos)]
            wl = workloads_in_turn[i % len(workloads_in_turn)]
            calls.append(((cl, n // 8, mdl, tp, wl, TOKENS_PER_GPU, ctx, steps), {"whole": False}))
            i += 1
    return _configs(calls)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def _gpus(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        gpus = ()
    if not gpus or any(n < 8 or n % 8 for n in gpus):
        raise argparse.ArgumentTypeError(f"--scale-gpus wants multiples of 8 separated by commas, got {text!r}")
    return gpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid (2 models, fewer scales)")
    ap.add_argument("--steps", type=int, default=1, help="batches per configuration")
    ap.add_argument("--scale-steps", type=int, default=1, help="batches per configuration of the scale grid")
    ap.add_argument("--scale-gpus", type=_gpus, default=SCALE_GPUS,
                    help="GPU counts of the scale grid (default 64,128,256,512,1024; 'none' is not accepted: give "
                         "--no-scale)")
    ap.add_argument("--no-scale", action="store_true", help="skip the scale grid")
    ap.add_argument("--workload", default=None,
                    help="a lengths file the scale grid samples from instead of the presets (any file `ballonet "
                         "plan --lengths` reads)")
    ap.add_argument("--held", type=int, default=0, metavar="MAX_GPUS",
                    help="also the held-out configurations of bench/estimate.py up to this many GPUs (e.g. 512; "
                         "default 0: none)")
    ap.add_argument("--only", default=None,
                    help="run only these parts, comma-separated (grid, scaling, contexts, mixed, scale, held), and "
                         "skip the ablations: a short check of the report; needs --out")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--jobs", type=int, default=1, help="processes for the configurations (default 1)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    global JOBS
    JOBS = args.jobs
    if args.steps < 1 or args.scale_steps < 1:
        ap.error("--steps and --scale-steps must be at least 1")
    parts = ("grid", "scaling", "contexts", "mixed", "scale", "held")
    only = None if args.only is None else [p.strip() for p in args.only.split(",") if p.strip()]
    if only is not None and (not only or any(p not in parts for p in only)):
        ap.error(f"--only: choose from {', '.join(parts)}, got {args.only!r}")
    if args.held < 0 or (only is not None and "held" in only and not args.held):
        ap.error("--held wants the most GPUs of the held-out configurations to run (e.g. 512), a positive number")
    if only is not None and os.path.abspath(args.out) == os.path.abspath(RESULTS):
        ap.error("--only writes a partial report: give --out a folder other than bench/results")
    if args.workload is not None:
        try:
            workloads.get(args.workload)
        except Exception as e:  # noqa: BLE001 (one line naming the file, exit 2)
            ap.error(f"--workload {args.workload}: {e}")
    t = time.perf_counter()
    data = {"load": os.getloadavg(), "steps": args.steps, "scale_steps": args.scale_steps, "notes": NOTES,
            "length_stats": {w: length_stats(w) for w in WORKLOADS}}
    seconds = {}
    for name, run in (("grid", lambda: grid(args.quick, args.steps)),
                      ("scaling", lambda: scaling(args.quick, args.steps)),
                      ("contexts", lambda: contexts(args.quick, args.steps)),
                      ("mixed", lambda: mixed(args.steps)),
                      ("scale", lambda: [] if args.no_scale else scale_grid(
                          args.scale_steps, args.scale_gpus, [args.workload] if args.workload else SCALE_WORKLOADS)),
                      ("held", lambda: held(args.held, args.scale_steps) if args.held else [])):
        if only is not None and name not in only:
            data[name] = []
            continue
        print(name, file=sys.stderr)
        s = time.perf_counter()
        data[name] = run()
        seconds[name] = time.perf_counter() - s
    os.makedirs(args.out, exist_ok=True)
    if only is None:
        print("pricing ablation, memory headroom, simulator settings", file=sys.stderr)
        data["pricing"] = pricing_ablation(data["grid"], args.steps)
        data["more_memory"] = more_memory(data["grid"], args.steps)
        data["settings"] = sensitivity(data["grid"])
        data["worst"] = worst(data["grid"], args.out)
        over_bound(data, args.out)
        data["ablation"] = ablation(8, "shortmix", args.steps)
        data["hop"] = hop("A", 2, "llama-3b", 65536)
    data["seconds"] = time.perf_counter() - t
    data["seconds_by_part"] = seconds
    data["load_after"] = os.getloadavg()
    name = "paper_quick" if args.quick else "paper"
    data = record(command("paper.py", argv), data, os.path.join(args.out, f"{name}.json"))
    text = report(data) if only is None else partial_report(data)
    write_text(os.path.join(args.out, f"{name}.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
