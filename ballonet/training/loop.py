"""The training loop: one process per rank under torchrun (gloo on CPU, NCCL on GPU).

Every rank reads the same corpus, builds the same global batches and computes the same
plan (`BalancedLoader`); the model runs its attention on the plan's attention layout and
everything else on the token-balanced linear layout, its weights sharded by FSDP2
(`parallel.py`). The loss is the sum of token losses divided by the global count of
valid labels, so the sum of the ranks' gradients (FSDP2's reduce-scatter, overlapped
with backward) is the gradient of the global mean loss whatever the layout: every
planner trains the same model.

Checkpoints (`checkpoint.py`) are sharded, atomic and safe to load. With `--resume`, a
restarted job (by hand or by torchrun's `--max-restarts`) continues from the last one,
on the same or another world size; the JSON log is cut back to it so every step appears
once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import signal
import time

import torch
import torch.distributed as dist

import ballonet
from ballonet import runtime
from ballonet.cost.recompute import plan_recompute
from ballonet.errors import InputError
from ballonet.integrations import hf_model
from ballonet.plan.recompute import heaviest
from ballonet.training import checkpoint, metrics, parallel, tensor_parallel
from ballonet.training.config import TrainConfig
from ballonet.training.corpus import Corpus, load_corpus
from ballonet.training.loader import BalancedLoader, Cursor, document_order, take_pieces
from ballonet.training.model import build_model


class RankFailure(InputError):
    """A peer died, timed out or disagreed: one line on every rank instead of a hang."""

    exit_code = 1  # not the user's input


_PEER_TROUBLE = re.compile(r"disagree on the plan|disagree on the step's tokens|another plan rank|the plan is for|"
                           r"[Cc]onnection|[Tt]imed? ?out|[Pp]eer|[Gg]loo|NCCL")
"""What the runtime's plan check and the communication backends say when ranks part ways."""


def _cluster(config: TrainConfig, world_size: int) -> ballonet.ClusterSpec:
    if world_size % config.nodes:
        raise InputError(f"{world_size} ranks cannot be spread evenly over --nodes {config.nodes}")
    spec = ballonet.cluster(config.cluster, num_nodes=config.nodes, gpus_per_node=world_size // config.nodes)
    if spec.num_ranks != world_size:
        raise InputError(f"cluster {spec.name!r} has {spec.num_ranks} ranks, the job {world_size}")
    return spec


def _check_paths(config: TrainConfig) -> None:
    if config.json_log:
        if os.path.isdir(config.json_log):
            raise InputError(f"--json-log {config.json_log}: is a folder, not a file")
        parent = os.path.dirname(config.json_log) or "."
        if not os.path.isdir(parent):
            raise InputError(f"--json-log {config.json_log}: folder {parent} does not exist")
    if config.checkpoint_dir and os.path.exists(config.checkpoint_dir) and not os.path.isdir(config.checkpoint_dir):
        raise InputError(f"--checkpoint-dir {config.checkpoint_dir}: is a file, not a folder")
    if config.resume and config.checkpoint_dir:
        path = checkpoint.latest(config.checkpoint_dir)  # a foreign folder or dangling pointer fails here
        if path:
            checkpoint.read_meta(path)


def preflight(config: TrainConfig, world_size: int):
    """Check what can be checked before any process starts or any batch is built; returns
    (cluster, model spec, corpus). Raises InputError with one line on bad input."""
    if config.global_tokens < world_size:
        raise InputError(f"--global-tokens {config.global_tokens} is smaller than one token per rank "
                         f"({world_size} ranks)")
    _check_paths(config)
    cluster = _cluster(config, world_size)
    spec = hf_model.model_spec(config.model) if hf_model.is_hf(config.model) else ballonet.model(config.model)
    _check_tp(config, world_size, spec)
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
    if config.checkpoint_dir and config.checkpoint_every:
        checkpoint.check_folder(config.checkpoint_dir, spec.num_params)
    if config.tensorboard:
        _tensorboard_writer(None)
    corpus = load_corpus(config.corpus, seed=config.seed)
    if corpus.vocab_size > spec.vocab_size:
        raise InputError(f"corpus {config.corpus!r} has token ids up to {corpus.vocab_size - 1}, "
                         f"model {spec.name!r} a vocabulary of {spec.vocab_size}")
    ballonet.plan_batch([1] * (world_size // config.tp), cluster, spec, planner=config.planner)  # a bad planner fails here
    metrics.peak_flops(cluster, config.calibration)  # a bad profile fails here
    return cluster, spec, corpus


def _check_tp(config: TrainConfig, world_size: int, spec: ballonet.ModelSpec) -> None:
    """--tp: a TP group is `tp` ranks of one node, and `tp` divides the model's heads."""
    if world_size % config.tp:
        raise InputError(f"{world_size} ranks are not a multiple of --tp {config.tp}")
    per_node = world_size // config.nodes
    if per_node % config.tp:
        raise InputError(f"--tp {config.tp} does not divide the {per_node} ranks of a node (--nodes {config.nodes}): "
                         "a tensor-parallel group must sit inside one node")
    tensor_parallel.check_heads(spec.name, spec.num_heads, spec.num_kv_heads, config.tp)


# ---- process group -----------------------------------------------------------------------


def _init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """init_process_group: from torchrun's environment, with the store keys of each restart
    attempt under their own prefix (after torchrun restarts the workers, the previous
    attempt's gloo addresses are still in the agent's store, and a rank that reads one
    fails with "connection refused", seen on torch 2.13 with --max-restarts); or a group
    of one (so one process runs the same FSDP2 code)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"ballonet/attempt{attempt}/", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def _maybe_fault(step: int, rank: int) -> None:
    """Test hook: BALLONET_FAULT="step:rank" kills that rank with SIGKILL at that step,
    on the first attempt only (torchrun's restart count is 0)."""
    spec = os.environ.get("BALLONET_FAULT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fault_step, fault_rank = map(int, spec.split(":"))
        if (step, rank) == (fault_step, fault_rank):
            os.kill(os.getpid(), signal.SIGKILL)


# ---- logs ----------------------------------------------------------------------------------


def _trim_log(path: str, last_step: int) -> None:
    """Keep the JSON log's entries up to `last_step` (the steps after it run again); a
    torn last line (a run killed mid-write) is dropped."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise InputError(f"{path}:{i + 1}: not a JSON log line; cannot resume its log") from None
        if record.get("step", 0) <= last_step:
            kept.append(json.dumps(record) + "\n")
    checkpoint.write_durably(path, "".join(kept))


def _tensorboard_writer(folder: str | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InputError("--tensorboard needs the tensorboard package (pip install 'ballonet[tb]')") from None
    return SummaryWriter(folder) if folder else None


def _reduce(values: list[float], group, device: torch.device) -> tuple[list[float], list[float]]:
    """Sum and max over ranks of each value (one tensor, two all-reduces; on the device,
    which NCCL needs)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    s, m = t.clone(), t.clone()
    dist.all_reduce(s, group=group)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return s.tolist(), m.tolist()


def _unplannable(e: InputError, step: int, loader: BalancedLoader, corpus: Corpus, config: TrainConfig) -> InputError:
    """The planner's message with the step and the corpus documents it is about."""
    state = loader.state_dict()
    cursor = Cursor(state["epoch"], state["position"], state["offset"], state["batch"])
    order = functools.partial(document_order, corpus.num_docs, seed=config.seed, shuffle=True)
    pieces, _ = take_pieces(corpus.lengths, lambda epoch: order(epoch), cursor, config.global_tokens,
                            config.max_doc_tokens, None)

    def name(match: re.Match) -> str:
        i = int(match.group(1))
        if i >= len(pieces):
            return match.group(0)
        p = pieces[i]
        return f"{match.group(0)} (corpus document {corpus.names[p.doc]}, tokens {p.start}-{p.end})"

    message = re.sub(r"document (\d+)", name, str(e))
    return InputError(f"step {step}: cannot plan the batch: {message}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:400] or type(e).__name__


# ---- the loop ------------------------------------------------------------------------------


def train(config: TrainConfig) -> list[dict]:
    """Run the loop in this process as one rank: of the process group already initialised,
    of torchrun's (from its environment), or alone. Returns the per-step log records."""
    return train_model(config)[0]


def train_model(config: TrainConfig):
    """`train`, also returning the trained (FSDP2-sharded) model."""
    owns_group = not dist.is_initialized()
    use_cuda = torch.cuda.is_available()
    if owns_group:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=config.timeout_minutes)
        try:
            _init_process_group("nccl" if use_cuda else "gloo", timeout)
        except (RuntimeError, dist.DistError) as e:
            raise RankFailure(f"rank {os.environ.get('RANK', '0')}: could not form the process group of "
                              f"{os.environ.get('WORLD_SIZE', '1')} ranks within --timeout-minutes "
                              f"{config.timeout_minutes:g} ({_one_line(e)})") from None
    try:
        return _run(config, dist.group.WORLD, use_cuda)
    except RuntimeError as e:
        if isinstance(e, dist.DistError) or _PEER_TROUBLE.search(str(e)):
            raise RankFailure(f"rank {dist.get_rank()}: {_one_line(e)}") from e
        raise
    finally:
        if owns_group:
            dist.destroy_process_group()


def _run(config: TrainConfig, group, use_cuda: bool):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not use_cuda:
        torch.set_num_threads(1)
    torch.manual_seed(config.seed)

    cluster, spec, corpus = preflight(config, world_size)
    # A plan rank is a TP group of `tp` consecutive ranks; the plan's traffic runs over the
    # plan ranks of this rank's TP index (`Groups.plan`).
    mesh = parallel.device_mesh(world_size, config.shard, device, config.tp)
    plan_rank = rank // config.tp
    plan_fn = functools.partial(ballonet.plan_batch, cluster=cluster, model=spec, planner=config.planner,
                                **({"double": False} if config.no_double else {}))
    loader = BalancedLoader(corpus, global_tokens=config.global_tokens, plan_fn=plan_fn, rank=plan_rank,
                            world_size=world_size // config.tp, seed=config.seed, max_doc_tokens=config.max_doc_tokens)
    hf = hf_model.is_hf(config.model)
    model = (hf_model.build_model(config.model, config.seed, device, config.recompute, config.recompute_layers)
             if hf else build_model(config, spec, device))
    if config.tp > 1:
        (tensor_parallel.parallelize_hf if hf else tensor_parallel.parallelize_transformer)(model, mesh["tp"])
    parallel.parallelize(model, mesh, config.dtype)
    groups = _groups(group, world_size, config.tp, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    step = 0
    if config.checkpoint_dir and rank == 0:
        checkpoint.clean_stale(config.checkpoint_dir)
    dist.barrier(group)
    found = checkpoint.latest(config.checkpoint_dir) if config.resume and config.checkpoint_dir else None
    if found:
        meta = checkpoint.load(found, model, optimizer, rank, group, device)
        try:
            loader.load_state_dict(meta["loader"])
        except InputError as e:
            raise InputError(f"{os.path.join(found, checkpoint.META)}: {e}") from None
        step = meta["step"]
    if rank == 0 and config.json_log:
        if step:
            _trim_log(config.json_log, step)
        elif os.path.exists(config.json_log):
            os.remove(config.json_log)
    writer = _tensorboard_writer(config.tensorboard) if config.tensorboard and rank == 0 else None
    peak = metrics.peak_flops(cluster, config.calibration)

    records = []
    batches = iter(loader)
    while step < config.steps:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except InputError as e:
            raise _unplannable(e, step + 1, loader, corpus, config) from None
        step += 1
        _maybe_fault(step, rank)
        recompute = _auto_recompute(model, batch.plan, spec, cluster, plan_rank) if spec.recompute is None else None
        record = _step(model, optimizer, batch, plan_rank, groups, device, spec, peak, step)
        if not math.isfinite(record["loss"]):  # the same on every rank (a reduced sum)
            raise InputError(f"step {step}: the loss is {record['loss']}; training stopped (try a smaller --lr)")
        if recompute is not None:
            record["recompute"], record["recompute_layers_max"] = recompute
        records.append(record)
        if rank == 0:
            _log(config, record, writer)
        if config.checkpoint_dir and config.checkpoint_every and step % config.checkpoint_every == 0:
            checkpoint.save(config.checkpoint_dir, step, model, optimizer, loader.state_dict(), rank, group, device)
    if writer is not None:
        writer.close()
    return records, model


def _auto_recompute(model, plan, spec, cluster, rank: int) -> tuple[str, int]:
    """--recompute auto: set this step's recomputation on this rank's blocks as the plan
    says (`Plan.recompute`, `cost.recompute.plan_recompute`: the cheapest its tokens fit
    under, what the planner and the simulator price: selective or linear on as few of the
    first layers as this rank's own tokens need). Every rank reads the same plan, so a
    "full" step (whose exchanges rerun in the backward) is full on all of them. -> (mode,
    the most layers any rank recomputes)."""
    per_rank = plan_recompute(plan, spec, [cluster.gpu_of(r * spec.tp) for r in range(plan.num_ranks)])
    mode, layers = per_rank[rank]
    model.set_recompute(mode.value, layers)
    most = heaviest(per_rank)
    return most.mode.value, most.layers


@dataclasses.dataclass(frozen=True)
class Groups:
    """The process groups of a run, by role (`parallel.py`)."""

    world: dist.ProcessGroup
    """Every rank: metrics, checkpoints (and FSDP2's collectives, over the same ranks)."""
    plan: dist.ProcessGroup
    """The plan's traffic: rings, relays, remaps, the plan check (with tensor parallelism,
    the plan ranks of this rank's TP index)."""
    outer: dist.ProcessGroup | None
    """Double rings' transfers across nodes."""


def _groups(world: dist.ProcessGroup, world_size: int, tp: int, device: torch.device) -> Groups:
    mesh = parallel.plan_mesh(device, world_size, tp)
    return Groups(world=world, plan=mesh.get_group("plan"),
                  outer=parallel.outer_group(world_size, tp, device) if world_size > tp else None)


SYNC_DEBUG = "BALLONET_SYNC_DEBUG"
"""Test hook (scripts/gpu_check.sh): "warn" or "error" runs each step after the first,
forward, backward and optimizer step, under `torch.cuda.set_sync_debug_mode`, so a
host-device synchronisation there warns or fails."""


@contextlib.contextmanager
def _sync_debug(step: int):
    mode = os.environ.get(SYNC_DEBUG)
    if not mode or step < 2 or not torch.cuda.is_available():
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _step(model, optimizer, batch, rank: int, groups: Groups, device, spec, peak: float, step: int) -> dict:
    """One optimizer step on plan rank `rank`'s share of `batch`; its log record over every rank."""
    wall, cpu = time.perf_counter(), time.thread_time()
    meta, input_ids, labels = batch.staged.to(device)  # the step's metadata and tokens: one copy
    if batch.plan.num_ranks > 1:  # every rank runs this plan on the same data, before the first exchange
        runtime.check_plan(batch.plan, rank, groups.plan, device, content=batch.content)
    counter = runtime.ByteCounter()
    with _sync_debug(step), tensor_parallel.loss_context(model):
        loss_sum = model.loss(input_ids, labels, batch.plan, rank, groups.plan, counter=counter,
                              outer_group=groups.outer, meta=meta, verify_plan=False)
        (loss_sum / batch.num_valid_tokens_global).backward()
        compute = time.thread_time() - cpu
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - wall
    step_cpu = time.thread_time() - cpu
    exposed = max(wall - step_cpu, 0.0)
    # Over every rank: a TP group's ranks hold the same loss, each counts its 1/tp of it.
    values = [loss_sum.item() / spec.tp, compute, float(sum(counter.total().values())), exposed,
              float(metrics.memory_high_water(device)), float(parallel.local_parameter_bytes(model, optimizer)),
              step_cpu]
    sums, maxes = _reduce(values, groups.world, device)
    world_size = dist.get_world_size(groups.world)
    num_tokens = sum(p.end - p.start for p in batch.pieces)
    return {
        "step": step,
        "loss": sums[0] / batch.num_valid_tokens_global,
        "tokens": num_tokens,
        "tokens_per_s": num_tokens / wall,
        "plan_ms": batch.plan_ms,
        "compute_s_max": maxes[1],
        "compute_s_mean": sums[1] / world_size,
        "cpu_s_max": maxes[6],
        "bytes_sent": int(sums[2]),
        "ledger": [list(p) for p in batch.pieces],
        "mfu": metrics.step_flops(spec, batch.plan.lengths) / (wall * peak),
        "exposed_comm_s_max": maxes[3],
        "memory_peak_bytes_max": int(maxes[4]),
        "param_bytes_max": int(maxes[5]),
    }


def _log(config: TrainConfig, record: dict, writer) -> None:
    if config.json_log:
        with open(config.json_log, "a") as f:
            f.write(json.dumps(record) + "\n")
    if writer is not None:
        for key in ("loss", "tokens_per_s", "mfu", "compute_s_max", "exposed_comm_s_max", "memory_peak_bytes_max"):
            writer.add_scalar(f"train/{key}", record[key], record["step"])
    step = record["step"]
    if step % config.log_every == 0 or step == config.steps:
        balance = record["compute_s_max"] / max(record["compute_s_mean"], 1e-9)
        recompute = (f"  recompute {record['recompute']} (at most {record['recompute_layers_max']} layers)"
                     if "recompute" in record else "")  # --recompute auto
        print(f"step {step:4d}  loss {record['loss']:.4f}  tok/s {record['tokens_per_s']:8.0f}  "
              f"MFU {record['mfu']:6.2%}  plan {record['plan_ms']:6.1f} ms  compute max/mean {balance:.2f}  "
              f"exposed comm {record['exposed_comm_s_max']:.3f} s  mem {record['memory_peak_bytes_max'] / 2**20:.0f} MiB  "
              f"bytes {record['bytes_sent']}{recompute}", flush=True)
