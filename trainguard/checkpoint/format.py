"""One checkpoint folder on disk: safetensors shards plus `manifest.json`, written last.

A save writes into a hidden sibling temp folder, fsyncs every file, writes the manifest
(sha256 and size of every shard), then renames the folder into place. A folder that has
a parseable manifest and every listed file at its listed size is complete; anything else
(temp folders, a crash at any point) is ignored by `list_checkpoints`. Loads validate the
manifest and each safetensors header themselves (safeheader.py) before safetensors parses a byte.

The manifest's versions (1: no parallel layout, 2: a layout, 3: a training job's) and its one
parser belong to manifest.py; this module writes folders and reads their files.

Several ranks can fill one temp folder (`temp_folder`, `write_shard`), after which one of
them calls `commit_checkpoint`; sharded.py does that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from .. import durable
from ..errors import CheckpointError
from .layout import CheckpointLayout
from .manifest import (
    MANIFEST,
    FileEntry,
    Kind,
    bad_file_name,
    new_manifest,
    read,
    required_files,
)
from .safeheader import DTYPE_NAMES, DTYPES, check_header, read_untrusted
from .safeheader import corrupt as _corrupt

log = logging.getLogger("trainguard.checkpoint")

STALE_TEMP_SECONDS = 3600.0
TEMP_TAGS = ("tmp", "old", "del")  # hidden siblings: a save in progress, a folder moved aside, one being pruned


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    epoch: int
    world_size: int
    kind: Kind = Kind.JOB  # what the folder holds: a training job's per-rank files, or a layout's slices


def checkpoint_name(prefix: str, epoch: int, step_in_epoch: int) -> str:
    """MindSpore's folder name: ``{prefix}-{epoch}_{step_in_epoch}``."""
    return f"{prefix}-{epoch}_{step_in_epoch}"


# --- writing -------------------------------------------------------------------------------


class WriteFault(Protocol):
    """A fault a test puts into every shard write (train/engine/faults.py: a full disk, a slow dying gasp). Either
    call may raise OSError, as a real disk does; nothing else changes how a shard is written."""

    def opened(self, path: Path, f: BinaryIO) -> None:
        """The file is open and empty."""

    def written(self, path: Path) -> None:
        """The file is written and fsynced."""


_FAULTS: list[WriteFault] = []


def inject_write_fault(fault: WriteFault) -> None:
    """Put `fault` into every later shard write of this process (once: an equal fault is not added again)."""
    if fault not in _FAULTS:
        _FAULTS.append(fault)


def remove_write_fault(fault: WriteFault) -> None:
    if fault in _FAULTS:
        _FAULTS.remove(fault)


def write_shard(path: Path, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write one safetensors file (streamed, fsynced), with string `metadata` in its header;
    return (sha256 hex, size)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    blobs, offset = [], 0
    for key in sorted(tensors):
        t = tensors[key]
        if not isinstance(key, str) or key == "__metadata__":
            raise CheckpointError(f"{path.name}: tensor name {key!r} is not a str or is reserved")
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{path.name}: tensor {key!r} has dtype {t.dtype}, which safetensors "
                                  f"cannot store; supported: {', '.join(sorted(DTYPES))}")
        t = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        n = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(tensors[key].shape),
                       "data_offsets": [offset, offset + n]}
        blobs.append(t.view(torch.uint8).numpy() if n else b"")
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    chunks = [struct.pack("<Q", len(head)), head, *blobs]
    # hashlib releases the GIL on large buffers: hash the same bytes while they are written and fsynced
    # (a plain thread, not an executor: executors refuse work once the interpreter begins to exit)
    digest: list[str] = []
    hasher = threading.Thread(target=lambda: digest.append(_sha256(chunks)), name="trainguard-sha256", daemon=True)
    hasher.start()
    try:
        with open(path, "xb") as f:
            for fault in _FAULTS:
                fault.opened(path, f)
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    finally:
        hasher.join()
    for fault in _FAULTS:
        fault.written(path)
    return digest[0], 8 + len(head) + offset


def _sha256(chunks: list) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def temp_folder(folder: Path, tag: str) -> Path:
    """The hidden sibling a save of `folder` fills before `commit_checkpoint` renames it."""
    return folder.parent / f".{folder.name}.tmp-{tag}"


def save_checkpoint(folder: Path, shards: dict[str, dict[str, torch.Tensor]], *, meta: dict, step: int,
                    epoch: int, world_size: int, append_info: dict | None = None,
                    layout: CheckpointLayout | None = None) -> Path:
    """Write `shards` and a manifest to `folder` atomically; an existing `folder` is replaced.

    On failure raises CheckpointError naming the file, removes the temp folder and leaves
    any earlier checkpoint at `folder` as it was."""
    folder = Path(folder)
    for name in shards:
        if (why := bad_file_name(name)) is not None:
            raise CheckpointError(f"cannot save {folder}: {why}")
    manifest = new_manifest(folder, meta=meta, step=step, epoch=epoch, world_size=world_size,
                            append_info=append_info, layout=layout)
    return commit_checkpoint(folder, f"{os.getpid()}-{secrets.token_hex(4)}", manifest, shards=shards)


def commit_checkpoint(folder: Path, tag: str, manifest: dict, *, shards: dict | None = None,
                      written: dict[str, dict] | None = None) -> Path:
    """Finish a save into `temp_folder(folder, tag)`: write `shards` there (creating it), or take
    the `written` files ({name: {"sha256", "bytes"}}) other processes put there already; then
    write the manifest, fsync, and swap the folder into place."""
    folder = Path(folder)
    parent = folder.parent
    tmp, old = temp_folder(folder, tag), parent / f".{folder.name}.old-{tag}"
    current, moved_aside, done = parent, False, False
    files = manifest["files"] = dict(written or {})
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if shards is not None:
            current = tmp
            tmp.mkdir()
            for name, tensors in shards.items():
                current = tmp / name
                sha, size = write_shard(current, tensors)
                files[name] = {"sha256": sha, "bytes": size}
        missing = [n for n in required_files(manifest) if n not in files]
        if missing:
            raise CheckpointError(f"cannot save {folder}: the manifest names files that were not written: {missing}")
        for name, entry in (written or {}).items():
            size = (tmp / name).stat().st_size if (tmp / name).is_file() else -1
            if size != entry["bytes"]:
                raise CheckpointError(f"cannot save {folder}: {tmp / name} is {'missing' if size < 0 else size} here, "
                                      f"but its writer reported {entry['bytes']} bytes; is the directory shared by "
                                      "every rank?")
        current = tmp / MANIFEST
        durable.write_json(current, manifest, indent=1)  # and fsyncs the folder
        current = folder
        if folder.exists():
            os.rename(folder, old)
            moved_aside = True
        os.rename(tmp, folder)
        done = True
        current = parent
        durable.fsync_dir(parent)
    except OSError as exc:
        state = ("it is in place but may not survive a power loss" if done
                 else "the previous checkpoint is unchanged")
        raise CheckpointError(f"could not write checkpoint {folder}: {current}: {exc.strerror or exc} "
                              f"[errno {exc.errno}]; {state}") from exc
    finally:  # also on CheckpointError (bad dtype) or KeyboardInterrupt
        if not done:
            if moved_aside:
                _undo_aside(old, folder)
            durable.remove(tmp)
        elif moved_aside:
            durable.remove(old)
    return folder


def _undo_aside(old: Path, folder: Path) -> None:
    try:
        os.rename(old, folder)
    except OSError as exc:
        log.error("could not move the previous checkpoint %s back to %s: %s", old, folder, exc)


# --- reading -------------------------------------------------------------------------------


def read_shard(path: Path, entry: FileEntry, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of one shard file, checked against its manifest `entry`."""
    return read_shard_metadata(path, entry, verify)[0]


def read_shard_metadata(path: Path, entry: FileEntry, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, string metadata of its header) of one shard file, checked as read_shard does."""
    try:
        data = read_untrusted(path, entry.bytes, expect=entry.bytes)
    except FileNotFoundError:
        raise _corrupt(path, "is missing but the manifest lists it") from None
    if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
        raise _corrupt(path, "sha256 does not match the manifest (the file was altered or bits flipped)")
    metadata = check_header(path, data)
    try:
        return st_load(data), metadata
    except (SafetensorError, ValueError, RuntimeError, KeyError) as exc:
        raise _corrupt(path, f"safetensors could not parse it ({exc})") from None


def read_checkpoint(folder: Path, *, verify: bool = True) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """(shards, manifest) of a complete checkpoint; verify=True also checks every sha256."""
    m = read(folder)
    return {name: read_shard(m.folder / name, entry, verify) for name, entry in m.files.items()}, m.raw
