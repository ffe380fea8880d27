"""Durable writes, the one helper every file trainguard keeps is written with (checkpoints, markers,
scheduler.json, job.secret, strategy.json): a file appears whole under its name or not at all, and
survives a power loss.

`replacing(path)` hands out a private temp name beside `path`; when the block ends without an
error, the temp file is fsynced, renamed over `path`, and its folder fsynced. The temp file never
stays behind. `write_bytes` and `write_json` are the one-call forms (`mode=0o600` for a file only its
owner may read, such as a secret). A whole checkpoint folder is swapped into place the same way
(checkpoint/format.commit_checkpoint), with `fsync_dir` and `remove`.

Temp names start with a dot and the target's name, ``.{name}.{pid}-{hex}``, so a writer killed
before its rename leaves only a hidden file that the folder's owner can sweep.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger("trainguard.durable")


def fsync_dir(path: Path) -> None:
    """Make the folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # filesystems without directory fsync
            raise
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_name(path: Path) -> Path:
    """A hidden name beside `path` that no other writer uses."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")


@contextmanager
def replacing(path: Path, *, fsync: bool = True, sync_dir: bool = True) -> Iterator[Path]:
    """Yield a temp path to write `path`'s new content to; on success rename it over `path`.

    fsync=False: the block fsyncs the file itself (format.write_shard does). sync_dir=False: the
    caller fsyncs the folder later (after more renames into it)."""
    path = Path(path)
    tmp = private_name(path)
    try:
        yield tmp
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
        if sync_dir:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: Path, data: bytes, *, sync_dir: bool = True, mode: int = 0o666) -> None:
    """`mode` as for os.open (the umask applies): the file has it from its creation, never wider."""
    with replacing(path, sync_dir=sync_dir) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def write_json(path: Path, obj: dict, *, sync_dir: bool = True, indent: int | None = None, mode: int = 0o666) -> None:
    """Write `obj` as strict JSON (no NaN or infinity) to `path`, atomically and durably."""
    write_bytes(path, json.dumps(obj, allow_nan=False, indent=indent).encode(), sync_dir=sync_dir, mode=mode)


def remove(path: Path) -> bool:
    """Delete a folder tree; False (logged) when it is not there or cannot be removed."""
    if not path.exists():
        return False
    try:
        shutil.rmtree(path)
        return True
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
        return False
