"""Any checkpoint folder, whatever its kind: open it, verify it, recover a rank's file from its
replicas, and read a rank's group info.

What differs between the three kinds of manifest.py is dispatched here once, through `FORMATS`;
each kind implements it where it is written: version 1 and 2 in pieces.py, version 3 (a training
job's) in jobsave.py. Nothing else chooses by kind.

- `open_checkpoint(path)`: a `PieceReader` over the checkpoint's tensors (reshard.py loads through
  it). A version-1 checkpoint with one file, or a job's (rank 0's file, or a replica of it), reads
  as if that file held whole tensors.
- `verify_checkpoint(path)`: hash and check every file; say which damaged data still has an intact
  replica.
- `recover_rank(folder, rank)`: rebuild a missing or corrupt rank file from its replicas, kept only
  if its sha256 matches the manifest; an intact file is left as it is.
- `restore_group_info_list(path, rank)`: MindSpore's, the ranks holding the same slices as `rank`
  (groupinfo.py); a damaged group info file is answered from the manifest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError
from . import jobsave, pieces
from .groupinfo import group_info_file, read_group_info
from .manifest import MANIFEST, Kind, Manifest, Recovered, Verified, read
from .pieces import PieceReader, checkpoint_folder
from .safeheader import CorruptFile

log = logging.getLogger("trainguard.checkpoint")


@dataclass(frozen=True, slots=True)
class Format:
    """What one kind of checkpoint implements."""

    open: Callable[..., PieceReader]  # (manifest, *, prefer, avoid)
    verify: Callable[[Manifest], Verified]
    recover: Callable[[Manifest, int], Recovered]


FORMATS: dict[Kind, Format] = {
    Kind.SINGLE: Format(pieces.open_single, pieces.verify_single, pieces.recover_single),
    Kind.LAYOUT: Format(pieces.open_layout, pieces.verify_layout, pieces.recover_layout),
    Kind.JOB: Format(jobsave.open_job, jobsave.verify_job, jobsave.recover_job),
}


def open_checkpoint(path: str | Path, *, prefer: int = 0, avoid: frozenset[int] = frozenset()) -> PieceReader:
    """A reader for the checkpoint at `path` (the folder, its manifest, or one of its files)."""
    manifest = read(checkpoint_folder(path))
    return FORMATS[manifest.kind].open(manifest, prefer=prefer, avoid=avoid)


def verify_checkpoint(path: str | Path) -> Verified:
    """Hash and check every file of a checkpoint against its manifest, and say which damaged
    data still has an intact replica."""
    manifest = read(checkpoint_folder(path))
    return FORMATS[manifest.kind].verify(manifest)


def recover_rank(folder: str | Path, rank: int) -> Recovered:
    """Rebuild rank `rank`'s file from its replicas, verified against the manifest's sha256 (and,
    in a sliced checkpoint, restore its group info file). An intact file is left as it is."""
    manifest = read(checkpoint_folder(folder))
    return FORMATS[manifest.kind].recover(manifest, rank)


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
        return read_group_info(path, rank)
    except CorruptFile as exc:
        if rank is None or not (folder / MANIFEST).exists():
            raise
        ranks = read(folder).group_info(rank)
        log.warning("%s; using the manifest's group info instead", exc)
        return ranks
