"""Sharded, safe, atomic checkpoints with `torch.distributed.checkpoint` (DCP).

A checkpoint folder holds the last few finished checkpoints, `step-NNNNNNNN/`, the
newest named by the text file `latest`:

    step-00000010/  DCP files: each rank writes its own shards of the model and optimizer
                    (FSDP2 DTensors); `.metadata` indexes them
                    ballonet.json: step, world size, loader state (JSON), RNG states, the
                    model's shape (for `export.py`)
    latest          "step-00000010"
    config.toml     the run's resolved config (`config_file.py`)

Saving: every rank writes into `.tmp-step-N/` (DCP fsyncs each file), rank 0 adds
`ballonet.json`, fsyncs, renames the folder into place, then replaces `latest` (write,
fsync, rename) and only then deletes the checkpoints beyond the newest `keep` (never the
one the run resumed from). A save killed at any point leaves `latest` naming a complete
checkpoint; stale `.tmp-*` folders are removed when the next run starts (`clean_stale`).
With DCP's `async_save` the shards are staged to CPU memory and written by a background
thread over a gloo group of their own, while training goes on; the steps after the
writing (metadata, rename, `latest`) follow at the first step boundary where every rank's
part is written (`Checkpointer.poll`), so a save counts as soon as it is complete. A save
that fails (a full disk: said so in words, whichever exception reported it) is one line,
on every rank, at that boundary; its `.tmp-` folder is removed and `latest` still names
the last complete checkpoint.

Loading never executes code from the checkpoint, by construction (`safe_dcp.py`: DCP's
`.metadata` read by torch's weights-only unpickler with DCP's classes as exact safe
globals, every storage item inside a plain file of the folder, non-tensor items through
`torch.load(weights_only=True)`, never DCP's default planner, whose `load_bytes` unpickles
with weights_only=False); step, loader state and RNG are JSON, checked field by field
(`folder.py`). Shards reassemble on any world size (DCP reshards DTensors), so a run saved
on 4 ranks resumes on 2; RNG states are restored only on the world size that saved them.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ballonet.errors import InputError
from ballonet.training.checkpoints.folder import FORMAT, LATEST, META, latest, read_meta
from ballonet.training.checkpoints.safe_dcp import (
    DCP_METADATA, SafeLoadPlanner, SafeReader, SafeWriter, check_tensors, expected_tensors, fsync_path, last_line,
    read_safe_metadata, write_durably)


# ---- RNG -------------------------------------------------------------------------------


def _rng_tensor(device: torch.device) -> torch.Tensor:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return torch.cat(states)


def _gather_rng(group, device: torch.device) -> list[str]:
    """Every rank's RNG state (CPU, and CUDA on GPU), base64, gathered to all ranks."""
    mine = _rng_tensor(device)
    if group is None:
        return [base64.b64encode(mine.numpy().tobytes()).decode()]
    comm_device = device if device.type == "cuda" else torch.device("cpu")
    everyone = [torch.empty_like(mine, device=comm_device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine.to(comm_device), group=group)
    return [base64.b64encode(t.cpu().numpy().tobytes()).decode() for t in everyone]


def _set_rng(encoded: str, device: torch.device, where: str) -> None:
    try:
        state = torch.frombuffer(bytearray(base64.b64decode(encoded, validate=True)), dtype=torch.uint8)
    except ValueError:
        raise InputError(f"{where}: field 'rng' holds a string that is not base64") from None
    cpu_size = torch.get_rng_state().numel()
    if state.numel() < cpu_size:
        raise InputError(f"{where}: field 'rng' holds a state of {state.numel()} bytes, not {cpu_size}")
    try:
        torch.set_rng_state(state[:cpu_size].clone())
        if device.type == "cuda" and state.numel() > cpu_size:
            torch.cuda.set_rng_state(state[cpu_size:].clone(), device)
    except RuntimeError as e:  # torch checks the state's contents: "Invalid mt19937 state"
        raise InputError(f"{where}: field 'rng' holds no RNG state torch takes ({last_line(e)})") from None


# ---- save and load ---------------------------------------------------------------------


def checkpoint_bytes(num_params: int) -> int:
    """What one checkpoint takes on disk, a little more than: fp32 master weights and
    AdamW's two fp32 states per parameter (DCP's own records add about 6% for the tiny
    model), plus a MiB of metadata."""
    return int(12 * num_params * 1.1) + (1 << 20)


def check_folder(folder: str, num_params: int, keep: int = 1) -> None:
    """Before training: `folder` is a folder (or can be made as one) that this process can
    write, on a disk with room for the checkpoints still to come: up to `keep` + 1 of them
    are on disk at once (the oldest is deleted only once a new one is complete), those
    already there included. InputError otherwise."""
    flag = f"--checkpoint-dir {folder}"
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise InputError(f"{flag}: is a file, not a folder")
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InputError(f"{flag}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag}: {existing} is not writable")
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # the free space cannot be known here: a full disk is reported at the save
    there = len([n for n in os.listdir(folder) if n.startswith("step-")]) if os.path.isdir(folder) else 0
    need = checkpoint_bytes(num_params) * max(keep + 1 - there, 1)
    if free < need:
        raise InputError(f"{flag}: {free / 2**20:.1f} MiB free on its disk, checkpoints of this model need "
                         f"{need / 2**20:.1f} MiB")


def save(folder: str, step: int, model, optimizer, loader_state: dict, rank: int, group, device, *,
         keep: int = 1, protect: str | None = None, meta: dict | None = None, async_group=None):
    """Collective: write checkpoint `step` of every rank's shards; returns its folder once
    written. Afterwards only the `keep` newest checkpoints stay, and `protect` (the one the
    run resumed from); `meta` adds JSON items to `ballonet.json`. With `async_group` (a
    gloo group of the same ranks, for DCP's background traffic only), the shards are
    staged to CPU memory and written in the background (DCP's `async_save`): returns a
    `PendingSave` to `wait()` on before the next save and at the end. A disk that fills or
    turns read-only meanwhile is one InputError line, nothing half-written."""
    name = f"step-{step:08d}"
    tmp = os.path.join(folder, f".tmp-{name}")
    with _failing_save(folder, tmp, step, rank):
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        world = 1 if group is None else dist.get_world_size(group)
        meta = {"format": FORMAT, "step": step, "world_size": world, "loader": loader_state,
                "rng": _gather_rng(group, device), **(meta or {})}
        _barrier(group)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state, writer = {"model": model_sd, "optimizer": optim_sd}, SafeWriter(tmp, sync_files=True)

        def finish() -> str:
            with _failing_save(folder, tmp, step, rank):
                if rank == 0:
                    _publish(folder, name, tmp, meta, keep, protect)
                _barrier(async_group or group)
                return os.path.join(folder, name)

        if async_group is not None:
            future = dcp.async_save(state, storage_writer=writer, process_group=async_group)
            return PendingSave(future, finish, functools.partial(_failing_save, folder, tmp, step, rank))
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    return finish()


@contextlib.contextmanager
def _failing_save(folder: str, tmp: str, step: int, rank: int):
    """A save's failures (OSError, DCP's, torch's writer's "unexpected pos" on a full disk)
    as one InputError line, its temporary folder removed."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(f"--checkpoint-dir {folder}: cannot write the checkpoint of step {step} "
                         f"({_reason(e, folder)}); the last complete checkpoint stays the latest") from None


def _reason(e: BaseException, folder: str) -> str:
    """Why a save failed, in words: a full disk says so whatever exception reported it."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if getattr(e, "errno", None) == errno.ENOSPC or (free is not None and free < FULL_BYTES):
        return f"the disk is full: No space left on device, {free if free is not None else 0} bytes free"
    return last_line(e)


FULL_BYTES = 1 << 20
"""Free bytes under which a failed save is put down to a full disk."""


class PendingSave:
    """A checkpoint being written in the background; `wait()` (collective) publishes it."""

    def __init__(self, future, finish, failing):
        self._future, self._finish, self._failing = future, finish, failing

    def done(self) -> bool:
        """Whether this rank's part is written (or failed): `wait` would not block."""
        return self._future.done()

    def wait(self) -> str:
        with self._failing():
            self._future.result()
        return self._finish()


def _publish(folder: str, name: str, tmp: str, meta: dict, keep: int, protect: str | None) -> None:
    """Rank 0, every shard written: add the metadata, rename the folder into place, point
    `latest` at it, then prune."""
    final = os.path.join(folder, name)
    write_durably(os.path.join(tmp, META), json.dumps(meta, allow_nan=False))
    previous = latest(folder)
    if os.path.exists(final):  # a run restarted without --resume reached this step again
        if previous == final:
            os.remove(os.path.join(folder, LATEST))
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(folder)
    write_durably(os.path.join(folder, LATEST), name)
    for other in prunable(folder, name, keep, protect):
        shutil.rmtree(os.path.join(folder, other), ignore_errors=True)


def prunable(folder: str, newest: str, keep: int, protect: str | None = None) -> list[str]:
    """The checkpoints to delete once `newest` is written: every one numbered after it (an
    earlier run's, not resumed), and all but the `keep` newest of the rest; never `newest`
    nor `protect`."""
    steps = sorted(n for n in os.listdir(folder) if n.startswith("step-") and n != newest)
    older, later = [n for n in steps if n < newest], [n for n in steps if n > newest]
    stale = later + older[:max(len(older) - (keep - 1), 0)]
    kept = os.path.basename(os.path.normpath(protect)) if protect else None
    return [n for n in stale if n != kept]


def load(path: str, model, optimizer, rank: int, group, device) -> dict:
    """Collective: restore model and optimizer shards from checkpoint `path` (any world
    size) and RNG (same world size); returns its metadata (step, loader state)."""
    meta = read_meta(path)
    metadata = read_safe_metadata(os.path.join(path, DCP_METADATA), path)  # refused here, before DCP logs it
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    check_tensors(metadata, expected_tensors(state), path, scope=("model.", "optimizer."))
    try:
        with warnings.catch_warnings():  # torch.load's warning on a crafted item: the refusal says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), process_group=group,
                     no_dist=group is None)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure
        raise InputError(f"{path}: corrupt or foreign checkpoint ({last_line(e)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    world = 1 if group is None else dist.get_world_size(group)
    if meta.get("world_size") == world and len(meta.get("rng", [])) == world:
        _set_rng(meta["rng"][rank], device, os.path.join(path, META))
    return meta


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group)


class Checkpointer:
    """A run's saves into `folder`: the newest `keep` checkpoints stay (and `protect`, the
    one the run resumed from). With `async_group` each save is written in the background
    and published at the first `poll()` (the loop's, after each step) that finds every
    rank's part written, or failed: a failure is reported there, on every rank together,
    not at the next save; `close()` waits for the last one (all collective)."""

    def __init__(self, folder: str, rank: int, group, device, *, keep: int, protect: str | None = None,
                 async_group=None):
        self.folder, self.rank, self.group, self.device = folder, rank, group, device
        self.keep, self.protect, self.async_group = keep, protect, async_group
        self.last_step: int | None = None
        self._pending: PendingSave | None = None
        # The ranks agree that a background save is done over a gloo group of their own: no
        # device synchronisation, and not DCP's group, which its thread is using.
        self._poll_group = None
        if async_group is not None and group is not None:
            self._poll_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")

    def save(self, step: int, model, optimizer, loader_state: dict, meta: dict | None = None) -> None:
        self.close()
        saved = save(self.folder, step, model, optimizer, loader_state, self.rank, self.group, self.device,
                     keep=self.keep, protect=self.protect, meta=meta, async_group=self.async_group)
        if isinstance(saved, PendingSave):
            self._pending = saved
        self.last_step = step

    def poll(self) -> None:
        """Collective while a save is pending: publish it if every rank's part is done."""
        if self._pending is None:
            return
        done = torch.tensor([int(self._pending.done())], dtype=torch.int32)
        if self._poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if done.item():
            self.close()

    def close(self) -> None:
        """Publish the save still being written, if any."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
