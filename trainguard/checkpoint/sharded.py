"""Collective saves of a parallel training state (DTensor tensor parallel, FSDP2, plain DP).

`save_sharded(folder, state, step=..., integrated=..., group=...)` is called by every rank of
`group` with the same structure of `state` (e.g. ``{"model": model.state_dict(), "optim":
opt.state_dict()}``). Plain tensors are taken to be replicated on every rank, as DDP keeps them.

- integrated=True: every DTensor is gathered (`full_tensor()`), and rank 0 writes one file of
  whole tensors, loadable in a single process into an unparallelised model.
- integrated=False: each rank writes only its own pieces to ``rank_{r}.safetensors`` and its
  ``rank_{r}.group_info.json``; the manifest (written last, by rank 0, after every rank has
  fsynced its file and reported its sha256) records every tensor's global shape and which
  slice each rank holds. Ranks holding the same slices are replicas of each other.

Failures are decided together: each phase ends with an all-gather of every rank's status, so
a rank that fails to write makes every rank raise, and nothing looks complete. The folder must
be on a filesystem every rank sees; the collectives wait as long as the group's timeout.
Every rank writes every piece it holds, so replicated pieces are stored once per replica: that
redundancy is what lets a lost file be read from, or rebuilt from, a replica.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .. import durable
from . import union
from .codec import flatten_state
from .format import commit_checkpoint, temp_folder, write_shard
from .groupinfo import group_info_file, write_group_info
from .layout import (
    CheckpointLayout,
    Piece,
    Slice,
    TensorLayout,
    check_cover,
    group_pieces,
    is_dtensor,
    local_slice,
    mesh_info,
    replica_groups,
)
from .manifest import new_manifest, rank_file
from .safeheader import dtype_name

log = logging.getLogger("trainguard.checkpoint")

INTEGRATED_FILE = "full.safetensors"


class _Comm:
    """The group's collectives on small int64 vectors; trivial in a single process."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.on else 0
        self.size = dist.get_world_size(group) if self.on else 1
        nccl = self.on and "nccl" in str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def all_gather(self, values: list[int]) -> list[list[int]]:
        if not self.on:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (any length)."""
        if not self.on:
            return [data]
        sizes = [row[0] for row in self.all_gather([len(data)])]
        mine = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [t[:n].cpu().numpy().tobytes() for t, n in zip(out, sizes)]

    def broadcast(self, values: list[int]) -> list[int]:
        if not self.on:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(t, src=src, group=self.group)
        return t.tolist()


@dataclass(slots=True)
class _Local:
    shape: tuple[int, ...]
    box: Slice | None  # None: this rank holds no piece of it
    dtype: str
    placements: tuple[str, ...] | None


class _Taker:
    """The tensor hook of a save: swaps each DTensor for its local piece (or, integrated, the
    whole tensor) and notes its global shape, slice, dtype and placements."""

    def __init__(self, folder: Path, integrated: bool) -> None:
        self.folder, self.integrated = folder, integrated
        self.local: dict[str, _Local] = {}
        self.meshes: list[dict] = []

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        shape, box = local_slice(t, name)
        placements = None
        with torch.no_grad():
            if is_dtensor(t):
                placements = tuple(str(p) for p in t.placements)
                if (info := mesh_info(t.device_mesh)) not in self.meshes:
                    self.meshes.append(info)
                piece = t.full_tensor() if self.integrated else t.to_local()
            else:
                piece = t
        if self.integrated:
            box = Slice.full(shape)
        elif box is not None and tuple(piece.shape) != box.lengths:
            raise CheckpointError(f"cannot save {self.folder}: tensor {name!r} holds {tuple(piece.shape)} locally but "
                                  f"its placements give {box.lengths}")
        self.local[name] = _Local(shape, box, dtype_name(t.dtype), placements)
        return piece

    def digest(self) -> list[int]:
        """Two int64s naming every tensor's name, global shape and dtype, to compare across ranks."""
        h = hashlib.sha256()
        for name in sorted(self.local):
            h.update(f"{name}\0{self.local[name].shape}\0{self.local[name].dtype}\n".encode())
        return np.frombuffer(h.digest()[:16], dtype="<i8").tolist()


def _sha_ints(sha: str) -> list[int]:
    return np.frombuffer(bytes.fromhex(sha), dtype="<i8").tolist()


def _sha_hex(ints: list[int]) -> str:
    return np.asarray(ints, dtype="<i8").tobytes().hex()


def _failed(rows: list[list[int]]) -> list[int]:
    return [r for r, row in enumerate(rows) if not row[0]]


def save_sharded(folder: str | Path, state: Any, *, step: int, epoch: int = 0, integrated: bool = False,
                 append_info: dict | None = None, group: Any = None, partial: bool = False) -> Path:
    """Collective: save `state` to `folder` (replacing it), integrated or sliced. Returns the folder.
    `partial`: the ranks hold different tensors (a pipeline's stages): the checkpoint holds their union, each
    tensor sliced over the ranks that hold it, and the union of their metas (checkpoint/union.py); sliced only."""
    folder, comm = Path(folder), _Comm(group)
    if partial and integrated:
        raise CheckpointError(f"cannot save {folder} integrated: the ranks hold different parts of the model (a "
                              "pipeline's stages), which no one rank can gather; save it sliced (load_checkpoint "
                              "reads a sliced checkpoint whole)")
    take = _Taker(folder, integrated)

    # --- 1. every rank flattens its state; all must hold the same names, shapes and dtypes -----------
    error: CheckpointError | None = None
    try:
        tensors, meta = flatten_state(state, copy=False, tensor_hook=take)
        new_manifest(folder, meta=meta, step=step, epoch=epoch, world_size=comm.size, append_info=append_info)
    except CheckpointError as exc:
        error, tensors, meta = exc, {}, {}
    rows = comm.all_gather([int(error is None), len(take.local), *take.digest()])
    if error is not None:
        raise error
    if bad := _failed(rows):
        raise CheckpointError(f"cannot save {folder}: rank(s) {bad} could not prepare their state; see their logs")
    if partial:
        meta = _union(comm, take, meta, folder)
    elif differ := [r for r, row in enumerate(rows) if row[1:] != rows[0][1:]]:
        raise CheckpointError(f"cannot save {folder}: rank(s) {differ} hold different tensors (names, global shapes "
                              "or dtypes) than rank 0; every rank must save the same structure")

    # --- 2. who holds what ------------------------------------------------------------------------------
    names, local = sorted(take.local), take.local
    if integrated:
        files = (INTEGRATED_FILE,)
        pieces = {n: TensorLayout(local[n].dtype, local[n].shape, (Piece(local[n].box, (0,)),), local[n].placements)
                  for n in names}
    else:
        files = tuple(rank_file(r) for r in range(comm.size))
        pieces = _gather_pieces(comm, names, local, folder)
    groups = tuple(tuple(g) for g in replica_groups(pieces.values(), len(files)))
    layout = CheckpointLayout("integrated" if integrated else "sliced", files, pieces, groups, tuple(take.meshes))

    # --- 3. every rank writes its file into rank 0's temp folder and reports its sha256 ---------------
    tag = _open_temp(comm, folder)
    tmp = temp_folder(folder, tag)
    written, error = [0] * 5, None
    if not integrated or comm.rank == 0:
        path = tmp / files[0 if integrated else comm.rank]
        try:
            sha, size = write_shard(path, {n: t for n, t in tensors.items() if local[n].box is not None})
            if not integrated:
                path = tmp / group_info_file(comm.rank)
                write_group_info(tmp, comm.rank, list(groups[comm.rank]), comm.size)
            written = [size, *_sha_ints(sha)]
        except (CheckpointError, OSError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            error = CheckpointError(f"cannot save {folder}: {path}: {why}")
            log.error("rank %d: %s", comm.rank, error)
    rows = comm.all_gather([int(error is None), *written])
    if bad := _failed(rows):
        if comm.rank == 0:
            durable.remove(tmp)
        raise error or CheckpointError(f"cannot save {folder}: rank(s) {bad} could not write their files; see "
                                       "their logs for the file and the cause")

    # --- 4. rank 0 writes the manifest last and renames the folder into place ------------------------
    if comm.rank == 0:
        entries = {name: {"sha256": _sha_hex(row[2:6]), "bytes": row[1]} for name, row in zip(files, rows)}
        manifest = new_manifest(folder, meta=meta, step=step, epoch=epoch, world_size=comm.size,
                                append_info=append_info, layout=layout)
        try:
            commit_checkpoint(folder, tag, manifest, written=entries)
        except CheckpointError as exc:
            error = exc
    if not comm.broadcast([int(error is None)])[0]:
        raise error or CheckpointError(f"cannot save {folder}: rank 0 could not write the manifest; see its log")
    if comm.rank == 0:
        log.info("saved %s checkpoint %s: step %d, %d tensors, %d file(s)", layout.kind, folder, step, len(names),
                 len(files))
    return folder


def _union(comm: _Comm, take: _Taker, meta: dict, folder: Path) -> dict:
    """Every rank learns the tensors the others hold (noted as ones it holds no piece of) and the union of the
    ranks' metas, which rank 0 writes (collective)."""
    mine = {"names": {n: [list(t.shape), t.dtype, t.placements] for n, t in take.local.items()}, "meta": meta}
    rows = [json.loads(data) for data in comm.all_gather_bytes(json.dumps(mine).encode())]
    seen: dict[str, tuple[int, list]] = {}
    for rank, row in enumerate(rows):
        for name, spec in row["names"].items():
            first = seen.setdefault(name, (rank, spec))
            if first[1][:2] != spec[:2]:
                raise CheckpointError(f"cannot save {folder}: tensor {name!r} is {first[1][1]} {first[1][0]} on rank "
                                      f"{first[0]} but {spec[1]} {spec[0]} on rank {rank}; ranks that hold the same "
                                      "name must hold the same tensor (give each stage's layers the whole model's names)")
    for name, (_, (shape, dtype, placements)) in seen.items():
        if name not in take.local:
            take.local[name] = _Local(tuple(shape), None, dtype, None if placements is None else tuple(placements))
    return union.merge([row["meta"] for row in rows], str(folder))


def _open_temp(comm: _Comm, folder: Path) -> str:
    """Rank 0 creates the temp folder; every rank gets its tag."""
    tag = [0, 0]
    if comm.rank == 0:
        tag = [os.getpid(), secrets.randbits(31)]
        try:
            temp_folder(folder, f"{tag[0]}-{tag[1]:x}").mkdir(parents=True)
        except OSError as exc:
            log.error("cannot create the temp folder for %s: %s", folder, exc)
            tag = [-1, 0]
    tag = comm.broadcast(tag)
    if tag[0] < 0:
        raise CheckpointError(f"cannot save {folder}: rank 0 could not create a temp folder next to it; check that "
                              "the directory is writable (and, across hosts, shared)")
    return f"{tag[0]}-{tag[1]:x}"


def _gather_pieces(comm: _Comm, names: list[str], local: dict[str, _Local], folder: Path) -> dict[str, TensorLayout]:
    """All-gather every rank's (offsets, lengths) of every tensor and group equal slices into pieces."""
    flat: list[int] = []
    for n in names:
        box, ndim = local[n].box, len(local[n].shape)
        flat += [0] * (1 + 2 * ndim) if box is None else [1, *box.offsets, *box.lengths]
    rows = comm.all_gather(flat) if flat else [[] for _ in range(comm.size)]
    layouts, at = {}, 0
    for n in names:
        ndim = len(local[n].shape)
        boxes = [Slice(tuple(row[at + 1:at + 1 + ndim]), tuple(row[at + 1 + ndim:at + 1 + 2 * ndim]))
                 if row[at] else None for row in rows]
        at += 1 + 2 * ndim
        pieces = group_pieces(boxes)
        try:
            check_cover(local[n].shape, pieces)
        except ValueError as exc:
            raise CheckpointError(f"cannot save {folder}: tensor {n!r}: {exc}; save with a group that holds every "
                                  "rank of its mesh") from None
        layouts[n] = TensorLayout(local[n].dtype, local[n].shape, pieces, local[n].placements)
    return layouts
