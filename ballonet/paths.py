"""Paths a user gives: told apart from preset names, checked before any work, written whole.

- `looks_like_path`: a preset name never has a folder separator or a file suffix, so an
  argument with either is a path, and any other argument that names a preset is the
  preset (a local folder `h200-8nic` does not shadow the cluster preset).
- `check_output`: an output file must be a file name in an existing, writable folder;
  checked when the command starts, not after minutes of work.
- `write_atomic`: the file appears whole or not at all (a temporary file in the same
  folder, renamed into place; removed if writing fails).
- `read_json_object`: a JSON file that must hold an object, or one line naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ballonet.errors import InputError


def looks_like_path(text: str, suffixes: tuple[str, ...] | None = None) -> bool:
    """True if `text` has a folder separator, or a suffix (one of `suffixes`, or any
    suffix when None)."""
    if os.sep in text or (os.altsep and os.altsep in text):
        return True
    suffix = os.path.splitext(text)[1].lower()
    return bool(suffix) and (suffixes is None or suffix in suffixes)


def check_output(path: str, flag: str, suffixes: tuple[str, ...] | None = None) -> None:
    """Raise InputError (naming `flag` and `path`) unless `path` can be written as a file:
    not a folder, in a folder that exists and is writable, with one of `suffixes` if given."""
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a folder; give a file name")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {path}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: folder {folder!r} is not writable")
    if suffixes is not None and os.path.splitext(path)[1].lower() not in suffixes:
        raise InputError(f"{flag} {path}: expected a file name ending in one of {', '.join(sorted(suffixes))}")


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes the file at the temporary path `tmp`; it then replaces `path`."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json_object(path: Path, what: str) -> dict:
    """The object in the JSON file `path`; InputError "{path}: not {what} (...)" otherwise."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not {what} ({getattr(e, 'strerror', None) or getattr(e, 'msg', None) or e})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not {what} (not a JSON object)")
    return value
