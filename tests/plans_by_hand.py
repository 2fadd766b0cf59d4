"""Plans built by hand for the runtime's tests: small ones whose every segment, ring,
transfer and route a test can name, plans of given placements (`make_plan`, `hand_plans`),
and routed and double rings (`rails_plan`, `tangled_plan`, `plans4`, `plans6`)."""

from __future__ import annotations

import dataclasses
import random

from ballonet.plan import Plan, Ring, Route, Segment, Transfer, chunk_bounds
from ballonet.planning.assembly import zigzag_bounds


def one_rank_plan(lengths=(5, 3), order=None) -> Plan:
    """One rank holding documents of `lengths`, in `order` (default input order)."""
    order = range(len(lengths)) if order is None else order
    return Plan(planner="hand", lengths=tuple(lengths), node_of_rank=(0,), nic_of_rank=(0,),
                attention=(tuple(Segment(d, 0, lengths[d]) for d in order),)).validate()


def small_plan(**changes) -> Plan:
    """2 nodes x 2 ranks; documents of 5, 7 and 3 tokens; the 7-token one split over
    ranks 0 and 2 (chunks 0,3 on rank 0 and 1,2 on rank 2); rank 1 gives one token to rank 0."""
    fields = dict(
        planner="hand",
        lengths=(5, 7, 3),
        node_of_rank=(0, 0, 1, 1),
        nic_of_rank=(0, 1, 2, 3),
        attention=(
            (Segment(1, 0, 1), Segment(1, 5, 7)),
            (Segment(0, 0, 5),),
            (Segment(1, 1, 3), Segment(1, 3, 5)),
            (Segment(2, 0, 3),),
        ),
        rings=(Ring(doc=1, kind="inter", ranks=(0, 2), bounds=(0, 1, 3, 5, 7)),),
        remap=(Transfer(1, 0, 4, 5),),
        routes=(Route(doc=1, src=0, dst=2, proxies=((0, 2), (1, 3))),),
        memory_bytes=(10.0, 10.0, 10.0, 10.0),
        memory_cap=(20.0, 20.0, 20.0, 20.0),
    )
    fields.update(changes)
    return Plan(**fields)


def remap_plan() -> Plan:
    """2 nodes x 2 ranks, 32 tokens, 8 per rank after the remap. Document 0 (9 tokens) is
    split over ranks 0 and 2 (chunks 0,3 and 1,2). Every rank sends and receives; rank 1
    sends two ranges to rank 0 and one to rank 3; rank 3's range [4, 7) spans two documents.

    Global positions: doc 0 is 0..8, 1 is 9..14, 2 is 15..17, 3 is 18..22, 4 is 23..24,
    5 is 25..28, 6 is 29..31."""
    return Plan(
        planner="hand",
        lengths=(9, 6, 3, 5, 2, 4, 3),
        node_of_rank=(0, 0, 1, 1),
        nic_of_rank=(0, 1, 2, 3),
        attention=(
            (Segment(0, 0, 2), Segment(0, 6, 9), Segment(4, 0, 2)),
            (Segment(1, 0, 6), Segment(2, 0, 3)),
            (Segment(0, 2, 4), Segment(0, 4, 6), Segment(6, 0, 3)),
            (Segment(3, 0, 5), Segment(5, 0, 4)),
        ),
        rings=(Ring(doc=0, kind="inter", ranks=(0, 2), bounds=chunk_bounds(9, 4)),),
        remap=(Transfer(1, 0, 7, 9), Transfer(1, 0, 2, 3), Transfer(1, 3, 5, 6),
               Transfer(0, 2, 1, 3), Transfer(3, 1, 4, 7), Transfer(2, 3, 0, 1)),
    ).validate()


NODES = {1: (0,), 2: (0, 1), 4: (0, 0, 1, 1)}


def make_plan(lengths, placement, node_of_rank, comms=None, seed=None, groups=None, tokens=None) -> Plan:
    """placement[d]: a rank (document d whole there) or a tuple of ranks (its ring, in
    order); comms[d]: that ring's comm; groups[d]: that ring is "double" over so many node
    groups; tokens[d]: its tokens per position (`zigzag_bounds`; default: even chunks).
    With `seed`, each rank's units (a local document, or the chunk pair of a ring) are
    shuffled."""
    units = [[] for _ in node_of_rank]
    rings = []
    for d, (length, where) in enumerate(zip(lengths, placement)):
        if isinstance(where, int):
            units[where].append((Segment(d, 0, length),))
            continue
        nodes = {node_of_rank[r] for r in where}
        k = (groups or {}).get(d, 1)
        bounds = zigzag_bounds(length, tokens[d]) if d in (tokens or {}) else chunk_bounds(length, 2 * len(where))
        ring = Ring(doc=d, kind="inter" if len(nodes) > 1 else "intra", ranks=tuple(where), bounds=bounds,
                    comm="double" if k > 1 else (comms or {}).get(d, "ring"), groups=k)
        rings.append(ring)
        for i, r in enumerate(where):
            units[r].append(ring.chunks_of(i))
    if seed is not None:
        for u in units:
            random.Random(seed).shuffle(u)
    return Plan(planner="hand", lengths=tuple(lengths), node_of_rank=tuple(node_of_rank),
                nic_of_rank=tuple(range(len(node_of_rank))),
                attention=tuple(tuple(s for unit in u for s in unit) for u in units), rings=tuple(rings)).validate()


def hand_plans(world: int) -> dict[str, Plan]:
    nodes, ranks = NODES[world], tuple(range(world))
    lengths = [13, 1, 7, 2 * world + 1, 30, 3]
    plans = {
        "te_cp": make_plan(lengths, [ranks] * len(lengths), nodes),
        "llama_cp": make_plan(lengths, [ranks] * len(lengths), nodes, comms=dict.fromkeys(range(len(lengths)), "allgather")),
        "packed": make_plan(lengths, [d % world for d in range(len(lengths))], nodes),
    }
    for seed in range(3):
        rng = random.Random(100 * world + seed)
        lengths = [rng.choice([1, rng.randint(2, 9), rng.randint(10, 45)]) for _ in range(rng.randint(4, 8))]
        placement, comms = [], {}
        for d in range(len(lengths)):
            if rng.random() < 0.4:
                placement.append(rng.randrange(world))
            else:
                placement.append(tuple(rng.sample(ranks, rng.randint(1, world))))
                comms[d] = rng.choice(["ring", "ring", "allgather"])
        plans[f"random{seed}"] = make_plan(lengths, placement, nodes, comms, seed=seed)
    return plans


def routed(plan: Plan, *routes: tuple[int, int, int, tuple]) -> Plan:
    return dataclasses.replace(plan, routes=tuple(Route(doc=d, src=s, dst=t, proxies=p) for d, s, t, p in routes)).validate()


def rails_plan() -> Plan:
    """Document 0 (16 tokens) on the ring 0 1 2 3, four rows per rank; hops 1->2 and 3->0
    cross nodes and go over both rails, as the planner routes them."""
    plan = make_plan([16, 5], [(0, 1, 2, 3), 1], (0, 0, 1, 1))
    return routed(plan, (0, 1, 2, ((0, 2), (1, 3))), (0, 3, 0, ((2, 0), (3, 1))))


def tangled_plan() -> Plan:
    """Every hop of three rings crosses nodes and is routed: proxies equal to the source
    or destination or to each other, three-leg paths, parts of one row or none, ranks that
    forward for rings they are not in, hops of one ring sharing a pair of ranks; beside an
    unrouted all-gather ring, an intra-node ring and local documents."""
    lengths = [37, 9, 5, 6, 11, 4, 3]
    plan = make_plan(lengths, [(0, 2, 1, 3), (1, 3), (2, 0, 3, 1), (0, 3), (2, 3), 0, 2], (0, 0, 1, 1),
                     comms={3: "allgather"}, seed=4)
    return routed(plan,
                  (0, 0, 2, ((0, 2), (1, 3))), (0, 2, 1, ((3, 1), (2, 0), (3, 0))),
                  (0, 1, 3, ((1, 3), (0, 2))), (0, 3, 0, ((2, 1),)),
                  (1, 1, 3, ((0, 2),)), (1, 3, 1, ((2, 0), (3, 1))),
                  (2, 2, 0, ((2, 0), (3, 1), (2, 1))), (2, 0, 3, ((1, 2), (0, 3), (1, 3))),
                  (2, 3, 1, ((3, 1), (3, 0), (2, 1))), (2, 1, 2, ((0, 2), (1, 3), (0, 3))))


NODES4, NODES6 = (0, 0, 1, 1), (0, 0, 1, 1, 2, 2)


def plans4() -> dict[str, Plan]:
    lengths = [37, 13, 5, 20, 9, 7, 3, 11, 6]
    placement = [(0, 1, 2, 3), (0, 2), (2, 3, 0, 1), (0, 1, 2, 3), (2, 3), 1, 3, (3, 1), (1, 2)]
    mixed = make_plan(lengths, placement, NODES4, comms={8: "allgather"}, seed=3,
                      groups={0: 2, 1: 2, 2: 2, 7: 2}, tokens={0: [11, 7, 12, 7], 1: [8, 5], 2: [2, 0, 3, 0]})
    routes = (Route(doc=3, src=1, dst=2, proxies=((0, 2), (1, 3))), Route(doc=3, src=3, dst=0, proxies=((2, 0), (3, 1))))
    return {
        "alone": make_plan([64], [(0, 1, 2, 3)], NODES4, groups={0: 2}, tokens={0: [20, 12, 18, 14]}),
        "mixed": mixed,
        "mixed routed": dataclasses.replace(mixed, routes=routes).validate(),
    }


def plans6() -> dict[str, Plan]:
    lengths = [45, 12, 10, 8, 15, 6, 4]
    placement = [(0, 1, 2, 3, 4, 5), (4, 0, 2), (2, 3, 4, 5), (5, 1), (1, 3, 5), 0, 4]
    return {"three nodes": make_plan(lengths, placement, NODES6, seed=5, groups={0: 3, 1: 3, 2: 2, 3: 2},
                                     tokens={0: [9, 6, 8, 7, 10, 5], 1: [5, 3, 4]})}


def heads_plan() -> Plan:
    """"heads" documents (one of a member holding no row) beside a double ring, a routed
    ring, an all-gather ring, a ring and local documents, on 2 nodes x 2 ranks."""
    plan = make_plan([37, 13, 20, 9, 21, 19, 5, 3, 11],
                     [(0, 1, 2, 3), (0, 2), (0, 1, 2, 3), (1, 2), (0, 1), (3, 2), 1, 3, (2, 3)], NODES4,
                     comms={3: "allgather", 4: "heads", 5: "heads", 8: "heads"}, seed=6, groups={0: 2},
                     tokens={5: [19, 0]})
    return routed(plan, (2, 1, 2, ((0, 2), (1, 3))), (2, 3, 0, ((2, 0), (3, 1))))
