"""A checkpoint folder on disk: which checkpoint `latest` names, a checkpoint's
`ballonet.json` checked field by field, which one a run resumes from, and what an
interrupted save left behind (the layout: `checkpoint.py`)."""

from __future__ import annotations

import os
import shutil

from ballonet import user_files
from ballonet.errors import InputError
from ballonet.training.config_file import RESOLVED

LATEST = "latest"
META = "ballonet.json"
FORMAT = "ballonet-dcp-2"
"""2: `.metadata` in pickle protocol 2, read weights-only (1, before it, was read by a
module-wide allow-list that a dotted global name could escape: refused)."""


def clean_stale(folder: str) -> None:
    """Remove what an interrupted save left behind (rank 0, before any save)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(".tmp-") or name == f"{LATEST}.tmp":
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def latest(folder: str) -> str | None:
    """The finished checkpoint `latest` names, or None if the folder holds none.
    Raises InputError for a folder with something else in it, or a dangling `latest`."""
    if not os.path.isdir(folder):
        return None
    pointer = os.path.join(folder, LATEST)
    if not os.path.lexists(pointer):
        foreign = sorted(n for n in os.listdir(folder) if not n.startswith(".") and n != RESOLVED)
        if foreign:
            raise InputError(f"{folder}: not a ballonet checkpoint folder (no '{LATEST}' file, holds {foreign[0]!r})")
        return None
    name = user_files.read_text(pointer, "pointer", folder, what="a checkpoint pointer").strip()
    path = os.path.join(folder, name)
    if os.sep in name or not name.startswith("step-") or not os.path.lexists(os.path.join(path, META)):
        raise InputError(f"{pointer}: names {name!r}, which is not a complete checkpoint in {folder}")
    user_files.inside(folder, path)
    return path


def read_meta(path: str) -> dict:
    """The checkpoint's `ballonet.json`, each field checked (step, world size, loader
    position, RNG states); InputError naming the file and the field otherwise."""
    meta_path = os.path.join(path, META)
    meta = user_files.read_json(meta_path, "json", path, what="checkpoint metadata")
    if isinstance(meta, dict) and meta.get("format") == "ballonet-dcp-1":
        raise InputError(f"{meta_path}: saved by an earlier Ballonet (ballonet-dcp-1), whose checkpoint metadata "
                         f"is not loaded (reading it safely needs {FORMAT}); start the run again")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(f"{meta_path}: not a {FORMAT} checkpoint")

    def count(where: str, value, least: int, most: int = MAX_COUNT) -> None:
        if type(value) is not int or not least <= value <= most:
            raise InputError(f"{meta_path}: field {where!r} must be an integer from {least} to {most}, got {value!r}")

    count("step", meta.get("step"), 1)
    count("world_size", meta.get("world_size"), 1, MAX_WORLD)
    loader = meta.get("loader")
    if not isinstance(loader, dict):
        raise InputError(f"{meta_path}: field 'loader' must be an object, got {loader!r}")
    for key in ("epoch", "position", "offset", "batch"):
        count(f"loader.{key}", loader.get(key), 0)
    rng = meta.get("rng")
    if not isinstance(rng, list) or not all(isinstance(r, str) for r in rng):
        raise InputError(f"{meta_path}: field 'rng' must be a list of strings")
    return meta


MAX_COUNT = 2**53
"""The largest step or loader position a `ballonet.json` may hold (exact in JSON)."""
MAX_WORLD = 1 << 20


def resume_path(folder: str, resume_from: str | None) -> str | None:
    """The checkpoint a run resumes from: `resume_from` (a step of `folder`, or a
    checkpoint's folder), or the one `latest` names (None if the folder holds none).
    InputError naming what is missing."""
    if resume_from is None:
        return latest(folder)
    if resume_from.isdigit():
        if len(resume_from) > 16:
            raise InputError(f"--resume-from {resume_from}: not a step")
        path = os.path.join(folder, f"step-{int(resume_from):08d}")
        if not os.path.isfile(os.path.join(path, META)):
            steps = sorted(n for n in os.listdir(folder) if n.startswith("step-")) if os.path.isdir(folder) else []
            raise InputError(f"--resume-from {resume_from}: {folder} holds no complete checkpoint of that step "
                             f"(it holds {', '.join(steps) or 'none'})")
        return path
    if not os.path.isdir(resume_from) or not os.path.isfile(os.path.join(resume_from, META)):
        raise InputError(f"--resume-from {resume_from}: not a step nor a checkpoint's folder (no {META})")
    return resume_from


def check_resumable(path: str, steps: int) -> dict:
    """`read_meta` of the checkpoint a run resumes from, refusing one past the run's
    `steps` (it would train nothing)."""
    meta = read_meta(path)
    if meta["step"] > steps:
        raise InputError(f"{path}: the checkpoint is at step {meta['step']}, past --steps {steps}; give --steps "
                         f"above {meta['step']} to train on from it")
    return meta
