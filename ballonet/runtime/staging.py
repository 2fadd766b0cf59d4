"""Metadata to the device in one copy.

A tree of CPU tensors (frozen dataclasses, tuples and lists holding them, as
`step.StepMeta`) is laid out in one byte buffer (`stage`, pinned where it will go to a
GPU), copied to the device with one non-blocking copy and rebuilt from views of that
copy (`Staged.to`): the index tensors and cu_seqlens the layers read never cross
between host and device one by one, and the layers make no copy of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["Staged", "stage", "to_device"]


def _leaves(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        if obj and not isinstance(obj[0], (int, float, str, bool)):
            for x in obj:
                _leaves(x, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.init:
                _leaves(getattr(obj, f.name), out)


def _rebuild(obj, table: dict):
    """`obj` with every tensor t replaced by table[id(t)]; unchanged parts are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return table[id(obj)]
    if isinstance(obj, (tuple, list)):
        if not obj or isinstance(obj[0], (int, float, str, bool)):
            return obj
        new = [_rebuild(x, table) for x in obj]
        if all(a is b for a, b in zip(new, obj)):
            return obj
        return type(obj)(new)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if f.init:
                old = getattr(obj, f.name)
                new = _rebuild(old, table)
                if new is not old:
                    changes[f.name] = new
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


@dataclass(frozen=True)
class Staged:
    """A tree of CPU tensors and one buffer holding all their bytes."""

    tree: object
    buffer: torch.Tensor
    """[bytes] uint8: each tensor's bytes, widest element type first (so every view is aligned)."""
    slots: tuple[tuple[int, int, torch.dtype, tuple[int, ...]], ...]
    """(id of the tensor in `tree`, byte offset, dtype, shape) per distinct tensor."""

    def to(self, device: torch.device | str):
        """The tree with its tensors on `device`: one copy of the buffer (the tree itself
        on the CPU)."""
        if torch.device(device).type == "cpu":
            return self.tree
        return self.from_buffer(self.buffer.to(device, non_blocking=True))

    def from_buffer(self, buffer: torch.Tensor):
        """The tree with each tensor a view of `buffer` (a copy of `self.buffer`)."""
        table = {}
        for key, offset, dtype, shape in self.slots:
            nbytes = dtype.itemsize * _numel(shape)
            table[key] = buffer[offset:offset + nbytes].view(dtype).view(shape)
        return _rebuild(self.tree, table)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def stage(tree, pin: bool = False) -> Staged:
    """Lay out the CPU tensors of `tree` in one buffer (`pin`: in page-locked memory, for
    a non-blocking copy to a GPU)."""
    seen, tensors = set(), []
    found: list[torch.Tensor] = []
    _leaves(tree, found)
    for t in found:
        if id(t) not in seen:
            seen.add(id(t))
            tensors.append(t)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("stage: every tensor must be on the CPU")
    tensors.sort(key=lambda t: -t.element_size())
    parts, slots, offset = [], [], 0
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(flat)
        slots.append((id(t), offset, t.dtype, tuple(t.shape)))
        offset += flat.numel()
    buffer = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    if pin:
        buffer = buffer.pin_memory()
    return Staged(tree=tree, buffer=buffer, slots=tuple(slots))


def to_device(tree, device: torch.device | str):
    """`tree` with its CPU tensors on `device`, in one copy."""
    return stage(tree, pin=False).to(device) if torch.device(device).type != "cpu" else tree
