"""Balance and traffic figures of a plan, from the cost model (per layer, forward).

* attention cost of a rank: seconds of its local documents (`attention_flops` at their
  length) plus its ring positions (`zigzag_flops`, efficiency at its block length; a
  "heads" document's member: 1/g of its FLOPs at its whole length's efficiency);
* `attention_imbalance`: max / mean of those seconds;
* `compute_imbalance`: max / mean of a step's attention plus linear seconds per rank
  (`pricing.rank_compute_seconds`): what the partitioner balances;
* `linear_imbalance`: max / mean of tokens after remap, each rank's tokens divided by its
  share of the cluster's speed (plain max / mean of tokens on a homogeneous cluster);
* bytes: forward K/V of every ring (a "heads" document's forward messages, q, k, v out
  and o back, `cost.flops.message_bytes`) plus what the runtime's remap moves (`cost.flops.
  remap_bytes`: q, k and v toward the attention layout, o back); inter-node
  bytes are those that cross nodes; `max_nic_bytes` is the busiest NIC direction, with
  routed hops spread over their proxies' NICs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import numpy as np

from ballonet.cost.flops import attention_flops, kv_bytes, message_bytes, remap_bytes, zigzag_flops
from ballonet.cost.recompute import plan_recompute
from ballonet.cost.seconds import attention_seconds
from ballonet.plan import Plan, Ring
from ballonet.plan.recompute import heaviest
from ballonet.planning.devices import devices
from ballonet.planning.pricing import rank_compute_seconds
from ballonet.planning.devices import rank_hardware
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["plan_metrics", "rank_attention_seconds", "rank_bytes", "rank_classes", "rank_step_compute_seconds"]


def rank_attention_seconds(plan: Plan, cluster: ClusterSpec, model: ModelSpec) -> list[float]:
    gpu = rank_hardware(cluster, model.tp).gpu
    out = [0.0] * plan.num_ranks
    for r in range(plan.num_ranks):
        for d in plan.local_docs(r):
            L = plan.lengths[d]
            out[r] += attention_seconds(model, gpu[r], attention_flops(model, L), L, launch_floor=True)
    for ring in plan.rings:
        if ring.comm == "heads":
            L, g = plan.lengths[ring.doc], len(ring.ranks)
            for r in ring.ranks:
                out[r] += attention_seconds(model, gpu[r], attention_flops(model, L) / g, L, launch_floor=True)
            continue
        for i, (r, flops) in enumerate(zip(ring.ranks, zigzag_flops(model, ring.bounds).tolist())):
            out[r] += attention_seconds(model, gpu[r], flops, ring.block_tokens(i), launch_floor=True)
    return out


def _traffic(plan: Plan, model: ModelSpec) -> dict:
    """Bytes: forward K/V (`Ring.forward_link_rows`; a "heads" document's forward
    messages), remap, crossing nodes, busiest NIC direction, and per rank out/in."""
    R = plan.num_ranks
    out, inn = [0.0] * R, [0.0] * R
    nic: dict[tuple[str, int], float] = defaultdict(float)
    total = {"kv": 0.0, "remap": 0.0, "inter": 0.0}
    routes = {(rt.doc, rt.src, rt.dst): rt.proxies for rt in plan.routes}
    node = plan.node_of_rank

    def send(src: int, dst: int, nbytes: float, kind: str, proxies=None) -> None:
        total[kind] += nbytes
        out[src] += nbytes
        inn[dst] += nbytes
        if node[src] != node[dst]:
            total["inter"] += nbytes
            pairs = proxies or ((src, dst),)
            for a, b in pairs:
                nic["out", plan.nic_of_rank[a]] += nbytes / len(pairs)
                nic["in", plan.nic_of_rank[b]] += nbytes / len(pairs)

    for ring in plan.rings:
        if ring.comm == "allgather":
            _allgather_traffic(plan, model, ring, out, inn, nic, total)
            continue
        if ring.comm == "heads":
            g = len(ring.ranks)
            for msg in ring.messages():
                if msg.phase == "forward":
                    send(msg.src, msg.dst, message_bytes(model, msg.payload, msg.rows, g), "kv")
            continue
        for src, dst, rows in ring.forward_link_rows():
            send(src, dst, kv_bytes(model, rows), "kv", routes.get((ring.doc, src, dst)))
    for (src, dst), n in plan.remap_tokens().items():  # tokens src -> dst, attention -> linear layout
        send(dst, src, remap_bytes(model, n, toward_attention=True), "remap")
        send(src, dst, remap_bytes(model, n, toward_attention=False), "remap")
    return {**total, "max_nic": max(nic.values(), default=0.0), "out": out, "in": inn}


def _allgather_traffic(plan: Plan, model: ModelSpec, ring: Ring, out, inn, nic, total) -> None:
    """`Ring.forward_link_rows` of an all-gather ring (each block to every other member),
    summed per rank and per node in O(g) rather than per pair."""
    g = len(ring.ranks)
    b = [kv_bytes(model, ring.block_tokens(i)) for i in range(g)]
    node = [plan.node_of_rank[r] for r in ring.ranks]
    per_node: dict[int, float] = defaultdict(float)
    count: Counter = Counter(node)
    for i in range(g):
        per_node[node[i]] += b[i]
    everything = sum(b)
    for i, r in enumerate(ring.ranks):
        far = g - count[node[i]]
        out[r] += b[i] * (g - 1)
        inn[r] += everything - b[i]
        total["kv"] += b[i] * (g - 1)
        total["inter"] += b[i] * far
        nic["out", plan.nic_of_rank[r]] += b[i] * far
        nic["in", plan.nic_of_rank[r]] += everything - per_node[node[i]]


def rank_step_compute_seconds(plan: Plan, cluster: ClusterSpec, model: ModelSpec) -> np.ndarray:
    """[R] a step's attention and linear kernel seconds per rank (`pricing.rank_compute_seconds`)
    under the recomputation each rank runs (`cost.recompute.plan_recompute`)."""
    per_rank = plan_recompute(plan, model, rank_hardware(cluster, model.tp).gpu)
    mode = heaviest(per_rank).mode.value
    spec = dataclasses.replace(model, recompute=mode)
    return rank_compute_seconds(plan, devices(cluster, spec), spec, mode, layers=per_rank)


def plan_metrics(plan: Plan, cluster: ClusterSpec, model: ModelSpec) -> dict:
    seconds = rank_attention_seconds(plan, cluster, model)
    step = rank_step_compute_seconds(plan, cluster, model)
    speed = np.array([gpu.peak_flops for gpu in rank_hardware(cluster, model.tp).gpu])
    linear = np.array(plan.linear_token_counts, dtype=float)
    traffic = _traffic(plan, model)
    mean_s = float(np.mean(seconds))
    per_speed = linear / (speed / speed.sum())
    return {
        "attention_imbalance": max(seconds) / mean_s if mean_s > 0 else 1.0,
        "linear_imbalance": float(per_speed.max() / linear.sum()) if linear.sum() > 0 else 1.0,
        "compute_imbalance": float(step.max() / step.mean()) if step.mean() > 0 else 1.0,
        "attention_max_s": max(seconds),
        "comm_bytes": traffic["kv"] + traffic["remap"],
        "kv_bytes": traffic["kv"],
        "remap_bytes": traffic["remap"],
        "inter_node_bytes": traffic["inter"],
        "max_nic_bytes": traffic["max_nic"],
        "num_rings": len(plan.rings),
        "num_inter_rings": sum(r.kind == "inter" for r in plan.rings),
    }


def rank_bytes(plan: Plan, model: ModelSpec) -> tuple[list[float], list[float]]:
    """Per rank, (bytes sent, bytes received): forward K/V of rings plus the remap (both ways)."""
    traffic = _traffic(plan, model)
    return traffic["out"], traffic["in"]


def rank_classes(plan: Plan, rank: int) -> dict[str, int]:
    """Documents a rank holds (part of), by class."""
    counts = {"local": len(plan.local_docs(rank)), "intra": 0, "inter": 0}
    for doc in {s.doc for s in plan.attention[rank]}:
        ring = plan.ring_of_doc.get(doc)
        if ring is not None:
            counts[ring.kind] += 1
    return counts
