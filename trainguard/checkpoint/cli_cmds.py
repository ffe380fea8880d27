"""The bodies of `trainguard ckpt ls | verify | inspect | recover`; each returns an exit code.

Errors are raised as CheckpointError (the CLI prints them and exits 2); reports go to stdout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import CheckpointCorrupt, CheckpointError
from .format import MANIFEST, manifest_layout, read_manifest
from .pieces import checkpoint_folder
from .replicas import recover_rank, verify_checkpoint


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _kind(manifest: dict) -> str:
    if "ranks" in manifest:
        return "job"
    return manifest["layout"]["kind"] if "layout" in manifest else "per-rank"


def _row(folder: Path) -> tuple:
    try:
        m = read_manifest(folder)
    except CheckpointCorrupt as exc:
        return (-1, folder.name, "-", "-", "-", "-", "-", f"INCOMPLETE: {str(exc).split(': ', 1)[-1]}")
    missing = [n for n, e in m["files"].items()
               if not (folder / n).is_file() or (folder / n).stat().st_size != e["bytes"]]
    status = f"DAMAGED: {', '.join(missing)} missing or wrong size" if missing else "complete (not hashed)"
    size = sum(e["bytes"] for e in m["files"].values())
    return (m["step"], folder.name, m["epoch"], m["world_size"], _kind(m), len(m["files"]), _size(size), status)


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
    folder = checkpoint_folder(path)
    m = read_manifest(folder)
    if as_json:
        print(json.dumps(m, indent=1))
        return 0
    layout = manifest_layout(m)
    print(f"{folder}\n  format {m['format_version']}, step {m['step']}, epoch {m['epoch']}, world size "
          f"{m['world_size']}, saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['created']))}")
    print(f"  append_info: {json.dumps(m.get('append_info'))}")
    for name, entry in m["files"].items():
        print(f"  file {name}: {entry['bytes']} bytes, sha256 {entry['sha256'][:16]}…")
    for r, entry in sorted(m.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
        print(f"  rank {r}: {entry['file']}, data position {json.dumps(entry['progress'])}, RNG state in the manifest")
    if layout is None:
        print("  no parallel layout: " + ("each rank's file holds its data-parallel state; equal sha256 = a replica"
                                          if "ranks" in m else "each file holds one rank's whole state"))
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
