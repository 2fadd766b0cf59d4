"""The candidate plans of the partitioner: steps 2-4 on a level 1 (`place`, `finish`),
each plan priced as the search compares them (`CandidateMaker`: its estimated step, and
whether memory caps bind where that step is set)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from ballonet.cost import hardware
from ballonet.cost.memory import activation_bytes, recompute_layer_count, recompute_mode
from ballonet.cost.recompute import layers_per_rank
from ballonet.errors import InfeasiblePlan
from ballonet.plan import Plan
from ballonet.plan.recompute import heaviest
from ballonet.planning.assembly import Placement, assemble, over_cap, replaced, with_memory
from ballonet.planning.crossing_rings import EVERY_PORT, PortRuns, crossing_exposed_seconds
from ballonet.planning.devices import Devices
from ballonet.planning.packing import NoRoom, apportion, lpt
from ballonet.planning.pcie_rings import pcie_ring_exposed_seconds
from ballonet.planning.pricing import (
    attention_kernels,
    rank_compute_seconds,
    rank_step_seconds,
    remaps_inside,
    synchronous_step_seconds,
)
from ballonet.planning.ring_waits import ring_wait_seconds
from ballonet.planning.remap import linear_targets, node_linear_targets, plan_remap
from ballonet.planning.step_terms import final_grad_wait_seconds, overlap_slowdown_seconds, step_tail_seconds
from ballonet.planning.zeppelin.classes import NodeLevel
from ballonet.planning.zeppelin.node_placement import level2
from ballonet.planning.zeppelin.refinement import refine
from ballonet.planning.zeppelin.state import Batch, Crossover, RankFill, node_ranks
from ballonet.planning.zeppelin.thresholds import THRESHOLDS
from ballonet.specs import ModelSpec

__all__ = ["Candidate", "CandidateMaker", "caps_bind", "fallback", "finish", "place"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A plan the search compares (`CandidateMaker.make`)."""
    plan: Plan
    seconds: float
    """Its estimated step: its layers, then what the step adds after them (`tail_s`)."""
    tail_s: float
    """The LM head, the last gradient bucket and the optimizer (`step_terms.step_tail_seconds`)."""
    binds: bool
    """Whether caps bind where that step is set (`caps_bind`)."""
    kernels: tuple
    """Its `pricing.attention_kernels`."""
    busiest_s: float
    """Its busiest rank's estimated step (`pricing.rank_step_seconds`)."""
    node_floor_s: float
    """Its busiest node's mean compute plus what its rings across nodes expose: no plan of
    the same nodes goes below it (the keep-tokens plan's `Thresholds.keep_margin`)."""
    dev: Devices
    model: ModelSpec
    """The spec it was made for (the recomputation of its caps)."""
    priced: _Priced | None = dataclasses.field(default=None, repr=False, compare=False)
    """What its estimate read that does not depend on which routed rings ran their ports
    (`CandidateMaker.reprice`)."""


@dataclass(frozen=True, kw_only=True)
class _Priced:
    """A plan's pricing but its single rings across nodes (`CandidateMaker.price`): the
    plan with its memory, the spec and layers it is priced under, its attention kernels,
    [R] attention and linear seconds, the [R] terms its exposure adds after the crossing
    rings' (ring waits, the final gradient wait, the overlap slowdown, the PCIe rings'
    forward and backward, in that order), the PCIe rings' backward skew and the step's tail."""
    plan: Plan
    model: ModelSpec
    layers: object
    kernels: tuple
    attention: np.ndarray
    linear: np.ndarray
    others: tuple
    skew: np.ndarray
    tail: float


@dataclass(frozen=True, kw_only=True)
class CandidateMaker:
    """What the candidate plans of one recomputation mode share: the batch, the devices
    under that mode's caps, the plans' meta, and how they are priced."""
    lengths: list[int]
    dev: Devices
    model: ModelSpec
    """The mode's spec: `recompute` is the mode whose caps the plans are made under."""
    crossovers: list[Crossover]
    meta: dict
    trim: bool
    """Each rank recomputes as little as its tokens need (`cost.recompute.layers_per_rank`),
    its estimate priced so (selective or linear recomputation left to the cost model)."""
    remap: bool
    price_linear: bool
    routing: bool
    fixed_tail_s: float = 0.0
    """What every plan's step adds after its layers but its LM head (`step_terms.fixed_tail_seconds`)."""
    dp_send_s: float = 0.0
    """Seconds of sends of each rank's data-parallel collectives in a step (`step_terms.dp_send_seconds`)."""

    @functools.cached_property
    def links(self) -> _Links:
        """Per rank, the node group's link facts `_step_seconds` prices with (one set per mode)."""
        return _links(self.dev, self.crossovers, self.routing)

    @property
    def every_rank_s(self) -> float:
        """What every rank's estimate adds to its compute whatever the plan: its
        data-parallel sends' slowdown (`step_terms.overlap_slowdown_seconds`; the least
        GPU type's)."""
        return min(hardware.profile(g).overlap_slowdown for g in set(self.dev.gpu)) * self.dp_send_s

    def plan(self, placement: Placement, facts: dict, *, keep: bool, double: bool) -> Plan:
        """Step 4 but routes and memory on `placement` (`remapped`)."""
        return remapped(self.lengths, self.dev, placement, {**self.meta, **facts, "keep_tokens": keep, "double": double},
                        remap=self.remap and not keep, node_remap=self.price_linear, double=double)

    def make(self, placement: Placement, facts: dict, *, keep: bool, double: bool,
             runs: PortRuns = EVERY_PORT) -> Candidate | None:
        """The plan of `placement`, priced (`price`); None when a rank is over its memory cap."""
        plan = self.plan(placement, facts, keep=keep, double=double)
        return None if over_cap(plan, self.dev) is not None else self._estimate(self._priced(plan, within=True), runs)

    def price(self, plan: Plan, runs: PortRuns = EVERY_PORT) -> Candidate:
        """`plan` (within its caps) with its memory and estimated step, its routed rings'
        ports run as `runs` says (`crossing_rings.crossing_exposed_seconds`)."""
        return self._estimate(self._priced(plan), runs)

    def reprice(self, candidate: Candidate, runs: PortRuns = EVERY_PORT) -> Candidate:
        """`price(candidate.plan, runs)`, what does not depend on `runs` read from
        `candidate`'s pricing (the same plan priced again gives the same)."""
        got = candidate.priced
        return self._estimate(got, runs) if got is not None else self.price(candidate.plan, runs)

    def _priced(self, plan: Plan, within: bool = False) -> _Priced:
        """`price` but its routed rings across nodes; `within`: `plan` is known within its caps."""
        model, dev, trim, links = self.model, self.dev, self.trim, self.links
        if not trim:
            plan = with_memory(plan, dev)
        elif not within and (why := over_cap(plan, dev)) is not None:  # (memory: each rank's under its own recomputation, below)
            raise InfeasiblePlan(why)
        caps = recompute_mode(model)  # the mode whose caps the plan was made under
        priced, layers = model, recompute_layer_count(model)  # the model's own, or every layer
        if trim:
            lin, att = plan.linear_token_counts, plan.attention_token_counts
            per_rank = layers_per_rank(model, lin, dev.gpu, dev.num_ranks, att, caps)
            if per_rank is None:  # (the caps hold every layer's activations of the mode; rounding aside)
                per_rank = [(caps, model.num_layers)] * dev.num_ranks
            heavy, most = heaviest(per_rank)
            mode = heavy.value
            priced = dataclasses.replace(model, recompute=mode, recompute_layers=most if mode != "none" else None)
            used = _rank_memory(model, dev, lin, att, per_rank)
            plan = replaced(plan, memory_bytes=used, meta={
                **plan.meta, "recompute": mode, "recompute_layers": most})
            layers = per_rank
        kernels = attention_kernels(plan, dev, priced)
        attention, linear = rank_compute_seconds(plan, dev, priced, recompute_mode(priced), split=True, layers=layers,
                                                 kernels=kernels)
        others, skew = _other_exposed(plan, dev, priced, attention + linear, self.dp_send_s, links, kernels)
        return _Priced(plan=plan, model=priced, layers=layers, kernels=kernels, attention=attention, linear=linear,
                       others=others, skew=skew,
                       tail=step_tail_seconds(plan, dev, priced, links.link, self.fixed_tail_s))

    def _estimate(self, got: _Priced, runs: PortRuns) -> Candidate:
        """The candidate of a plan's pricing (`_priced`), its routed rings' ports run as `runs` says."""
        dev, plan, priced, attention, linear = self.dev, got.plan, got.model, got.attention, got.linear
        seconds, exposed = _step_seconds(plan, dev, priced, (attention, linear), self.links, got.others, runs)
        node = float(dev.node_means(attention + linear + exposed).max())
        busiest = float(seconds.max())
        step = max(busiest, synchronous_step_seconds(plan, dev, priced, got.kernels, seconds,
                                                     attention + linear + got.skew, got.layers if self.trim else None))
        return Candidate(plan=plan, seconds=step + got.tail, tail_s=got.tail, binds=caps_bind(plan, dev, seconds),
                         kernels=got.kernels, busiest_s=busiest, node_floor_s=node, dev=dev, model=self.model,
                         priced=got)


def place(shared: NodeLevel, keep_tokens: bool) -> tuple[Placement, dict] | None:
    """Steps 2-3 on `shared`: every rank keeping its tokens, or remapping inside NVLink
    nodes; (the placement, facts for the plan's meta), or None when a greedy step finds a
    document no room (`NoRoom`)."""
    try:
        return _place(shared, keep_tokens)
    except (NoRoom, InfeasiblePlan):
        return None


def _place(shared: NodeLevel, keep_tokens: bool) -> tuple[Placement, dict]:
    dev = shared.batch.dev
    R, nodes, lengths, intra = dev.num_ranks, dev.nodes(), shared.batch.lengths, shared.intra
    keeps = np.array([keep_tokens or not remaps_inside(g) for g in dev.gpu])
    batch = dataclasses.replace(shared.batch, linear_on_rank=np.where(keeps, shared.rank_token, 0.0))
    fill = RankFill(local=[[] for _ in range(R)], split_shares={}, token_room=dev.token_cap.astype(float))
    if shared.level1 is None:  # every split document over all ranks, shares set by refinement
        solid = [d for d in range(len(lengths)) if not intra[d]]
        for i, docs in lpt(solid, batch.work_list, lengths, np.zeros(R), dev.speed, fill.token_room).items():
            fill.local[i] = docs
        fill.split_shares = {int(d): dict.fromkeys(range(R), 0.0) for d in np.nonzero(intra)[0]}
        return refine(batch, fill), {}
    node_load, node_docs, inter_shares = shared.level1.node_load, shared.level1.node_docs, shared.level1.shares
    stepped: dict[float, Batch] = {}
    water: dict[int, list[tuple[float, int]]] = {}  # per node, its shares of inter-node documents
    for d, sh in inter_shares.items():
        for n, w in sh.items():
            if w > 0:
                water.setdefault(n, []).append((w, d))
    for n, node in enumerate(node_ranks(shared.batch, nodes)):
        level2(batch, fill, node, node_load[n], node_docs.get(n, []), water.get(n, []),
               batch.crossovers[dev.group[nodes[n][0]]].intra, stepped)
    return refine(batch, fill), {"inter_docs": len(inter_shares)}


def fallback(lengths: list[int], dev: Devices) -> Placement:
    """Runs of the batch in input order, cut at speed-proportional token counts."""
    quota = apportion(sum(lengths), dev.speed, dev.token_cap)
    placement = Placement(num_ranks=dev.num_ranks)
    r = 0
    for d, L in enumerate(lengths):
        parts, left = {}, L
        while left:
            while quota[r] == 0:
                r += 1
            take = min(left, int(quota[r]))
            parts[r] = take
            quota[r] -= take
            left -= take
        if len(parts) == 1:
            placement.local[next(iter(parts))].append(d)
        else:
            placement.split[d] = parts
    return placement


def finish(lengths, dev: Devices, placement: Placement, meta, *, remap: bool, node_remap: bool,
           double: bool) -> Plan:
    """Step 4 but routes, on a placement: remap (inside nodes, or across the cluster) and
    memory (raises `InfeasiblePlan` over a cap); the chosen plan gets its routes and is
    validated by `zeppelin` (`bench/investigations/hill_climb.py` rebuilds moved placements with it)."""
    return with_memory(remapped(lengths, dev, placement, meta, remap=remap, node_remap=node_remap, double=double),
                       dev)


def remapped(lengths, dev: Devices, placement: Placement, meta, *, remap: bool, node_remap: bool,
             double: bool) -> Plan:
    """`finish` but memory: the assembled plan, with its remap (inside nodes, or across the
    cluster)."""
    plan = assemble("zeppelin", lengths, dev, placement, double=double, attention_engine=True, meta=meta)
    if remap:
        counts = plan.attention_token_counts
        nodes = [rs for rs in dev.nodes() if remaps_inside(dev.gpu[rs[0]])]
        targets = (node_linear_targets(counts, dev.speed, dev.token_cap, nodes) if node_remap
                   else linear_targets(sum(lengths), dev.speed, dev.token_cap))
        plan = replaced(plan, remap=plan_remap(list(counts), targets, dev.node))
    return plan


@dataclass(frozen=True)
class _Links:
    """[R] each rank's node group's intra-node and crossing bandwidths, rails, NIC share and
    data-parallel pieces (`state.Crossover`)."""
    link: np.ndarray
    nic: np.ndarray
    rails: np.ndarray
    dp_piece: np.ndarray
    rank_nic: np.ndarray


def _links(dev: Devices, crossovers, routing: bool) -> _Links:
    per_group = [crossovers[g] for g in dev.group]
    return _Links(link=np.array([c.intra_bw for c in per_group]), nic=np.array([c.crossing_bw for c in per_group]),
                  rails=np.array([c.rails if routing else 1 for c in per_group]),
                  dp_piece=np.array([c.dp_piece for c in per_group]),
                  rank_nic=np.array([c.rank_nic_bw for c in per_group]))


def _other_exposed(plan: Plan, dev: Devices, model: ModelSpec, compute: np.ndarray, dp_send_s: float, links: _Links,
                   kernels) -> tuple[tuple, np.ndarray]:
    """([R] terms of what `_step_seconds` adds to a rank's attention but its single rings
    across nodes, in the order it adds them: ring waits (`ring_waits.ring_wait_seconds`), the
    final gradient wait, the overlap slowdown, the PCIe-only nodes' rings' forward and
    backward (`pcie_rings`); the latter's backward skew)."""
    link, nic, rails = links.link, links.nic, links.rails
    final = final_grad_wait_seconds(plan, dev, model, link, nic, rails)
    slow = overlap_slowdown_seconds(plan, dev, model, link, nic, dp_send_s, compute)
    pcie = pcie_ring_exposed_seconds(plan, dev, model, link)
    return (ring_wait_seconds(plan, dev, model, kernels), final, slow, pcie.forward, pcie.backward), \
        pcie.backward_skew(final)


def _step_seconds(plan: Plan, dev: Devices, model: ModelSpec, compute, links: _Links, others: tuple,
                  runs: PortRuns = EVERY_PORT) -> tuple[np.ndarray, np.ndarray]:
    """[R] what the partitioner compares its candidate plans by (`pricing.rank_step_seconds`),
    and [R] the part of it single rings across nodes expose (`crossing_rings.crossing_exposed_seconds`;
    their crossing hops routed over the node's rails with `routing`, routed rings' ports
    run as `runs` says) and the `others` (`_other_exposed`) add."""
    link, dp_piece = links.link, links.dp_piece
    start, linear = compute
    exposed = crossing_exposed_seconds(plan, dev, model, link, links.nic, links.rails, dp_piece, runs)
    for term in others:
        exposed = exposed + term
    seconds = rank_step_seconds(plan, dev, model, link, (start + exposed, linear), links.rank_nic, dp_piece)
    return seconds, exposed


def _rank_memory(model: ModelSpec, dev: Devices, linear, attention, per_rank) -> tuple[float, ...]:
    """[R] bytes each rank holds: its state and `activation_bytes` of its `linear` and
    `attention` tokens under its (mode, layers) of `per_rank`, the ranks of a mode at once."""
    lin, att = np.asarray(linear, dtype=np.int64), np.asarray(attention, dtype=np.int64)
    code = {m: i for i, m in enumerate(dict.fromkeys(m for m, _ in per_rank))}  # each mode's number
    modes = np.fromiter((code[m] for m, _ in per_rank), dtype=np.int64, count=len(per_rank))
    layers = np.array([k for _, k in per_rank], dtype=np.int64)
    out = np.zeros(len(per_rank))
    for mode, i in code.items():
        on = modes == i
        out[on] = dev.static_bytes + activation_bytes(model, lin[on], att[on], mode, layers[on])
    return tuple(out.tolist())


def caps_bind(plan: Plan, dev: Devices, seconds: np.ndarray) -> bool:
    """Whether a rank of the node whose rank sets the estimated step (`seconds`, [R]) is
    at its memory cap: only then can looser caps (a costlier recomputation) shorten it."""
    ranks = dev.nodes()[dev.node[int(np.argmax(seconds))]]
    return any(plan.memory_bytes[r] >= (1 - THRESHOLDS.cap_slack) * dev.memory_total[r] for r in ranks)
