"""What a training run is: `TrainConfig`, and its command-line flags generated from the
dataclass fields (one declaration per field: its type, default and docstring give the
flag, its argument type, choices and help). No torch import, so `ballonet --help` stays
fast."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import typing
from dataclasses import dataclass
from typing import Literal

from ballonet.errors import InputError
from ballonet.training.config_file import read_config_file


@dataclass(kw_only=True)
class TrainConfig:
    model: str = "tiny"
    """Model preset (`ballonet.specs.MODELS`), a model TOML file (fields of `ballonet.ModelSpec`, optionally
    `base = "PRESET"` to start from), or hf:DIR (a Hugging Face model folder)."""
    vocab_size: int | None = None
    """Vocabulary of the built-in model (default: the preset's); at least the corpus's tokenizer's."""
    corpus: str = "stdlib"
    """'stdlib', a folder of text files, a .jsonl file (text, input_ids or length per line), or a
    lengths file as `plan --lengths` reads it (.json, .npy, one length per line; synthetic tokens)."""
    planner: str = "zeppelin"
    """zeppelin or a baseline (`ballonet.PLANNERS`)."""
    no_double: bool = False
    """Zeppelin without double rings across nodes (a ring inside each node, rounds between rail peers): every
    ring across nodes is one ring through them."""
    global_tokens: int = 8192
    """Tokens in every global batch, whatever the number of ranks."""
    max_doc_tokens: int | None = None
    """Context window: longer documents are cut."""
    outlier_delay: int | None = None
    """WLB-LLM's outlier delay over G groups (G >= 2), with any planner: a document (or context window) of
    (T/2G, T/G] tokens, T = --global-tokens, waits in a queue, one per power-of-two length range, until its queue
    holds G; those G then start the next batch, filled up as usual. Every token still trains once per epoch; the
    queue is in the checkpoint. Unset: documents in stream order."""
    steps: int = 20
    """Training steps (optimizer updates)."""
    lr: float = 3e-3
    """AdamW peak learning rate."""
    warmup_steps: int = 0
    """Steps of linear warmup: step s of the first W runs at lr * s / (W + 1)."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After the warmup, the learning rate stays at --lr or decays (linear, cosine) to --min-lr at the last step."""
    min_lr: float = 0.0
    """The learning rate --lr-decay linear or cosine reaches at the last step."""
    max_grad_norm: float | None = None
    """Clip the gradient (the norm over every rank's shards) to this L2 norm; unset: no clipping (its norm is
    logged either way)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step: each global batch is split into this many, each planned on its own; the
    loss is normalised by the whole global batch's valid tokens."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    seed: int = 0
    """Seed of the weights, the document order and synthetic tokens (>= 0)."""
    cluster: str = "cpu"
    """Cluster preset or TOML file giving the (emulated) topology; a file of several node groups runs one rank per
    GPU of them (or of its groups not loaned)."""
    nodes: int | None = None
    """Nodes the ranks are spread over (ranks per node = world size / nodes; default 1); a cluster file of several
    node groups sets its own, which this must then equal."""
    tp: int = 1
    """Tensor-parallel degree: each plan rank is a group of tp ranks of one node holding the same tokens, the
    model's heads and FFN split over them (PyTorch DTensor); the ranks, and those of a node, a multiple of it."""
    shard: Literal["full", "none"] = "full"
    """FSDP2 parameter sharding over the plan ranks: full (ZeRO-3 style) or none (replicated)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype (bf16: bf16 compute, fp32 master weights and gradient reduction)."""
    recompute: Literal["none", "selective", "linear", "full", "auto"] = "none"
    """Activation recomputation: none, selective (the MLP), linear (every linear layer, no exchange) or full (each
    block), as the cost model prices them; auto: each step the cheapest its plan fits under, selective or linear
    on as few layers as each rank's own tokens need."""
    recompute_layers: int | None = None
    """With --recompute selective or linear: how many layers (the first ones) recompute so, the others one mode
    below (none, selective); unset: every layer."""
    timeout_minutes: float = 5.0
    """Process-group timeout: a dead or disagreeing peer fails every rank after this long."""
    calibration: str | None = None
    """Calibration profile (JSON, `ballonet calibrate`) of the cluster's GPU: the run plans with it and reports
    MFU against its GPU's peak."""
    checkpoint_dir: str | None = None
    """Folder of sharded checkpoints (torch.distributed.checkpoint)."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only the last step's, with --checkpoint-dir)."""
    keep_checkpoints: int = 3
    """Checkpoints kept in --checkpoint-dir (the newest; the one a run resumed from is kept until a newer one is
    written)."""
    async_checkpoint: bool = False
    """Write checkpoints in the background (DCP's async_save): training goes on while the shards are written."""
    resume: bool = False
    """Continue from the last checkpoint in --checkpoint-dir."""
    resume_from: str | None = None
    """Continue from a chosen checkpoint: a step of --checkpoint-dir (its step-N folder) or a checkpoint folder's
    path (implies --resume)."""
    lease: str | None = None
    """File saying whether the cluster's loaned node groups (`loaned = true`) are `lent` (or no file) or
    `reclaimed`: the job saves and goes on over the ranks it allows (needs --checkpoint-dir). Under torchrun on
    several nodes, each node's environment says BALLONET_NODE_GROUP=INDEX (its [[node_groups]] table, 0 first) and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (examples/lease_multinode.sh)."""
    eval_every: int = 0
    """Steps between evaluations of the held-out loss (0: never); the JSON log line of that step carries
    eval_loss."""
    eval_corpus: str | None = None
    """Corpus to evaluate on (as --corpus); default: documents held out of --corpus (about --eval-tokens tokens),
    which training then never sees."""
    eval_tokens: int | None = None
    """Tokens each evaluation reads (whole documents; default: two global batches)."""
    json_log: str | None = None
    """Write one JSON object per step to this file."""
    tensorboard: str | None = None
    """Also log the step metrics to this TensorBoard folder (needs the `tb` extra)."""
    log_every: int = 1
    """Steps between printed log lines."""
    profile_steps: str | None = None
    """A:B: trace steps A to B (1-based, inclusive) with torch.profiler into a Chrome trace beside --json-log (or in
    the working folder), rank 0."""
    wandb: str | None = None
    """Also log the step metrics to this Weights & Biases project (needs the `wandb` extra)."""
    # Read by the launcher (`ballonet train --nproc`), not by the loop:
    nproc: int | None = None
    """Launch this many ranks with torchrun (otherwise: one process, or torchrun's ranks)."""
    max_restarts: int = 0
    """With --nproc: torchrun restarts after a failure."""
    gpus_per_node: int | None = None
    """Ranks per node; with --nproc, defaults to nproc / nodes."""

    def __post_init__(self):
        for name in ("global_tokens", "steps", "nodes", "tp", "log_every", "max_doc_tokens", "nproc", "gpus_per_node",
                     "recompute_layers", "grad_accum", "keep_checkpoints", "vocab_size", "eval_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{_flag(name)} must be positive, got {value}")
        for name in ("weight_decay", "seed", "max_restarts", "checkpoint_every", "warmup_steps", "min_lr",
                     "eval_every"):
            if not getattr(self, name) >= 0:  # NaN included
                raise InputError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            name, value = f.name, getattr(self, f.name)
            if type(value) is int and value > MAX_INT:
                raise InputError(f"{_flag(name)} must be at most {MAX_INT}, got {value}")
        for name in ("lr", "weight_decay", "timeout_minutes", "min_lr", "max_grad_norm"):
            if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):
                raise InputError(f"{_flag(name)} must be a finite number, got {getattr(self, name)}")
        for name, choices in _choices().items():
            if getattr(self, name) not in choices:
                raise InputError(f"{_flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if not 0 < self.timeout_minutes <= MAX_TIMEOUT_MINUTES:
            raise InputError(f"--timeout-minutes must be positive and at most {MAX_TIMEOUT_MINUTES} (a year), "
                             f"got {self.timeout_minutes}")
        if not self.lr > 0:
            raise InputError(f"--lr must be positive, got {self.lr}")
        if self.outlier_delay is not None and self.outlier_delay < 2:
            raise InputError(f"--outlier-delay must be at least 2 (groups that each get one outlier), got "
                             f"{self.outlier_delay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise InputError(f"--max-grad-norm must be positive, got {self.max_grad_norm}")
        if self.min_lr > self.lr:
            raise InputError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.resume_from is not None:
            self.resume = True
        self._check_pairs()
        self.profile_range()

    def _check_pairs(self) -> None:
        """Options that do nothing alone, or nothing within the run's --steps."""
        needs = [(self.recompute_layers is not None and self.recompute not in ("selective", "linear"),
                  "--recompute-layers needs --recompute selective or linear"),
                 (self.no_double and self.planner != "zeppelin", f"--no-double needs --planner zeppelin, got "
                                                                 f"{self.planner!r}"),
                 (bool(self.min_lr) and self.lr_decay == "constant", "--min-lr needs --lr-decay linear or cosine")]
        for name in ("checkpoint_every", "async_checkpoint"):
            needs.append((bool(getattr(self, name)) and not self.checkpoint_dir, f"{_flag(name)} needs --checkpoint-dir"))
        needs.append((self.resume and self.resume_from is None and not self.checkpoint_dir,
                      "--resume needs --checkpoint-dir"))
        needs.append((bool(self.lease) and not self.checkpoint_dir,
                      "--lease needs --checkpoint-dir (the job saves there before its ranks change)"))
        needs.append((self.resume_from is not None and self.resume_from.isdigit() and not self.checkpoint_dir,
                      f"--resume-from {self.resume_from} (a step) needs --checkpoint-dir"))
        for name in ("gpus_per_node", "max_restarts"):
            needs.append((bool(getattr(self, name)) and self.nproc is None, f"{_flag(name)} needs --nproc"))
        for name in ("eval_corpus", "eval_tokens"):
            needs.append((bool(getattr(self, name)) and not self.eval_every, f"{_flag(name)} needs --eval-every"))
        needs += [(self.warmup_steps > self.steps, f"--warmup-steps {self.warmup_steps} is over --steps {self.steps}"),
                  (self.eval_every > self.steps, f"--eval-every {self.eval_every} is over --steps {self.steps}: "
                                                 "no evaluation would run"),
                  (self.checkpoint_every > self.steps, f"--checkpoint-every {self.checkpoint_every} is over --steps "
                                                       f"{self.steps} (the last step is saved anyway)")]
        for wrong, message in needs:
            if wrong:
                raise InputError(message)

    def profile_range(self) -> tuple[int, int] | None:
        """--profile-steps A:B as (A, B), checked: 1 <= A <= B <= --steps."""
        if self.profile_steps is None:
            return None
        parts = self.profile_steps.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() and len(p.strip()) < 19 for p in parts):
            raise InputError(f"--profile-steps must be A:B (steps, e.g. 3:5), got {self.profile_steps!r}")
        first, last = int(parts[0]), int(parts[1])
        if not 1 <= first <= last <= self.steps:
            raise InputError(f"--profile-steps {self.profile_steps}: needs 1 <= A <= B <= --steps {self.steps}")
        return first, last


PER_PROCESS = ("nproc", "max_restarts", "gpus_per_node", "timeout_minutes", "json_log", "tensorboard", "wandb",
               "log_every", "profile_steps")
"""Fields that change no rank's work: the launcher's, and rank 0's logging. Every other
field, resolved, is compared across the ranks before the first step (`preflight.agree`)."""
MAY_CHANGE_ON_RESUME = PER_PROCESS + ("steps", "resume", "resume_from", "checkpoint_every", "keep_checkpoints",
                                      "async_checkpoint", "eval_every")
"""Fields a resumed run may set anew and still be the same run (its JSON log goes on)."""


def run_fields(config: TrainConfig, leave_out: tuple[str, ...]) -> dict:
    """{field: value} of `config` but `leave_out`, in declaration order."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in leave_out}


MAX_INT = 2**53
"""The largest integer a field takes (what a JSON reader holds exactly; past it a count
is a mistake, and torch's seeds, timedeltas and counters overflow)."""
MAX_TIMEOUT_MINUTES = 525_600.0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def _choices() -> dict[str, tuple]:
    hints = typing.get_type_hints(TrainConfig)
    return {name: typing.get_args(t) for name, t in hints.items() if typing.get_origin(t) is Literal}


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal right after its declaration)."""
    body = ast.parse(inspect.getsource(TrainConfig)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _arg_type(hint):
    """int, float or str from `int`, `int | None`, ... (argparse's `type`)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if args[0] in (int, float) else str


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per `TrainConfig` field: `--name-with-dashes`, typed, help from the docstring;
    and `--config FILE.toml`. A flag not given is absent from the parsed arguments (its
    default is the field's), so that the flags given override the file's values."""
    hints, docs, choices = typing.get_type_hints(TrainConfig), field_docs(), _choices()
    p.add_argument("--config", metavar="FILE.toml", default=argparse.SUPPRESS,
                   help="TOML file of TrainConfig fields (`lr = 1e-3`, `lr_decay = \"cosine\"`, ...); the flags "
                        "given override it")
    for f in dataclasses.fields(TrainConfig):
        help_text = docs.get(f.name, "").replace("%", "%%")
        if hints[f.name] is bool:  # --x and --no-x (`no_x`: --no-x and --x), so a config file's true can be undone
            if f.name.startswith("no_"):
                p.add_argument(_flag(f.name), action="store_true", default=argparse.SUPPRESS, help=help_text)
                p.add_argument(_flag(f.name[3:]), dest=f.name, action="store_false", default=argparse.SUPPRESS,
                               help=f"undo {_flag(f.name)} (a config file's)")
            else:
                p.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
            continue
        if f.default is not None:
            help_text += f" (default: {str(f.default).replace('%', '%%')})"
        p.add_argument(_flag(f.name), type=_arg_type(hints[f.name]), default=argparse.SUPPRESS,
                       choices=choices.get(f.name), help=help_text)


def config_from_args(args) -> TrainConfig:
    """The run's config: each field's default, overridden by `--config FILE`'s values,
    overridden by the flags given."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = read_config_file(args.config, TrainConfig) if getattr(args, "config", None) else {}
    given = {k: v for k, v in vars(args).items() if k in names}
    if given.get("resume") is False and given.get("resume_from") is not None:
        raise InputError(f"--resume-from {given['resume_from']} resumes: it contradicts --no-resume")
    from_file = set(values) - set(given)
    values.update(given)
    if "keep_checkpoints" in values and not values.get("checkpoint_dir"):
        raise InputError("--keep-checkpoints needs --checkpoint-dir")
    try:
        return TrainConfig(**values)
    except InputError as e:  # a value the file gave is named as the file names it
        flag, _, rest = str(e).partition(" ")
        key = flag.removeprefix("--").replace("-", "_")
        if flag.startswith("--") and key in from_file:
            raise InputError(f"{args.config}: {key} {rest}") from None
        raise
