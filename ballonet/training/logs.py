"""The run's step log: one JSON object per step (`--json-log`), TensorBoard scalars
(`--tensorboard`) and the printed line every `--log-every` steps, all from rank 0; and
the JSON log cut back to a checkpoint on resume, so that every step appears once."""

from __future__ import annotations

import json
import os

from ballonet.errors import InputError
from ballonet.training.checkpoint import write_durably
from ballonet.training.config import TrainConfig


def trim(path: str, last_step: int) -> None:
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
    write_durably(path, "".join(kept))


def tensorboard_writer(folder: str | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InputError("--tensorboard needs the tensorboard package (pip install 'ballonet[tb]')") from None
    return SummaryWriter(folder) if folder else None


def write(config: TrainConfig, record: dict, writer) -> None:
    if config.json_log:
        with open(config.json_log, "a") as f:
            f.write(json.dumps(record) + "\n")
    if writer is not None:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "compute_s_max", "exposed_comm_s_max",
                    "memory_peak_bytes_max"):
            writer.add_scalar(f"train/{key}", record[key], record["step"])
        if "eval_loss" in record:
            writer.add_scalar("eval/loss", record["eval_loss"], record["step"])
    step = record["step"]
    if step % config.log_every == 0 or step == config.steps:
        balance = record["compute_s_max"] / max(record["compute_s_mean"], 1e-9)
        recompute = (f"  recompute {record['recompute']} (at most {record['recompute_layers_max']} layers)"
                     if "recompute" in record else "")  # --recompute auto
        print(f"step {step:4d}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  grad norm {record['grad_norm']:.3f}  "
              f"tok/s {record['tokens_per_s']:8.0f}  MFU {record['mfu']:6.2%}  plan {record['plan_ms']:6.1f} ms  "
              f"compute max/mean {balance:.2f}  exposed comm {record['exposed_comm_s_max']:.3f} s  "
              f"mem {record['memory_peak_bytes_max'] / 2**20:.0f} MiB  bytes {record['bytes_sent']}{recompute}",
              flush=True)
    if "eval_loss" in record:
        print(f"step {step:4d}  eval loss {record['eval_loss']:.4f} over {record['eval_tokens']} tokens", flush=True)
