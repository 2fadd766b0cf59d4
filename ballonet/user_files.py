"""Files a user hands us: the one door every reader of a user's file goes through.

- A file is read only if it is a regular file: no FIFO, device, socket or folder where a
  file is meant. It is checked with `os.stat` before it is opened, opened non-blocking
  (a FIFO swapped in meanwhile cannot block) without following a last symlink, and
  checked again on the open descriptor (`open_file`).
- Each kind of file has a size cap (`LIMITS`), checked before a byte is read, and no
  read takes more than the cap even if the file grows meanwhile.
- One symlink policy for every folder the project reads (a checkpoint, a corpus, a
  Hugging Face model folder, `prepare`'s input folder): a link is followed only if it
  resolves inside the folder the user named (`inside`); a link out of it, a dangling
  link and a loop are refused. A file the user names on the command line is theirs to
  name, wherever a link in its path leads.
- JSON and TOML are parsed with bounded nesting (`MAX_DEPTH`) and integers (at most
  `MAX_INT_DIGITS` digits, within int64), floats finite (no NaN or Infinity): Python's
  own limits (RecursionError, "Exceeds the limit (4300 digits)") never reach the user.

Every refusal is one `InputError` naming the file and what is wrong (exit code 2).
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from typing import BinaryIO

from ballonet.errors import InputError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LIMITS: dict[str, int | None] = {
    "toml": 1 * MiB,  # cluster and model files, --config
    "json": 64 * MiB,  # profiles, manifests, config.json, ballonet.json
    "pointer": 4 * KiB,  # a checkpoint folder's `latest`
    "metadata": 256 * MiB,  # DCP's .metadata
    "lengths": 1 * GiB,  # a lengths file (.json, .npy, text)
    "index": 4 * GiB,  # a prepared corpus's index.npy (40 bytes a document)
    "document": 1 * GiB,  # one file of a text corpus folder: one document
    "tokenizer": 256 * MiB,  # a Hugging Face tokenizer.json
    "data": None,  # streamed or memory-mapped: JSON Lines and Parquet inputs, token shards, weights
}
"""The most bytes a file of each kind may hold (None: no cap; it is never read whole)."""
MAX_DEPTH = 64
"""Nesting of JSON and TOML values (no file Ballonet reads nests more than 4 deep)."""
MAX_INT_DIGITS = 19
"""Digits of a JSON or TOML integer (int64's range: every integer Ballonet reads fits)."""
INT64_MAX = (1 << 63) - 1

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(path, mode: int, what: str) -> InputError | None:
    for test, kind in _KINDS:
        if test(mode):
            return InputError(f"{path}: cannot read {what} (is {kind}, not a regular file)")
    if not stat.S_ISREG(mode):
        return InputError(f"{path}: cannot read {what} (not a regular file)")
    return None


def _cannot(path, e: OSError, what: str) -> InputError:
    if os.path.islink(path) and not os.path.exists(path):
        return InputError(f"{path}: a symbolic link to nothing (dangling, or a loop)")
    return InputError(f"{path}: cannot read {what} ({e.strerror or type(e).__name__})")


def inside(folder, path) -> str:
    """The real path of `path`, which lies in the user's `folder`; InputError unless it
    resolves inside the folder's real path (the symlink policy)."""
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise InputError(f"{path}: a symbolic link out of {folder} (only links inside the folder are followed)")
    return real


def check(path, kind: str, folder=None, what: str = "file") -> os.stat_result:
    """The stat of the regular file `path` (no larger than its kind's cap; inside `folder`
    if given), without opening it: for files a library opens itself (weights, Parquet)."""
    real = inside(folder, path) if folder is not None else os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise _cannot(path, e, what) from None
    error = _not_regular(path, st.st_mode, what)
    if error:
        raise error
    _check_size(path, kind, st.st_size)
    return st


def _check_size(path, kind: str, size: int) -> None:
    cap = LIMITS[kind]
    if cap is not None and size > cap:
        raise InputError(f"{path}: {size:,} bytes, over the {cap:,} a {kind} file may hold")


def open_file(path, kind: str, folder=None, what: str = "file") -> BinaryIO:
    """The regular file `path` open for binary reading (see `check`): opened non-blocking,
    without following a last symlink (its real path is opened), checked again once open."""
    check(path, kind, folder, what)
    real = inside(folder, path) if folder is not None else os.path.realpath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as e:
        raise _cannot(path, e, what) from None
    try:
        if folder is not None:
            _opened_inside(fd, folder, path)
        st = os.fstat(fd)
        error = _not_regular(path, st.st_mode, what)
        if error:
            raise error
        _check_size(path, kind, st.st_size)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _opened_inside(fd: int, folder, path) -> None:
    """InputError unless the file open as `fd` lies in `folder`: a folder on the way to it
    swapped for a link out between the check and the open (O_NOFOLLOW guards only the last
    name) is caught by where the open landed (Linux's /proc; elsewhere the check stands)."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    root = os.path.realpath(folder)
    if os.path.commonpath([root, opened]) != root:
        raise InputError(f"{path}: a symbolic link out of {folder} (only links inside the folder are followed; "
                         "a folder on its way changed as it was opened)")


def read_bytes(path, kind: str, folder=None, what: str = "file") -> bytes:
    """The whole file (at most its kind's cap, even if it grows while read)."""
    with open_file(path, kind, folder, what) as f:
        cap = LIMITS[kind]
        try:
            data = f.read() if cap is None else f.read(cap + 1)
        except OSError as e:
            raise _cannot(path, e, what) from None
    if LIMITS[kind] is not None:
        _check_size(path, kind, len(data))
    return data


def read_text(path, kind: str, folder=None, what: str = "text") -> str:
    """The whole file as UTF-8 text; InputError "{path}: not {what} (not UTF-8 text)"."""
    try:
        return read_bytes(path, kind, folder, what).decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not {what} (not UTF-8 text)") from None


def load_npy(path, kind: str, folder=None, what: str = "a .npy array"):
    """The array in the .npy file `path` (a regular file, see `open_file`), its header
    checked against the file's size before numpy allocates anything: a 100-byte file
    whose header claims 10^12 elements is one line, not a MemoryError. Pickled objects
    are never loaded."""
    import numpy as np
    from numpy.lib import format as npy

    with open_file(path, kind, folder, what) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            version = npy.read_magic(f)
            header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, _, dtype = header(f)
            if dtype.hasobject:
                raise InputError(f"{path}: not {what} (it holds Python objects, which are never unpickled)")
            data = math.prod(shape) * dtype.itemsize
            if f.tell() + data != size:
                raise InputError(f"{path}: not {what} (its header says {data:,} bytes of data for shape "
                                 f"{shape}, the file holds {size - f.tell():,})")
            f.seek(0)
            return np.load(f, allow_pickle=False)
        except InputError:
            raise
        except (ValueError, EOFError, OSError, TypeError) as e:
            raise InputError(f"{path}: not {what} ({str(e)[:120] or type(e).__name__})") from None


# ---- bounded JSON and TOML -----------------------------------------------------------------


class _Refused(ValueError):
    """A number a parse hook refuses (turned into an InputError naming the file)."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-+"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    value = int(text.replace("_", ""))
    if abs(value) > INT64_MAX:
        raise _Refused(f"integer {text} is outside int64")
    return value


def _parse_float(text: str) -> float:
    value = float(text.replace("_", ""))
    if not math.isfinite(value):
        raise _Refused(f"number {text} must be finite")
    return value


def _parse_constant(text: str):
    raise _Refused(f"{text} is not a number JSON allows")


def check_nesting(value, where) -> None:
    """InputError unless `value` nests at most MAX_DEPTH deep and its numbers are in range
    (for values a library parsed; `loads_json` and `loads_toml` check as they parse)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise InputError(f"{where}: nested more than {MAX_DEPTH} deep")
            stack += [(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v)]
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT64_MAX:
            raise InputError(f"{where}: integer {v if abs(v) < 10**40 else '(over 40 digits)'} is outside int64")
        elif isinstance(v, float) and not math.isfinite(v):
            raise InputError(f"{where}: number {v} must be finite")


def loads_json(text: str | bytes, where, what: str = "JSON", line_numbers: bool = False) -> object:
    """The JSON value of `text` (from `where`, a path or "path:line"), bounded: one
    InputError naming `where` (and the line of a syntax error, with `line_numbers`) on
    malformed, deep or out-of-range input."""
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except _Refused as e:
        raise InputError(f"{where}: not {what} ({e})") from None
    except json.JSONDecodeError as e:
        if line_numbers:
            raise InputError(f"{where}:{e.lineno}: malformed JSON ({e.msg}; not {what})") from None
        raise InputError(f"{where}: not {what}: malformed JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise InputError(f"{where}: not {what} (not UTF-8 text)") from None
    except RecursionError:
        raise InputError(f"{where}: not {what} (nested more than {MAX_DEPTH} deep)") from None
    except ValueError as e:  # Python's own limits on integers
        raise InputError(f"{where}: not {what} ({str(e)[:120]})") from None
    check_nesting(value, where)
    return value


def read_json(path, kind: str = "json", folder=None, what: str = "JSON", line_numbers: bool = False) -> object:
    """The JSON value in the file `path` (through `read_text`, bounded as `loads_json`)."""
    return loads_json(read_text(path, kind, folder, what), path, what, line_numbers)


def loads_toml(text: str, where, what: str = "TOML") -> dict:
    """The table of the TOML `text`, bounded as `loads_json` bounds JSON."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        value = tomllib.loads(text, parse_float=_parse_float)
    except _Refused as e:
        raise InputError(f"{where}: not {what} ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{where}: malformed TOML: {e}") from None
    except RecursionError:
        raise InputError(f"{where}: not {what} (nested more than {MAX_DEPTH} deep)") from None
    except ValueError as e:  # Python's limit on integer digits
        raise InputError(f"{where}: not {what} ({str(e)[:120]})") from None
    check_nesting(value, where)
    return value


def read_toml(path, what: str = "TOML file", kind: str = "toml") -> dict:
    """The table of the TOML file `path` (through `read_bytes`, bounded as `loads_toml`)."""
    try:
        text = read_bytes(path, kind, what=what).decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a TOML {what} (not UTF-8 text)") from None
    return loads_toml(text, path, f"a TOML {what}")


def text_lines(path, kind: str = "data", folder=None, what: str = "file") -> io.TextIOWrapper:
    """The regular file `path` open as UTF-8 text for reading line by line (JSON Lines)."""
    return io.TextIOWrapper(open_file(path, kind, folder, what), encoding="utf-8")


def files_under(root, suffix: str = "", exclude=frozenset()) -> list[str]:
    """Files under the folder `root` ending in `suffix` (hidden ones and folders named in
    `exclude` skipped), sorted by relative path; a symlink among them must resolve to a
    regular file inside `root` (the symlink policy), else one InputError. Linked folders
    are not descended into."""
    found = []
    for folder, subdirs, files in os.walk(root, onerror=_raise_walk_error):
        subdirs[:] = sorted(d for d in subdirs if d not in exclude and not d.startswith("."))
        for name in files:
            if name.endswith(suffix) and not name.startswith("."):
                path = os.path.join(folder, name)
                if os.path.islink(path):
                    check(path, "data", root)
                found.append(path)
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def _raise_walk_error(e: OSError) -> None:
    raise InputError(f"{e.filename}: cannot read folder ({e.strerror or type(e).__name__})")
