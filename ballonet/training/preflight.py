"""What a training run checks before any process starts or any batch is built
(`preflight`): the topology, the model and its memory budget, the corpus and its
vocabulary, the evaluation set, the checkpoint folder, the planner and the calibration
profile. Bad input is one InputError line, raised on the launcher before torchrun starts
(`ballonet train --nproc`) and again on every rank. Then, on the ranks, before the first
step, `agree`: every rank runs with the same settings (ranks started by hand with another
`--lr` trained on, each its own model)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch
import torch.distributed as dist

import ballonet
from ballonet import specs
from ballonet.errors import InputError
from ballonet.integrations import hf_model
from ballonet.training import evaluation, logs, metrics
from ballonet.training.checkpoints import checkpoint, folder as checkpoint_folder
from ballonet.training.parallelism import parallel, tensor_parallel
from ballonet.training.config import PER_PROCESS, TrainConfig, run_fields
from ballonet.training.data.corpus import load_corpus
from ballonet.training.jobs import node_order
from ballonet.training.jobs.launch import ERROR_DIR_ENV


def _cluster(config: TrainConfig, world_size: int) -> ballonet.ClusterSpec:
    return specs.job_cluster(config.cluster, world_size, config.nodes)


def _check_paths(config: TrainConfig) -> None:
    if config.json_log:
        if os.path.isdir(config.json_log):
            raise InputError(f"--json-log {config.json_log}: is a folder, not a file")
        parent = os.path.dirname(config.json_log) or "."
        if not os.path.isdir(parent):
            raise InputError(f"--json-log {config.json_log}: folder {parent} does not exist")
    if config.checkpoint_dir and os.path.exists(config.checkpoint_dir) and not os.path.isdir(config.checkpoint_dir):
        raise InputError(f"--checkpoint-dir {config.checkpoint_dir}: is a file, not a folder")
    if config.resume:  # a foreign folder, a dangling pointer or a step past --steps fails here
        path = checkpoint_folder.resume_path(config.checkpoint_dir or "", config.resume_from)
        if path:
            checkpoint_folder.check_resumable(path, config.steps)


def preflight(config: TrainConfig, world_size: int):
    """Check what can be checked before any process starts or any batch is built; returns
    (cluster, model spec, corpus). Raises InputError with one line on bad input."""
    if config.global_tokens < world_size:
        raise InputError(f"--global-tokens {config.global_tokens} is smaller than one token per rank "
                         f"({world_size} ranks)")
    _check_paths(config)
    cluster = _cluster(config, world_size)
    is_hf = hf_model.is_hf(config.model)
    spec = hf_model.model_spec(config.model) if is_hf else ballonet.model(config.model)
    if config.vocab_size is not None:
        if is_hf:
            raise InputError(f"--vocab-size is for the built-in model; {config.model}'s config.json sets its own")
        spec = dataclasses.replace(spec, vocab_size=config.vocab_size)
    _check_tp(config, world_size, spec, cluster)
    if config.recompute not in hf_model.RECOMPUTE and hf_model.is_hf(config.model):
        choices = ", ".join(hf_model.RECOMPUTE)
        raise InputError(f"--recompute {config.recompute}: not for a Hugging Face model ({config.model}), whose "
                         f"modules are checkpointed whole when it is built (--recompute {choices})")
    if config.recompute_layers is not None and config.recompute_layers > spec.num_layers:
        raise InputError(f"--recompute-layers {config.recompute_layers}: model {spec.name!r} has "
                         f"{spec.num_layers} layers")
    # The planner and the cost model price what this run does: its dtype and recomputation
    # (auto: None, the cheapest each plan fits under).
    spec = dataclasses.replace(spec, tp=config.tp, dtype_bytes=parallel.DTYPES[config.dtype].itemsize,
                               recompute=None if config.recompute == "auto" else config.recompute,
                               recompute_layers=config.recompute_layers)
    metrics.check_budget(spec, cluster, config.global_tokens, world_size, config.shard)
    if config.checkpoint_dir:  # the last step is saved whatever --checkpoint-every
        checkpoint.check_folder(config.checkpoint_dir, spec.num_params, config.keep_checkpoints)
    logs.check_outputs(config)  # the JSON log is this run's, the optional loggers installed
    corpus = load_corpus(config.corpus, seed=config.seed)
    if corpus.vocab_size > spec.vocab_size:
        fix = ("a model whose config.json has a larger vocab_size" if is_hf else
               f"--vocab-size {corpus.vocab_size} (or vocab_size in a model TOML)")
        raise InputError(f"corpus {config.corpus!r} has token ids up to {corpus.vocab_size - 1}, "
                         f"model {spec.name!r} a vocabulary of {spec.vocab_size}: give {fix}")
    _, eval_corpus = evaluation.split_corpora(config, corpus)  # too little left to train on fails here
    if eval_corpus is not None and eval_corpus.vocab_size > spec.vocab_size:
        raise InputError(f"--eval-corpus {config.eval_corpus!r} has token ids up to {eval_corpus.vocab_size - 1}, "
                         f"model {spec.name!r} a vocabulary of {spec.vocab_size}")
    if config.global_tokens // config.grad_accum < world_size:
        raise InputError(f"--grad-accum {config.grad_accum}: micro-batches of --global-tokens "
                         f"{config.global_tokens} / {config.grad_accum} tokens hold less than one token per rank "
                         f"({world_size} ranks)")
    ballonet.plan_batch([1] * (world_size // config.tp), cluster, spec, planner=config.planner)  # a bad planner fails
    metrics.peak_flops(cluster, config.calibration)  # a bad profile fails here
    metrics.plan_profile(cluster, config.calibration)
    return cluster, spec, corpus


def _check_tp(config: TrainConfig, world_size: int, spec: ballonet.ModelSpec, cluster: ballonet.ClusterSpec) -> None:
    """--tp: a TP group is `tp` ranks of one node, and `tp` divides the model's heads."""
    if world_size % config.tp:
        raise InputError(f"{world_size} rank{'s' if world_size != 1 else ''} (the world size) {'are' if world_size != 1 else 'is'} "
                         f"not a multiple of --tp {config.tp}")
    for per_node in sorted({g.gpus_per_node for g in cluster.groups}):
        if per_node % config.tp:
            raise InputError(f"--tp {config.tp} does not divide the {per_node} ranks of a node (--nodes "
                             f"{cluster.num_nodes}): a tensor-parallel group must sit inside one node")
    tensor_parallel.check_heads(spec.name, spec.num_heads, spec.num_kv_heads, config.tp)


def agree(config: TrainConfig, group, device: torch.device) -> None:
    """Collective, before the first step: every rank of `group` resolved the same settings
    (each `TrainConfig` field but `PER_PROCESS`: the learning rate and its schedule,
    clipping, accumulation, dtype, recomputation, seed, data, model, planner, ...). One
    all_gather of a digest per field; every rank decides from the same rows, so ranks that
    disagree fail together, each with the same one line naming the fields."""
    fields = run_fields(config, PER_PROCESS)
    words = [int.from_bytes(hashlib.blake2b(json.dumps(v).encode(), digest_size=8).digest(), "little", signed=True)
             for v in fields.values()]
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = torch.stack(everyone).cpu()
    differ = [i for i in range(len(words)) if bool((rows[:, i] != rows[0, i]).any())]
    if differ:
        names = list(fields)
        column = rows[:, differ[0]].tolist()
        sets = sorted({tuple(r for r, v in enumerate(column) if v == value) for value in column})
        raise InputError(f"ranks disagree on the run's settings: {', '.join('--' + names[i].replace('_', '-') for i in differ)} "
                         f"(ranks {' | '.join(str(list(s)) for s in sets)} were started with different values); start "
                         "every rank with the same flags")


def placement_problem(cluster, rank: int, use_cuda: bool) -> str | None:
    """What is wrong with where this rank runs, if anything: under torchrun (not our
    launcher, which emulates nodes on one machine), its node's ranks (LOCAL_WORLD_SIZE)
    against its node group's GPUs per node (--nodes); on a GPU, the device it found
    against its group's GPU type (a "cpu" group is emulated and runs anywhere)."""
    group = cluster.group_of(rank)
    index = cluster.groups.index(group)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and not os.environ.get(ERROR_DIR_ENV) and int(local) != group.gpus_per_node:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        nodes = max(world // int(local), 1)
        if len(cluster.groups) == 1:
            return (f"--nodes {cluster.num_nodes}: torchrun runs {world} ranks as {local} per node "
                    f"(LOCAL_WORLD_SIZE), so {nodes} node{'s' * (nodes > 1)}; give --nodes {nodes}")
        return (f"rank {rank}: torchrun runs {local} ranks on its node (LOCAL_WORLD_SIZE), cluster "
                f"{cluster.name!r} {group.gpus_per_node} (node group {index}, {group.gpu})")
    if use_cuda and group.gpu != "cpu":
        found = torch.cuda.get_device_name()
        if not node_order.matches(group.gpu, found):
            return (f"rank {rank}: cluster {cluster.name!r} puts it on a {group.gpu} (node group {index}), but its "
                    f"device is a {found}")
    return None


def check_placement(cluster, rank: int, group, use_cuda: bool) -> None:
    """`placement_problem` of every rank, raised on every rank together (the first)."""
    problems: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, placement_problem(cluster, rank, use_cuda), group=group)
    first = next((p for p in problems if p), None)
    if first:
        raise InputError(first)
