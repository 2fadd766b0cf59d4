"""What a training run is: `TrainConfig` and its command-line flags (no torch import, so
`ballonet --help` stays fast)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ballonet.errors import InputError


@dataclass(kw_only=True)
class TrainConfig:
    model: str = "tiny"
    """Model preset (`ballonet.specs.MODELS`)."""
    corpus: str = "stdlib"
    """"stdlib", a JSONL file, a folder of text files, or a lengths file (synthetic tokens)."""
    planner: str = "zeppelin"
    global_tokens: int = 8192
    """Tokens in every global batch, whatever the number of ranks."""
    max_doc_tokens: int | None = None
    """Context window: longer documents are cut."""
    steps: int = 20
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    cluster: str = "cpu"
    """Cluster preset or TOML file giving the (emulated) topology."""
    nodes: int = 1
    """Nodes the ranks are spread over (ranks per node = world size / nodes)."""
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    json_log: str | None = None
    log_every: int = 1

    def __post_init__(self):
        for name in ("global_tokens", "steps", "nodes", "log_every"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint_dir):
            raise InputError("--checkpoint-every needs --checkpoint-dir and must be >= 0")
        if self.resume and not self.checkpoint_dir:
            raise InputError("--resume needs --checkpoint-dir")
        if not self.lr > 0:
            raise InputError(f"--lr must be positive, got {self.lr}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    p.add_argument("--model", default=defaults.model, help="model preset (default: %(default)s)")
    p.add_argument("--corpus", default=defaults.corpus,
                   help="'stdlib' (default), a folder of text files, a .jsonl file (text, input_ids or length "
                        "per line), or a lengths file as plan --lengths reads it (.json, .npy, one length per line)")
    p.add_argument("--planner", default=defaults.planner, help="zeppelin or a baseline (default: %(default)s)")
    p.add_argument("--global-tokens", type=int, default=defaults.global_tokens,
                   help="tokens per global batch, independent of the number of ranks (default: %(default)s)")
    p.add_argument("--max-doc-tokens", type=int, default=None, help="context window; longer documents are cut")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--cluster", default=defaults.cluster, help="topology preset or TOML file (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=defaults.nodes, help="(emulated) nodes the ranks are spread over")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node; with --nproc, defaults to nproc / nodes")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    p.add_argument("--json-log", default=None, help="write one JSON object per step to this file")
    p.add_argument("--log-every", type=int, default=defaults.log_every, help="steps between printed log lines")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch this many ranks with torchrun (otherwise: one process, or torchrun's ranks)")
    p.add_argument("--max-restarts", type=int, default=0, help="with --nproc: torchrun restarts after a failure")


def config_from_args(args) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
