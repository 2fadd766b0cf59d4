"""The search's prunes (`search.CandidateSearch`), each a named predicate: which level 1s,
modes and plans are not made, because a bound says they cannot win, and which placements
a double level 1 shares with its single one."""

from __future__ import annotations

import numpy as np

from ballonet.planning.pricing import rank_compute_seconds
from ballonet.planning.zeppelin.candidates import Candidate, CandidateMaker
from ballonet.planning.zeppelin.classes import NodeLevel
from ballonet.planning.zeppelin.thresholds import THRESHOLDS

__all__ = ["costlier_mode_loses", "level_enough", "level_too_slow", "nearly_full", "plan_looser", "same_nodes"]


def level_too_slow(level: NodeLevel, maker: CandidateMaker, beat: float) -> bool:
    """Level 1 already leaves a node slower than `beat` seconds by the node margin, with
    what every rank adds to its compute (`CandidateMaker.every_rank_s`): no plan of its
    nodes beats it."""
    return level.node_seconds + maker.every_rank_s > (1 + THRESHOLDS.node_prune_margin) * beat


def level_enough(kept: Candidate) -> bool:
    """The keep-tokens plan's busiest rank is within the keep margin of its busiest node's
    mean compute: no plan of the same nodes goes below that mean, and the remap only adds
    traffic."""
    return kept.busiest_s <= (1 + THRESHOLDS.keep_margin) * kept.node_floor_s


def plan_looser(trim: bool, next_mode: str, best: Candidate | None) -> bool:
    """Plan the next mode whatever its cost on every layer: selective recomputation on as
    few layers as a plan needs costs little more than none, and where caps bind in the node
    that sets the best plan's step its looser caps may pay (linear recomputation's looser
    caps planned so too did not pay: docs/planner_evidence.md, step 0); and so where memory
    is nearly full on any rank (`nearly_full`)."""
    return trim and next_mode == "selective" and best is not None and (best.binds or nearly_full(best))


def costlier_mode_loses(first: Candidate, next_mode: str, best_layers_s: float) -> bool:
    """The next mode's compute of this mode's first plan, spread over the ranks by speed (on
    every layer), is already slower than the best plan's estimated layers."""
    dev = first.dev
    seconds = rank_compute_seconds(first.plan, dev, first.model, next_mode, kernels=first.kernels)
    return np.average(seconds, weights=dev.speed) >= best_layers_s


def same_nodes(single: NodeLevel, double: NodeLevel) -> bool:
    """Whether two level 1s of one batch send the same documents (and shares) to the same
    nodes: steps 2-3 then place them alike (`place` reads nothing else that differs)."""
    a, b = single.level1, double.level1
    return (a is not None and b is not None and single.batch is double.batch
            and single.rank_token is double.rank_token and np.array_equal(single.intra, double.intra)
            and a.node_docs == b.node_docs and a.shares == b.shares and np.array_equal(a.node_load, b.node_load))


def nearly_full(best: Candidate) -> bool:
    """Whether a rank of `best` is within `Thresholds.full_slack` of its memory cap: its
    caps shaped the placement there, and selective recomputation on the few layers a plan
    needs may even it out (in any node, not only the one whose rank sets the step)."""
    used, total = np.asarray(best.plan.memory_bytes), np.asarray(best.dev.memory_total)
    return bool((used >= (1 - THRESHOLDS.full_slack) * total).any())
