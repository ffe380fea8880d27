"""Where each piece of a tensor lives: global shapes, per-rank slices and replicas.

A sliced checkpoint stores, for every tensor, its global shape and its *pieces*: the
distinct slices (offsets and lengths per dim) that ranks hold, each with the ranks that hold
it. Ranks that hold the same slice of every tensor are replicas of each other (MindSpore's
group info): with dp=2 x tp=4 on ``DeviceMesh(arange(8).view(2, 4))``, ranks 0 and 4 are.

Everything here is pure arithmetic on plain data, except `local_slice`, which asks a DTensor
for the piece this rank holds through DTensor's own `compute_local_shape_and_global_offset`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from ..errors import CheckpointError
from .safeheader import MAX_DIM

KINDS = ("sliced", "integrated")


@dataclass(frozen=True, slots=True)
class Slice:
    """A box in a tensor: ``offsets[d] <= i < offsets[d] + lengths[d]`` in every dim d."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Slice:
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def numel(self) -> int:
        n = 1
        for length in self.lengths:
            n *= length
        return n

    def intersect(self, other: Slice) -> Slice | None:
        """The common box, or None when it holds no element."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + m, b + n) for a, m, b, n in zip(self.offsets, self.lengths, other.offsets, other.lengths))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Slice(lo, tuple(h - low for low, h in zip(lo, hi)))

    def within(self, outer: Slice) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds `outer`."""
        return tuple(slice(o - p, o - p + n) for o, n, p in zip(self.offsets, self.lengths, outer.offsets))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"


@dataclass(frozen=True, slots=True)
class Piece:
    """One distinct slice of a tensor and the ranks that hold a copy of it."""

    slice: Slice
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    dtype: str  # safetensors' dtype name, e.g. "F32"
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    placements: tuple[str, ...] | None = None  # as the saving DTensor named them; None for a plain tensor

    def piece_of(self, rank: int) -> Piece | None:
        return next((p for p in self.pieces if rank in p.ranks), None)

    def overlapping(self, box: Slice) -> list[tuple[Piece, Slice]]:
        """The pieces that hold part of `box`, each with the part it holds."""
        return [(p, common) for p in self.pieces if (common := p.slice.intersect(box)) is not None]


# --- grouping and checking ----------------------------------------------------------------


def group_pieces(per_rank: Sequence[Slice | None]) -> tuple[Piece, ...]:
    """Group ranks by the slice they hold (None: the rank holds none), in order of first holder."""
    holders: dict[Slice, list[int]] = {}
    for rank, box in enumerate(per_rank):
        if box is not None:
            holders.setdefault(box, []).append(rank)
    return tuple(Piece(box, tuple(ranks)) for box, ranks in holders.items())


def check_cover(shape: Sequence[int], pieces: Sequence[Piece]) -> None:
    """Raise ValueError unless the pieces lie inside `shape` and tile it exactly.

    Shard and Replicate placements always cut a tensor into a grid: along each dim, the pieces'
    intervals partition the dim. Checking that, and that every cell of the grid is held once,
    takes O(P log P) for P pieces (a pairwise overlap test would not scale to large meshes)."""
    for p in pieces:
        if len(p.slice.offsets) != len(shape) or len(p.slice.lengths) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(p.slice.offsets, p.slice.lengths, shape)):
            raise ValueError(f"piece {p.slice} held by ranks {list(p.ranks)[:8]} is outside the shape {list(shape)}")
    held = [p.slice for p in pieces if p.slice.numel > 0]
    if Slice.full(shape).numel == 0:
        return
    cells = 1
    for d, size in enumerate(shape):
        cuts = sorted({(b.offsets[d], b.lengths[d]) for b in held})
        end = 0
        for o, n in cuts:
            if o != end:
                raise ValueError(f"along dim {d} the pieces {'overlap' if o < end else 'leave a gap'} at {o} "
                                 f"(the previous piece ends at {end})")
            end = o + n
        if end != size:
            raise ValueError(f"along dim {d} the pieces cover [0:{end}] of [0:{size}]")
        cells *= len(cuts)
    if len(held) != len(set(held)) or len(held) != cells:
        raise ValueError(f"{len(held)} pieces (distinct: {len(set(held))}) do not fill the {cells} cells of their grid "
                         "exactly once: some overlap or are missing")


def replica_groups(layouts: Iterable[TensorLayout], world_size: int) -> list[list[int]]:
    """For each rank, the ranks holding the same slice of every tensor as it does (itself included)."""
    signature: list[list[Any]] = [[] for _ in range(world_size)]
    for layout in layouts:
        for rank in range(world_size):
            piece = layout.piece_of(rank)
            signature[rank].append(None if piece is None else piece.slice)
    groups: dict[tuple, list[int]] = {}
    for rank, sig in enumerate(signature):
        groups.setdefault(tuple(sig), []).append(rank)
    return [groups[tuple(sig)] for sig in signature]


# --- slices from placements ------------------------------------------------------------------


def check_placements(placements: Sequence[Any], name: str) -> None:
    """Only Shard (even or uneven) and Replicate give one contiguous box per rank."""
    from torch.distributed.tensor import Replicate, Shard

    for p in placements:
        if type(p) not in (Shard, Replicate):
            raise CheckpointError(f"cannot checkpoint tensor {name!r} with placement {p}: only Shard and Replicate "
                                  "are supported; redistribute it (e.g. Partial -> Replicate) before saving")


def mesh_slices(global_shape: Sequence[int], mesh_ranks: Any, placements: Sequence[Any]) -> dict[int, Slice]:
    """The slice every rank of a mesh holds (pure: no process group needed).

    `mesh_ranks` is the mesh's nested list (or tensor) of ranks, e.g. ``arange(8).view(2, 4)``."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    ranks = torch.as_tensor(mesh_ranks)
    check_placements(placements, "<pure>")
    out = {}
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        lengths, offsets = _compute_local_shape_and_global_offset(
            list(global_shape), list(ranks.shape), list(coord), list(placements))
        out[int(ranks[coord])] = Slice(tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))
    return out


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_slice(t: torch.Tensor, name: str) -> tuple[tuple[int, ...], Slice | None]:
    """(global shape, the slice this rank holds) of a DTensor or a plain (whole) tensor.
    The slice is None when this rank is not in the DTensor's mesh."""
    if not is_dtensor(t):
        return tuple(t.shape), Slice.full(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    check_placements(t.placements, name)
    shape = tuple(int(s) for s in t.shape)
    if t.device_mesh.get_coordinate() is None:
        return shape, None
    lengths, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return shape, Slice(tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))


def mesh_info(mesh: Any) -> dict:
    """A JSON description of a DeviceMesh as seen from this rank (its root mesh where known)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return {"shape": list(root.mesh.shape), "dim_names": list(root.mesh_dim_names or ()),
            "ranks": root.mesh.tolist(), "sub_dims": list(mesh.mesh_dim_names or ())}


# --- the manifest's "layout" field -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """What a version-2 manifest records under "layout".

    kind: "sliced" (each rank wrote its own slices to ``rank_files[rank]``) or "integrated"
    (one file of whole tensors, ``rank_files == ("full.safetensors",)``).
    tensors: name -> TensorLayout; piece ranks index `rank_files`.
    group_info[r]: the ranks holding the same slices as rank r (see `replica_groups`).
    meshes: the DeviceMeshes seen by the saving rank, for people (loads do not need them)."""

    kind: str
    rank_files: tuple[str, ...]
    tensors: dict[str, TensorLayout]
    group_info: tuple[tuple[int, ...], ...]
    meshes: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        return {"kind": self.kind, "rank_files": list(self.rank_files),
                "group_info": [list(g) for g in self.group_info], "meshes": list(self.meshes),
                "tensors": {name: {"dtype": t.dtype, "shape": list(t.shape),
                                   "placements": None if t.placements is None else list(t.placements),
                                   "pieces": [{"offsets": list(p.slice.offsets), "lengths": list(p.slice.lengths),
                                               "ranks": list(p.ranks)} for p in t.pieces]}
                            for name, t in self.tensors.items()}}

    @classmethod
    def from_json(cls, obj: Any) -> CheckpointLayout:
        """Parse and check a manifest's layout; raises ValueError saying what is wrong."""
        _need(isinstance(obj, dict), "'layout' is not an object")
        _need(obj.get("kind") in KINDS, f"layout kind {str(obj.get('kind'))[:40]!r} is not one of {KINDS}")
        files = obj.get("rank_files")
        _need(isinstance(files, list) and files and all(isinstance(f, str) for f in files)
              and len(set(files)) == len(files), "layout 'rank_files' must be a non-empty list of distinct names")
        n = len(files)
        tensors_json = obj.get("tensors")
        _need(isinstance(tensors_json, dict), "layout 'tensors' is not an object")
        tensors = {name: _tensor_from_json(name, spec, n) for name, spec in tensors_json.items()}
        groups = obj.get("group_info")
        _need(isinstance(groups, list) and len(groups) == n and all(_int_list(g) for g in groups),
              f"layout 'group_info' must list {n} lists of ranks")
        expected = replica_groups(tensors.values(), n)
        _need([list(g) for g in groups] == expected,
              f"layout 'group_info' {groups} does not match its tensors' pieces, which give {expected}")
        meshes = obj.get("meshes", [])
        _need(isinstance(meshes, list) and all(isinstance(m, dict) for m in meshes), "layout 'meshes' is not a list")
        return cls(obj["kind"], tuple(files), tensors, tuple(tuple(g) for g in groups), tuple(meshes))


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)


def _int_list(x: Any, low: int = 0) -> bool:
    return isinstance(x, list) and all(type(v) is int and v >= low for v in x)


def _tensor_from_json(name: str, spec: Any, n_ranks: int) -> TensorLayout:
    _need(isinstance(name, str) and name != "__metadata__", f"tensor name {str(name)[:80]!r} is reserved")
    _need(isinstance(spec, dict), f"tensor {name!r}: entry is not an object")
    shape, pieces_json, placements = spec.get("shape"), spec.get("pieces"), spec.get("placements")
    _need(isinstance(spec.get("dtype"), str), f"tensor {name!r}: 'dtype' is not a string")
    _need(_int_list(shape) and all(s < MAX_DIM for s in shape),
          f"tensor {name!r}: 'shape' {str(shape)[:80]} is not a list of sizes below {MAX_DIM}")
    _need(placements is None or (isinstance(placements, list) and all(isinstance(p, str) for p in placements)),
          f"tensor {name!r}: 'placements' is not a list of strings")
    _need(isinstance(pieces_json, list) and pieces_json, f"tensor {name!r}: 'pieces' is not a non-empty list")
    pieces, seen = [], set()
    for p in pieces_json:
        _need(isinstance(p, dict) and _int_list(p.get("offsets")) and _int_list(p.get("lengths"))
              and _int_list(p.get("ranks")) and p["ranks"], f"tensor {name!r}: malformed piece {str(p)[:120]}")
        for r in p["ranks"]:
            _need(r < n_ranks, f"tensor {name!r}: rank {r} is outside the {n_ranks} rank files")
            _need(r not in seen, f"tensor {name!r}: rank {r} holds more than one piece")
            seen.add(r)
        pieces.append(Piece(Slice(tuple(p["offsets"]), tuple(p["lengths"])), tuple(p["ranks"])))
    try:
        check_cover(shape, pieces)
    except ValueError as exc:
        raise ValueError(f"tensor {name!r}: {exc}") from None
    return TensorLayout(spec["dtype"], tuple(shape), tuple(pieces), None if placements is None else tuple(placements))
