"""Reading tensor pieces out of a checkpoint's rank files, falling back to replicas.

`open_checkpoint(folder)` reads and checks the manifest and returns a `PieceReader`. It opens
a rank file only when a piece it holds is needed, verifies its sha256, and checks every tensor
against the manifest's layout. A file that is missing or corrupt is skipped with a logged
warning, and the piece is read from another rank that holds an identical copy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import CheckpointCorrupt, CheckpointError
from .format import MANIFEST, manifest_layout, read_manifest, read_shard
from .safeheader import DTYPES, dtype_name, problem
from .layout import CheckpointLayout, Piece, Slice, TensorLayout

log = logging.getLogger("trainguard.checkpoint")


def checkpoint_folder(path: str | Path) -> Path:
    """A checkpoint folder given as itself, its manifest, or one of its files."""
    path = Path(path)
    if path.is_file() and (path.parent / MANIFEST).exists():
        return path.parent
    return path


class PieceReader:
    def __init__(self, folder: Path, manifest: dict, layout: CheckpointLayout, *, prefer: int = 0,
                 avoid: frozenset[int] = frozenset()) -> None:
        self.folder, self.manifest, self.layout = folder, manifest, layout
        self.prefer = prefer
        self.avoid = set(avoid)  # ranks whose files must not be used (being rebuilt)
        self.files: dict[int, dict[str, torch.Tensor]] = {}
        self.bad: dict[int, CheckpointCorrupt] = {}
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
                tensors = read_shard(self.folder / name, self.manifest["files"][name])
                self._check(rank, tensors)
            except CheckpointCorrupt as exc:
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
                raise CheckpointCorrupt(f"{path}: tensor {name!r} is missing but the manifest says this file holds "
                                        f"{piece.slice} of it; fall back to an earlier checkpoint")
            if tuple(t.shape) != piece.slice.lengths or t.dtype != DTYPES[spec.dtype][0]:
                raise CheckpointCorrupt(f"{path}: tensor {name!r} is {dtype_name(t.dtype)} {list(t.shape)}, the "
                                        f"manifest says {spec.dtype} {list(piece.slice.lengths)}; fall back to an "
                                        "earlier checkpoint")

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
            except CheckpointCorrupt as exc:
                if rank not in self._warned:
                    self._warned.add(rank)
                    log.warning("%s; reading its slices from replicas instead", problem(exc))
                errors.append(str(exc))
                continue
            self.used.add(rank)
            return t
        holders = ", ".join(self.layout.rank_files[r] for r in piece.ranks)
        raise CheckpointCorrupt(f"{self.folder}: no intact copy of tensor {name!r} {piece.slice} (held by {holders}): "
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




def open_checkpoint(path: str | Path, *, prefer: int = 0, avoid: frozenset[int] = frozenset()) -> PieceReader:
    """A reader for the checkpoint at `path`. A version-1 checkpoint with one file, or a training
    job's checkpoint (rank 0's file), reads as if that file held whole tensors."""
    folder = checkpoint_folder(path)
    manifest = read_manifest(folder)
    layout = manifest_layout(manifest)
    if layout is not None:
        return PieceReader(folder, manifest, layout, prefer=prefer, avoid=avoid)
    if "ranks" in manifest:  # a training job's checkpoint: rank 0's data-parallel state, or a replica of it
        from .jobsave import read_rank_file

        tensors = read_rank_file(folder, manifest, manifest["ranks"]["0"]["file"], repair=False)[0]
        return _single(folder, manifest, manifest["ranks"]["0"]["file"], tensors)
    if len(manifest["files"]) != 1:
        raise CheckpointError(f"{folder / MANIFEST}: a version-1 checkpoint with {len(manifest['files'])} files has "
                              "no layout saying how they fit together; read it with trainguard.checkpoint.format")
    (name, entry), = manifest["files"].items()
    return _single(folder, manifest, name, read_shard(folder / name, entry))


def _single(folder: Path, manifest: dict, name: str, tensors: dict) -> PieceReader:
    specs = {k: TensorLayout(dtype_name(t.dtype), tuple(t.shape), (Piece(Slice.full(t.shape), (0,)),))
             for k, t in tensors.items()}
    reader = PieceReader(folder, manifest, CheckpointLayout("integrated", (name,), specs, ((0,),)))
    reader.files[0] = tensors
    return reader
