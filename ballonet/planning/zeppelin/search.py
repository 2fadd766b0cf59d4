"""The partitioner's search: plans for each recomputation mode, with single rings and then
with "double" rings across nodes, each with every rank keeping its tokens and with the
remap, keeping the plan with the shortest estimated step (docs/design.md, section 4).

`CandidateSearch` walks those three axes in one loop each. Beside each mode's level 1 it
plans its variants: nodes priced under what their shares recompute (`recomputed.py`),
heavy documents over two nodes (`variants.spread_level`) and, for the best plan, a level 1
with no document split inside a PCIe-only node where it has a ring there (`pcie_level.py`),
one with every document a node holds inside one where a member of its ring across nodes
steps another ring (`variants.inside_level`) and one balanced on the backward
(`variants.backward_level`), the best plan, where it
remaps, with its nodes' ranks evened in attention tokens (`evened.py`), and, where its rings
across nodes are double, with its most waiting one over one node more, compared with it by
their members' waits as the simulator runs them (`variants.wider_level`, `member_waits.py`),
and last the chosen plan with its rings inside PCIe-only nodes split by heads
(`pcie_level.by_heads`). A double level 1 that sends the same
documents to the same nodes reuses its single one's placements (`prunes.same_nodes`). Every
prune is a named predicate (`prunes.py`: `level_too_slow`, `level_enough`, `costlier_mode_loses`,
`plan_looser`), every step that can fail returns None, and the one reason the search
refuses the batch is kept (`refusal`). Until the best plan's variants, candidates are
priced with their routed single rings across nodes hop by hop (`crossing_rings.HOP_BY_HOP`);
then the few that can still win run those rings' ports (`_settle`, `settling.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ballonet.cost.memory import BELOW, recompute_layer_count, recompute_mode
from ballonet.cost.seconds import attention_work
from ballonet.errors import InfeasiblePlan, InputError
from ballonet.plan import Plan
from ballonet.planning.assembly import Placement, over_cap
from ballonet.planning.devices import check_lengths, devices, infeasibility
from ballonet.planning.crossing_rings import EVERY_PORT, HOP_BY_HOP, PortRuns
from ballonet.planning.pricing import recompute_modes
from ballonet.planning.routing import plan_routes
from ballonet.planning.step_terms import dp_send_seconds, fixed_tail_seconds
from ballonet.planning.zeppelin.candidates import Candidate, CandidateMaker, fallback, place
from ballonet.planning.zeppelin.classes import NodeLevel, crossover_lengths, level_nodes
from ballonet.planning.zeppelin.evened import evened
from ballonet.planning.zeppelin.pcie_level import by_heads, pcie_ring_inside, unsplit_level
from ballonet.planning.zeppelin.prunes import (
    costlier_mode_loses,
    level_enough,
    level_too_slow,
    plan_looser,
    same_nodes,
)
from ballonet.planning.zeppelin.recomputed import mixed, recomputed_levels
from ballonet.planning.zeppelin.settling import settle
from ballonet.planning.zeppelin.thresholds import THRESHOLDS
from ballonet.planning.zeppelin.member_waits import corrected_step, double_wait_excess
from ballonet.planning.zeppelin.variants import backward_level, doubled_level, inside_level, spread_level, wider_level
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["CandidateSearch", "ZeppelinOptions", "zeppelin"]

Placed = dict[bool, tuple[Placement, dict] | None]
"""A level 1's placements (`candidates.place`) by keep_tokens, None where it found no room."""


class Made(NamedTuple):
    """A plan `CandidateSearch._made`, with where it came from."""
    candidate: Candidate
    maker: CandidateMaker
    level: NodeLevel
    """The level 1 it was made from."""
    placed: Placed
    """That level's placements."""


@dataclass(frozen=True, kw_only=True)
class ZeppelinOptions:
    """The partitioner's switches (`zeppelin`'s keyword arguments; in `plan.meta["options"]`)."""
    routing: bool = True
    """Route crossing ring hops over idle, rail-aligned NICs (and price them so)."""
    remap: bool = True
    """Remap tokens for the linear layers (off: every rank keeps its attention tokens)."""
    hierarchical: bool = True
    """Nodes first, then ranks (off: a document that must be split spans every rank)."""
    assume_homogeneous: bool = False
    """Plan as if every GPU were the first type (memory caps stay real)."""
    price_linear: bool = True
    """Balance nodes on attention plus linear work, remap inside nodes only, and keep every
    rank's tokens where that prices shorter (off: attention alone, remap across the cluster)."""
    price_recompute: bool = True
    """Plan for each recomputation the batch fits under (off: the model's, full when unset)."""
    double: bool = True
    """Also plan "double" rings across nodes where that pricing sends any document across."""

    def __post_init__(self):
        for key, value in dataclasses.asdict(self).items():
            if not isinstance(value, bool):
                raise InputError(f"zeppelin option {key} must be True or False, got {value!r}")


@dataclass
class CandidateSearch:
    """One batch's search (`run`): its inputs, the best plan so far, every plan compared
    (`plan.meta["candidates"]`) and why the batch was refused, if it was."""
    lengths: list[int]
    cluster: ClusterSpec
    model: ModelSpec
    options: ZeppelinOptions
    crossovers: list = field(default_factory=list)
    best: Candidate | None = None
    compared: list[dict] = field(default_factory=list)
    refusal: str | None = None
    """The last mode's reason for no plan (a batch over every cap)."""
    made: list[Made] = field(default_factory=list)
    """Every plan `_made`, with where it came from."""
    pending: list = field(default_factory=list)
    """(its place in `compared`, plan, its maker) of every plan compared hop by hop, for `_settle`."""
    settled: bool = False
    """Whether `_settle` has run: candidates made since run every routed ring's ports (`runs`)."""

    @property
    def best_s(self) -> float:
        return self.best.seconds if self.best is not None else np.inf

    @property
    def best_layers_s(self) -> float:
        """The best plan's estimated layers (its step but `Candidate.tail_s`): what the
        prunes' bounds, which count layers only, are compared with."""
        return self.best.seconds - self.best.tail_s if self.best is not None else np.inf

    @property
    def runs(self) -> PortRuns:
        """Which routed rings' ports the candidates made now run: none until `_settle`, every one after."""
        return EVERY_PORT if self.settled else HOP_BY_HOP

    def run(self) -> Plan:
        opts, model = self.options, self.model
        self.crossovers = crossover_lengths(self.cluster, model)
        self._search()
        self._settle()
        self._variants()
        if self.best is None:
            raise InfeasiblePlan(self.refusal)
        best = self.best
        plan = dataclasses.replace(best.plan, meta={**best.plan.meta, "candidates": self.compared,
                                                    "estimated_step_s": best.seconds})
        if opts.routing:
            plan = dataclasses.replace(plan, routes=plan_routes(plan, self.cluster, best.model, best.dev.local_index))
        return plan.validate()

    def _search(self) -> None:
        """Each mode's level 1s and their variants, then the double and spread level 1s."""
        opts, model = self.options, self.model
        modes = recompute_modes(model) if opts.price_recompute else (recompute_mode(model),)
        trim = opts.price_recompute and model.recompute is None  # selective on as few layers as a plan needs
        singles: list[tuple[CandidateMaker, NodeLevel, Placed]] = []  # each mode's single-ring level 1, for `double`
        looser = False  # this mode is planned for its looser caps, whatever its cost on every layer
        for i, mode in enumerate(modes):
            maker = self._maker(dataclasses.replace(model, recompute=mode), trim and mode in BELOW)
            if maker is None:
                continue
            level = level_nodes(self.lengths, maker.dev, self.crossovers, maker.model, hierarchical=opts.hierarchical,
                                price_linear=opts.price_linear, routing=opts.routing)
            extra: list[NodeLevel] = []
            if level is not None and level.level1 is not None and maker.trim and opts.price_linear \
                    and not opts.assume_homogeneous:  # nodes priced under what their shares recompute
                level, *extra = recomputed_levels(level, mixed_cluster=mixed(maker.dev))
            if level is not None and level_too_slow(level, maker, np.inf if looser else self.best_layers_s):
                break  # and costlier modes, whose caps are tighter nowhere
            placed: Placed = {}
            plans = self._made(maker, level, placed) if level is not None else []
            for lv in extra if plans else ():  # as the mode's best plan: keeping tokens or remapping them
                if not level_too_slow(lv, maker, np.inf if looser else self.best_layers_s):
                    plans += self._made(maker, lv, {}, keep=min(plans, key=lambda c: c.seconds).plan.meta["keep_tokens"])
            if not plans and i == len(modes) - 1 and self.best is None:
                plans = self._fallback(maker)
            if not plans:
                continue
            self._compare(plans, maker)
            if level is not None:
                singles.append((maker, level, placed))
                top = min(plans, key=lambda c: c.seconds)  # a variant level 1 whose plan is the mode's best
                singles += [(maker, lv, p) for c, _, lv, p in self.made if c is top and lv is not level]
            if i + 1 < len(modes):
                looser = plan_looser(trim, modes[i + 1], self.best)
                if not looser and costlier_mode_loses(plans[0], modes[i + 1], self.best_layers_s):
                    break
        # After the single-ring search, so that it prunes as without `double`; the most
        # promising level 1 first, so that the others' prune meets the best plan it makes.
        # A double level 1 that sends the same documents to the same nodes as the single one
        # places them alike: only the rings across nodes run (and are priced) otherwise.
        doubled = [(d, maker, placed if same_nodes(level, d) else {}) for maker, level, placed in singles
                   if opts.double
                   and (d := doubled_level(level, price_linear=opts.price_linear, routing=opts.routing)) is not None]
        spread: list[tuple[NodeLevel, CandidateMaker, Placed]] = [  # heavy documents over two nodes
            (s, maker, {}) for maker, level, _ in singles
            if opts.price_linear and opts.hierarchical and (s := spread_level(level)) is not None]
        for level, maker, placed in sorted(doubled + spread, key=lambda x: x[0].node_seconds):
            if not level_too_slow(level, maker, self.best_layers_s):
                self._compare(self._made(maker, level, placed), maker)

    def _variants(self) -> None:
        """The best plan's variants (priced port by port). Each reads the best plan as the
        variants before it left it (`_best_made`)."""
        opts = self.options
        # The best plan's most waiting double ring over one node more, compared by its members' waits (`member_waits`).
        if (best := self._best_made()) is not None and best.level.double:
            self._wider(best.candidate, best.maker, best.level)
        # The best plan's level 1 with no ring inside a PCIe-only node, where it has one (`pcie_level`).
        if (best := self._best_made()) is not None and pcie_ring_inside(best.candidate.plan, best.candidate.dev) \
                and (unsplit := unsplit_level(best.level)) is not None \
                and not level_too_slow(unsplit, best.maker, self.best_layers_s):
            self._compare(self._made(best.maker, unsplit, {}), best.maker)
        # The best plan's level 1 with every document one node holds kept inside one (`variants.inside_level`).
        if (best := self._best_made()) is not None and opts.hierarchical \
                and (inside := inside_level(best.level, best.candidate.plan)) is not None \
                and not level_too_slow(inside, best.maker, self.best_layers_s):
            self._compare(self._made(best.maker, inside, {}), best.maker)
        # The best plan's level 1 balanced on the backward, where every rank recomputes alike.
        if (best := self._best_made()) is not None and opts.price_linear and best.maker.model.recompute not in BELOW \
                and (backward := backward_level(best.level)) is not None \
                and not level_too_slow(backward, best.maker, self.best_layers_s):
            made = self._candidate(best.maker, backward, best.candidate.plan.meta["keep_tokens"], {})  # as the best plan
            if made is not None and made.seconds < (1 - THRESHOLDS.variant_margin) * best.candidate.seconds:
                self._compare([made], best.maker)
        # The best plan, where it remaps, with its nodes' ranks evened in attention tokens (`evened`).
        if (best := self._best_made()) is not None and not best.candidate.plan.meta["keep_tokens"] \
                and (got := best.placed.get(False)) is not None:
            self._compare(self._evened(best.candidate, best.maker, *got), best.maker)
        # The chosen plan with its rings inside PCIe-only nodes split by heads (`pcie_level.by_heads`).
        if (best := self._best_made()) is not None \
                and (heads := by_heads(best.candidate.plan, best.candidate.dev, best.candidate.model)) is not None:
            made = best.maker.price(heads, self.runs)
            self.made.append(best._replace(candidate=made))
            self._compare([made], best.maker)

    def _best_made(self) -> Made | None:
        """The best plan as it is now, with where it came from (its entry in `made`); None
        where it was not made from a level 1 (a fallback) or there is none."""
        return next((x for x in self.made if x.candidate is self.best), None)

    # ---- one mode ---------------------------------------------------------------------

    def _maker(self, spec: ModelSpec, trim: bool) -> CandidateMaker | None:
        """The mode's devices and plan facts; None (the reason kept) when no plan can hold
        the batch under its caps."""
        dev = devices(self.cluster, spec, self.options.assume_homogeneous)
        why = infeasibility(self.lengths, dev, spec)
        if why is not None:
            self.refusal = why
            return None
        opts = self.options
        meta = {"options": dataclasses.asdict(opts),
                "crossover_lengths": [dataclasses.asdict(t) for t in self.crossovers],
                "recompute": spec.recompute, "recompute_layers": recompute_layer_count(spec), "keep_tokens": False,
                "fallback": False}
        return CandidateMaker(lengths=self.lengths, dev=dev, model=spec, crossovers=self.crossovers, meta=meta,
                              trim=trim, remap=opts.remap, price_linear=opts.price_linear, routing=opts.routing,
                              fixed_tail_s=fixed_tail_seconds(self.cluster, dev, spec),
                              dp_send_s=dp_send_seconds(self.cluster, spec))

    def _plans(self, maker: CandidateMaker, level: NodeLevel, placed: Placed) -> list[Candidate]:
        """From one level 1: every rank keeping its tokens (attention plus linear work
        balanced per rank; when pricing may prefer it), then remapping tokens inside
        nodes unless the first is already `level_enough`. A plan the greedy steps cannot
        fit is left out: [] when neither fits. `placed`: the placements of a level 1 of
        the same nodes (`prunes.same_nodes`), by keep; those made here are added."""
        out = []
        if self.options.price_linear and self.options.remap:
            kept = self._candidate(maker, level, True, placed)
            if kept is not None:
                out.append(kept)
                if level_enough(kept):
                    return out
        remapped = self._candidate(maker, level, False, placed)
        return out + ([remapped] if remapped is not None else [])

    def _made(self, maker: CandidateMaker, level: NodeLevel, placed: Placed, keep: bool | None = None) \
            -> list[Candidate]:
        """`_plans` (with `keep`, that plan alone), each kept in `made` with where it came from."""
        plans = self._plans(maker, level, placed) if keep is None else [
            c for c in (self._candidate(maker, level, keep, placed),) if c is not None]
        self.made += [Made(c, maker, level, placed) for c in plans]
        return plans

    def _candidate(self, maker: CandidateMaker, level: NodeLevel, keep: bool, placed: Placed) -> Candidate | None:
        if keep not in placed:
            placed[keep] = place(level, keep_tokens=keep)
        got = placed[keep]
        if got is None:
            return None
        placement, facts = got
        return maker.make(placement.copy(), facts, keep=keep, double=level.double, runs=self.runs)

    def _evened(self, best: Candidate, maker: CandidateMaker, placement: Placement, facts: dict) -> list[Candidate]:
        """`best`'s placement (`placement`, remapped) with its nodes' ranks evened in attention tokens."""
        work = attention_work(maker.model, self.lengths, maker.dev.gpu[int(np.argmax(maker.dev.speed))])
        even = evened(placement, self.lengths, work, maker.dev.nodes(), THRESHOLDS.even_tolerance)
        made = maker.make(even, facts, keep=False, double=best.plan.meta["double"], runs=self.runs) \
            if even is not None else None
        return [made] if made is not None else []

    def _wider(self, best: Candidate, maker: CandidateMaker, level: NodeLevel) -> None:
        """`best` (made from the double `level`) replaced by its plan with the double ring
        whose members wait most beyond the estimate over one node more
        (`variants.wider_level`; kept or remapped as `best`) where that plan's step with
        its members' waits (`member_waits.corrected_step`) is shorter than `best`'s so."""
        excess = double_wait_excess(best, self.crossovers)
        if not excess or (w := wider_level(level, max(excess, key=lambda d: (excess[d], d)))) is None:
            return
        made = self._made(maker, w, {}, keep=best.plan.meta["keep_tokens"])
        if not made:
            return
        self._compare_only(made)
        before = best.seconds + max(excess.values())  # `corrected_step(best)`
        if corrected_step(made[0], self.crossovers) < (1 - THRESHOLDS.wider_margin) * before:
            self.best = made[0]

    def _fallback(self, maker: CandidateMaker) -> list[Candidate]:
        """A batch the greedy steps fit no way, cut in speed-proportional runs of tokens
        (valid, not balanced; `meta["fallback"]`); [] (the reason kept) over a cap."""
        plan = maker.plan(fallback(self.lengths, maker.dev), {"fallback": True}, keep=False, double=False)
        why = over_cap(plan, maker.dev)
        if why is not None:
            self.refusal = why
            return []
        return [maker.price(plan, self.runs)]

    def _compare(self, plans: list[Candidate], maker: CandidateMaker) -> None:
        if not self.settled:
            self.pending += [(len(self.compared) + i, c, maker) for i, c in enumerate(plans)]
        self._compare_only(plans)
        for c in plans:
            if self._shorter(c):
                self.best = c

    def _settle(self) -> None:
        """The best plan of the search's hop-by-hop part, its candidates that can still win
        re-priced with their routed rings' ports run (`settling.settle`: the new estimates
        replace the old in `made` and `compared`)."""
        self.settled = True
        estimates = settle(self.pending)
        self.best = None
        for index, c, _ in self.pending:
            if (priced := estimates.get(index)) is not None and priced is not c:
                self.made = [x._replace(candidate=priced) if x.candidate is c else x for x in self.made]
                self.compared[index]["estimated_step_s"] = priced.seconds
            if priced is not None and self._shorter(priced):
                self.best = priced
        self.pending = []

    def _shorter(self, c: Candidate) -> bool:
        """Whether `c` is to replace the best plan: estimated shorter, but where one of
        them keeps every rank's tokens and the other remaps, the remap only adds traffic:
        a tie (within `Thresholds.remap_tie`) goes to the plan that keeps them."""
        best = self.best
        if best is None:
            return True
        keeps, kept = c.plan.meta["keep_tokens"], best.plan.meta["keep_tokens"]
        if keeps and not kept:
            return c.seconds <= (1 + THRESHOLDS.remap_tie) * best.seconds
        if kept and not keeps:
            return c.seconds < (1 - THRESHOLDS.remap_tie) * best.seconds
        return c.seconds < best.seconds

    def _compare_only(self, plans: list[Candidate]) -> None:
        """`plans` listed among those compared (`plan.meta["candidates"]`)."""
        for c in plans:
            self.compared.append({"recompute": c.plan.meta["recompute"], "keep_tokens": c.plan.meta["keep_tokens"],
                                  "recompute_layers": c.plan.meta["recompute_layers"], "estimated_step_s": c.seconds,
                                  "double": c.plan.meta["double"]})


def zeppelin(lengths, cluster: ClusterSpec, model: ModelSpec, *, routing: bool = True, remap: bool = True,
             hierarchical: bool = True, assume_homogeneous: bool = False, price_linear: bool = True,
             price_recompute: bool = True, double: bool = True) -> Plan:
    """The Ballonet planner (`ZeppelinOptions` says what each switch does; the ablations
    turn them off). The plan's meta says what was chosen (`recompute` and
    `recompute_layers`, the caps it was planned under; `keep_tokens`, `double`) and among
    which plans (`candidates`: the recomputation, its layers, keep_tokens, double and
    estimated step seconds of each; `estimated_step_s`: the chosen plan's, not always the
    least of them: `CandidateSearch._wider`)."""
    options = ZeppelinOptions(routing=routing, remap=remap, hierarchical=hierarchical,
                              assume_homogeneous=assume_homogeneous, price_linear=price_linear,
                              price_recompute=price_recompute, double=double)
    return CandidateSearch(lengths=check_lengths(lengths), cluster=cluster, model=model, options=options).run()

