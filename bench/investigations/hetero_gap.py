"""Where zeppelin's distance to the lower bound on mixed GPU types goes (issue 48, item 3).

    OMP_NUM_THREADS=1 python bench/investigations/hetero_gap.py [--steps 8] [--out bench/results]

On `bench/hetero.py`'s configurations (both mixed presets, both workloads, the same
batches: 16K tokens per GPU, 64K context, LLaMA-7B, seed 0), each batch's zeppelin plan is
simulated as chosen and as three counterfactuals, each against the same bound
(`cost.bounds.batch_lower_bound`):

- the best of zeppelin's own candidate plans by simulation (what a perfect estimate could
  choose among the plans the search made);
- zeppelin's plan of the batch on the same cluster with `AMPLE` times each GPU's memory,
  against that cluster's bound: nothing is recomputed, so what is left is placement,
  kernels and communication (the part of the gap that is not memory);
- its plan, where it recomputes fully, with linear recomputation on every layer of every
  rank instead (memory ignored): at most what full recomputation on only the layers that
  need it could buy (the runtime reruns a fully recomputed layer's ring and remap, so every
  rank recomputes fully on every layer or none does: `cost.recompute`);
- its plan with part of the memory-poor group's attention layout moved to the
  memory-rich group (an H800 has 80 GB to an H20's 96; an L40S 48 to an A800's 80): each
  memory-poor rank gives `X` tokens of its shortest whole documents, the linear layout of
  every rank is unchanged (those tokens' GEMMs stay where they were: a remap across the
  groups), and each rank recomputes as little as its new memory needs
  (`cost.recompute.per_rank_recompute`, as `plan_batch` decides). This is the pooling of
  memory across groups that the bound assumes free: it prices the remap traffic it adds.

Each batch's simulated step is also taken apart (`trace`): its slowest rank, what it
spends (attention, linear work, exposed communication, idle), how far it is over its
group's mean, each group's mean compute, which of the bound's parts binds, and the
estimate's error on the chosen plan and on the best candidate by simulation.

And, for each batch whose plan runs a ring inside a PCIe-only node (`zeppelin.pcie_level`),
its rings, its estimated step beside its simulated one, the communication the simulator
leaves exposed on the rings' members and on the PCIe nodes' other ranks, and the best of
its candidates with no such ring, simulated, and its plan with the longest such ring over
one to three fewer members (`fewer_members`), simulated and estimated.

Writes hetero_gap.json and hetero_gap.md to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, BENCH)  # after this folder: bench/ (_common, hetero)

import numpy as np
from _common import RESULTS, command, record, write_text
from hetero import CLUSTERS, MAX_LENGTH, MODEL, TOKENS_PER_GPU, WORKLOADS

from ballonet import plan_batch, specs, workloads
from ballonet.cost import hardware
from ballonet.cost.bounds import bound_parts, overlap_bound
from ballonet.cost.memory import activation_bytes, memory_cap
from ballonet.cost.recompute import per_rank_recompute
from ballonet.plan import Plan, RankRecompute, RecomputeMode
from ballonet.planning.assembly import Placement, assemble
from ballonet.planning.devices import devices
from ballonet.planning.remap import plan_remap
from ballonet.planning.routing import plan_routes
from ballonet.planning.zeppelin import finish
from ballonet.planning.zeppelin.pcie_level import inside_pcie_node, pcie_ring_inside
from ballonet.planning.zeppelin.search import CandidateSearch, ZeppelinOptions
from ballonet.simulation.simulator import simulate

AMPLE = 4
"""Times each GPU's memory in the counterfactual where nothing needs recomputing."""
MOVES = (1000, 2000, 4000, 8000)
"""Attention-layout tokens each memory-poor rank gives the memory-rich group."""


def _recomputed(plan: Plan, model, gpus) -> Plan:
    """`plan` with what each rank recomputes for its tokens (as `plan_batch` sets it)."""
    return dataclasses.replace(plan, recompute=per_rank_recompute(model, plan.linear_token_counts, gpus,
                                                                  plan.attention_token_counts))


def moved(plan: Plan, lengths, cluster, model, per_rank: int) -> Plan:
    """`plan` with up to `per_rank` attention-layout tokens of each memory-poor rank's
    shortest whole documents on the memory-rich group's ranks (the least loaded first),
    its linear layout unchanged (module docstring)."""
    dev = devices(cluster, model)
    caps = {g: memory_cap(model, g, dev.num_ranks) for g in set(dev.gpu)}
    poor_gpu = min(caps, key=caps.get)
    poor = [r for r in range(dev.num_ranks) if dev.gpu[r] == poor_gpu]
    rich = [r for r in range(dev.num_ranks) if dev.gpu[r] != poor_gpu]
    placement = Placement(num_ranks=dev.num_ranks, local=[plan.local_docs(r) for r in range(dev.num_ranks)],
                          rings={ring.doc: (ring.ranks, ring.bounds) for ring in plan.rings})
    attention = np.array(plan.attention_token_counts)
    for r in poor:
        given = 0
        for d in sorted(placement.local[r], key=lambda d: lengths[d]):
            if given + lengths[d] > per_rank:
                break
            to = min(rich, key=lambda x: attention[x])
            placement.local[r].remove(d)
            placement.local[to].append(d)
            attention[[r, to]] += (-lengths[d], lengths[d])
            given += lengths[d]
    new = assemble("zeppelin", list(lengths), dev, placement, attention_engine=True, meta=dict(plan.meta))
    new = dataclasses.replace(new, remap=plan_remap(list(new.attention_token_counts),
                                                    np.array(plan.linear_token_counts), dev.node))
    new = _recomputed(dataclasses.replace(new, routes=plan.routes), model, dev.gpu)
    used = tuple(dev.static_bytes + activation_bytes(model, n, a, m.value, k) for n, a, (m, k)
                 in zip(new.linear_token_counts, new.attention_token_counts, new.recompute))
    return dataclasses.replace(new, memory_bytes=used).validate()


def cross_group_bytes(plan: Plan, cluster, model) -> float:
    """Bytes the remap moves between the groups in a step (q, k, v there and o back in
    the forward, their gradients in the backward: 2 (h + 2 kv + h) bytes a token and layer)."""
    group = devices(cluster, model).group
    tokens = sum(n for (s, d), n in plan.remap_tokens().items() if group[s] != group[d])
    per_token = 2 * (2 * model.hidden + 2 * model.kv_dim) * model.dtype_bytes * model.num_layers
    return float(tokens * per_token)


def fewer_members(plan: Plan, lengths, search: CandidateSearch, ring, k: int) -> Plan:
    """`plan` with `ring` (inside a PCIe-only node) over its first `k` members, equal
    shares, and each member it drops taking whole documents, smallest first, from the
    ranks of its node group outside the ring, up to that group's mean tokens a rank
    (their own ranks keep at least as many): the ring's other sizes, its node kept full."""
    best = search.best
    dev = best.dev
    local = [plan.local_docs(r) for r in range(dev.num_ranks)]
    group = [r for r in range(dev.num_ranks) if dev.group[r] == dev.group[ring.ranks[0]]]
    tokens = np.array(plan.attention_token_counts, dtype=float)
    mean = tokens[group].mean()
    pool = sorted((lengths[d], r, d) for r in group if r not in ring.ranks for d in local[r])
    for r in ring.ranks[k:]:
        got = 0
        for item in list(pool):
            n, src, d = item
            if got + n > mean or tokens[src] - n < mean:
                continue
            local[src].remove(d)
            local[r].append(d)
            tokens[[src, r]] += (-n, n)
            got += n
            pool.remove(item)
    placement = Placement(num_ranks=dev.num_ranks, local=local,
                          rings={x.doc: (x.ranks, x.bounds) for x in plan.rings if x.doc != ring.doc})
    L = lengths[ring.doc]
    placement.split[ring.doc] = {r: L // k + (i < L % k) for i, r in enumerate(ring.ranks[:k])}
    return finish(list(lengths), dev, placement, dict(plan.meta), remap=False, node_remap=True, double=False)


def batch_figures(lengths, cluster, model) -> dict:
    search = CandidateSearch(lengths=list(lengths), cluster=cluster, model=model, options=ZeppelinOptions())
    chosen = search.run()
    gpus = search.best.dev.gpu
    chosen = _recomputed(chosen, model, gpus)
    sim = simulate(chosen, cluster, model)
    bound = sim.lower_bound_s
    candidates = [simulate(_recomputed(dataclasses.replace(
        c.plan, routes=plan_routes(c.plan, cluster, c.model, c.dev.local_index)), model, gpus), cluster, model)
        for c, *_ in search.made]
    dev = search.best.dev
    inside = [r for r in chosen.rings if inside_pcie_node(r, dev)]
    members = sorted({x for r in inside for x in r.ranks})
    others = [x for x in range(dev.num_ranks) if dev.gpu[x].intra_link == "pcie" and x not in members]
    roomy = dataclasses.replace(cluster, groups=tuple(
        dataclasses.replace(g, memory_gb=AMPLE * g.gpu_type.memory_bytes / hardware.GB) for g in cluster.groups))
    ample = simulate(plan_batch(list(lengths), roomy, model, "zeppelin"), roomy, model)
    full = any(m == RecomputeMode.FULL for m, _ in chosen.recompute)
    linear = dataclasses.replace(chosen, recompute=(RankRecompute(RecomputeMode.LINEAR, model.num_layers),)
                                 * chosen.num_ranks)
    out = {"step_s": sim.step_time_s, "linear_for_full_s": simulate(linear, cluster, model).step_time_s
           if full else sim.step_time_s, "bound_s": bound, "compute_s": max(sim.compute_s),
           "recompute": sorted({f"{m.value} on {k}" for m, k in chosen.recompute}),
           "oracle_s": min([sim.step_time_s] + [c.step_time_s for c in candidates]),
           "estimate_s": search.best.seconds,
           "pcie_rings": [[chosen.lengths[r.doc], len(r.ranks)] for r in inside],
           "pcie_ring_exposed_s": max((sim.exposed_comm_s[x] for x in members), default=0.0),
           "pcie_other_exposed_s": statistics.median([sim.exposed_comm_s[x] for x in others]) if others else 0.0,
           "no_pcie_ring_s": min((c.step_time_s for (m, *_), c in zip(search.made, candidates)
                                  if not pcie_ring_inside(m.plan, m.dev)), default=None),
           "pcie_fewer": {},
           "ample_s": ample.step_time_s, "ample_bound_s": ample.lower_bound_s,
           "ample_recompute": ample.recompute,
           "moved": {}, "trace": trace(sim, chosen, dev, lengths, cluster, model)}
    best = min(range(len(candidates)), key=lambda i: candidates[i].step_time_s)
    out["trace"]["best_candidate"] = {"step_s": candidates[best].step_time_s, "estimate_s": search.made[best][0].seconds,
                                      "recompute": candidates[best].recompute}
    for ring in sorted(inside, key=lambda r: -chosen.lengths[r.doc])[:1]:  # the longest
        maker = next(m for c, m, *_ in search.made if c is search.best)
        out["pcie_comm"] = ring.comm
        if ring.comm == "heads":  # split by heads (`pcie_level.by_heads`): the same plan with its rings
            as_ring = dataclasses.replace(chosen, rings=tuple(dataclasses.replace(r, comm="ring") if r in inside
                                                              else r for r in chosen.rings))
            out["as_ring_s"] = simulate(as_ring, cluster, model).step_time_s
            out["as_ring_estimate_s"] = maker.price(as_ring).seconds
        for k in range(len(ring.ranks) - 1, max(len(ring.ranks) - 4, 1), -1):
            plan = fewer_members(chosen, lengths, search, ring, k)
            out["pcie_fewer"][k] = {"step_s": simulate(_recomputed(dataclasses.replace(
                plan, routes=plan_routes(plan, cluster, maker.model, dev.local_index)), model, gpus), cluster,
                model).step_time_s, "estimate_s": maker.price(plan).seconds}
    for x in MOVES:
        plan = moved(chosen, lengths, cluster, model, x)
        res = simulate(plan, cluster, model)
        out["moved"][x] = {"step_s": res.step_time_s, "compute_s": max(res.compute_s),
                           "cross_group_gb": cross_group_bytes(plan, cluster, model) / 1e9,
                           "recompute": sorted({f"{m.value} on {k}" for m, k in plan.recompute})}
    return out


def trace(sim, plan: Plan, dev, lengths, cluster, model) -> dict:
    """The simulated step taken apart: the slowest rank (most compute plus exposed
    communication), its group, attention and linear seconds (recomputation included),
    exposed communication and idle time; each group's mean and busiest compute; and which
    of the bound's three parts binds (`bound_parts`, `overlap_bound`)."""
    slow = int(np.argmax(np.add(sim.compute_s, sim.exposed_comm_s)))
    group = np.array(dev.group)
    pooled, held = bound_parts(lengths, cluster, model)
    parts = {"pooled": pooled, "per group": held, "overlap": overlap_bound(lengths, cluster, model)}
    return {"slowest": slow, "slowest_group": int(group[slow]), "slowest_compute_s": sim.compute_s[slow],
            "slowest_attention_s": sim.attention_s[slow], "slowest_exposed_s": sim.exposed_comm_s[slow],
            "slowest_idle_s": sim.idle_s[slow], "slowest_linear_tokens": plan.linear_token_counts[slow],
            "slowest_attention_tokens": plan.attention_token_counts[slow],
            "group_mean_compute_s": [float(np.mean(np.array(sim.compute_s)[group == g])) for g in sorted(set(dev.group))],
            "group_max_compute_s": [float(np.max(np.array(sim.compute_s)[group == g])) for g in sorted(set(dev.group))],
            "binds": max(parts, key=parts.get)}


def config(cluster_name: str, workload: str, steps: int) -> dict:
    cluster, model = specs.cluster(cluster_name), specs.model(MODEL)
    t = time.perf_counter()
    batches = list(workloads.get(workload).batches(TOKENS_PER_GPU * cluster.num_ranks, 0, steps, MAX_LENGTH))
    per_batch = [batch_figures(b, cluster, model) for b in batches]
    mean = lambda get: statistics.mean(get(b) for b in per_batch)  # noqa: E731
    bound = mean(lambda b: b["bound_s"])
    out = {"cluster": cluster_name, "workload": workload, "steps": steps, "ample_memory": AMPLE, "batches": per_batch,
           "to_bound": mean(lambda b: b["step_s"]) / bound,
           "compute_to_bound": mean(lambda b: b["compute_s"]) / bound,
           "oracle_to_bound": mean(lambda b: b["oracle_s"]) / bound,
           "linear_for_full_to_bound": mean(lambda b: b["linear_for_full_s"]) / bound,
           "ample_to_bound": mean(lambda b: b["ample_s"]) / mean(lambda b: b["ample_bound_s"]),
           "moved": {x: {"to_bound": mean(lambda b: b["moved"][x]["step_s"]) / bound,
                         "compute_to_bound": mean(lambda b: b["moved"][x]["compute_s"]) / bound,
                         "cross_group_gb": mean(lambda b: b["moved"][x]["cross_group_gb"])} for x in MOVES},
           "best_moved_to_bound": mean(lambda b: min([b["step_s"]] + [m["step_s"] for m in b["moved"].values()])) / bound,
           "seconds": time.perf_counter() - t}
    print(f"  {cluster_name} {workload}: {out['to_bound']:.3f} of bound, best candidate {out['oracle_to_bound']:.3f}, "
          f"ample memory {out['ample_to_bound']:.3f} ({out['seconds']:.0f}s)", file=sys.stderr, flush=True)
    return out


def markdown(runs: list[dict], cmd: str, header: str) -> str:
    lines = ["# Where zeppelin's distance to the bound on mixed GPU types goes", "",
             f"Command: `{cmd}` ({header}).", "",
             f"The configurations and batches of `bench/hetero.py` ({runs[0]['steps']} batches each, seed 0); "
             "means over the batches, each over the mean bound (`cost.bounds.batch_lower_bound`). Counterfactuals "
             "(this script's docstring): the best of zeppelin's own candidate plans by simulation; zeppelin on the "
             f"same cluster with {AMPLE}x each GPU's memory over that cluster's bound (nothing recomputed); and the memory-poor "
             "group's attention layout partly moved to the memory-rich group, GEMMs left where they were (a remap "
             "across the groups), each rank recomputing as little as its new memory needs; and, where a plan recomputes "
             "fully, linear recomputation on every layer instead (memory ignored).", "",
             "| cluster | workload | zeppelin / bound | busiest compute / bound | best own candidate / bound | "
             f"{AMPLE}x memory: zeppelin / its bound | full recomputation replaced by linear / bound | "
             + " | ".join(f"{x} tokens moved: step / bound (compute / bound; GB across groups)" for x in MOVES)
             + " |",
             "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in MOVES) + " |"]
    for r in runs:
        moves = " | ".join(f"{m['to_bound']:.3f} ({m['compute_to_bound']:.3f}; {m['cross_group_gb']:.0f})"
                           for m in r["moved"].values())
        lines.append(f"| {r['cluster']} | {r['workload']} | {r['to_bound']:.3f} | {r['compute_to_bound']:.3f} | "
                     f"{r['oracle_to_bound']:.3f} | {r['ample_to_bound']:.3f} | {r['linear_for_full_to_bound']:.3f} | {moves} |")
    lines += ["", "The simulated trace taken apart (`trace`; seconds summed over the batches, over the "
              "bounds summed): the slowest rank (most compute plus exposed communication), by group; its compute, of which "
              "attention (recomputation's rerun included), its exposed communication and idle time; the busiest rank "
              "of its group over that group's mean compute; each group's mean compute; the batches recomputing fully; "
              "the chosen plan's estimate over its simulated step, and the best candidate by simulation (its step "
              "over the bound, its estimate over its step); the bound's part that binds, by batch.", "",
              "| cluster | workload | slowest rank's group | compute | attention | exposed | idle | busiest / group mean "
              "| groups' mean compute | full recomputation | chosen: estimate / step | best candidate: step / bound "
              "(estimate / step) | bound binding |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        gpus = [g.gpu_type.name.upper() for g in specs.cluster(r["cluster"]).groups]
        bs = r["batches"]
        avg = lambda get: sum(get(b) for b in bs) / sum(b["bound_s"] for b in bs)  # noqa: E731
        t = [b["trace"] for b in bs]
        count = lambda xs: ", ".join(f"{x} {xs.count(x)}" for x in sorted(set(xs)))  # noqa: E731
        busiest = statistics.mean(x["group_max_compute_s"][x["slowest_group"]]
                                  / x["group_mean_compute_s"][x["slowest_group"]] for x in t)
        means = ", ".join(f"{gpu} {avg(lambda b, g=g: b['trace']['group_mean_compute_s'][g]):.3f}"
                          for g, gpu in enumerate(gpus))
        full = sum(any(m.startswith("full") for m in b["recompute"]) for b in bs)
        chosen = statistics.mean(b["estimate_s"] / b["step_s"] for b in bs)
        best = statistics.mean(x["best_candidate"]["estimate_s"] / x["best_candidate"]["step_s"] for x in t)
        lines.append(f"| {r['cluster']} | {r['workload']} | {count([gpus[x['slowest_group']] for x in t])} | "
                     f"{avg(lambda b: b['trace']['slowest_compute_s']):.3f} | "
                     f"{avg(lambda b: b['trace']['slowest_attention_s']):.3f} | "
                     f"{avg(lambda b: b['trace']['slowest_exposed_s']):.3f} | "
                     f"{avg(lambda b: b['trace']['slowest_idle_s']):.3f} | {busiest:.3f} | {means} | "
                     f"{full} of {len(bs)} | {chosen:.3f} | "
                     f"{avg(lambda b: b['trace']['best_candidate']['step_s']):.3f} ({best:.3f}) | "
                     f"{count([x['binds'] for x in t])} |")
    lines += ["", "Zeppelin / bound by batch (real memory; " f"{AMPLE}x memory):", ""]
    for r in runs:
        lines.append(f"- {r['cluster']} {r['workload']}: " + ", ".join(
            f"{b['step_s'] / b['bound_s']:.3f} ({b['ample_s'] / b['ample_bound_s']:.3f})" for b in r["batches"]))
    lines += ["", "Batches whose plan splits a document inside a PCIe-only node (`planning/pcie_rings.py` prices "
              "it): its split documents (tokens over members, as a ring or by heads: `pcie_level.by_heads`), its "
              "step simulated and estimated (split by heads: also as a ring), the communication left exposed on the "
              "members and (median) on the PCIe nodes' other ranks, the best candidate with no such split, "
              "simulated, and the chosen plan with its longest such document over fewer members as a ring (equal "
              "shares; each member dropped takes the smallest whole documents of its group's other ranks up to the "
              "group's mean tokens), simulated and estimated:", ""]
    for r in runs:
        for i, b in enumerate(r["batches"]):
            if b["pcie_rings"]:
                other = "none" if b["no_pcie_ring_s"] is None else f"{b['no_pcie_ring_s']:.2f} s"
                lines.append(f"- {r['cluster']} {r['workload']} batch {i}: "
                             + ", ".join(f"{n // 1024}K over {g}" for n, g in b["pcie_rings"])
                             + f" ({b.get('pcie_comm', 'ring')})"
                             + f"; {b['step_s']:.2f} s simulated, {b['estimate_s']:.2f} s estimated"
                             + (f" (as a ring {b['as_ring_s']:.2f} s, {b['as_ring_estimate_s']:.2f} s estimated)"
                                if "as_ring_s" in b else "") + "; exposed "
                             f"{b['pcie_ring_exposed_s']:.1f} s and {b['pcie_other_exposed_s']:.1f} s; "
                             f"without: {other}; the longest ring over fewer members: "
                             + (", ".join(f"{k}: {v['step_s']:.2f} s ({v['estimate_s']:.2f} s estimated)"
                                          for k, v in b["pcie_fewer"].items()) or "none"))
    lines += ["", "Recomputation of zeppelin's plans, and of the plans with 4000 tokens moved (each rank's mode on "
              "its first layers), by batch:", ""]
    for r in runs:
        lines.append(f"- {r['cluster']} {r['workload']}: "
                     + "; ".join(f"{'/'.join(b['recompute'])} -> {'/'.join(b['moved'][4000]['recompute'])}"
                                 for b in r["batches"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="batches per configuration (bench/hetero.py's)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    t = time.perf_counter()
    runs = [config(c, w, args.steps) for c in CLUSTERS for w in WORKLOADS]
    cmd = command("investigations/hetero_gap.py", argv)
    data = record(cmd, {"runs": runs, "seconds": time.perf_counter() - t}, os.path.join(args.out, "hetero_gap.json"))
    header = f"{data['date']}, {data['machine']}, {data['seconds']:.0f} s"
    write_text(os.path.join(args.out, "hetero_gap.md"), markdown(runs, cmd, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
