"""glibc's accounting of this process's heap (`mallinfo2`)."""

from __future__ import annotations

import ctypes
import ctypes.util


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo2() -> _Mallinfo2 | None:
    """glibc's accounting of this process's heap (`mallinfo2`, glibc 2.33+; None without):
    `arena` bytes the heap holds, `fordblks` of them free, `hblkhd` bytes mapped apart."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2()
