"""What every bench script shares: one shape and one way to record a run.

Each script is `main(argv: list[str] | None = None) -> int` (argparse on `argv`; None:
the command line), run as `sys.exit(main())`, and records its result with
`record(command, data, out)`: the
data, the command that reproduces it (`command(script, argv)`), the date and the machine,
written whole to `out` (JSON); a Markdown report beside it with `write_text`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
"""Where the scripts write by default (`--out`)."""
ROOT = os.path.dirname(HERE)


def command(script: str, argv: list[str] | None, env: str = "OMP_NUM_THREADS=1 ") -> str:
    """The command line that reproduces this run: `env python bench/<script> <argv>` (`script`
    relative to bench/, e.g. "investigations/host_allocator.py")."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"{env}python bench/{script}", *args]).rstrip()


def machine() -> str:
    """This machine in a few words (architecture, cores, Python)."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` whole (a temporary file renamed over it), folders made."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def record(command: str, data: dict, out: str) -> dict:
    """`data` with the command that made it, the date and the machine first, written to
    `out` as JSON (`write_text`); returns what was written."""
    recorded = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": machine(), **data}
    write_text(out, json.dumps(recorded, indent=1) + "\n")
    return recorded

