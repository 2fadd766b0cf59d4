"""Level 1 priced under what each node will recompute (docs/design.md, section 4, step 1).

A selective or linear plan is made under that mode's caps on every layer, and then each
rank recomputes only what its own tokens need (`cost.recompute.layers_per_rank`). Priced
as the mode on every layer, a node whose share fits its memory without recomputation
looks dearer per token than it will be, and a node at its cap as cheap as the others: on
a mixed cluster the GPUs with memory to spare are given too little work while the
memory-full ones recompute. `recomputed_level` prices each node's linear work per token
under the recomputation its level-1 share needs and makes level 1 once more with those
rates; a node priced cheaper takes more tokens, which may need more recomputation, so each
of the two is priced under its own shares' recomputation and the one whose busiest node
is least busy is kept (more rounds bought nothing on the mixed presets' batches). On one
GPU type the second is planned beside the uniform level 1 where it prices shorter
(`recomputed_levels`), and the estimate chooses.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ballonet.cost.memory import recompute_mode
from ballonet.cost.recompute import layers_per_rank
from ballonet.planning.devices import Devices
from ballonet.planning.pricing import linear_work_per_token
from ballonet.planning.zeppelin.classes import Level1, NodeLevel, node_seconds, node_tokens, with_level1

__all__ = ["mixed", "node_recompute", "recomputed_level", "recomputed_levels"]


def mixed(dev: Devices) -> bool:
    """Whether `dev` holds more than one GPU type: there level 1 is `recomputed_level`'s (on
    one type it lengthened as many main-grid steps as it shortened: docs/design.md)."""
    return len(set(dev.gpu)) > 1


def node_recompute(level: NodeLevel, lv: Level1) -> list[tuple[str, int]]:
    """[nodes] (mode, layers) a rank of each node recomputes to hold the node's mean share
    of tokens after level 1 `lv` (on both layouts: the remap evens them inside a node), of
    the modes up to the one whose caps `level` was made under; that mode on every layer
    where even it is not enough (rounding)."""
    batch = level.batch
    dev, model = batch.dev, batch.model
    nodes = dev.nodes()
    per_rank = node_tokens(batch, nodes, lv) / np.array([len(rs) for rs in nodes])
    gpus = [dev.gpu[rs[0]] for rs in nodes]
    mode = recompute_mode(model)
    need = layers_per_rank(model, per_rank, gpus, dev.num_ranks, per_rank, mode)
    return need if need is not None else [(mode, model.num_layers)] * len(nodes)


def _rank_token(level: NodeLevel, need: list[tuple[str, int]], cache: dict) -> np.ndarray:
    """[R] linear work per token of each rank under its node's recomputation `need`
    (`pricing.linear_work_per_token`, as `classes.level_nodes` prices the mode)."""
    batch = level.batch
    dev, model = batch.dev, batch.model
    tokens = float(batch.length_array.sum()) / dev.num_ranks
    out = np.zeros(dev.num_ranks)
    for rs, (mode, layers) in zip(dev.nodes(), need):
        key = (dev.group[rs[0]], mode, layers)
        if key not in cache:
            spec = dataclasses.replace(model, recompute=mode, recompute_layers=layers if mode != "none" else None)
            cache[key] = linear_work_per_token(spec, dev.gpu[rs[0]], tokens, level.weights.attention_step,
                                               batch.crossovers[dev.group[rs[0]]].intra_bw)
        out[rs] = cache[key]
    return out


def recomputed_level(level: NodeLevel) -> NodeLevel:
    """`level` (made with `price_linear`, hierarchical) with level 1 made once more with
    each node priced under what its share there recomputes (module docstring); of the two,
    the one whose busiest node is least busy under its own shares' recomputation, with its
    `rank_token` and `node_seconds` so priced."""
    first, second = _both(level)
    return second if second is not None and second.node_seconds < first.node_seconds else first


def recomputed_levels(level: NodeLevel, *, mixed_cluster: bool) -> list[NodeLevel]:
    """The level 1s a selective or linear mode plans from: on a mixed cluster
    `recomputed_level`'s; on one GPU type `level` itself, and beside it the level 1 made
    under each node's recomputation where that one's busiest node prices less busy than
    `level`'s under its own shares' recomputation (the estimate then chooses among their
    plans: made instead of `level` it lengthened as many main-grid steps as it shortened)."""
    if mixed_cluster:
        return [recomputed_level(level)]
    first, second = _both(level)
    return [level] + ([second] if second is not None and second.node_seconds < first.node_seconds else [])


def _both(level: NodeLevel) -> tuple[NodeLevel, NodeLevel | None]:
    """`level` priced under its shares' recomputation, and level 1 made once more under
    those rates, so priced (None when that level 1 finds a document no room)."""
    batch, weights = level.batch, level.weights
    nodes = batch.dev.nodes()
    cache: dict = {}

    def priced(lv: NodeLevel) -> NodeLevel:
        assert lv.level1 is not None
        token = _rank_token(level, node_recompute(level, lv.level1), cache)
        return dataclasses.replace(lv, rank_token=token,
                                   node_seconds=node_seconds(batch, nodes, lv.level1, token, weights))

    first = priced(level)
    again = with_level1(batch, weights, level.per_token, first.rank_token, (level.intra, level.inter, level.span),
                        hierarchical=True, price_linear=True, double=level.double)
    if again is None or again.level1 is None:
        return first, None
    return first, priced(again)
