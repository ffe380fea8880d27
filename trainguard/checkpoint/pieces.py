"""Reading tensor pieces out of a checkpoint's rank files, falling back to replicas; the formats
described by a layout (version 2) or by their files alone (version 1).

A `PieceReader` opens a rank file only when a piece it holds is needed, verifies its sha256, and
checks every tensor against the manifest's layout. A file that is missing or corrupt is skipped
with a logged warning, and the piece is read from another rank that holds an identical copy. A
version-1 checkpoint with one file reads as if that file held whole tensors (`single_reader`).

Version 2 and 1 each implement open, verify and recover here (`open_layout`, `verify_layout`,
`recover_layout`; `open_single`, `verify_single`, `recover_single`); replicas.py dispatches to them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import CheckpointError
from .. import durable
from .format import read_shard, write_shard
from .groupinfo import group_info_file, read_group_info, write_group_info
from .layout import CheckpointLayout, Piece, Slice, TensorLayout
from .manifest import MANIFEST, Manifest, Recovered, Verified
from .safeheader import DTYPES, CorruptFile, corrupt, dtype_name

log = logging.getLogger("trainguard.checkpoint")


def checkpoint_folder(path: str | Path) -> Path:
    """A checkpoint folder given as itself, its manifest, or one of its files."""
    path = Path(path)
    if path.is_file() and (path.parent / MANIFEST).exists():
        return path.parent
    return path


class PieceReader:
    def __init__(self, manifest: Manifest, layout: CheckpointLayout, *, prefer: int = 0,
                 avoid: frozenset[int] = frozenset()) -> None:
        self.folder, self.manifest, self.layout = manifest.folder, manifest, layout
        self.prefer = prefer
        self.avoid = set(avoid)  # ranks whose files must not be used (being rebuilt)
        self.files: dict[int, dict[str, torch.Tensor]] = {}
        self.bad: dict[int, CorruptFile] = {}
        self.used: set[int] = set()
        self._warned: set[int] = set()

    @property
    def n_ranks(self) -> int:
        return len(self.layout.rank_files)

    def path(self, rank: int) -> Path:
        return self.folder / self.layout.rank_files[rank]

    def open_rank(self, rank: int) -> dict[str, torch.Tensor]:
        if rank in self.bad:
            raise self.bad[rank]
        if rank not in self.files:
            name = self.layout.rank_files[rank]
            try:
                tensors = read_shard(self.folder / name, self.manifest.files[name])
                self._check(rank, tensors)
            except CorruptFile as exc:
                self.bad[rank] = exc
                raise
            self.files[rank] = tensors
        return self.files[rank]

    def _check(self, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        path = self.path(rank)
        for name, spec in self.layout.tensors.items():
            piece = spec.piece_of(rank)
            if piece is None:
                continue
            t = tensors.get(name)
            if t is None:
                raise corrupt(path, f"tensor {name!r} is missing but the manifest says this file holds "
                              f"{piece.slice} of it")
            if tuple(t.shape) != piece.slice.lengths or t.dtype != DTYPES[spec.dtype][0]:
                raise corrupt(path, f"tensor {name!r} is {dtype_name(t.dtype)} {list(t.shape)}, the manifest says "
                              f"{spec.dtype} {list(piece.slice.lengths)}")

    def candidates(self, piece: Piece) -> list[int]:
        """Holders of `piece` to try, best first: files already open, then by distance from `prefer`."""
        ranks = [r for r in piece.ranks if r not in self.avoid]
        return sorted(ranks, key=lambda r: (r not in self.files, (r - self.prefer) % self.n_ranks))

    def read_piece(self, name: str, piece: Piece) -> torch.Tensor:
        """The whole of one piece, from the first of its holders whose file is intact."""
        errors = []
        for rank in self.candidates(piece):
            try:
                t = self.open_rank(rank)[name]
            except CorruptFile as exc:
                if rank not in self._warned:
                    self._warned.add(rank)
                    log.warning("%s; reading its slices from replicas instead", exc.problem)
                errors.append(exc.problem)
                continue
            self.used.add(rank)
            return t
        holders = ", ".join(self.layout.rank_files[r] for r in piece.ranks)
        raise corrupt(self.folder, f"no intact copy of tensor {name!r} {piece.slice} (held by {holders}): "
                      + " | ".join(errors or ["its only holders are being rebuilt"]))

    def assemble(self, name: str, box: Slice) -> torch.Tensor:
        """The slice `box` of tensor `name`, put together from whichever pieces overlap it."""
        spec: TensorLayout = self.layout.tensors[name]
        # read (and so check against the files) before allocating: a hostile manifest cannot make
        # `out` larger than the pieces the files really hold
        parts = [(common, self.read_piece(name, piece), piece) for piece, common in spec.overlapping(box)]
        out = torch.empty(box.lengths, dtype=DTYPES[spec.dtype][0])
        for common, data, piece in parts:
            out[common.within(box)] = data[common.within(piece.slice)]
        return out


# --- version 1: files of whole tensors -------------------------------------------------------------


def single_reader(manifest: Manifest, name: str, tensors: dict) -> PieceReader:
    """A reader of one file's `tensors`, whole, as if a layout said so."""
    specs = {k: TensorLayout(dtype_name(t.dtype), tuple(t.shape), (Piece(Slice.full(t.shape), (0,)),))
             for k, t in tensors.items()}
    reader = PieceReader(manifest, CheckpointLayout("integrated", (name,), specs, ((0,),)))
    reader.files[0] = tensors
    return reader


def open_single(manifest: Manifest, *, prefer: int = 0, avoid: frozenset[int] = frozenset()) -> PieceReader:
    if len(manifest.files) != 1:
        raise CheckpointError(f"{manifest.path}: a version-1 checkpoint with {len(manifest.files)} files has no "
                              "layout saying how they fit together; read it with trainguard.checkpoint.format")
    (name, entry), = manifest.files.items()
    return single_reader(manifest, name, read_shard(manifest.folder / name, entry))


def verify_single(m: Manifest) -> Verified:
    """Hash and check every file; a damaged one has no replica to recover it from."""
    problems = {}
    for name, entry in m.files.items():
        try:
            read_shard(m.folder / name, entry)
        except CorruptFile as exc:
            problems[name] = exc.reason
    return Verified(m.folder, problems, [], sorted(problems), len(m.files))


def recover_single(manifest: Manifest, rank: int) -> Recovered:
    raise CheckpointError(f"{manifest.folder}: is a version-1 checkpoint; only sliced and job checkpoints have "
                          "per-rank files with replicas to rebuild from")


# --- version 2: a parallel layout ----------------------------------------------------------------


def open_layout(manifest: Manifest, *, prefer: int = 0, avoid: frozenset[int] = frozenset()) -> PieceReader:
    return PieceReader(manifest, manifest.layout, prefer=prefer, avoid=avoid)


def verify_layout(manifest: Manifest) -> Verified:
    """Hash and check every rank file (and group info file) against the manifest and layout, and
    say which damaged slices still have an intact replica."""
    reader = open_layout(manifest)
    problems, damaged = {}, set()
    for rank, name in enumerate(reader.layout.rank_files):
        try:
            reader.open_rank(rank)
        except CorruptFile as exc:
            problems[name] = exc.reason
            damaged.add(rank)
    if reader.layout.kind == "sliced":
        for rank in range(reader.n_ranks):
            try:
                read_group_info(reader.folder / group_info_file(rank), rank)
            except CorruptFile as exc:
                problems[group_info_file(rank)] = exc.reason
                damaged.add(rank)
    lost = [f"{name} {piece.slice}" for name, spec in reader.layout.tensors.items() for piece in spec.pieces
            if all(r in reader.bad for r in piece.ranks)]
    return Verified(reader.folder, problems, sorted(damaged), lost, len(reader.layout.rank_files))


def recover_layout(manifest: Manifest, rank: int) -> Recovered:
    """Rebuild rank `rank`'s file of a sliced checkpoint from its replicas, verified against the
    manifest's sha256, and restore its group info file. An intact file is left as it is."""
    reader = open_layout(manifest, prefer=rank, avoid=frozenset({rank}))
    folder, layout = reader.folder, reader.layout
    if layout.kind != "sliced":
        raise CheckpointError(f"{folder}: is an {layout.kind} checkpoint; only sliced ones have per-rank files "
                              "with replicas to rebuild from")
    if not 0 <= rank < reader.n_ranks:
        raise CheckpointError(f"{folder}: has ranks 0..{reader.n_ranks - 1}; there is no rank {rank}")
    name = layout.rank_files[rank]
    path, entry = folder / name, manifest.files[name]
    try:
        read_shard(path, entry)
        intact = True
    except CorruptFile as exc:
        log.warning("%s; rebuilding it from its replicas", exc.problem)
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
    with durable.replacing(path, fsync=False) as tmp:  # write_shard fsyncs
        sha, size = write_shard(tmp, tensors)
        if (sha, size) != (entry.sha256, entry.bytes):
            sources = ", ".join(layout.rank_files[r] for r in sorted(reader.used))
            raise corrupt(path, f"rebuilt it from {sources}, but the result ({size} bytes, sha256 {sha[:16]}…) differs "
                          f"from the manifest's ({entry.bytes} bytes, {entry.sha256[:16]}…): the replicas are not "
                          f"bit-identical to what rank {rank} wrote")
    _restore_group_info(folder, rank, layout)
    log.info("rebuilt %s from %s; its sha256 matches the manifest", path,
             ", ".join(layout.rank_files[r] for r in sorted(reader.used)))
    return Recovered(path, tuple(sorted(reader.used)), False)


def _restore_group_info(folder: Path, rank: int, layout: CheckpointLayout) -> None:
    expected = list(layout.group_info[rank])
    try:
        if read_group_info(folder / group_info_file(rank), rank) == expected:
            return
    except CorruptFile as exc:
        log.warning("%s; rewriting it from the manifest", exc)
    write_group_info(folder, rank, expected, len(layout.rank_files))
