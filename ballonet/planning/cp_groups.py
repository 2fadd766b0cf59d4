"""The CP baselines' groups: the ranks cut into consecutive groups of a CP degree, and the
batch's documents packed into them (LPT on a weight a document, under each group's token
caps), as te_cp, llama_cp, hybrid_dp, wlb_llm and magi group their ranks; and the set-up
wlb_llm and magi share (`cp_setup`)."""

from __future__ import annotations

import numpy as np

from ballonet.errors import InfeasiblePlan, InputError
from ballonet.planning.devices import Devices, check_feasible, check_lengths, devices
from ballonet.planning.packing import NoRoom, lpt
from ballonet.specs import ClusterSpec, ModelSpec

__all__ = ["cp_groups", "cp_setup", "node_cp_size", "pack_groups"]


def node_cp_size(dev: Devices) -> int:
    """The default CP degree of the baselines that keep CP inside NVLink domains: the GPUs
    every node has a multiple of."""
    return int(np.gcd.reduce([len(n) for n in dev.nodes()]))


def cp_groups(num_ranks: int, cp_size, name: str) -> list[list[int]]:
    """Ranks 0..num_ranks-1 in consecutive groups of `cp_size` (a positive divisor of
    them; one clear line naming `name` otherwise)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or num_ranks % cp_size:
        raise InputError(f"{name}: cp_size must divide the {num_ranks} ranks, got {cp_size!r}")
    return [list(range(i, i + cp_size)) for i in range(0, num_ranks, cp_size)]


def cp_setup(lengths, cluster: ClusterSpec, model: ModelSpec, cp_size: int | None, name: str) \
        -> tuple[list[int], Devices, int, list[list[int]]]:
    """The checked batch, its devices (every document within the caps: `check_feasible`),
    the CP degree (`cp_size`, default `node_cp_size`) and its `cp_groups` of a baseline
    that keeps CP inside NVLink domains by default."""
    lengths = check_lengths(lengths)
    dev = devices(cluster, model)
    check_feasible(lengths, dev, model)
    if cp_size is None:
        cp_size = node_cp_size(dev)
    return lengths, dev, cp_size, cp_groups(dev.num_ranks, cp_size, name)


def pack_groups(lengths: list[int], weights, groups: list[list[int]], dev: Devices, name: str) \
        -> list[list[int]]:
    """Each group's documents, in the order LPT placed them: LPT on `weights` (one a document) under the sum of
    the group's ranks' token caps; InfeasiblePlan naming the first document no group holds."""
    rooms = np.array([dev.token_cap[g].sum() for g in groups], dtype=float)
    try:
        by_group = lpt(range(len(lengths)), np.asarray(weights, dtype=float), lengths, np.zeros(len(groups)),
                       np.ones(len(groups)), rooms)
    except NoRoom as e:
        raise InfeasiblePlan(f"{name}: document {e.doc} ({lengths[e.doc]} tokens) fits no CP group of "
                             f"{len(groups[0])} GPUs") from None
    return [by_group.get(i, []) for i in range(len(groups))]
