"""Plan ranks in the cluster file's group order, whatever order torch's rendezvous gave
the nodes.

A rank's place in a job of several node groups is the cluster's rank table: node by
node, group by group, as the file lists them. Under torchrun the rendezvous numbers the
nodes (so the global ranks) itself: c10d sorts them by address and agent pid, so an
inference node whose address sorts first would take the training nodes' ranks, and the
plan would put their work on it. So each rank says which group its node is in:
`BALLONET_NODE_GROUP` (the index of its `[[node_groups]]` table, 0 first) in its
torchrun's environment, or, on a GPU without it, the one group of the job whose GPU type
its device is (`matches`). The ranks all_gather what they said (`agreed_order`, every rank
deciding from the same rows, so they fail together); the order is a stable sort by
group, which keeps a node's ranks consecutive and a group's nodes in the rendezvous's
order, and the loop forms its process group again with each rank at its place in it.
Where no rank can tell (CPU ranks without the variable, one GPU type in several groups),
the rendezvous's order stands, and `preflight.check_placement` checks what it can.
"""

from __future__ import annotations

import os
import re
import socket

from ballonet import specs
from ballonet.errors import InputError

NODE_GROUP_ENV = "BALLONET_NODE_GROUP"


def matches(gpu: str, device_name: str) -> bool:
    """Whether a CUDA device called `device_name` is of GPU type `gpu` ("h20" in "NVIDIA H20")."""
    return re.search(rf"\b{re.escape(gpu)}\b", device_name, re.IGNORECASE) is not None


def member_groups(cluster: specs.ClusterSpec, job: specs.ClusterSpec) -> list[int]:
    """Indices in `cluster` (the file's) of the groups `job` (`specs.job_cluster`) runs on:
    all of them, or, while the loaned groups are reclaimed, the others."""
    if len(job.groups) == len(cluster.groups):
        return list(range(len(cluster.groups)))
    return [i for i, g in enumerate(cluster.groups) if not g.loaned]


def _groups_line(cluster: specs.ClusterSpec) -> str:
    return ", ".join(f"{i}: {g.gpu}{' loaned' if g.loaned else ''}" for i, g in enumerate(cluster.groups))


def claim(cluster: specs.ClusterSpec, members: list[int], value: str | None,
          device_name: str | None) -> tuple[int | None, str | None, str | None]:
    """What one rank says: (its group's index in `cluster`, or None; a problem line; why it
    cannot tell). `value`: BALLONET_NODE_GROUP; `device_name`: its CUDA device's, on a GPU."""
    where = f"{NODE_GROUP_ENV}={value}"
    if value is not None:
        index = value.strip()
        if not index.isdigit() or int(index) >= len(cluster.groups):
            return None, (f"{where}: cluster {cluster.name!r} has node groups 0 to {len(cluster.groups) - 1} "
                          f"({_groups_line(cluster)})"), None
        return int(index), None, None
    if device_name is None:
        return None, None, f"a CPU rank without {NODE_GROUP_ENV}"
    fits = [i for i in members if cluster.groups[i].gpu == "cpu" or matches(cluster.groups[i].gpu, device_name)]
    if len(fits) == 1:
        return fits[0], None, None
    if not fits:
        return None, (f"its device, a {device_name}, is of no node group's GPU type in this job of cluster "
                      f"{cluster.name!r} ({_groups_line(cluster)})"), None
    return None, None, f"its {device_name} is the type of node groups {' and '.join(map(str, fits))}"


def order(cluster: specs.ClusterSpec, job: specs.ClusterSpec, claims: list[tuple]) -> list[int]:
    """The global ranks in plan order, from every rank's (group, problem, unknown, node)
    (`claim` and its node's name), the same list on every rank; InputError (the same line
    on every rank) where they cannot be put in order."""
    world_size = len(claims)
    identity = list(range(world_size))
    for rank, (_, problem, _, node) in enumerate(claims):
        if problem:
            raise InputError(f"rank {rank} ({node}): {problem}")
    known = [c[0] is not None for c in claims]
    if not any(known):
        return identity  # nothing to tell the groups apart by: the rendezvous's order stands
    if not all(known):
        rank = known.index(False)
        raise InputError(f"rank {rank} ({claims[rank][3]}): cannot tell which node group its node is in "
                         f"({claims[rank][2]}), while other nodes can; set {NODE_GROUP_ENV}=INDEX (its "
                         f"[[node_groups]] table, 0 first: {_groups_line(cluster)}) in every node's torchrun "
                         "environment")
    by_node: dict[str, int] = {}
    for rank, (group, _, _, node) in enumerate(claims):
        if by_node.setdefault(node, group) != group:
            raise InputError(f"{node}: its ranks say node groups {by_node[node]} and {group}; a node is in one group")
    members = member_groups(cluster, job)
    for i, g in enumerate(cluster.groups):
        want = g.num_nodes * g.gpus_per_node if i in members else 0
        have = sum(c[0] == i for c in claims)
        if have != want:
            role = "loaned, reclaimed" if i not in members else "loaned" if g.loaned else ""
            raise InputError(f"node group {i} ({g.gpu}{', ' + role if role else ''}) has {want} GPUs in this job of "
                             f"{world_size} ranks, but {have} ranks say they are on it ({NODE_GROUP_ENV} or their "
                             "device)")
    return sorted(identity, key=lambda r: (members.index(claims[r][0]), r))


def agreed_order(cluster_name: str, num_nodes: int | None, group, use_cuda: bool) -> list[int]:
    """Collective over `group` (the rendezvous's world): the global ranks in plan order
    (`order`), from this rank's environment and device."""
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    cluster, job = specs.cluster(cluster_name), specs.job_cluster(cluster_name, world_size, num_nodes)
    if len(cluster.groups) == 1:
        return list(range(world_size))
    device_name = torch.cuda.get_device_name() if use_cuda else None
    node = f"node {os.environ.get('GROUP_RANK', '?')} of the rendezvous, {socket.gethostname()}"
    mine = (*claim(cluster, member_groups(cluster, job), os.environ.get(NODE_GROUP_ENV), device_name), node)
    claims: list = [None] * world_size
    dist.all_gather_object(claims, mine, group=group)
    return order(cluster, job, claims)
