"""Flags of the trainers a user comes from (Megatron-LM, torchtitan, Hugging Face's Trainer)
and what Ballonet calls them, so that `ballonet train --train-iters 100` answers with
`--steps` instead of a bare "unrecognized arguments" (`common.unrecognized`). Names are compared with `_` read
as `-` (`--max_steps` is `--max-steps`)."""

from __future__ import annotations

FOREIGN_FLAGS: dict[str, tuple[str, str]] = {
    # Megatron-LM (megatron/training/arguments.py)
    "--train-iters": ("Megatron-LM", "--steps"),
    "--global-batch-size": ("Megatron-LM", "--global-tokens (tokens, not sequences)"),
    "--seq-length": ("Megatron-LM", "--max-doc-tokens (documents are cut to it, never packed to it)"),
    "--lr-warmup-iters": ("Megatron-LM", "--warmup-steps"),
    "--lr-decay-style": ("Megatron-LM", "--lr-decay"),
    "--clip-grad": ("Megatron-LM", "--max-grad-norm"),
    "--save": ("Megatron-LM", "--checkpoint-dir"),
    "--load": ("Megatron-LM", "--checkpoint-dir with --resume"),
    "--save-interval": ("Megatron-LM", "--checkpoint-every"),
    "--eval-interval": ("Megatron-LM", "--eval-every"),
    "--log-interval": ("Megatron-LM", "--log-every"),
    "--tensor-model-parallel-size": ("Megatron-LM", "--tp"),
    "--bf16": ("Megatron-LM and HF Trainer", "--dtype bf16"),
    "--recompute-granularity": ("Megatron-LM", "--recompute"),
    "--recompute-num-layers": ("Megatron-LM", "--recompute-layers"),
    "--data-path": ("Megatron-LM", "--corpus"),
    "--tensorboard-dir": ("Megatron-LM", "--tensorboard"),
    "--wandb-project": ("Megatron-LM", "--wandb"),
    # torchtitan (its job config's sections)
    "--job.config-file": ("torchtitan", "--config (a TOML file of TrainConfig fields)"),
    "--training.steps": ("torchtitan", "--steps"),
    "--training.seq-len": ("torchtitan", "--max-doc-tokens (documents are cut to it, never packed to it)"),
    "--training.max-norm": ("torchtitan", "--max-grad-norm"),
    "--optimizer.lr": ("torchtitan", "--lr"),
    "--lr-scheduler.warmup-steps": ("torchtitan", "--warmup-steps"),
    "--lr-scheduler.decay-type": ("torchtitan", "--lr-decay"),
    "--checkpoint.folder": ("torchtitan", "--checkpoint-dir"),
    "--checkpoint.interval": ("torchtitan", "--checkpoint-every"),
    "--checkpoint.keep-latest-k": ("torchtitan", "--keep-checkpoints"),
    "--parallelism.tensor-parallel-degree": ("torchtitan", "--tp"),
    "--activation-checkpoint.mode": ("torchtitan", "--recompute"),
    "--metrics.log-freq": ("torchtitan", "--log-every"),
    # Hugging Face's Trainer (TrainingArguments)
    "--max-steps": ("HF Trainer", "--steps"),
    "--learning-rate": ("HF Trainer", "--lr"),
    "--lr-scheduler-type": ("HF Trainer", "--lr-decay"),
    "--gradient-accumulation-steps": ("HF Trainer", "--grad-accum"),
    "--gradient-checkpointing": ("HF Trainer", "--recompute full"),
    "--output-dir": ("HF Trainer", "--checkpoint-dir"),
    "--save-steps": ("HF Trainer", "--checkpoint-every"),
    "--save-total-limit": ("HF Trainer", "--keep-checkpoints"),
    "--resume-from-checkpoint": ("HF Trainer", "--resume-from"),
    "--eval-steps": ("HF Trainer", "--eval-every"),
    "--logging-steps": ("HF Trainer", "--log-every"),
    "--model-name-or-path": ("HF Trainer", "--model hf:DIR"),
}
"""A foreign flag, as `-`-separated: (whose it is, Ballonet's flag for it and what differs)."""


def equivalent(arg: str, known: set[str]) -> str | None:
    """"here, TOOL's FLAG is OURS" for a foreign flag whose equivalent the parser (its
    option strings `known`) has, else None."""
    name = arg.split("=", 1)[0]
    found = FOREIGN_FLAGS.get(name.replace("_", "-"))
    if found is None or found[1].split()[0] not in known:
        return None
    tool, ours = found
    return f"here, {tool}'s {name} is {ours}"
