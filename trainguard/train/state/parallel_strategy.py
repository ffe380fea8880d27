"""`strategy.json`: the job's parallel layout, written by rank 0 when training starts.

Like MindSpore's strategy file, it says how the state is laid out over the ranks, so a
checkpoint can be read back (or resharded) without the code that made it:

    {"format_version": 1, "world_size": 2, "generation": 1,
     "mesh": null,                                   # or {"shape": [2, 4], "dim_names": ["dp", "tp"]}
     "parameters": {"0.weight": {"shape": [32, 16], "dtype": "float32", "placement": "replicate"}, ...}}

A plain tensor under data parallelism is "replicate"; a DTensor lists one placement per mesh
dimension ("replicate", "shard(0)", "partial"). It is written atomically into the recovery path
(TG_RECOVERY_PATH) and into the root directory of each disk checkpoint the session writes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ... import durable

log = logging.getLogger("trainguard.strategy")

FILE_NAME = "strategy.json"
FORMAT_VERSION = 1


def _placement(p) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"shard({p.dim})"
    return name.lower()


def _mesh_doc(device_mesh) -> dict:
    return {"shape": list(device_mesh.shape), "dim_names": list(device_mesh.mesh_dim_names or ())}


def describe(module: torch.nn.Module, world_size: int, generation: int = 0, mesh=None) -> dict:
    """The layout of `module`'s parameters over `world_size` ranks (a pure function of the module).
    `mesh`: the job's whole DeviceMesh, when parameters live on sub-meshes of it (DP x TP: the
    DTensors are on the "tp" mesh, and data parallelism is done by hand over "dp"); each
    parameter then also names the mesh dimensions its placements refer to."""
    inner = getattr(module, "module", module)  # DataParallel wraps the user's module
    doc_mesh = _mesh_doc(mesh) if mesh is not None else None
    params = {}
    for name, param in inner.named_parameters():
        entry: dict = {"shape": list(param.shape), "dtype": str(param.dtype).removeprefix("torch."),
                       "placement": "replicate"}
        placements = getattr(param, "placements", None)
        device_mesh = getattr(param, "device_mesh", None)
        if placements is not None and device_mesh is not None:  # a DTensor
            entry["placement"] = [_placement(p) for p in placements]
            entry["mesh_dims"] = list(device_mesh.mesh_dim_names or ())
            if doc_mesh is None:
                doc_mesh = _mesh_doc(device_mesh)
        params[name] = entry
    return {"format_version": FORMAT_VERSION, "world_size": world_size, "generation": generation, "mesh": doc_mesh,
            "parameters": params}


def write(doc: dict, directories: list[Path]) -> list[Path]:
    """Write `doc` as strategy.json into each directory (tmp file + rename); returns the paths written."""
    text = json.dumps(doc, indent=1, sort_keys=True)
    written = []
    for directory in dict.fromkeys(Path(d) for d in directories):
        path = directory / FILE_NAME
        try:
            directory.mkdir(parents=True, exist_ok=True)
            durable.write_bytes(path, text.encode())
            written.append(path)
        except OSError as exc:  # the layout is documentation for a later reader; training goes on
            log.error("could not write %s: %s", path, exc)
    return written


def read(directory: Path) -> dict | None:
    """The strategy.json in `directory`, or None when there is none or it cannot be read (logged)."""
    path = Path(directory) / FILE_NAME
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.error("could not read %s: %s; it is ignored", path, exc)
        return None
    if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION:
        log.error("%s: not a strategy file of format version %d; it is ignored", path, FORMAT_VERSION)
        return None
    return doc


def mesh_words(doc: dict | None) -> str:
    """A layout document's mesh in words: "dp=2 x tp=2" (a plain data-parallel job: "dp=<world size>")."""
    mesh = (doc or {}).get("mesh") or {}
    if not mesh and (doc or {}).get("world_size"):
        return f"dp={doc['world_size']}"
    names = mesh.get("dim_names") or [f"dim{i}" for i in range(len(mesh.get("shape", ())))]
    return " x ".join(f"{n}={s}" for n, s in zip(names, mesh.get("shape", ()))) or "unknown"


def write_for(session, mesh=None) -> list[Path]:
    """Rank 0 writes the session's layout where recovery and its disk checkpoints live (`mesh`: the job's whole
    DeviceMesh, see `describe`)."""
    rt = session.rt
    if rt.rank != 0 or session.state.model is None:
        return []
    dirs = [rt.cfg.recovery_path] if rt.cfg.recovery_path is not None else []
    dirs += [src.root for src in session.disk_sources]
    return write(describe(session.state.model, rt.world_size, rt.generation, mesh), dirs) if dirs else []
