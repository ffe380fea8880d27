"""Which checkpoint folders in a directory are complete, and retention: pruning old ones and stale temps.

A folder counts when its manifest parses and every listed file has its listed size (no hashing:
loads verify the sha256), or a file that can stand in for it does (`Manifest.incomplete`: in a
training job's checkpoint, a bit-identical replica, which loading reads and copies back).
Pruning renames a folder aside before deleting it, so no half-deleted folder is ever left under
a real checkpoint name, and always keeps the newest complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from pathlib import Path

from ..errors import CheckpointCorrupt
from .. import durable
from .format import STALE_TEMP_SECONDS, TEMP_TAGS, CheckpointInfo
from .manifest import Manifest, read

log = logging.getLogger("trainguard.checkpoint")


def _is_complete(folder: Path) -> Manifest | None:
    try:
        m = read(folder)
    except CheckpointCorrupt as exc:
        log.warning("ignoring incomplete checkpoint folder: %s", exc)
        return None
    if (why := m.incomplete()) is not None:
        log.warning("ignoring checkpoint %s: %s", folder, why)
        return None
    return m


def list_checkpoints(directory: Path, prefix: str) -> list[CheckpointInfo]:
    """Complete checkpoints `{prefix}-{epoch}_{n}` in `directory`, oldest step first (no hashing)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-\d+_\d+$")
    try:
        entries = sorted(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    found = []
    for path in entries:
        if pattern.match(path.name) and path.is_dir() and (m := _is_complete(path)) is not None:
            found.append(CheckpointInfo(path, m.step, m.epoch, m.world_size, m.kind))
    return sorted(found, key=lambda c: (c.step, c.epoch, c.path.name))


def _stale(path: Path, cutoff: float) -> bool:
    try:
        newest = max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.iterdir()])
    except OSError:
        return False  # vanished or unreadable; another process owns it
    return newest < cutoff


def prune_checkpoints(directory: Path, prefix: str, keep_max: int, *,
                      stale_temp_seconds: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Delete the oldest complete checkpoints so at most max(keep_max, 1) remain, and temp
    folders older than `stale_temp_seconds`. Returns what was deleted."""
    directory = Path(directory)
    infos = list_checkpoints(directory, prefix)
    deleted = []
    for info in infos[:max(len(infos) - max(keep_max, 1), 0)]:
        aside = directory / f".{info.path.name}.del-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(info.path, aside)  # no half-deleted folder under the real name
        except OSError as exc:
            log.warning("could not prune %s: %s", info.path, exc)
            continue
        durable.remove(aside)
        deleted.append(info.path)
    temp = re.compile(rf"^\.{re.escape(prefix)}-\d+_\d+\.(?:{'|'.join(TEMP_TAGS)})-\d+-[0-9a-f]+$")
    cutoff = time.time() - stale_temp_seconds
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        if temp.match(path.name) and path.is_dir() and _stale(path, cutoff) and durable.remove(path):
            deleted.append(path)
    return deleted
