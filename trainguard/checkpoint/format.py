"""One checkpoint folder on disk: safetensors shards plus `manifest.json`, written last.

A save writes into a hidden sibling temp folder, fsyncs every file, writes the manifest
(sha256 and size of every shard), then renames the folder into place. A folder that has
a parseable manifest and every listed file at its listed size is complete; anything else
(temp folders, a crash at any point) is ignored by `list_checkpoints`. Loads validate the
manifest and each safetensors header themselves (safeheader.py) before safetensors parses a byte.

Manifest versions: 1 has no parallel layout; 2 adds "layout" (see layout.CheckpointLayout:
every tensor's global shape and which rank file holds which slice); 3 is a training job's
checkpoint (jobsave.py): one file per rank plus "ranks", every rank's own state (RNG, data
position). A save without a layout or ranks still writes version 1, so readers that only know
version 1 read it; all three are read here.
Several ranks can fill one temp folder (`temp_folder`, `write_shard`), after which one of
them calls `commit_checkpoint`; sharded.py does that.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from ..errors import CheckpointError
from .layout import CheckpointLayout
from .safeheader import DTYPE_NAMES, DTYPES, check_header
from .safeheader import corrupt as _corrupt

log = logging.getLogger("trainguard.checkpoint")

FORMAT_VERSION = 2  # sliced/integrated saves with a layout; without one, version 1 is written (and read)
JOB_VERSION = 3  # a training job's checkpoint: one file per rank and every rank's own state (jobsave.py)
READ_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
STALE_TEMP_SECONDS = 3600.0
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.\-]+\.safetensors$")
_TEMP_TAGS = ("tmp", "old", "del")

@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    epoch: int
    world_size: int


def checkpoint_name(prefix: str, epoch: int, step_in_epoch: int) -> str:
    """MindSpore's folder name: ``{prefix}-{epoch}_{step_in_epoch}``."""
    return f"{prefix}-{epoch}_{step_in_epoch}"


def _bad_name(name: Any) -> str | None:
    if not isinstance(name, str):
        return f"file name {name!r} is not a string"
    if "/" in name or "\\" in name or ".." in name or os.path.isabs(name):
        return f"file name {name!r} leaves the checkpoint folder"
    if not _SHARD_NAME.match(name):
        return f"file name {name!r} is not a plain *.safetensors name"
    return None


# --- writing -------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # filesystems without directory fsync
            raise
    finally:
        os.close(fd)


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
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    finally:
        hasher.join()
    return digest[0], 8 + len(head) + offset


def _sha256(chunks: list) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "x", encoding="utf-8") as f:
        json.dump(obj, f, allow_nan=False, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def new_manifest(folder: Path, *, meta: dict, step: int, epoch: int, world_size: int,
                 append_info: dict | None = None, layout: CheckpointLayout | None = None,
                 ranks: dict | None = None) -> dict:
    """A checked manifest without its "files" entries; raises CheckpointError naming `folder`."""
    for key, value, low in (("step", step, 0), ("epoch", epoch, 0), ("world_size", world_size, 1)):
        if type(value) is not int or value < low:
            raise CheckpointError(f"cannot save {folder}: {key} must be an int >= {low}, got {value!r}")
    if not isinstance(meta, dict) or not isinstance(append_info, (dict, type(None))):
        raise CheckpointError(f"cannot save {folder}: meta must be a dict and append_info a dict or None")
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this host is big-endian")
    if layout is not None and ranks is not None:
        raise CheckpointError(f"cannot save {folder}: a manifest has a layout or per-rank states, not both")
    version = JOB_VERSION if ranks is not None else 1 if layout is None else FORMAT_VERSION
    manifest = {"format_version": version, "step": step, "epoch": epoch,
                "world_size": world_size, "meta": meta, "append_info": append_info, "files": {},
                "created": time.time()}
    if ranks is not None:
        manifest["ranks"] = ranks
    if layout is not None:
        for name in layout.rank_files:
            if (why := _bad_name(name)) is not None:
                raise CheckpointError(f"cannot save {folder}: {why}")
        manifest["layout"] = layout.to_json()
    try:
        json.dumps(manifest, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot save {folder}: meta/append_info is not plain JSON: {exc}") from exc
    return manifest


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
        if (why := _bad_name(name)) is not None:
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
    manifest["files"] = dict(written or {})
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if shards is not None:
            current = tmp
            tmp.mkdir()
            for name, tensors in shards.items():
                current = tmp / name
                sha, size = write_shard(current, tensors)
                manifest["files"][name] = {"sha256": sha, "bytes": size}
        missing = [n for n in _layout_files(manifest) if n not in manifest["files"]]
        if missing:
            raise CheckpointError(f"cannot save {folder}: the layout names files that were not written: {missing}")
        for name, entry in (written or {}).items():
            size = (tmp / name).stat().st_size if (tmp / name).is_file() else -1
            if size != entry["bytes"]:
                raise CheckpointError(f"cannot save {folder}: {tmp / name} is {'missing' if size < 0 else size} here, "
                                      f"but its writer reported {entry['bytes']} bytes; is the directory shared by "
                                      "every rank?")
        current = tmp / MANIFEST
        _write_json(current, manifest)
        current = tmp
        _fsync_dir(tmp)
        current = folder
        if folder.exists():
            os.rename(folder, old)
            moved_aside = True
        os.rename(tmp, folder)
        done = True
        current = parent
        _fsync_dir(parent)
    except OSError as exc:
        state = ("it is in place but may not survive a power loss" if done
                 else "the previous checkpoint is unchanged")
        raise CheckpointError(f"could not write checkpoint {folder}: {current}: {exc.strerror or exc} "
                              f"[errno {exc.errno}]; {state}") from exc
    finally:  # also on CheckpointError (bad dtype) or KeyboardInterrupt
        if not done:
            if moved_aside:
                _undo_aside(old, folder)
            _remove(tmp)
        elif moved_aside:
            _remove(old)
    return folder


def _undo_aside(old: Path, folder: Path) -> None:
    try:
        os.rename(old, folder)
    except OSError as exc:
        log.error("could not move the previous checkpoint %s back to %s: %s", old, folder, exc)


def _remove(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        shutil.rmtree(path)
        return True
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
        return False


# --- reading -------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict:
    """The validated manifest of `folder` (no hashing); raises CheckpointCorrupt."""
    path = Path(folder) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise _corrupt(path, "is missing: the save never completed") from None
    except OSError as exc:
        raise _corrupt(path, f"cannot be read ({exc.strerror})") from exc
    try:
        m = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(path, f"is not JSON ({exc})") from None
    if not isinstance(m, dict):
        raise _corrupt(path, "is not a JSON object")
    version = m.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise _corrupt(path, f"has format_version {version!r}; this trainguard reads versions "
                       f"{', '.join(map(str, READ_VERSIONS))} (a newer trainguard wrote it?)")
    for key, kind in (("step", int), ("epoch", int), ("world_size", int), ("meta", dict), ("files", dict),
                      ("created", (int, float))):
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise _corrupt(path, f"field {key!r} is missing or not a {getattr(kind, '__name__', 'number')}")
    if m["step"] < 0 or m["epoch"] < 0 or m["world_size"] < 1:
        raise _corrupt(path, f"step/epoch/world_size {m['step']}/{m['epoch']}/{m['world_size']} out of range")
    if m.get("append_info") is not None and not isinstance(m["append_info"], dict):
        raise _corrupt(path, "field 'append_info' is not an object")
    for name, entry in m["files"].items():
        if (why := _bad_name(name)) is not None:
            raise _corrupt(path, why)
        ok = isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not ok or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _corrupt(path, f"entry for {name!r} needs a 64-hex 'sha256' and a non-negative 'bytes'")
    if version == 2:
        _check_layout(path, m)
    elif "layout" in m:
        raise _corrupt(path, f"has format_version {version} but a 'layout' field (only version 2 has one)")
    if version == JOB_VERSION:
        _check_ranks(path, m)
    elif "ranks" in m:
        raise _corrupt(path, f"has format_version {version} but a 'ranks' field (version 3 introduced it)")
    return m


def _check_ranks(path: Path, m: dict) -> None:
    """Version 3: "ranks" maps every rank 0..world_size-1 to its file, progress and own state."""
    ranks = m.get("ranks")
    if not isinstance(ranks, dict) or sorted(ranks) != sorted(str(r) for r in range(m["world_size"])):
        raise _corrupt(path, f"has format_version 3 but its 'ranks' field does not name ranks 0..{m['world_size'] - 1}")
    for r, entry in ranks.items():
        progress = entry.get("progress") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("file") not in m["files"] or not isinstance(entry.get("state"), str):
            raise _corrupt(path, f"rank {r} needs a 'file' among its files and a 'state' string")
        if not isinstance(progress, dict) or not all(type(progress.get(k)) is int and progress[k] >= 0
                                                     for k in ("step", "epoch", "in_epoch")):
            raise _corrupt(path, f"rank {r}: 'progress' needs non-negative ints step, epoch and in_epoch")


def _layout_files(manifest: dict) -> list[str]:
    return list(manifest.get("layout", {}).get("rank_files", []))


def _check_layout(path: Path, m: dict) -> None:
    if "layout" not in m:
        raise _corrupt(path, f"has format_version {m['format_version']} but no 'layout' field")
    try:
        layout = CheckpointLayout.from_json(m["layout"])
    except ValueError as exc:
        raise _corrupt(path, f"layout: {exc}") from None
    for name in layout.rank_files:
        if (why := _bad_name(name)) is not None:
            raise _corrupt(path, f"layout: {why}")
        if name not in m["files"]:
            raise _corrupt(path, f"layout names {name!r}, which is not among its files")
    for name, t in layout.tensors.items():
        if t.dtype not in DTYPES:
            raise _corrupt(path, f"layout: tensor {name!r} has unknown dtype {t.dtype[:20]!r}")
    if len(layout.rank_files) not in (1, m["world_size"]):
        raise _corrupt(path, f"layout has {len(layout.rank_files)} rank files for world_size {m['world_size']}")


def manifest_layout(manifest: dict) -> CheckpointLayout | None:
    """The parsed layout of a manifest `read_manifest` returned (None for version 1)."""
    return CheckpointLayout.from_json(manifest["layout"]) if "layout" in manifest else None


def read_shard(path: Path, entry: dict, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of one shard file, checked against its manifest `entry` ({"sha256", "bytes"})."""
    return read_shard_metadata(path, entry, verify)[0]


def read_shard_metadata(path: Path, entry: dict, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, string metadata of its header) of one shard file, checked as read_shard does."""
    if path.is_symlink() or not path.is_file():
        raise _corrupt(path, "is missing (or not a regular file) but the manifest lists it")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _corrupt(path, f"cannot be read ({exc.strerror})") from exc
    if len(data) != entry["bytes"]:
        raise _corrupt(path, f"is {len(data)} bytes, the manifest says {entry['bytes']} (truncated or "
                       "overwritten)")
    if verify and hashlib.sha256(data).hexdigest() != entry["sha256"].lower():
        raise _corrupt(path, "sha256 does not match the manifest (the file was altered or bits flipped)")
    metadata = check_header(path, data)
    try:
        return st_load(data), metadata
    except (SafetensorError, ValueError, RuntimeError, KeyError) as exc:
        raise _corrupt(path, f"safetensors could not parse it ({exc})") from None


def load_checkpoint(folder: Path, *, verify: bool = True) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """(shards, manifest) of a complete checkpoint; verify=True also checks every sha256."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    shards = {name: read_shard(folder / name, entry, verify) for name, entry in manifest["files"].items()}
    return shards, manifest
