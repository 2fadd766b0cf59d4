"""A configuration of the grids as the investigations study it: its cluster, its model and
its first batch (`bench/estimate.py`'s held and scale configurations, `scale_one.py`'s
grids)."""

from __future__ import annotations

from paper import TOKENS_PER_GPU
from paper_report import CLUSTERS

from ballonet import specs, workloads


def first_batch(cl: str, nodes: int, mdl: str, tp: int, wl: str, ctx: int,
                seed: int) -> tuple[specs.ClusterSpec, specs.ModelSpec, list[int]]:
    """(cluster, model, document lengths): `paper_report.CLUSTERS[cl]` on `nodes` nodes,
    model `mdl` at tensor-parallel degree `tp`, and the first batch of workload `wl`
    (`TOKENS_PER_GPU` a GPU, documents up to `ctx` tokens, seed `seed`)."""
    c, m = specs.cluster(CLUSTERS[cl], num_nodes=nodes), specs.model(mdl, tp=tp)
    return c, m, next(iter(workloads.get(wl).batches(TOKENS_PER_GPU * c.num_ranks, seed, 1, ctx)))
