"""The Ballonet planner: the hierarchical sequence partitioner of the Zeppelin design
(docs/design.md, section 4, says what each step does and why; docs/planner_evidence.md
holds the measurements behind each rule and the variants tried and not kept).

    thresholds.py      every margin it decides by, with its reason (`Thresholds`)
    classes.py         step 0: each document's class; step 1 (level 1): the documents' nodes
    variants.py        level 1 again for the search: double rings, heavy documents over two
                       nodes, balanced on the backward
    pcie_level.py      level 1 with no document split inside a PCIe-only node; the chosen
                       plan with its splits there by heads (DeepSpeed-Ulysses)
    recomputed.py      level 1 priced under what each node's share recomputes (on one GPU
                       type beside the uniform level 1)
    evened.py          the best plan, where it remaps, with its nodes' ranks evened in
                       attention tokens (so in memory and recomputed layers)
    node_placement.py  step 2 (level 2): a node's documents onto its ranks
    refinement.py      step 3: split documents levelled over their members (water.py:
                       water-filling and the work of a split document)
    candidates.py      step 4 (remap, memory) and the pricing of each candidate plan
    search.py          the search over recomputation modes, single and double rings,
                       keep-tokens and remap plans (`CandidateSearch`); `zeppelin`
    state.py           the values the steps read and fill (`Batch`, `RankFill`, `Crossover`)

Every step is a function of values; the search keeps the plan with the shortest estimate.
"""

from ballonet.planning.zeppelin.candidates import finish
from ballonet.planning.zeppelin.classes import crossover_lengths
from ballonet.planning.zeppelin.search import ZeppelinOptions, zeppelin

__all__ = ["ZeppelinOptions", "crossover_lengths", "finish", "zeppelin"]
