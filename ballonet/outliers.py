"""WLB-LLM's outlier documents: which document lengths its "outlier delay" holds back, and
in which queue (docs/design.md, sections 10 and 11).

The one definition both users share: `planning.wlb_llm.outlier_steps` prices WLB-LLM's
steps under the delay, and the training loader (`training.data.loader`,
`--outlier-delay`) trains in that order with any planner.
"""

from __future__ import annotations


def outlier_level(length: int, step_tokens: int, groups: int) -> int | None:
    """The queue a document of `length` tokens waits in under WLB-LLM's outlier delay, in a
    step of `step_tokens` tokens (T) over `groups` micro-batches or CP groups (G); None if
    it is no outlier. An outlier fills most of a group's share alone: its length is in
    (T/2G, T/G] (longer ones cannot go one to a group within the step's tokens). Its level
    is k for lengths in (2^(k-1), 2^k], `(length - 1).bit_length()`. Exact in integers."""
    if groups * length <= step_tokens < 2 * groups * length:
        return (length - 1).bit_length()
    return None
