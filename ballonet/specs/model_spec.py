"""A model's shape (`ModelSpec`): layers, widths, heads, vocabulary, tensor parallelism
and the recomputation it was asked for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ballonet.errors import InputError

@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tp: int = 1
    """Tensor-parallel degree: heads and FFN are split over `tp` GPUs of one node."""
    dtype_bytes: int = 2
    """Bytes per activation element (2 for bf16)."""
    recompute: str | None = None
    """Activation recomputation: "none", "selective" (the MLP), "linear" (every linear
    layer, not attention nor the exchanges) or "full" (every layer); None: the cheapest
    under which the plan fits in memory, per rank (`cost.recompute.cheapest_per_rank`)."""
    recompute_layers: int | None = None
    """With "selective" or "linear" recomputation: how many layers (the first ones)
    recompute so, the others one mode below (selective: none, as Megatron's
    `--recompute-num-layers`, for the MLP; linear: selective); None: every layer. With
    `recompute` None the cost model picks this too: as few as each rank's memory needs."""

    def __post_init__(self):
        if self.recompute not in (None, "none", "selective", "linear", "full"):
            raise InputError(f"model {self.name!r}: recompute must be none, selective, linear or full, "
                             f"got {self.recompute!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "recompute") or (f.name == "recompute_layers" and v is None):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"model {self.name!r}: {f.name} must be a positive integer, got {v!r}")
        if self.recompute_layers is not None and (self.recompute not in ("selective", "linear")
                                                  or self.recompute_layers > self.num_layers):
            raise InputError(f"model {self.name!r}: recompute_layers={self.recompute_layers} needs selective or "
                             f"linear recomputation and at most its {self.num_layers} layers")
        if self.hidden % self.num_heads:
            raise InputError(f"model {self.name!r}: hidden={self.hidden} is not a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of num_kv_heads")
        if self.num_heads % self.tp or self.num_kv_heads % self.tp:
            raise InputError(f"model {self.name!r}: tp={self.tp} must divide its {self.num_heads} heads and "
                             f"{self.num_kv_heads} KV heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h = self.hidden
        per_layer = h * (h + 2 * self.kv_dim) + h * h + 3 * h * self.ffn_hidden + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h
