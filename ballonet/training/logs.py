"""The run's step log, from rank 0 (`StepLog`): one JSON object per step (`--json-log`),
TensorBoard scalars (`--tensorboard`), Weights & Biases (`--wandb`), the printed line every
`--log-every` steps, and a `torch.profiler` trace of `--profile-steps A:B`.

Every JSON record carries `time` (UTC, ISO 8601), `step_time_s` (since the previous
record, or since the log opened), `eta_s` (the steps left at the mean step time so far)
and `run`, the digest of the run's settings (`run_id`). The log belongs to its run: an
existing file is appended to only if it is a Ballonet log of this run (every record's
`run` this run's; on `--resume` cut back to the checkpoint, so that every step appears
once); any other file is refused before the run starts (`check_log`), never replaced.
JSON is strict: a value that is not finite is written as null.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import time

from ballonet import user_files
from ballonet.errors import InputError
from ballonet.training.config import MAY_CHANGE_ON_RESUME, TrainConfig, run_fields
from ballonet.training.checkpoints.safe_dcp import write_durably

SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "compute_s_max", "exposed_comm_s_max",
           "memory_peak_bytes_max", "step_time_s")


def run_id(config: TrainConfig) -> str:
    """The digest of the settings a run keeps across resumes (`MAY_CHANGE_ON_RESUME`
    aside; the checkpoint folder as an absolute path)."""
    fields = run_fields(config, MAY_CHANGE_ON_RESUME)
    if fields.get("checkpoint_dir"):
        fields["checkpoint_dir"] = os.path.abspath(fields["checkpoint_dir"])
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=8).hexdigest()


def _parse(line: str, where: str) -> dict | None:
    """The JSON object on a log line (bounded: `user_files.loads_json`), None if it is not one."""
    try:
        record = user_files.loads_json(line, where, "a JSON log record", line_numbers=False)
    except InputError:
        return None
    return record if isinstance(record, dict) else None


def _lines(path: str):
    """The log's non-empty lines, numbered, through the one door (a regular file)."""
    with user_files.text_lines(path, "data", what="a JSON log") as f:
        try:
            yield from ((i + 1, line) for i, line in enumerate(f) if line.strip())
        except UnicodeDecodeError:
            raise InputError(f"--json-log {path}: not the JSON log of this run (not UTF-8 text); give a new "
                             "file") from None


def check_log(config: TrainConfig) -> None:
    """Before the run: `--json-log` is absent, empty, or a Ballonet log of this run
    (its first record's `run`; `trim` checks every record). InputError otherwise."""
    path = config.json_log
    if not path or not os.path.lexists(path):
        return
    if os.path.islink(path):
        raise InputError(f"--json-log {path}: is a symbolic link; give a new file (nothing is written through a "
                         "link)")
    first = next(_lines(path), None)
    if first is None:
        return
    record = _parse(first[1], f"{path}:{first[0]}")
    if record is None or "step" not in record or record.get("run") != run_id(config):
        raise InputError(f"--json-log {path}: exists and is not the JSON log of this run (not replaced, not "
                         "appended to); give a new file")


def trim(path: str, last_step: int, run: str) -> None:
    """Keep the log's records up to `last_step` (the steps after it run again); a torn last
    line (a run killed mid-write) is dropped; a record of another run is refused."""
    if not os.path.exists(path):
        return
    lines = list(_lines(path))
    kept = []
    for n, (number, line) in enumerate(lines):
        record = _parse(line, f"{path}:{number}")
        if record is None:
            if n == len(lines) - 1:
                break
            raise InputError(f"{path}:{number}: not a JSON log line; cannot resume its log") from None
        if record.get("run") != run:
            raise InputError(f"{path}:{number}: a record of another run; give a new --json-log")
        step = record.get("step")
        if type(step) is int and step <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        write_durably(path, "".join(kept))


def tensorboard_writer(folder: str | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InputError("--tensorboard needs the tensorboard package (pip install 'ballonet[tb]')") from None
    return SummaryWriter(folder) if folder else None


def wandb_module():
    """`wandb`, imported only when asked for (`--wandb`)."""
    try:
        import wandb
    except ImportError:
        raise InputError("--wandb needs the wandb package (pip install 'ballonet[wandb]')") from None
    return wandb


def profile_path(config: TrainConfig) -> str | None:
    """Where --profile-steps A:B writes its Chrome trace: beside --json-log, in
    --checkpoint-dir, or in the working folder."""
    span = config.profile_range()
    if span is None:
        return None
    folder = os.path.dirname(config.json_log) if config.json_log else config.checkpoint_dir or ""
    return os.path.join(folder or ".", f"profile-steps-{span[0]}-{span[1]}.json")


def check_outputs(config: TrainConfig) -> None:
    """Before the run: the log is this run's, the optional loggers are installed, the
    trace would replace nothing."""
    check_log(config)
    if config.tensorboard:
        tensorboard_writer(None)
    if config.wandb:
        wandb_module()
    trace = profile_path(config)
    if trace and os.path.lexists(trace):
        raise InputError(f"--profile-steps: {trace} exists (not replaced); remove it or move it")


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def append_whole(path: str, data: bytes) -> None:
    """Appends `data` to `path` whole or not at all: on a failed write (a full disk) the file
    is cut back to where it was, and removed if this call made it. Never through a symlink."""
    created = not os.path.lexists(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, start)
            if created:
                os.unlink(path)
            raise
    finally:
        os.close(fd)


class StepLog:
    """Rank 0's loggers for a run starting after `start_step` steps (0, or the checkpoint's)."""

    def __init__(self, config: TrainConfig, start_step: int):
        self.config, self.start_step, self.run = config, start_step, run_id(config)
        if config.json_log:
            check_log(config)
            trim(config.json_log, start_step, self.run)
        self.tensorboard = tensorboard_writer(config.tensorboard) if config.tensorboard else None
        self.wandb = None
        if config.wandb:
            self.wandb = wandb_module().init(project=config.wandb, config=run_fields(config, ()), resume="allow")
        self.span, self.profiler = config.profile_range(), None
        if self.span and self.span[0] == start_step + 1:
            self._start_profiler()
        self.opened = self.last = time.perf_counter()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        import torch

        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()

    def _profile(self, step: int) -> None:
        if self.span is None:
            return
        if self.profiler is None and step + 1 == self.span[0]:
            self._start_profiler()
        elif self.profiler is not None and step == self.span[1]:
            profiler, self.profiler = self.profiler, None
            profiler.__exit__(None, None, None)
            path = profile_path(self.config)
            try:
                profiler.export_chrome_trace(path)
            except OSError as e:
                raise InputError(f"--profile-steps: cannot write {path} ({e.strerror})") from None
            print(f"step {step:4d}  profile of steps {self.span[0]}-{self.span[1]} written to {path}", flush=True)

    def write(self, record: dict) -> None:
        now = time.perf_counter()
        step, total = record["step"], self.config.steps
        done = step - self.start_step
        elapsed = now - self.opened
        record.update(time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                      step_time_s=now - self.last, eta_s=elapsed / max(done, 1) * (total - step), run=self.run)
        self.last = now
        if self.config.json_log:
            line = json.dumps({k: _strict(v) for k, v in record.items()}, allow_nan=False) + "\n"
            try:
                append_whole(self.config.json_log, line.encode("utf-8"))
            except OSError as e:
                raise InputError(f"--json-log {self.config.json_log}: cannot write step {step} "
                                 f"({e.strerror})") from None
        scalars = {key: record[key] for key in SCALARS if key in record}
        if "eval_loss" in record:
            scalars["eval_loss"] = record["eval_loss"]
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(("eval/loss" if key == "eval_loss" else f"train/{key}"), value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        self._print(record, elapsed)
        self._profile(step)

    def _print(self, record: dict, elapsed: float) -> None:
        step, config = record["step"], self.config
        if step % config.log_every == 0 or step == config.steps:
            balance = record["compute_s_max"] / max(record["compute_s_mean"], 1e-9)
            recompute = (f"  recompute {record['recompute']} (at most {record['recompute_layers_max']} layers)"
                         if "recompute" in record else "")  # --recompute auto
            print(f"step {step}/{config.steps}  elapsed {_clock(elapsed)}  left {_clock(record['eta_s'])}  "
                  f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  grad norm {record['grad_norm']:.3f}  "
                  f"tok/s {record['tokens_per_s']:8.0f}  MFU {record['mfu']:6.2%}  plan {record['plan_ms']:6.1f} ms  "
                  f"compute max/mean {balance:.2f}  exposed comm {record['exposed_comm_s_max']:.3f} s  "
                  f"mem {record['memory_peak_bytes_max'] / 2**20:.0f} MiB  bytes {record['bytes_sent']}{recompute}",
                  flush=True)
        if "eval_loss" in record:
            print(f"step {step}/{config.steps}  eval loss {record['eval_loss']:.4f} over {record['eval_tokens']} "
                  "tokens", flush=True)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def write(config: TrainConfig, record: dict, writer: StepLog) -> None:
    """The loop's call after each step (rank 0): `writer.write(record)`."""
    writer.write(record)
