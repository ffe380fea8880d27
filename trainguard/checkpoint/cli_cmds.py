"""The bodies of `trainguard ckpt ls | verify | inspect | recover`; each returns an exit code.

Errors are raised as CheckpointError (the CLI prints them and exits 2); reports go to stdout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import CheckpointCorrupt, CheckpointError
from .manifest import MANIFEST, read
from .pieces import checkpoint_folder
from .replicas import recover_rank, verify_checkpoint
from .safeheader import CorruptFile


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _row(folder: Path) -> tuple:
    try:
        m = read(folder)
    except CorruptFile as exc:
        return (-1, folder.name, "-", "-", "-", "-", "-", f"INCOMPLETE: {exc.reason}")
    missing = m.wrong_size()
    status = f"DAMAGED: {', '.join(missing)} missing or wrong size" if missing else "complete (not hashed)"
    size = sum(e.bytes for e in m.files.values())
    return (m.step, folder.name, m.epoch, m.world_size, m.label, len(m.files), _size(size), status)


def ls(directory: Path) -> int:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: is not a directory; give the folder that holds checkpoints")
    folders = [directory] if (directory / MANIFEST).exists() else sorted(
        p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists())
    if not folders:
        print(f"{directory}: no checkpoints (no folder with a {MANIFEST})")
        return 0
    rows = sorted((_row(f) for f in folders), key=lambda r: (r[0], r[1]))
    head = ("step", "name", "epoch", "world", "kind", "files", "size", "status")
    table = [head] + [(str(r[0]) if r[0] >= 0 else "-", *map(str, r[1:])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 0


def verify(path: Path) -> int:
    result = verify_checkpoint(path)
    for name, why in sorted(result.problems.items()):
        print(f"CORRUPT  {name}: {why}")
    if result.ok:
        print(f"{result.folder}: OK, {result.files} file(s) match the manifest's sha256 and layout")
        return 0
    if result.unrecoverable:
        lost = ", ".join(result.unrecoverable[:5]) + (" …" if len(result.unrecoverable) > 5 else "")
        raise CheckpointCorrupt(f"{result.folder}: no intact copy is left of {lost}; "
                                "fall back to an earlier checkpoint")
    fixes = "; ".join(f"trainguard ckpt recover {result.folder} --rank {r}" for r in result.damaged_ranks)
    raise CheckpointCorrupt(f"{result.folder}: {len(result.problems)} damaged file(s), but every slice has an intact "
                            f"replica, so it still loads; rebuild them with: {fixes}")


def inspect(path: Path, as_json: bool = False) -> int:
    m = read(checkpoint_folder(path))
    if as_json:
        print(json.dumps(m.raw, indent=1))
        return 0
    print(f"{m.folder}\n  format {m.version}, step {m.step}, epoch {m.epoch}, world size {m.world_size}, saved "
          f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.created))}")
    print(f"  append_info: {json.dumps(m.append_info)}")
    for name, entry in m.files.items():
        print(f"  file {name}: {entry.bytes} bytes, sha256 {entry.sha256[:16]}…")
    for r, entry in enumerate(m.ranks):
        print(f"  rank {r}: {entry.file}, data position {json.dumps(entry.progress)}, RNG state in the manifest")
    layout = m.layout
    if layout is None:
        print(f"  no parallel layout: {m.holds}")
        return 0
    print(f"  kind {layout.kind}; group info (ranks holding identical slices): "
          f"{[list(g) for g in layout.group_info]}")
    for mesh in layout.meshes:
        print(f"  mesh {mesh.get('dim_names')} {mesh.get('shape')}: {mesh.get('ranks')}")
    for name, t in layout.tensors.items():
        where = "; ".join(f"{p.slice} on {list(p.ranks)}" for p in t.pieces)
        placed = f" {'/'.join(t.placements)}" if t.placements else ""
        print(f"  {name}: {t.dtype} {list(t.shape)}{placed}: {where}")
    return 0


def recover(path: Path, rank: int) -> int:
    done = recover_rank(checkpoint_folder(path), rank)
    if done.intact:
        print(f"{done.path}: intact, nothing to do")
    else:
        print(f"{done.path}: rebuilt from rank(s) {list(done.sources)}; its sha256 matches the manifest")
    return 0
