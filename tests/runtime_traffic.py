"""What the runtime sends in one layer, by phase, class and pair of ranks, as the plan
predicts it (`runtime_bytes`)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from ballonet.runtime import remapping, routing


def _dtype(model) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32}[model.dtype_bytes]


def runtime_bytes(plan, model) -> dict[str, Counter]:
    """Per phase, Counter of (class, src, dst) the runtime sends in one layer, from one
    GPU of each tensor-parallel group (its 1/tp of the heads)."""
    heads = [r for r in plan.rings if r.comm == "heads"]  # by payload (the simulator's classes for them)
    rings = dataclasses.replace(plan, rings=tuple(r for r in plan.rings if r.comm != "heads"))
    ring = routing.predicted_bytes(rings, model.num_kv_heads // model.tp, model.head_dim, _dtype(model))
    grad_only = ring.backward - ring.forward  # backward = K/V again + fp32 dK/dV
    elem = model.dtype_bytes
    qkv = remapping.predicted_bytes(plan, (model.hidden + 2 * model.kv_dim) * elem // model.tp, src="linear")
    o = remapping.predicted_bytes(plan, model.hidden * elem // model.tp, src="attention")
    out = {}
    for phase in ("forward", "backward"):
        c = Counter()
        for (a, b), n in ring.forward.items():
            c["kv", a, b] += n
        if phase == "backward":
            for (a, b), n in grad_only.items():
                c["grad", a, b] += n
        for (a, b), n in (getattr(qkv, phase) + getattr(o, phase)).items():
            c["remap", a, b] += n
        for r in heads:
            width = routing.heads_row_bytes(model.num_heads // model.tp, model.num_kv_heads // model.tp,
                                            model.head_dim, _dtype(model), len(r.ranks))
            for msg in r.messages():
                if msg.phase == phase:
                    c[msg.payload, msg.src, msg.dst] += msg.rows * width[msg.payload]
        out[phase] = +c
    return out
