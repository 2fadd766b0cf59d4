"""The default process group of a run: from torchrun's environment (each restart's keys
apart, the ranks in the cluster file's group order) or a group of one."""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from ballonet.errors import InputError
from ballonet.training.config import TrainConfig
from ballonet.training.jobs import lease, node_order
from ballonet.training.jobs.launch import preempt_file

__all__ = ["init"]


def init(backend: str, timeout: datetime.timedelta, config: TrainConfig, use_cuda: bool) -> None:
    """init_process_group: from torchrun's environment; or a group of one (so one process
    runs the same FSDP2 code). Where torchrun's agent hosts the store (its default), the
    keys of each restart attempt go under their own prefix (after torchrun restarts the
    workers, the previous attempt's gloo addresses are still in the agent's store, and a
    rank that reads one fails with "connection refused", seen on torch 2.13 with
    --max-restarts); where rank 0 hosts it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which
    `--lease` under bare torchrun needs: `lease.shared_store_problem`), the store is new in
    every rendezvous round, and the nodes' restart counts, which differ once a node joins
    or leaves, must not enter the keys. Under bare torchrun, where the rendezvous numbered
    the nodes out of the cluster file's group order, formed again with the ranks in that
    order (`node_order`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    launched = preempt_file() is not None  # by our launcher: one machine, its nodes emulated in rank order
    problem = None if launched else lease.shared_store_problem(config.lease, agent_hosts_store)
    if problem:
        raise InputError(problem)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    prefix = f"ballonet/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" if agent_hosts_store else "ballonet/"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                            timeout=timeout)
    if launched:
        return
    try:
        order = node_order.agreed_order(config.cluster, config.nodes, dist.group.WORLD, use_cuda)
    except InputError:
        dist.destroy_process_group()
        raise
    if order != sorted(order):
        dist.destroy_process_group()
        dist.init_process_group(backend, store=dist.PrefixStore(f"{prefix}ordered/", store),
                                rank=order.index(rank), world_size=world_size, timeout=timeout)
        os.environ["RANK"] = str(dist.get_rank())
        if dist.get_rank() == 0:
            print(f"ballonet train: torchrun's rendezvous numbered the nodes out of the cluster file's group order; "
                  f"ranks renumbered in that order (torchrun ranks {order})", file=sys.stderr, flush=True)
