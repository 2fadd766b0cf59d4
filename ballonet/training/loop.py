"""The training loop: one process per rank under torchrun (gloo on CPU, NCCL on GPU).

Every rank reads the same corpus, builds the same global batches and computes the same
plan (`BalancedLoader`); the model runs its attention on the plan's attention layout and
everything else on the token-balanced linear layout, its weights sharded by FSDP2
(`parallel.py`). The loss is the sum of token losses divided by the global count of
valid labels, so the sum of the ranks' gradients (FSDP2's reduce-scatter, overlapped
with backward) is the gradient of the global mean loss whatever the layout: every
planner trains the same model. With `--grad-accum` a global batch arrives as its
micro-batches (`accumulation.py`), each divided by the whole batch's valid labels, and
one optimizer step follows them all; the step's gradient is clipped and its learning
rate scheduled by `optim.py`; every `--eval-every` steps `evaluation.py` measures the
held-out loss.

Checkpoints (`checkpoint.py`) are sharded, atomic and safe to load. With `--resume`, a
restarted job (by hand or by torchrun's `--max-restarts`) continues from the last one,
on the same or another world size; the JSON log is cut back to it so every step appears
once (`logs.py`). After every step the ranks agree whether to stop there (`lease.py`: a
signal, a loan that ends or begins): they save that step and raise `lease.Stopped`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import re
import signal
import time

import torch
import torch.distributed as dist

import ballonet
from ballonet import calibration, runtime
from ballonet.cost.recompute import plan_recompute
from ballonet.errors import InputError
from ballonet.integrations import hf_model
from ballonet.plan.recompute import heaviest
from ballonet.training import config_file, evaluation, logs, metrics, optim
from ballonet.training.checkpoints import checkpoint, export, folder as checkpoint_folder
from ballonet.training.jobs import host, lease, process_group
from ballonet.training.parallelism import parallel, tensor_parallel
from ballonet.training.config import TrainConfig
from ballonet.training.data.corpus import Corpus
from ballonet.training.jobs.launch import preempt_file
from ballonet.training.data.loader import BalancedLoader
from ballonet.training.parallelism.build import build_sharded_model
from ballonet.training.preflight import agree, check_placement, preflight


class RankFailure(InputError):
    """A peer died, timed out or disagreed: one line on every rank instead of a hang."""

    exit_code = 1  # not the user's input


_PEER_TROUBLE = re.compile(r"disagree on the plan|disagree on the step's tokens|another plan rank|the plan is for|"
                           r"[Cc]onnection|[Tt]imed? ?out|[Pp]eer|[Gg]loo|NCCL")
"""What the runtime's plan check and the communication backends say when ranks part ways."""


def _maybe_fault(step: int, rank: int) -> None:
    """Test hook: BALLONET_FAULT="step:rank" kills that rank with SIGKILL at that step,
    on the first attempt only (torchrun's restart count is 0)."""
    spec = os.environ.get("BALLONET_FAULT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fault_step, fault_rank = map(int, spec.split(":"))
        if (step, rank) == (fault_step, fault_rank):
            os.kill(os.getpid(), signal.SIGKILL)


# ---- collectives and errors ---------------------------------------------------------------


def _reduce(values: list[float], group, device: torch.device) -> tuple[list[float], list[float]]:
    """Sum and max over ranks of each value (one tensor, two all-reduces; on the device,
    which NCCL needs)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    s, m = t.clone(), t.clone()
    dist.all_reduce(s, group=group)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return s.tolist(), m.tolist()


def _unplannable(e: InputError, step: int, loader: BalancedLoader, corpus: Corpus) -> InputError:
    """The planner's message with the step and the corpus documents it is about."""
    pieces = loader.next_pieces()

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
    signals = lease.Signals()
    try:
        return _train_model(config, signals)
    finally:
        signals.close()


def _train_model(config: TrainConfig, signals: lease.Signals):
    owns_group = not dist.is_initialized()
    use_cuda = torch.cuda.is_available()
    if owns_group:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=config.timeout_minutes)
        try:
            process_group.init("nccl" if use_cuda else "gloo", timeout, config, use_cuda)
        except (RuntimeError, dist.DistError) as e:
            raise RankFailure(f"rank {os.environ.get('RANK', '0')}: could not form the process group of "
                              f"{os.environ.get('WORLD_SIZE', '1')} ranks within --timeout-minutes "
                              f"{config.timeout_minutes:g} ({_one_line(e)})") from None
    try:
        return _run(config, dist.group.WORLD, use_cuda, signals)
    except RuntimeError as e:
        if isinstance(e, dist.DistError) or _PEER_TROUBLE.search(str(e)):
            raise RankFailure(f"rank {dist.get_rank()}: {_one_line(e)}") from e
        raise
    finally:
        if owns_group:
            dist.destroy_process_group()


def _run(config: TrainConfig, group, use_cuda: bool, signals: lease.Signals):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    heap_kept = not use_cuda and host.setup_cpu_rank()
    torch.manual_seed(config.seed)

    cluster, spec, corpus = preflight(config, world_size)
    agree(config, group, device)  # every rank runs with the same settings, or all fail here
    if config.lease and not ballonet.cluster(config.cluster).has_loans:
        raise InputError(f"--lease {config.lease}: cluster {cluster.name!r} has no node group with loaned = true")
    check_placement(cluster, rank, group, use_cuda)
    corpus, eval_corpus = evaluation.split_corpora(config, corpus)
    # A plan rank is a TP group of `tp` consecutive ranks; the plan's traffic runs over the
    # plan ranks of this rank's TP index (`Groups.plan`).
    mesh = parallel.device_mesh(world_size, config.shard, device, config.tp)
    plan_rank, num_plan_ranks = rank // config.tp, world_size // config.tp
    plan_fn = functools.partial(_plan, metrics.plan_profile(cluster, config.calibration), cluster=cluster,
                                model=spec, planner=config.planner, **({"double": False} if config.no_double else {}))
    loader = BalancedLoader(corpus, global_tokens=config.global_tokens, plan_fn=plan_fn, rank=plan_rank,
                            world_size=num_plan_ranks, seed=config.seed, max_doc_tokens=config.max_doc_tokens,
                            grad_accum=config.grad_accum, outlier_delay=config.outlier_delay)
    eval_set = None if eval_corpus is None else functools.partial(
        evaluation.eval_batches, eval_corpus, num_tokens=evaluation.eval_tokens(config),
        global_tokens=config.global_tokens, plan_fn=plan_fn, rank=plan_rank, world_size=num_plan_ranks,
        max_doc_tokens=config.max_doc_tokens, grad_accum=config.grad_accum)
    model = build_sharded_model(config, spec, mesh, device)  # on meta, split, then each rank's shards
    groups = _groups(group, world_size, config.tp, device)
    optimizer = optim.build_optimizer(model, config.lr, config.weight_decay)
    if heap_kept:  # a micro-batch's heap faulted in now, not in whichever step first needs it
        host.warm_heap(host.step_heap_bytes(spec, config.global_tokens // config.grad_accum,
                                            parallel.local_parameter_bytes(model)))

    step = 0
    if config.checkpoint_dir and rank == 0:
        checkpoint_folder.clean_stale(config.checkpoint_dir)
        config_file.write_resolved(config, config.checkpoint_dir)
    dist.barrier(group)
    found = checkpoint_folder.resume_path(config.checkpoint_dir or "", config.resume_from) if config.resume else None
    if found:
        meta = checkpoint.load(found, model, optimizer, rank, group, device)
        try:
            loader.load_state_dict(meta["loader"])
        except InputError as e:
            raise InputError(f"{os.path.join(found, checkpoint_folder.META)}: {e}") from None
        step = meta["step"]
        if rank == 0:
            print(f"resumed from step {step} ({found})", flush=True)
    scheduler = optim.lr_scheduler(optimizer, lr=config.lr, steps=config.steps, warmup_steps=config.warmup_steps,
                                   decay=config.lr_decay, min_lr=config.min_lr, start_step=step)
    saver = _checkpointer(config, rank, group, device, found, world_size)
    hf_config = hf_model.config_dict(config.model) if hf_model.is_hf(config.model) else None
    model_meta = {"model": export.model_meta(spec, hf_config, config.max_doc_tokens or config.global_tokens)}
    writer = logs.StepLog(config, step) if rank == 0 else None
    peak = metrics.peak_flops(cluster, config.calibration)

    records, stop = [], None
    boundary = lease.StepBoundary(signals, config.lease, lease.members_state(cluster), group, device, preempt_file())
    batches = iter(loader)
    auto = functools.partial(_auto_recompute, model, spec=spec, cluster=cluster, rank=plan_rank) \
        if spec.recompute is None else None
    while step < config.steps:
        try:
            first = next(batches)
            micro = [first] + [next(batches) for _ in range(first.num_micro_batches - 1)]
        except StopIteration:
            break
        except InputError as e:
            raise _unplannable(e, step + 1, loader, corpus) from None
        step += 1
        _maybe_fault(step, rank)
        record = _step(model, optimizer, micro, plan_rank, groups, device, spec, peak, step, config.max_grad_norm, auto)
        if not math.isfinite(record["loss"]):  # the same on every rank (a reduced sum)
            raise InputError(f"step {step}: the loss is {record['loss']}; training stopped (try a smaller --lr)")
        scheduler.step()
        if eval_set is not None and step % config.eval_every == 0:
            # Reduced over the plan ranks: with tensor parallelism every TP rank holds the same sum.
            record.update(evaluation.evaluate(model, eval_set(), plan_rank, groups.plan, device, groups.outer))
        records.append(record)
        if rank == 0:
            logs.write(config, record, writer)
        if saver and config.checkpoint_every and step % config.checkpoint_every == 0:
            saver.save(step, model, optimizer, loader.state_dict(), model_meta)
        elif saver:
            saver.poll()  # a background save is published as soon as every rank has written it
        stop = boundary.check()
        if stop:
            break
    if saver and records and saver.last_step != step:  # the final step (or the one stopped after), always
        saver.save(step, model, optimizer, loader.state_dict(), model_meta)
    if saver:
        saver.close()
    if writer is not None:
        writer.close()
    if stop:
        leaves = cluster.group_of(rank).loaned and lease.members_state(cluster) == lease.LENT
        raise lease.Stopped(stop, step, config.checkpoint_dir, leaves=leaves)
    return records, model


def _plan(profile, lengths, **options):
    """`ballonet.plan_batch`, priced with `profile` (`--calibration`) when given: on the
    loader's prefetch thread too, which does not inherit the caller's `calibration.use`."""
    if profile is None:
        return ballonet.plan_batch(lengths, **options)
    with calibration.use(profile):
        return ballonet.plan_batch(lengths, **options)


def _auto_recompute(model, plan, *, spec, cluster, rank: int) -> tuple[str, int]:
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


def _checkpointer(config: TrainConfig, rank: int, group, device, resumed_from: str | None,
                  world_size: int) -> checkpoint.Checkpointer | None:
    """The run's saves (None without --checkpoint-dir); --async-checkpoint writes over a
    gloo group of its own (made here, collectively), as DCP's background saves need."""
    if not config.checkpoint_dir:
        return None
    async_group = None
    if config.async_checkpoint:
        async_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
    return checkpoint.Checkpointer(config.checkpoint_dir, rank, group, device, keep=config.keep_checkpoints,
                                   protect=resumed_from, async_group=async_group)


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


def _step(model, optimizer, micro: list, rank: int, groups: Groups, device, spec, peak: float, step: int,
          max_grad_norm: float | None = None, auto_recompute=None) -> dict:
    """One optimizer step on plan rank `rank`'s share of a global batch, given as its
    micro-batches `micro` (one without --grad-accum; each one's loss over the global
    batch's valid labels, so their gradients add up to the global batch's); its log record
    over every rank. The gradient is clipped to `max_grad_norm` if given;
    `auto_recompute(plan)` sets each micro-batch's recomputation (--recompute auto)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    counter = runtime.ByteCounter()
    loss_sum, recomputes = torch.zeros((), dtype=torch.float64, device=device), []
    for batch in micro:
        meta, input_ids, labels = batch.staged.to(device)  # the micro-batch's metadata and tokens: one copy
        if batch.plan.num_ranks > 1:  # every rank runs this plan on the same data, before the first exchange
            runtime.check_plan(batch.plan, rank, groups.plan, device, content=batch.content)
        if auto_recompute is not None:
            recomputes.append(auto_recompute(batch.plan))
        with _sync_debug(step), tensor_parallel.loss_context(model):
            part = model.loss(input_ids, labels, batch.plan, rank, groups.plan, counter=counter,
                              outer_group=groups.outer, meta=meta, verify_plan=False)
            (part / batch.num_valid_tokens_global).backward()
            loss_sum += part.detach().double()
    compute = time.thread_time() - cpu
    with _sync_debug(step):
        grad_norm = optim.clip_gradients(model.parameters(), max_grad_norm)  # a tensor: read after the step
        lr = optim.current_lr(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - wall
    step_cpu = time.thread_time() - cpu
    exposed = max(wall - step_cpu, 0.0)
    world_rank, world_size = dist.get_rank(groups.world), dist.get_world_size(groups.world)
    # Over every rank: a TP group's ranks hold the same loss, each counts its 1/tp of it.
    values = [loss_sum.item() / spec.tp, compute, float(sum(counter.total().values())), exposed,
              float(metrics.memory_high_water(device)), float(parallel.local_parameter_bytes(model, optimizer)),
              step_cpu] + [compute if r == world_rank else 0.0 for r in range(world_size)]  # summed: each rank's compute
    sums, maxes = _reduce(values, groups.world, device)
    pieces = [p for batch in micro for p in batch.pieces]
    num_tokens = sum(p.end - p.start for p in pieces)
    record = {
        "step": step,
        "world_size": world_size,
        "loss": sums[0] / micro[0].num_valid_tokens_global,
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens": num_tokens,
        "tokens_per_s": num_tokens / wall,
        "plan_ms": sum(batch.plan_ms for batch in micro),
        "compute_s_max": maxes[1],
        "compute_s_mean": sums[1] / world_size,
        "compute_s": sums[7:7 + world_size],
        "cpu_s_max": maxes[6],
        "bytes_sent": int(sums[2]),
        "ledger": [list(p) for p in pieces],
        "plan_digest": micro[0].plan.digest if len(micro) == 1 else [batch.plan.digest for batch in micro],
        "mfu": metrics.step_flops(spec, [p.end - p.start for p in pieces]) / (wall * peak),
        "exposed_comm_s_max": maxes[3],
        "memory_peak_bytes_max": int(maxes[4]),
        "param_bytes_max": int(maxes[5]),
    }
    if len(micro) > 1:
        record["micro_batches"] = len(micro)
    if recomputes:  # the most any micro-batch recomputed
        most = heaviest(recomputes)
        record["recompute"], record["recompute_layers_max"] = most.mode.value, most.layers
    return record
