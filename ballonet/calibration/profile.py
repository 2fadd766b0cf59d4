"""Calibration profiles: how fast one GPU type runs the pieces of a training step.

A `Profile` holds what the cost model cannot derive from a datasheet: the fraction of
peak FLOP/s an attention kernel reaches, forward and backward separately, against the
tokens of the sequence (or chunk) it runs on; the same for the layer's GEMMs against the
tokens of one call; the latency and the share of the nominal bandwidth reached by a
point-to-point transfer inside a node and across nodes, and by each collective; how
much compute slows while communication runs beside it; the share of the memory bandwidth
the layer's elementwise work (norms, rotary, SwiGLU's product, residual adds, the loss's
softmax) reaches; and what a training step costs besides the model's kernels: the
framework's per-layer work on the compute thread (FSDP2's gathers and reduce hooks) and
the optimizer step.

Built-in profiles, one per GPU type, are in `cost/profiles.py` with their sources. A profile
file (JSON, `SCHEMA_VERSION`) is what `ballonet calibrate` writes; `load` reads one and
refuses a wrong schema version, a missing field or a negative figure with one line naming
the field (schema 1 files, from before the elementwise, framework and optimizer terms,
are refused: run `ballonet calibrate` again); `use(profile)` prices every GPU of that
type with it inside a `with` block (a context variable, so nothing global changes).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field

import numpy as np

from ballonet.errors import InputError
from ballonet.user_files import read_json

SCHEMA_VERSION = 2
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True, kw_only=True)
class Curve:
    """Efficiency (achieved / peak) at increasing token counts; log-linear in between,
    flat beyond the first and last points."""
    tokens: tuple[float, ...]
    efficiency: tuple[float, ...]

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(float(x) for x in self.tokens))
        object.__setattr__(self, "efficiency", tuple(float(x) for x in self.efficiency))
        if not self.tokens or len(self.tokens) != len(self.efficiency):
            raise InputError("tokens and efficiency must be non-empty lists of one length")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or self.tokens[0] < 1:
            raise InputError("tokens must increase from 1 or more")
        if any(not 0 < e <= 1 for e in self.efficiency):
            raise InputError("efficiency must lie in (0, 1]")

    def at(self, tokens) -> np.ndarray:
        """The efficiency at each of `tokens` (array-like; any shape)."""
        x = np.log2(np.maximum(np.asarray(tokens, dtype=float), 1.0))
        return np.interp(x, self._log_tokens, self._efficiency)

    def at_one(self, tokens: float) -> float:
        """`at` for one token count, in plain Python (the partitioner calls it in loops)."""
        xs, ys, slopes = self._log_list
        x = math.log2(max(tokens, 1.0))
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        j = bisect.bisect_right(xs, x) - 1
        return slopes[j] * (x - xs[j]) + ys[j]

    @functools.cached_property
    def _log_list(self) -> tuple[list, list, list]:
        """The points as lists, and each segment's slope (as `at_one` computed it per call)."""
        xs, ys = self._log_tokens.tolist(), list(self.efficiency)
        return xs, ys, [(ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) for j in range(len(xs) - 1)]

    @functools.cached_property
    def _log_tokens(self) -> np.ndarray:
        return np.log2(self.tokens)

    @functools.cached_property
    def _efficiency(self) -> np.ndarray:
        return np.asarray(self.efficiency)


@dataclass(frozen=True, kw_only=True)
class Profile:
    gpu: str
    """The GPU type this profile prices (a key of `hardware.GPUS`)."""
    source: str
    """Where the figures come from: a measurement (machine, command) or a citation."""
    attention_forward: Curve
    """Causal varlen attention forward, against the tokens of one sequence (or chunk);
    FLOPs counted as 2*H*D*L*(L+1) (`cost.flops.attention_flops`)."""
    attention_backward: Curve
    """The backward of the same kernel, FLOPs counted as 2.5x the forward's."""
    attention_launch_s: float
    """Floor of one attention kernel call, forward or backward."""
    linear: Curve
    """bf16 GEMMs of a layer (QKV, O, MLP) and the LM head against the tokens of one call."""
    elementwise: Curve
    """Achieved over `memory_bw` by a layer's elementwise work and the loss, against the
    tokens of one call; bytes counted by `cost.flops.elementwise_bytes_per_token`, the
    backward's as 2x the forward's."""
    memory_bw: float
    """Nominal memory bandwidth (bytes/s) `elementwise` is a fraction of: the datasheet's
    for a GPU; for a measured profile, the best rate measured (its curve peaks at 1)."""
    framework_s_per_layer: float
    """Seconds per layer and step the compute thread spends in the training framework
    outside the model's kernels (FSDP2's parameter gathers, copies and gradient hooks)."""
    optimizer_s_per_param: float
    """Seconds of the optimizer step (AdamW) per parameter a rank holds."""
    p2p_latency_s: float
    """One intra-node point-to-point transfer's fixed cost."""
    p2p_efficiency: float
    """Bandwidth reached by a large intra-node transfer over the GPU type's nominal one."""
    nic_latency_s: float
    nic_efficiency: float
    """Bandwidth reached across nodes over the NIC's line rate."""
    collective_latency_s: float
    collective_efficiency: dict
    """Bus bandwidth of each of `COLLECTIVES` over the nominal intra-node bandwidth."""
    overlap_slowdown: float = 0.0
    """Compute seconds added per second of communication running beside it on the same
    GPU (copy engines and NCCL kernels take memory bandwidth and SMs)."""
    assumptions: tuple[str, ...] = ()
    """Figures of this profile that no measurement backs, in words."""
    machine: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False)


_SCALARS = ("attention_launch_s", "p2p_latency_s", "p2p_efficiency", "nic_latency_s", "nic_efficiency",
            "collective_latency_s", "overlap_slowdown", "memory_bw", "framework_s_per_layer", "optimizer_s_per_param")
_CURVES = ("attention_forward", "attention_backward", "linear", "elementwise")


_RANGES = {"efficiency": (1e-6, 100.0), "memory_bw": (1e3, 1e17), "tokens": (1.0, 1e12), "": (0.0, 1e6)}
"""What a profile's figures may be, by the end of their name ("" for the rest: seconds
and slowdowns): a zero or tiny efficiency or bandwidth, or a huge figure, would price a
step at Infinity or NaN, which strict JSON cannot hold."""


def _number(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise InputError(f"{where} must be a number, got {value!r}")
    if value < 0:
        raise InputError(f"{where} must not be negative, got {value!r}")
    name = where.rsplit("'", 2)[-2] if where.endswith("'") else where
    lo, hi = next(r for end, r in _RANGES.items() if end in name)
    if value <= 0 < lo:
        raise InputError(f"{where} must be positive, got {value!r}")
    if not lo <= value <= hi:
        raise InputError(f"{where} must lie in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def from_dict(d, where: str = "calibration") -> Profile:
    """A validated `Profile` from its JSON form; InputError names the first bad field."""
    if not isinstance(d, dict):
        raise InputError(f"{where}: a profile must be a JSON object")
    if d.get("schema") != SCHEMA_VERSION:
        raise InputError(f"{where}: field 'schema' must be {SCHEMA_VERSION}, got {d.get('schema')!r}")
    required = [f.name for f in dataclasses.fields(Profile)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        if name not in d:
            raise InputError(f"{where}: field {name!r} is missing")
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}")
    kw = dict(d)
    for name in _SCALARS:
        if name in kw:
            kw[name] = _number(f"{where}: field {name!r}", kw[name])
    if kw["memory_bw"] <= 0:
        raise InputError(f"{where}: field 'memory_bw' must be positive, got {kw['memory_bw']!r}")
    for name in _CURVES:
        c = kw[name]
        if not isinstance(c, dict) or set(c) != {"tokens", "efficiency"}:
            raise InputError(f"{where}: field {name!r} must be an object with 'tokens' and 'efficiency' lists")
        for key in ("tokens", "efficiency"):
            if not isinstance(c[key], list):
                raise InputError(f"{where}: field '{name}.{key}' must be a list")
            for i, v in enumerate(c[key]):
                _number(f"{where}: field '{name}.{key}[{i}]'", v)
        try:
            kw[name] = Curve(**c)
        except InputError as e:
            raise InputError(f"{where}: field {name!r}: {e}") from None
    coll = kw["collective_efficiency"]
    if not isinstance(coll, dict):
        raise InputError(f"{where}: field 'collective_efficiency' must be an object")
    for op in COLLECTIVES:
        if op not in coll:
            raise InputError(f"{where}: field 'collective_efficiency.{op}' is missing")
        coll[op] = _number(f"{where}: field 'collective_efficiency.{op}'", coll[op])
    assumptions = kw.get("assumptions", [])
    if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
        raise InputError(f"{where}: field 'assumptions' must be a list of strings")
    kw["assumptions"] = tuple(assumptions)
    for name in ("machine", "versions"):
        if not isinstance(kw.get(name, {}), dict):
            raise InputError(f"{where}: field {name!r} must be an object")
    for name in ("gpu", "source"):
        if not isinstance(kw[name], str) or not kw[name]:
            raise InputError(f"{where}: field {name!r} must be a non-empty string")
    return Profile(**kw)


def load(path: str) -> Profile:
    """Read (through `user_files`: a regular file, bounded JSON) and validate a profile file."""
    return from_dict(read_json(path, "json", what="a calibration profile"), where=path)


_OVERRIDES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ballonet_calibration", default=None)


@contextlib.contextmanager
def use(*profiles: Profile):
    """Inside the block, GPUs of each profile's type are priced with it."""
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), **{p.gpu: p for p in profiles}})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def override(gpu: str) -> Profile | None:
    """The profile `use` installed for `gpu`, if any."""
    return (_OVERRIDES.get() or {}).get(gpu)
