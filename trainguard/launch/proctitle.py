"""A process's command line as `ps` and /proc/PID/cmdline show it, rewritten in place.

A worker forked by the zygote (zygote.py) would otherwise show the zygote's command line. It shows the
command a fresh process would have had (`python -u -m trainguard.launch.worker_main SCRIPT ARGS...`), so
that `ps`, `pgrep -f` and a user's own tooling see the same processes as without the zygote. The kernel
reads the command line from the memory of the process's original arguments (arg_start..arg_end in
/proc/self/stat); the new one is written there, NUL-separated, and cut to fit. Linux only; elsewhere,
or if /proc cannot be read, nothing changes.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Sequence

ARG_START_FIELD = 48  # /proc/PID/stat, 1-based (man 5 proc); arg_end follows


def room() -> tuple[int, int] | None:
    """(address, size) of this process's argument memory, or None where it cannot be known."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parens
        start, end = int(fields[ARG_START_FIELD - 3]), int(fields[ARG_START_FIELD - 2])
    except (OSError, IndexError, ValueError):
        return None
    return (start, end - start) if start and end > start else None


def encode(args: Sequence[str], size: int) -> bytes:
    """The arguments NUL-separated and NUL-padded to `size` bytes; those that do not fit are dropped (the
    last one that fits in part is cut), and the final byte is always NUL, as the kernel expects."""
    out = b""
    for arg in args:
        piece = arg.encode("utf-8", "surrogateescape") + b"\0"
        if len(out) + len(piece) > size - 1:
            out += piece[:max(0, size - 1 - len(out))]
            break
        out += piece
    return out.ljust(size, b"\0")[:size]


def set_cmdline(args: Sequence[str]) -> bool:
    """Make /proc/self/cmdline read `args` (cut to fit); False where it cannot be done."""
    where = room()
    if where is None:
        return False
    address, size = where
    data = encode(args, size)
    ctypes.memmove(address, data, size)
    return True
