"""Launching: a cluster file of two GPU types with a loaned group (`lent_cluster_toml`),
and a free port for a rendezvous (`free_port`)."""

from __future__ import annotations

import socket


def lent_cluster_toml(name: str, lent_nodes: int, lent_gpus_per_node: int) -> str:
    """A cluster file of two GPU types: one node of 2 H800s (2 NICs), and a loaned group of
    `lent_nodes` H20 nodes of `lent_gpus_per_node` GPUs (a NIC each)."""
    return f"""
name = "{name}"
[[node_groups]]
gpu = "h800"
gpus_per_node = 2
nics_per_node = 2
[[node_groups]]
gpu = "h20"
num_nodes = {lent_nodes}
gpus_per_node = {lent_gpus_per_node}
nics_per_node = {lent_gpus_per_node}
loaned = true
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
