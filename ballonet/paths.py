"""Paths a user gives: told apart from preset names, checked before any work, written whole.

- `looks_like_path`: a preset name never has a folder separator or a file suffix, so an
  argument with either is a path, and any other argument that names a preset is the
  preset (a local folder `h200-8nic` does not shadow the cluster preset).
- `check_output`: an output file must be a file name in an existing, writable folder,
  with room where that can be known; checked when the command starts, not after minutes
  of work.
- `write_atomic`: the file appears whole or not at all (a temporary file in the same
  folder, renamed into place; removed if writing fails).
- `read_json_object`: a JSON file that must hold an object, or one line naming the file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ballonet.errors import InputError
from ballonet.user_files import read_json


def looks_like_path(text: str, suffixes: tuple[str, ...] | None = None) -> bool:
    """True if `text` has a folder separator, or a suffix (one of `suffixes`, or any
    suffix when None)."""
    if os.sep in text or (os.altsep and os.altsep in text):
        return True
    suffix = os.path.splitext(text)[1].lower()
    return bool(suffix) and (suffixes is None or suffix in suffixes)


OUTPUT_ROOM = 1 << 20
"""Free bytes an output file of a few kilobytes (a profile, a plot) asks of its disk."""


def plot_formats() -> tuple[str, ...]:
    """The file suffixes matplotlib's Agg canvas writes (.png, .svg, .pdf, ...)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return tuple("." + ext for ext in FigureCanvasAgg(Figure()).get_supported_filetypes())


def check_output(path: str, flag: str, suffixes: tuple[str, ...] | None = None, min_free_bytes: int = 0) -> None:
    """Raise InputError (naming `flag` and `path`) unless `path` can be written as a file:
    not a folder nor another kind of file (a device, a pipe), in a folder that exists and
    is writable (a read-only mount included), with one of `suffixes` if given, on a disk
    with `min_free_bytes` free where the free space can be known."""
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a folder; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise InputError(f"{flag} {path}: exists and is not a regular file (it would be replaced)")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {path}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: folder {folder!r} is not writable")
    if suffixes is not None and os.path.splitext(path)[1].lower() not in suffixes:
        raise InputError(f"{flag} {path}: expected a file name ending in one of {', '.join(sorted(suffixes))}")
    if min_free_bytes:
        check_free_space(folder, min_free_bytes, f"{flag} {path}")


def check_free_space(folder: str, need_bytes: int, what: str) -> None:
    """InputError naming `what` if the disk of `folder` has less than `need_bytes` free
    (nothing when the free space cannot be known)."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < need_bytes:
        raise InputError(f"{what}: {free / 2**20:.1f} MiB free on its disk, {need_bytes / 2**20:.1f} MiB needed")


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes the file at the temporary path `tmp`; it then replaces `path`.
    A disk that fills or turns read-only meanwhile is one InputError naming `path`, and
    nothing is left behind."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise InputError(f"{path}: cannot write ({e.strerror or e})") from None
        raise


def read_json_object(path: Path, what: str, folder=None) -> dict:
    """The object in the JSON file `path` (in the user's `folder`, if given: `user_files`);
    InputError "{path}: not {what} (...)" otherwise."""
    value = read_json(path, "json", folder, what)
    if not isinstance(value, dict):
        raise InputError(f"{path}: not {what} (not a JSON object)")
    return value
