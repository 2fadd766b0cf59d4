"""Hill-climbing a plan's placement under the simulator: how much of the distance to the
lower bound a partitioner's greedy steps leave (`bench/investigations/hill_climb.py` runs it).

From a zeppelin plan, a random move is kept when the simulated step gets shorter. Moves:
a whole document to another rank, two whole documents swapped, or 16 to 1024 tokens of a
document split inside a node from one of its members to another. The rings stay those
the partitioner chose (rings across nodes keep their tokens), as do its recomputation
(each rank recomputes as little as its tokens need, as simulated) and, where it remaps,
the remap's rule (each node's tokens spread over its ranks).
"""

from __future__ import annotations

import dataclasses
import random

from ballonet.cost.recompute import per_rank_recompute
from ballonet.errors import InfeasiblePlan
from ballonet.plan import Plan
from ballonet.plan.recompute import heaviest
from ballonet.planning.assembly import Placement
from ballonet.planning.devices import devices
from ballonet.planning.routing import plan_routes
from ballonet.planning.zeppelin import finish
from ballonet.simulation.simulator import simulate
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["SHIFTS", "hill_climb", "placement_of", "rebuild"]

SHIFTS = (16, 64, 256, 1024)
"""Tokens a ring-share move takes from one member to another."""


def placement_of(plan: Plan) -> Placement:
    """The placement `plan` was assembled from: its whole documents per rank and, per
    ring, each member's tokens (its chunks i and 2g-1-i)."""
    out = Placement(num_ranks=plan.num_ranks, local=[plan.local_docs(r) for r in range(plan.num_ranks)])
    for ring in plan.rings:
        g, b = len(ring.ranks), ring.bounds
        out.split[ring.doc] = {r: (b[i + 1] - b[i]) + (b[2 * g - i] - b[2 * g - 1 - i])
                               for i, r in enumerate(ring.ranks)}
    return out


def rebuild(plan: Plan, placement: Placement, cluster: ClusterSpec, model: ModelSpec, *,
            price_linear: bool = True) -> Plan:
    """`placement` as a plan made like `plan` (`zeppelin.finish`): the memory caps of the
    costliest recomputation its ranks run (raises `InfeasiblePlan` over them), double
    rings where it had them, its remap rule where it remapped (inside nodes with
    `price_linear`, zeppelin's default), routes where it had them, and what each rank
    recomputes for `model`."""
    caps = heaviest(plan.recompute).mode.value if plan.recompute else model.recompute
    spec = dataclasses.replace(model, recompute=caps)
    dev = devices(cluster, spec)
    copy = dataclasses.replace(placement, local=[list(ds) for ds in placement.local],
                               split={d: dict(s) for d, s in placement.split.items()})  # `assemble` edits it
    out = finish(list(plan.lengths), dev, copy, plan.meta, remap=bool(plan.remap), node_remap=price_linear,
                 double=any(r.comm == "double" for r in plan.rings))
    if plan.routes:
        out = dataclasses.replace(out, routes=plan_routes(out, cluster, spec, dev.local_index))
    return dataclasses.replace(out, recompute=per_rank_recompute(model, out.linear_token_counts, dev.gpu,
                                                                 out.attention_token_counts))


def random_move(placement: Placement, plan: Plan, rng: random.Random) -> Placement | None:
    """One random move on a copy of `placement` (None when the draw has nothing to move):
    a whole document to another rank (60%), two swapped (20%), or `SHIFTS` tokens of a
    ring inside a node from one member to another (20%)."""
    local = [list(ds) for ds in placement.local]
    split = {d: dict(s) for d, s in placement.split.items()}
    R, draw = len(local), rng.random()
    if draw < 0.6:
        a, b = rng.randrange(R), rng.randrange(R)
        if a == b or not local[a]:
            return None
        d = rng.choice(local[a])
        local[a].remove(d)
        local[b].append(d)
    elif draw < 0.8:
        a, b = rng.randrange(R), rng.randrange(R)
        if a == b or not local[a] or not local[b]:
            return None
        d, e = rng.choice(local[a]), rng.choice(local[b])
        local[a][local[a].index(d)], local[b][local[b].index(e)] = e, d
    else:
        inside = [r.doc for r in plan.rings if r.kind == "intra"]
        if not inside:
            return None
        d = rng.choice(inside)
        a, b = rng.sample(sorted(split[d]), 2)
        n = min(rng.choice(SHIFTS), split[d][a] - 1)
        if n <= 0:
            return None
        split[d][a] -= n
        split[d][b] += n
    return dataclasses.replace(placement, local=local, split=split)


def hill_climb(plan: Plan, cluster: ClusterSpec, model: ModelSpec, moves: int, seed: int = 0) -> tuple[Plan, int]:
    """(the shortest plan found from `plan` in `moves` random moves, moves kept)."""
    rng = random.Random(seed)
    placement, best = placement_of(plan), simulate(plan, cluster, model).step_time_s
    kept = 0
    for _ in range(moves):
        trial = random_move(placement, plan, rng)
        if trial is None:
            continue
        try:
            candidate = rebuild(plan, trial, cluster, model)
        except InfeasiblePlan:
            continue
        step = simulate(candidate, cluster, model).step_time_s
        if step < best:
            placement, best, plan, kept = trial, step, candidate, kept + 1
    return plan.validate(), kept
