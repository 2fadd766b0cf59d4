"""A variant of a remapping plan: whole documents moved or swapped between the ranks of a
node so that they hold about the same tokens in the attention layout.

Where a plan remaps, the remap evens each node's tokens in the linear layout, but the
attention layout keeps what step 3 placed: ranks of equal attention work hold unequal
tokens (one long document against several short ones), and the one holding most needs
the most memory. Under selective or linear recomputation each rank recomputes as few
layers as its own memory needs, and the layers meet across ranks in the backward, so the
rank that holds most recomputes layers the others do not, beside the heaviest attention
(B, LLaMA-13B at tp 2, prolong, 32 GPUs: attention tokens 29216-32832 in the first node,
linear recomputation on 32-38 of its layers). Evening its tokens trades a little
attention balance (`Thresholds.even_tolerance`) for fewer recomputed layers there; the
search keeps it only where its estimate is shorter (`search.CandidateSearch`).
"""

from __future__ import annotations

import numpy as np

from ballonet.planning.assembly import Placement

__all__ = ["evened"]


def evened(placement: Placement, lengths, work: np.ndarray, nodes: list[list[int]], tolerance: float,
           rounds: int = 64) -> Placement | None:
    """A copy of `placement` with, in each node of `nodes` (rank lists), whole documents
    moved from the rank holding most tokens to the one holding fewest, or swapped for a
    shorter one of it: each time the move that leaves the two closest, as long as it closes
    at least a tenth of their gap and neither rank's attention work (`work`, per document;
    a split document's member holds its share of it) goes over (1 + `tolerance`) times the
    node's busiest before any move; None where nothing moves."""
    L = np.asarray(lengths, dtype=float)
    out = placement.copy()
    tokens = np.array([L[ds].sum() for ds in out.local])
    load = np.array([work[ds].sum() for ds in out.local])
    for d, shares in out.split.items():
        for r, n in shares.items():
            tokens[r] += n
            load[r] += work[d] * n / L[d]  # a zig-zag share's causal work is its share of the document's
    moved = False
    for ranks in nodes:
        cap = (1 + tolerance) * load[ranks].max()
        for _ in range(rounds):
            hi, lo = max(ranks, key=lambda r: tokens[r]), min(ranks, key=lambda r: tokens[r])
            gap, best = tokens[hi] - tokens[lo], None
            for d in out.local[hi]:
                for e in [None, *out.local[lo]]:
                    dl = L[d] - (L[e] if e is not None else 0.0)
                    dw = work[d] - (work[e] if e is not None else 0.0)
                    if 0 < dl < gap and load[lo] + dw <= cap and load[hi] - dw <= cap \
                            and (best is None or abs(gap - 2 * dl) < best[0]):
                        best = (abs(gap - 2 * dl), d, e, dl, dw)
            if best is None or best[0] > 0.9 * gap:
                break
            _, d, e, dl, dw = best
            out.local[hi].remove(d)
            out.local[lo].append(d)
            if e is not None:
                out.local[lo].remove(e)
                out.local[hi].append(e)
            tokens[hi] -= dl
            tokens[lo] += dl
            load[hi] -= dw
            load[lo] += dw
            moved = True
    return out if moved else None
