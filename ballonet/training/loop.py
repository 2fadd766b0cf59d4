"""The training loop: one process per rank under torchrun (gloo on CPU, NCCL on GPU).

Every rank reads the same corpus, builds the same global batches and computes the same
plan (`BalancedLoader`); the model runs its attention on the plan's attention layout and
everything else on the token-balanced linear layout. The loss is the sum of token losses
divided by the global count of valid labels, so summing gradients over ranks gives the
gradient of the global mean loss whatever the layout: every planner trains the same model.

Checkpoints hold model, optimizer, loader state and RNG, written by rank 0 to a temporary
file and renamed into place. With `--resume`, a restarted job (by hand or by torchrun's
`--max-restarts`) continues from the last checkpoint; the JSON log is cut back to it so
every step appears once.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import ballonet
from ballonet import runtime
from ballonet.errors import InputError
from ballonet.integrations import hf_model
from ballonet.training.checkpoint import (
    CHECKPOINT,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from ballonet.training.config import TrainConfig
from ballonet.training.corpus import load_corpus
from ballonet.training.loader import BalancedLoader
from ballonet.training.model import Transformer


def _cluster(config: TrainConfig, world_size: int) -> ballonet.ClusterSpec:
    if world_size % config.nodes:
        raise InputError(f"{world_size} ranks cannot be spread evenly over --nodes {config.nodes}")
    spec = ballonet.cluster(config.cluster, num_nodes=config.nodes, gpus_per_node=world_size // config.nodes)
    if spec.num_ranks != world_size:
        raise InputError(f"cluster {spec.name!r} has {spec.num_ranks} ranks, the job {world_size}")
    return spec


def _trim_log(path: str, last_step: int) -> None:
    """Keep the JSON log's entries up to `last_step`: the steps after it will run again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _all_reduce_grads(model, group) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _stats(values: list[float], group) -> list[float]:
    """Sum and max over ranks of each value."""
    t = torch.tensor(values, dtype=torch.float64)
    if group is None:
        return list(values) + list(values)
    s, m = t.clone(), t.clone()
    dist.all_reduce(s, group=group)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return s.tolist() + m.tolist()


def _maybe_fault(step: int, rank: int) -> None:
    """Test hook: BALLONET_FAULT="step:rank" kills that rank with SIGKILL at that step,
    on the first attempt only (torchrun's restart count is 0)."""
    spec = os.environ.get("BALLONET_FAULT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fault_step, fault_rank = map(int, spec.split(":"))
        if (step, rank) == (fault_step, fault_rank):
            os.kill(os.getpid(), signal.SIGKILL)


def _init_process_group(backend: str) -> None:
    """init_process_group from torchrun's environment, with the store keys of each restart
    attempt under their own prefix: after torchrun restarts the workers, the previous
    attempt's gloo addresses are still in the agent's store, and a rank that reads one
    fails with "connection refused" (seen on torch 2.13 with --max-restarts)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"ballonet/attempt{attempt}/", store),
                            rank=rank, world_size=world_size)


def preflight(config: TrainConfig, world_size: int):
    """Check what can be checked before any process starts; returns (cluster, model spec,
    corpus). Raises InputError with one line on bad input."""
    if config.global_tokens < world_size:
        raise InputError(f"--global-tokens {config.global_tokens} is smaller than one token per rank "
                         f"({world_size} ranks)")
    cluster = _cluster(config, world_size)
    spec = hf_model.model_spec(config.model) if hf_model.is_hf(config.model) else ballonet.model(config.model)
    corpus = load_corpus(config.corpus, seed=config.seed)
    if corpus.vocab_size > spec.vocab_size:
        raise InputError(f"corpus {config.corpus!r} has token ids up to {corpus.vocab_size - 1}, "
                         f"model {spec.name!r} a vocabulary of {spec.vocab_size}")
    ballonet.plan_batch([1] * world_size, cluster, spec, planner=config.planner)  # a bad planner fails here
    return cluster, spec, corpus


def train(config: TrainConfig) -> list[dict]:
    """Run the loop in this process as one rank: of the process group already initialised,
    of torchrun's (from its environment), or alone. Returns the per-step log records."""
    owns_group = not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    use_cuda = torch.cuda.is_available()
    if owns_group:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        _init_process_group("nccl" if use_cuda else "gloo")
    distributed = dist.is_initialized()
    group = dist.group.WORLD if distributed else None
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)

    cluster, spec, corpus = preflight(config, world_size)
    plan_fn = functools.partial(ballonet.plan_batch, cluster=cluster, model=spec, planner=config.planner)
    loader = BalancedLoader(corpus, global_tokens=config.global_tokens, plan_fn=plan_fn, rank=rank,
                                 world_size=world_size, seed=config.seed, max_doc_tokens=config.max_doc_tokens)
    model = (hf_model.build_model(config.model, config.seed, device) if hf_model.is_hf(config.model)
             else Transformer(spec, seed=config.seed).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    step = 0
    ckpt = os.path.join(config.checkpoint_dir, CHECKPOINT) if config.checkpoint_dir else None
    if config.resume and ckpt and os.path.exists(ckpt):
        state = load_checkpoint(ckpt, device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        step = state["step"]
    if rank == 0 and config.json_log:
        if step:
            _trim_log(config.json_log, step)
        elif os.path.exists(config.json_log):
            os.remove(config.json_log)
    if rank == 0 and ckpt:
        os.makedirs(config.checkpoint_dir, exist_ok=True)

    records = []
    batches = iter(loader)
    while step < config.steps:
        try:
            batch = next(batches)
        except StopIteration:
            break
        step += 1
        _maybe_fault(step, rank)
        wall, cpu = time.perf_counter(), time.thread_time()
        counter = runtime.ByteCounter()
        loss_sum = model.loss(batch.input_ids.to(device), batch.labels.to(device), batch.plan, rank, group,
                              counter=counter)
        (loss_sum / batch.num_valid_tokens_global).backward()
        cpu = time.thread_time() - cpu
        if group is not None:
            _all_reduce_grads(model, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wall = time.perf_counter() - wall
        sums_maxes = _stats([loss_sum.item(), cpu, sum(counter.total().values())], group)
        loss_total, cpu_sum, bytes_sum, _, cpu_max, _ = sums_maxes
        num_tokens = sum(p.end - p.start for p in batch.pieces)
        record = {
            "step": step,
            "loss": loss_total / batch.num_valid_tokens_global,
            "tokens": num_tokens,
            "tokens_per_s": num_tokens / wall,
            "plan_ms": batch.plan_ms,
            "compute_s_max": cpu_max,
            "compute_s_mean": cpu_sum / world_size,
            "bytes_sent": int(bytes_sum),
            "ledger": [list(p) for p in batch.pieces],
        }
        records.append(record)
        if rank == 0:
            if config.json_log:
                with open(config.json_log, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if step % config.log_every == 0 or step == config.steps:
                print(f"step {step:4d}  loss {record['loss']:.4f}  tok/s {record['tokens_per_s']:8.0f}  "
                      f"plan {record['plan_ms']:6.1f} ms  compute max/mean "
                      f"{cpu_max / max(cpu_sum / world_size, 1e-9):.2f}  bytes {record['bytes_sent']}",
                      flush=True)
        if ckpt and config.checkpoint_every and step % config.checkpoint_every == 0:
            if rank == 0:
                save_checkpoint(ckpt, step, model, optimizer, loader)
            if group is not None:
                dist.barrier(group)
    if owns_group:
        dist.destroy_process_group()
    return records
