"""Remap planning (docs/design.md, section 5): from the attention layout to a token-balanced one.

Only surplus tokens move. Each rank with more tokens than its linear target sends the
tail of its attention-local order; surplus is matched to deficit inside each node first,
so only a node's net imbalance crosses the network. With `node_linear_targets` nodes keep
their tokens and nothing crosses it: the partitioner has balanced nodes on attention plus
linear work (`pricing.py`), so a token-balanced node is a balanced node.
"""

from __future__ import annotations

import numpy as np

from ballonet.plan import Transfer
from ballonet.planning.packing import apportion

__all__ = ["linear_targets", "node_linear_targets", "plan_remap"]


def linear_targets(num_tokens: int, speed: np.ndarray, token_cap: np.ndarray) -> np.ndarray:
    """[R] tokens per rank for the linear layers: in proportion to each rank's speed (equal
    on a homogeneous cluster), none above its memory cap."""
    return apportion(num_tokens, speed, token_cap)


def node_linear_targets(attention_tokens, speed: np.ndarray, token_cap: np.ndarray, nodes) -> np.ndarray:
    """[R] `linear_targets` inside each node of `nodes` (lists of ranks): a node's tokens
    spread over its own ranks; ranks of no node in `nodes` keep their tokens."""
    counts = np.asarray(attention_tokens, dtype=np.int64)
    targets = counts.copy()
    nodes = [list(rs) for rs in nodes]
    if not nodes:
        return targets
    if len({len(rs) for rs in nodes}) == 1:  # nodes of one size: every node's first round at once
        idx = np.array(nodes)
        done = _first_round(counts[idx].sum(axis=1), speed[idx].astype(float), token_cap[idx].astype(np.int64))
        for i in np.nonzero(done.min(axis=1) >= 0)[0].tolist():
            targets[idx[i]] = done[i]
        nodes = [nodes[i] for i in np.nonzero(done.min(axis=1) < 0)[0].tolist()]
    for ranks in nodes:
        targets[ranks] = linear_targets(int(counts[ranks].sum()), speed[ranks], token_cap[ranks])
    return targets


def _first_round(total: np.ndarray, weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """`packing.apportion` of each row's `total` by its `weights` ([nodes, ranks]) where its
    first round binds no cap: the same operations, row by row; -1 on the rows where a cap
    binds (or the weights sum to none), which `apportion` itself then takes."""
    w_sum = np.array([row.sum() for row in weights])  # (each row's sum in `apportion`'s order)
    ideal = total[:, None] * weights / w_sum[:, None]
    base = np.floor(ideal).astype(np.int64)
    rest = total - base.sum(axis=1)
    order = np.argsort(-(ideal - base), axis=1, kind="stable")  # largest remainder first, ties to the lower rank
    extra = np.zeros_like(base)
    np.put_along_axis(extra, order, (np.arange(base.shape[1])[None, :] < rest[:, None]).astype(np.int64), axis=1)
    out = base + extra
    out[(ideal >= caps).any(axis=1) | (w_sum <= 0)] = -1
    return out


def plan_remap(attention_tokens: list[int], targets: np.ndarray, node_of_rank: tuple[int, ...]) -> tuple[Transfer, ...]:
    """Transfers taking ranks from `attention_tokens` to `targets` tokens (same total)."""
    want = np.asarray(targets).tolist()  # (numpy's scalars, read one by one, are slower and alike in value)
    surplus = {r: a - int(t) for r, (a, t) in enumerate(zip(attention_tokens, want)) if a > t}
    deficit = {r: int(t) - a for r, (a, t) in enumerate(zip(attention_tokens, want)) if a < t}
    cursor = {r: attention_tokens[r] - s for r, s in surplus.items()}  # first token each sender gives away
    transfers: list[Transfer] = []

    def match(senders: list[int], receivers: list[int]) -> None:
        i = j = 0
        while i < len(senders) and j < len(receivers):
            src, dst = senders[i], receivers[j]
            n = min(surplus[src], deficit[dst])
            if n > 0:
                transfers.append(Transfer(src, dst, cursor[src], cursor[src] + n))
                cursor[src] += n
                surplus[src] -= n
                deficit[dst] -= n
            if surplus[src] == 0:
                i += 1
            if deficit[dst] == 0:
                j += 1

    # Step 1: inside each node.
    by_node: dict[int, tuple[list[int], list[int]]] = {}
    for r in sorted(surplus):
        by_node.setdefault(node_of_rank[r], ([], []))[0].append(r)
    for r in sorted(deficit):
        by_node.setdefault(node_of_rank[r], ([], []))[1].append(r)
    for node in sorted(by_node):
        match(*by_node[node])
    # Step 2: the net imbalance of nodes, across the network.
    match([r for r in sorted(surplus) if surplus[r]], [r for r in sorted(deficit) if deficit[r]])
    assert not any(surplus.values()) and not any(deficit.values())
    return tuple(sorted(transfers, key=lambda t: (t.src, t.start)))
