"""The Plan: the one contract between planner, simulator and runtime (docs/design.md,
section 2).

    plan.py          `Plan`: where every token lives in the attention and linear layouts, its
                     derived views, its validation and its canonical JSON
    layout.py        the pieces of the two layouts: `Segment`, `Transfer`, `chunk_bounds`
    ring_traffic.py  a split document's `Ring`, the `Route` of a hop across nodes, and the
                     one walk of its messages (`RingMessage`)
    recompute.py     what each rank recomputes (`RankRecompute`, `RecomputeMode`)
"""

from ballonet.plan.layout import Segment, Transfer, chunk_bounds
from ballonet.plan.plan import InvalidPlan, Plan
from ballonet.plan.recompute import RankRecompute, RecomputeMode
from ballonet.plan.ring_traffic import (
    PAYLOADS,
    PHASES,
    RING_COMMS,
    SPLIT_KINDS,
    Ring,
    RingMessage,
    Route,
    double_schedule,
    ring_schedule,
)

__all__ = ["PAYLOADS", "PHASES", "RING_COMMS", "SPLIT_KINDS", "InvalidPlan", "Plan", "RankRecompute",
           "RecomputeMode", "Ring", "RingMessage", "Route", "Segment", "Transfer", "chunk_bounds", "double_schedule",
           "ring_schedule"]
