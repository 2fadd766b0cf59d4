"""Every margin the partitioner decides by, with the reason it has its value (the
measurements behind them: docs/planner_evidence.md). The steps quoted were simulated
before 2026-12-07, when the cost model charged ZeRO-1's memory (docs/design.md, section 3);
they were not measured again under FSDP2's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    keep_margin: float = 0.01
    """The remap plan is not made when the keep-tokens plan's busiest rank is within this
    of its busiest node's mean compute (it was never estimated faster in such cases)."""
    cap_slack: float = 0.02
    """A rank within this share of its memory is at its cap (`candidates.caps_bind`): only
    then can a costlier recomputation's looser caps shorten the step."""
    full_slack: float = 0.03
    """A rank within this share of its memory cap makes memory nearly full
    (`prunes.nearly_full`): selective recomputation on as few layers as a plan needs is
    planned too (97% memory: a plan evened by it was 4.4% faster; issue 49)."""
    node_prune_margin: float = 0.05
    """A recomputation mode (or a double-ring level 1) is not planned when its level 1
    already leaves a node this much slower than the best plan so far (level 1's estimate
    is within about 3% of its plans' estimated step)."""
    spread_share: float = 0.5
    """A document kept in one node whose step share is over this share of a node's is
    also planned across two nodes (`variants.spread_level`): in one node it takes most of
    the node's ranks' time on attention, and layers meet in the forward and backward."""
    widen_over: float = 0.1
    """Level 1 widens a document across nodes by one node where its busiest node, holding a
    share of it, ends over this times the mean node (`classes._widened`). On the scale
    grid three batches widen (C 128 llama3-8b wlbllm 64K, B 128 llama-13b wlbllm 256K,
    B 256 llama-7b prolong 128K: 2.223, 5.325, 2.000 s simulated, widened 2.170, 5.246,
    1.908); at 0.05 the same, at 0.15 none widens; at 0 A 512 llama-13b wlbllm 256K and
    C 256 llama-7b wlbllm 256K widen too and run longer (11.850 -> 11.987 s, 2.288 ->
    2.303 s). No main-grid step changes (bench/investigations/scale_one.py). At 0.05 two
    held-out batches widen too (`bench/estimate.py`'s A 512 llama-13b wlbllm 256K seed 1,
    12.417 -> 13.128 s, and A 256 llama-7b, 6.929 -> 6.865 s), at 0.1 neither."""
    variant_margin: float = 0.003
    """A plan from the best plan's level 1 balanced on the backward
    (`variants.backward_level`) is kept only where its estimate is this much shorter than
    the best plan's: it shifts a few percent of the balance between attention and linear
    work, about what the estimate errs by between alike plans (at 0, C llama-3b shortmix's
    two alike plans priced 1.2489 and 1.2494 s ran 1.252 and 1.230 s: 1.8% longer)."""
    remap_tie: float = 1e-4
    """A plan keeping every rank's tokens is chosen over a remapping plan estimated at
    most this much shorter (`search._keeps_at_a_tie`)."""
    wider_margin: float = 0.003
    """The best plan's most waiting double ring over one node more (`search._wider`)
    replaces it only where its step with the members' waits (`member_waits.corrected_step`)
    is this much shorter than the best plan's so: at 0, C 128 llama3-8b wlbllm 64K's
    widened plan, 0.1% shorter so, replaced the best plan before its backward-balanced
    variant (2.170 s simulated) was made: 2.203 s; B 256 llama-7b prolong 128K's is 2.4%
    shorter (1.908 -> 1.830 s simulated)."""
    port_margin: float = 0.01
    """After the search's hop-by-hop part, the routed rings' ports of the plans whose
    estimate is within this share above the least estimate so far are run
    (`settling.settle`): running them can price a plan lower than hop by hop (down to
    0.897 of its estimate at scale-grid A 1024 llama-7b prolong 128K, 26% above the least),
    so the margin is not a proof; at 0.01 the search picks the plan it picks with every
    plan's ports run on all 70 main-grid, scale-grid, held-out and planner-benchmark
    configurations (bench/results/port_margin.txt, from bench/investigations/port_margin.py)."""
    even_tolerance: float = 0.01
    """A remapping plan's ranks are evened in attention tokens (`evened.evened`) with no
    rank's attention work over this much more than its node's busiest. On the main grid
    (bench/investigations/scale_one.py --main) 0.01 shortens the five steps 0.005 and 0.02
    shorten together (A llama-13b prolong 9.876 -> 9.841 s, B llama-13b prolong 3.973 ->
    3.943, B llama-30b wlbllm 13.817 -> 13.785, B llama-30b shortmix 13.801 -> 13.760,
    C llama-30b wlbllm 11.122 -> 11.090) and slows none; 0.005 gains less on three, 0.02
    nothing on two (B llama-30b wlbllm, C llama-30b wlbllm); no scale-grid step changes."""
    work_rounds: int = 4
    """Fixed-point rounds for a document over a rank's fair share: more members, shorter
    blocks, lower kernel efficiency, more work (`classes.level_nodes`); the rounds settle
    well before this on every grid batch."""
    rounding: float = 1e-9
    """Relative slack for float sums that should meet exactly (a span of nodes holds a
    document when their water-filled shares reach its work up to this)."""
    near_cap: float = 0.02
    """Level 2 fills a node a second time, on work beyond the light documents' mean per
    token, when the first fill leaves a rank with under this share of its token cap
    (`node_placement.level2`: caps that nearly bind)."""
    split_tolerance: float = 0.02
    """Level 2 splits the busiest rank's largest document while that rank is over its
    node's mean by more than this (`node_placement.split_to_level`)."""
    sliver: float = 0.25
    """A ring member holding under this share of the ring's mean block is a sliver and
    leaves a ring of 3 or more (`refinement.Sweep.DROP`): the large blocks pass through it
    hop by hop, and its short steps hide none of their transfers."""
    grow_above: float = 1.01
    """A split document's members take in another rank of their nodes while they end over
    this times the cluster's mean level (`refinement.Sweep.GROW`)."""
    settled_change: float = 1e-3
    """A split document whose members' work per token moved by less than this (relative)
    since it was last levelled is not levelled again (`refinement.refine`)."""


THRESHOLDS = Thresholds()
"""The partitioner's thresholds."""
