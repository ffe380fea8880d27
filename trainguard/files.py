"""Reading the small files a user names (a secret, TLS settings, a password, a certificate): only a regular
file of at most a given size is ever opened, so a FIFO, a device or a huge file named by mistake (or by
someone else) cannot hang or exhaust the process."""

from __future__ import annotations

import os
import stat

from .errors import ConfigError


def read_small_file(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The whole file, or ConfigError starting with `what` (a variable and its value, a file name)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise ConfigError(f"{what}: not a regular file of at most {limit} bytes")
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it ({exc.strerror or exc})") from None
