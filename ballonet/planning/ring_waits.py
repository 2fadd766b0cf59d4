"""What a ring's members wait for each other in a step's backward (docs/design.md, section
4, the estimate): the runtime queues a rank's local documents after every ring's first
step and steps its rings round-robin, and from the second step on each member waits for
its predecessor's partial dK/dV (sections 7 and 8).
"""

from __future__ import annotations

import numpy as np

from ballonet.plan import Plan
from ballonet.planning.devices import Devices
from ballonet.planning.pricing import attention_kernels
from ballonet.specs import ModelSpec

__all__ = ["ring_wait_seconds"]


def ring_wait_seconds(plan: Plan, dev: Devices, model: ModelSpec, kernels=None) -> np.ndarray:
    """[R] what each member of a ring waits for its slowest member in a step's backward
    (all layers): the runtime queues a rank's local documents after every ring's first
    step, and from the second step on each member waits for its predecessor's partial
    dK/dV before going on (docs/design.md, sections 7 and 8), so a ring's members move on
    together behind the one whose local documents' backward is longest; a member with
    less waits the difference (the most over the rings it is in). Charging the spread of
    the members' ring shares too (they also step together) lengthened more main-grid
    steps than it shortened: the levelling that gives them unequal shares evens more.
    A ring of two waits only at its end (the partial of step 1 leaves before the
    predecessor's local documents): its members then end together behind the one with
    more work in all, which sets the layer's end itself (the simulator ends each layer
    with its slowest rank's), so nothing is charged (the end's own transfer:
    `final_grad_wait_seconds`). A member's other rings' steps fill its wait as its local
    documents do (the engine steps its rings round-robin): not counting them charged a
    member of a small ring beside a large one up to 12% of its step on mixed clusters.
    Where a rank steps two rings or more, their members move on together for longer
    (`_shared_rounds`), and each is charged the more of the two.
    A "heads" document's members wait too, in both passes: `heads_exposure` prices them.
    `kernels`: the plan's `attention_kernels`, when known (read, not recomputed)."""
    R = plan.num_ranks
    rings = [ring.ranks for ring in plan.rings if _waits(ring)]
    if not rings:
        return np.zeros(R)
    rank, _, bwd = kernels if kernels is not None else attention_kernels(plan, dev, model)
    n = sum(len(ring.ranks) for ring in plan.rings)  # the kernels end with every ring position, in ring order
    ring_rank, own = rank[len(rank) - n:], bwd[len(rank) - n:]
    local = np.bincount(rank[:len(rank) - n], weights=bwd[:len(rank) - n], minlength=R).astype(float)
    fill = local + np.bincount(ring_rank, weights=own, minlength=R)  # [R] local documents and every ring step
    big = np.repeat([_waits(ring) for ring in plan.rings], [len(ring.ranks) for ring in plan.rings])
    members = ring_rank[big]
    sizes = [len(ranks) for ranks in rings]
    slowest = np.maximum.reduceat(local[members], np.cumsum([0] + sizes[:-1]))  # per ring
    out = np.zeros(R)
    # the most over a rank's rings; what fills it: all but this ring's own steps
    np.maximum.at(out, members, np.repeat(slowest, sizes) - (fill[members] - own[big]))
    if np.bincount(members, minlength=R).max() > 1:
        out = np.maximum(out, _shared_rounds(plan, ring_rank, own, local, fill, big))
    return model.num_layers * out


def _shared_rounds(plan: Plan, ring_rank: np.ndarray, own: np.ndarray, local: np.ndarray, fill: np.ndarray,
                   big: np.ndarray) -> np.ndarray:
    """[R] one layer's wait of each member of a ring whose members wait (`_waits`) that
    a member shares with another such ring: that member steps them round-robin, one step
    of each still going a round, and from the second round on each member waits for its
    predecessor's partial, so the ring moves on round by round behind its busiest member
    of that round, after its longest local documents, and a member waits where that
    leaves the ring's end beyond its own work. Charged as rings of one member each alone
    (`ring_wait_seconds`), a member of two rings waited for neither: C, 32 GPUs,
    llama-7b, a step of WLB-LLM's outlier delay, eight 64K documents, a ring over 5 ranks
    of a node inside one over its 8, 4.35 s estimated and 5.15 s simulated. A ring of
    two beside them is not counted (it waits only at its end: its steps fill the others'
    waits as local documents do). Positions are `ring_wait_seconds`' (`ring_rank`,
    `own`; `big`: those of rings whose members wait)."""
    R = plan.num_ranks
    counts = [len(ring.ranks) for ring in plan.rings]
    sizes = np.repeat(counts, counts)
    K = int(sizes[big].max())
    per_round = np.zeros((R, K + 1))  # [R, rounds] each rank's ring steps in each round, as differences
    np.add.at(per_round, (ring_rank[big], 0), own[big] / sizes[big])
    np.add.at(per_round, (ring_rank[big], sizes[big]), -own[big] / sizes[big])
    per_round = np.cumsum(per_round, axis=1)
    shared = np.bincount(ring_rank[big], minlength=R) > 1
    out = np.zeros(R)
    start = 0
    for n in counts:
        members = ring_rank[start:start + n]
        if big[start] and shared[members].any():
            end = local[members].max() + per_round[members, :n].max(axis=0).sum()
            out[members] = np.maximum(out[members], end - fill[members])
        start += n
    return out


def _waits(ring) -> bool:
    """Whether `ring_wait_seconds` prices `ring`'s members' waits: over two members, not a
    "heads" document (`heads_exposure` prices its waits for its slowest member)."""
    return len(ring.ranks) > 2 and ring.comm != "heads"
