"""A checkpoint folder's `manifest.json`: its one parser, the checks of a manifest about to be
written, and the names of the files it governs.

Three versions are on disk, and they stay three (docs/ARCHITECTURE.md says why):

1. files of whole tensors, no parallel layout (`format.save_checkpoint` without a layout);
2. adds "layout": every tensor's global shape and which rank file holds which slice
   (layout.CheckpointLayout: an integrated or a sliced save, sharded.py);
3. a training job's checkpoint (jobsave.py): one file per rank, and "ranks": every rank's file,
   data position and own state (RNG, ...).

`read(folder)` parses the file once, as untrusted input, into a `Manifest` whose `kind` says which
version it is; a malformed manifest, whatever is wrong with it, raises CorruptFile (a
CheckpointCorrupt) naming the file. Nothing else looks inside the JSON. Code asks the `Manifest`:
its typed fields, `stand_ins`, `incomplete`. What differs by kind beyond that (open, verify,
recover) is dispatched once, in replicas.py.
"""

from __future__ import annotations

import enum
import json
import os
import re
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .layout import CheckpointLayout
from .safeheader import DTYPES, CorruptFile, corrupt, read_untrusted

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists files and slices; a larger one is not ours
MAX_WORLD_SIZE = 1 << 20
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.\-]+\.safetensors$")
_HEX = frozenset(string.hexdigits)


class Kind(enum.Enum):
    """What a checkpoint folder holds; the value is its manifest's format_version."""

    SINGLE = 1  # files of whole tensors
    LAYOUT = 2  # a parallel layout: integrated (one file) or sliced (a file per rank)
    JOB = 3  # a training job's: a file and an own state per rank


_HOLDS = {Kind.SINGLE: "each file holds one rank's whole state",
          Kind.LAYOUT: "each file holds the slices its layout names",
          Kind.JOB: "each rank's file holds its data-parallel state; equal sha256 = a replica"}
FORMAT_VERSION = Kind.LAYOUT.value  # sliced/integrated saves with a layout; without one, version 1 is written
JOB_VERSION = Kind.JOB.value
READ_VERSIONS = tuple(k.value for k in Kind)


def rank_file(rank: int) -> str:
    """The file of `rank` in a sliced or a job's checkpoint."""
    return f"rank_{rank}.safetensors"


def bad_file_name(name: Any) -> str | None:
    """Why `name` cannot be a checkpoint file (it must stay inside its folder), or None."""
    if not isinstance(name, str):
        return f"file name {name!r} is not a string"
    if "/" in name or "\\" in name or ".." in name or os.path.isabs(name):
        return f"file name {name!r} leaves the checkpoint folder"
    if not _SHARD_NAME.match(name):
        return f"file name {name!r} is not a plain *.safetensors name"
    return None


@dataclass(frozen=True, slots=True)
class FileEntry:
    sha256: str  # 64 lower-case hex digits
    bytes: int


@dataclass(frozen=True, slots=True)
class RankEntry:
    """Version 3: one rank's file, data position ({"step", "epoch", "in_epoch"}) and own state
    (base64 of a blob.py byte string)."""

    file: str
    progress: dict[str, int]
    state: str


@dataclass(frozen=True, slots=True)
class Manifest:
    folder: Path
    kind: Kind
    step: int
    epoch: int
    world_size: int
    meta: dict
    append_info: dict | None
    files: dict[str, FileEntry]
    created: float
    layout: CheckpointLayout | None = None  # Kind.LAYOUT only
    ranks: tuple[RankEntry, ...] = ()  # Kind.JOB only: ranks[r] is rank r's
    raw: dict = field(default_factory=dict, repr=False, compare=False)  # the JSON as read

    @property
    def path(self) -> Path:
        return self.folder / MANIFEST

    @property
    def version(self) -> int:
        return self.kind.value

    @property
    def label(self) -> str:
        """What `trainguard ckpt ls` calls it: job, sliced, integrated or per-rank."""
        if self.layout is not None:
            return self.layout.kind
        return "job" if self.kind is Kind.JOB else "per-rank"

    @property
    def holds(self) -> str:
        """What its files hold, for people."""
        return _HOLDS[self.kind]

    def stand_ins(self, name: str) -> list[str]:
        """Other files whose bytes can replace `name`. In a job's checkpoint a file with the same
        sha256 and size is a bit-identical replica (in data parallel every rank's file is). Other
        kinds have none: a sliced file's replicas hold pieces of it, which pieces.py reads."""
        if self.kind is not Kind.JOB:
            return []
        want = self.files[name]
        return [n for n, e in self.files.items() if n != name and e == want]

    def group_info(self, rank: int) -> list[int]:
        """The ranks holding the same data as `rank`, itself included: the layout's group info, or
        in a job's checkpoint the ranks whose files are bit-identical; CheckpointError otherwise."""
        n = len(self.layout.rank_files) if self.layout is not None else len(self.ranks)
        if not 0 <= rank < n:
            raise CheckpointError(f"{self.folder}: rank {rank} is outside the checkpoint's {n} ranks"
                                  + ("" if n else " (a version-1 checkpoint has no ranks)"))
        if self.layout is not None:
            return list(self.layout.group_info[rank])
        want = self.files[self.ranks[rank].file]
        return [r for r, e in enumerate(self.ranks) if self.files[e.file] == want]

    def wrong_size(self) -> list[str]:
        """The listed files that are missing or not of their listed size (no hashing)."""
        return [n for n, e in self.files.items() if _size(self.folder / n) != e.bytes]

    def incomplete(self) -> str | None:
        """Why the folder is not complete, or None: a listed file is missing or of another size,
        and no stand-in of the right size is there instead (no hashing: loads verify)."""
        wrong = self.wrong_size()
        for name in wrong:
            if any(s not in wrong for s in self.stand_ins(name)):
                continue
            size = _size(self.folder / name)
            return f"{name} is {'missing' if size < 0 else f'{size} bytes'}, the manifest says {self.files[name].bytes}"
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


# --- reading ---------------------------------------------------------------------------------


def read(folder: str | Path) -> Manifest:
    """The parsed, checked manifest of `folder` (no hashing); raises CorruptFile naming it."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        data = read_untrusted(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise corrupt(path, "is missing: the save never completed") from None
    return parse(data, folder)


def read_manifest(folder: str | Path) -> dict:
    """The checked manifest of `folder` as plain JSON (for people and tools); raises CheckpointCorrupt."""
    return read(folder).raw


def parse(data: bytes, folder: Path) -> Manifest:
    """Parse the bytes of `folder`'s manifest. Whatever is wrong, the error is CorruptFile."""
    path = Path(folder) / MANIFEST
    try:
        m = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise corrupt(path, f"is not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    try:
        return _parse(m, Path(folder), path)
    except CorruptFile:
        raise
    except (RecursionError, TypeError, KeyError, ValueError, AttributeError, IndexError) as exc:
        raise corrupt(path, f"is malformed ({type(exc).__name__}: {str(exc)[:200]})") from None


def _number(value: Any, kind: type | tuple) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def _parse(m: Any, folder: Path, path: Path) -> Manifest:
    if not isinstance(m, dict):
        raise corrupt(path, "is not a JSON object")
    version = m.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise corrupt(path, f"has format_version {str(version)[:40]}; this trainguard reads versions "
                      f"{', '.join(map(str, READ_VERSIONS))} (a newer trainguard wrote it?)")
    kind = Kind(version)
    for key, want in (("step", int), ("epoch", int), ("world_size", int), ("meta", dict), ("files", dict),
                      ("created", (int, float))):
        if not _number(m.get(key), want):
            raise corrupt(path, f"field {key!r} is missing or not a {getattr(want, '__name__', 'number')}")
    if m["step"] < 0 or m["epoch"] < 0 or not 1 <= m["world_size"] <= MAX_WORLD_SIZE:
        raise corrupt(path, f"step/epoch/world_size {m['step']}/{m['epoch']}/{m['world_size']} out of range")
    if m.get("append_info") is not None and not isinstance(m["append_info"], dict):
        raise corrupt(path, "field 'append_info' is not an object")
    files = {}
    for name, entry in m["files"].items():
        if (why := bad_file_name(name)) is not None:
            raise corrupt(path, why)
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not (isinstance(sha, str) and len(sha) == 64 and _HEX.issuperset(sha)) or not _number(size, int) \
                or size < 0:
            raise corrupt(path, f"entry for {name!r} needs a 64-hex 'sha256' and a non-negative 'bytes'")
        files[name] = FileEntry(sha.lower(), size)
    for key, owner in (("layout", Kind.LAYOUT), ("ranks", Kind.JOB)):
        if kind is not owner and key in m:
            raise corrupt(path, f"has format_version {version} but a {key!r} field (only version {owner.value} "
                          "has one)")
    layout = _layout(path, m, files) if kind is Kind.LAYOUT else None
    ranks = _ranks(path, m, files) if kind is Kind.JOB else ()
    return Manifest(folder, kind, m["step"], m["epoch"], m["world_size"], m["meta"], m.get("append_info"), files,
                    float(m["created"]), layout, ranks, m)


def _ranks(path: Path, m: dict, files: dict[str, FileEntry]) -> tuple[RankEntry, ...]:
    """Version 3: "ranks" maps every rank 0..world_size-1 to its file, progress and own state."""
    ranks = m.get("ranks")
    if not isinstance(ranks, dict) or sorted(ranks) != sorted(str(r) for r in range(m["world_size"])):
        raise corrupt(path, f"has format_version 3 but its 'ranks' field does not name ranks 0..{m['world_size'] - 1}")
    out = []
    for r in range(m["world_size"]):
        entry = ranks[str(r)]
        progress = entry.get("progress") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("file") not in files or not isinstance(entry.get("state"), str):
            raise corrupt(path, f"rank {r} needs a 'file' among its files and a 'state' string")
        if not isinstance(progress, dict) or not all(type(progress.get(k)) is int and progress[k] >= 0
                                                     for k in ("step", "epoch", "in_epoch")):
            raise corrupt(path, f"rank {r}: 'progress' needs non-negative ints step, epoch and in_epoch")
        out.append(RankEntry(entry["file"], dict(progress), entry["state"]))
    return tuple(out)


def _layout(path: Path, m: dict, files: dict[str, FileEntry]) -> CheckpointLayout:
    if "layout" not in m:
        raise corrupt(path, f"has format_version {m['format_version']} but no 'layout' field")
    try:
        layout = CheckpointLayout.from_json(m["layout"])
    except ValueError as exc:
        raise corrupt(path, f"layout: {exc}") from None
    for name in layout.rank_files:
        if (why := bad_file_name(name)) is not None:
            raise corrupt(path, f"layout: {why}")
        if name not in files:
            raise corrupt(path, f"layout names {name!r}, which is not among its files")
    for name, t in layout.tensors.items():
        if t.dtype not in DTYPES:
            raise corrupt(path, f"layout: tensor {name!r} has unknown dtype {t.dtype[:20]!r}")
    if len(layout.rank_files) not in (1, m["world_size"]):
        raise corrupt(path, f"layout has {len(layout.rank_files)} rank files for world_size {m['world_size']}")
    return layout


# --- writing ---------------------------------------------------------------------------------


def new_manifest(folder: Path, *, meta: dict, step: int, epoch: int, world_size: int,
                 append_info: dict | None = None, layout: CheckpointLayout | None = None,
                 ranks: dict | None = None) -> dict:
    """A checked manifest without its "files" entries; raises CheckpointError naming `folder`.
    `ranks` is jobsave.ranks_entry's; with neither a layout nor ranks it is version 1."""
    for key, value, low in (("step", step, 0), ("epoch", epoch, 0), ("world_size", world_size, 1)):
        if type(value) is not int or value < low:
            raise CheckpointError(f"cannot save {folder}: {key} must be an int >= {low}, got {value!r}")
    if not isinstance(meta, dict) or not isinstance(append_info, (dict, type(None))):
        raise CheckpointError(f"cannot save {folder}: meta must be a dict and append_info a dict or None")
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this host is big-endian")
    if layout is not None and ranks is not None:
        raise CheckpointError(f"cannot save {folder}: a manifest has a layout or per-rank states, not both")
    kind = Kind.JOB if ranks is not None else Kind.SINGLE if layout is None else Kind.LAYOUT
    manifest = {"format_version": kind.value, "step": step, "epoch": epoch, "world_size": world_size,
                "meta": meta, "append_info": append_info, "files": {}, "created": time.time()}
    if ranks is not None:
        manifest["ranks"] = ranks
    if layout is not None:
        for name in layout.rank_files:
            if (why := bad_file_name(name)) is not None:
                raise CheckpointError(f"cannot save {folder}: {why}")
        manifest["layout"] = layout.to_json()
    try:
        json.dumps(manifest, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot save {folder}: meta/append_info is not plain JSON: {exc}") from exc
    return manifest


def required_files(draft: dict) -> list[str]:
    """The files a manifest made by `new_manifest` refers to, which must be written before it."""
    layout_files = draft["layout"]["rank_files"] if draft["format_version"] == Kind.LAYOUT.value else []
    rank_files = [e["file"] for e in draft["ranks"].values()] if draft["format_version"] == Kind.JOB.value else []
    return list(dict.fromkeys([*layout_files, *rank_files]))


# --- what verify and recover report, for every kind --------------------------------------------


@dataclass(frozen=True, slots=True)
class Verified:
    folder: Path
    problems: dict[str, str]  # file name -> what is wrong with it
    damaged_ranks: list[int]  # ranks whose data or group info file is damaged
    unrecoverable: list[str]  # what has no intact copy left: "tensor [slice]", or a file
    files: int

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class Recovered:
    path: Path
    sources: tuple[int, ...]  # ranks whose files it was rebuilt from; () when it was intact
    intact: bool
