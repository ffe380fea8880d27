"""Group info: which ranks hold identical slices, and rebuilding a lost rank file from them.

As in MindSpore, each rank of a sliced save writes its group info next to its file
(``rank_{r}.group_info.json``), and `restore_group_info_list` reads it back: with dp=2 x tp=4
on ``DeviceMesh(arange(8).view(2, 4))`` rank 0 gets [0, 4]. Pure data parallel makes every
rank a replica of every other; pure model parallel leaves each rank alone. The manifest holds
the same lists for every rank (layout "group_info") and is the authority when the two differ.

`recover_rank(folder, rank)` rebuilds a missing or corrupt ``rank_{r}.safetensors`` from the
ranks that hold identical pieces, and keeps it only if its sha256 matches the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointCorrupt, CheckpointError
from .format import _fsync_dir, _write_json, read_shard, write_shard
from .format import read_manifest
from .pieces import checkpoint_folder, open_checkpoint
from .safeheader import problem

log = logging.getLogger("trainguard.checkpoint")

GROUP_INFO_KIND = "trainguard-group-info"


def group_info_file(rank: int) -> str:
    return f"rank_{rank}.group_info.json"


def write_group_info(folder: Path, rank: int, ranks: list[int], world_size: int) -> Path:
    path = Path(folder) / group_info_file(rank)
    _write_json(path, {"kind": GROUP_INFO_KIND, "version": 1, "rank": rank, "world_size": world_size,
                       "group_info": sorted(ranks)})
    return path


def restore_group_info_list(path: str | Path, rank: int | None = None) -> list[int]:
    """The ranks whose slices are identical to this rank's, itself included, e.g. [0, 4].

    `path` is a group info file, or a checkpoint folder together with `rank`. A missing or
    damaged file is answered from the folder's manifest, with a warning."""
    path = Path(path)
    if path.is_dir():
        if rank is None:
            raise CheckpointError(f"{path} is a checkpoint folder: pass rank= to say whose group info to read")
        folder, path = path, path / group_info_file(rank)
    else:
        folder = path.parent
    try:
        return _parse(path, rank)
    except CheckpointCorrupt as exc:
        if rank is None or not (folder / "manifest.json").exists():
            raise
        reader = open_checkpoint(folder)
        if rank >= len(reader.layout.group_info):
            raise CheckpointError(f"{folder}: rank {rank} is outside the checkpoint's "
                                  f"{len(reader.layout.group_info)} ranks") from None
        log.warning("%s; using the manifest's group info instead", exc)
        return list(reader.layout.group_info[rank])


def _parse(path: Path, rank: int | None) -> list[int]:
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path}: is missing; recreate it with `trainguard ckpt recover`") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"{path}: is not a readable JSON group info file ({exc})") from None
    ranks = obj.get("group_info") if isinstance(obj, dict) else None
    own = obj.get("rank") if isinstance(obj, dict) else None
    if (obj.get("kind") if isinstance(obj, dict) else None) != GROUP_INFO_KIND or type(own) is not int \
            or not isinstance(ranks, list) or not all(type(r) is int and r >= 0 for r in ranks) or own not in ranks:
        raise CheckpointCorrupt(f"{path}: is not a trainguard group info file (needs 'kind', 'rank' and a "
                                "'group_info' list of ranks that includes it)")
    if rank is not None and own != rank:
        raise CheckpointCorrupt(f"{path}: holds the group info of rank {own}, not rank {rank}")
    return sorted(ranks)


def _is_job(path: str | Path) -> bool:
    """A training job's checkpoint (format 3: one file per rank and every rank's state)."""
    return "ranks" in read_manifest(checkpoint_folder(path))


# --- recovery ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Recovered:
    path: Path
    sources: tuple[int, ...]  # ranks whose files it was rebuilt from; () when it was intact
    intact: bool


def recover_rank(folder: str | Path, rank: int) -> Recovered:
    """Rebuild rank `rank`'s file of a sliced checkpoint from its replicas, verified against the
    manifest's sha256, and restore its group info file. An intact file is left as it is.
    A training job's checkpoint (format 3) copies a bit-identical replica (jobsave.py)."""
    if _is_job(folder):
        from .jobsave import recover_job_rank

        return recover_job_rank(checkpoint_folder(folder), rank)
    reader = open_checkpoint(folder, prefer=rank, avoid=frozenset({rank}))
    folder, layout, manifest = reader.folder, reader.layout, reader.manifest
    if layout.kind != "sliced":
        raise CheckpointError(f"{folder}: is an {layout.kind} checkpoint; only sliced ones have per-rank files "
                              "with replicas to rebuild from")
    if not 0 <= rank < reader.n_ranks:
        raise CheckpointError(f"{folder}: has ranks 0..{reader.n_ranks - 1}; there is no rank {rank}")
    name = layout.rank_files[rank]
    path, entry = folder / name, manifest["files"][name]
    try:
        read_shard(path, entry)
        intact = True
    except CheckpointCorrupt as exc:
        log.warning("%s; rebuilding it from its replicas", problem(exc))
        intact = False
    if intact:
        _restore_group_info(folder, rank, layout)
        return Recovered(path, (), True)

    tensors = {}
    for tname, spec in layout.tensors.items():
        piece = spec.piece_of(rank)
        if piece is None:
            continue
        if len(piece.ranks) == 1:
            raise CheckpointError(f"{path}: rank {rank} alone holds tensor {tname!r} {piece.slice}, so no replica can "
                                  "rebuild it; fall back to an earlier checkpoint")
        tensors[tname] = reader.read_piece(tname, piece)
    tmp = folder / f".{name}.recover-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        sha, size = write_shard(tmp, tensors)
        if (sha, size) != (entry["sha256"].lower(), entry["bytes"]):
            sources = ", ".join(layout.rank_files[r] for r in sorted(reader.used))
            raise CheckpointCorrupt(f"{path}: rebuilt it from {sources}, but the result ({size} bytes, sha256 "
                                    f"{sha[:16]}…) differs from the manifest's ({entry['bytes']} bytes, "
                                    f"{entry['sha256'][:16]}…): the replicas are not bit-identical to what rank "
                                    f"{rank} wrote; fall back to an earlier checkpoint")
        os.replace(tmp, path)
        _fsync_dir(folder)
    finally:
        if tmp.exists():
            tmp.unlink()
    _restore_group_info(folder, rank, layout)
    log.info("rebuilt %s from %s; its sha256 matches the manifest", path,
             ", ".join(layout.rank_files[r] for r in sorted(reader.used)))
    return Recovered(path, tuple(sorted(reader.used)), False)


def _restore_group_info(folder: Path, rank: int, layout) -> None:
    expected = list(layout.group_info[rank])
    try:
        if _parse(folder / group_info_file(rank), rank) == expected:
            return
    except CheckpointCorrupt as exc:
        log.warning("%s; rewriting it from the manifest", exc)
    write_group_info(folder, rank, expected, len(layout.rank_files))


# --- verification ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verified:
    folder: Path
    problems: dict[str, str]  # file name -> what is wrong with it
    damaged_ranks: list[int]  # ranks whose data or group info file is damaged
    unrecoverable: list[str]  # "tensor [slice]" with no intact copy left
    files: int

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | Path) -> Verified:
    """Hash and check every file of a checkpoint against its manifest and layout, and say which
    damaged slices still have an intact replica."""
    if _is_job(path):
        from .jobsave import verify_job

        return verify_job(checkpoint_folder(path))
    reader = open_checkpoint(path)
    problems, damaged = {}, set()
    for rank, name in enumerate(reader.layout.rank_files):
        try:
            reader.open_rank(rank)
        except CheckpointCorrupt as exc:
            problems[name] = problem(exc).removeprefix(f"{reader.path(rank)}: ")
            damaged.add(rank)
    if reader.layout.kind == "sliced":
        for rank in range(reader.n_ranks):
            try:
                _parse(reader.folder / group_info_file(rank), rank)
            except CheckpointCorrupt as exc:
                problems[group_info_file(rank)] = str(exc).removeprefix(f"{reader.folder / group_info_file(rank)}: ")
                damaged.add(rank)
    lost = [f"{name} {piece.slice}" for name, spec in reader.layout.tensors.items() for piece in spec.pieces
            if all(r in reader.bad for r in piece.ranks)]
    return Verified(reader.folder, problems, sorted(damaged), lost, len(reader.layout.rank_files))
