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
import os
from pathlib import Path

import torch

log = logging.getLogger("trainguard.strategy")

FILE_NAME = "strategy.json"
FORMAT_VERSION = 1


def _placement(p) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"shard({p.dim})"
    return name.lower()


def describe(module: torch.nn.Module, world_size: int, generation: int = 0) -> dict:
    """The layout of `module`'s parameters over `world_size` ranks (a pure function of the module)."""
    inner = getattr(module, "module", module)  # DataParallel wraps the user's module
    mesh = None
    params = {}
    for name, param in inner.named_parameters():
        entry: dict = {"shape": list(param.shape), "dtype": str(param.dtype).removeprefix("torch."),
                       "placement": "replicate"}
        placements = getattr(param, "placements", None)
        device_mesh = getattr(param, "device_mesh", None)
        if placements is not None and device_mesh is not None:  # a DTensor
            entry["placement"] = [_placement(p) for p in placements]
            if mesh is None:
                mesh = {"shape": list(device_mesh.shape), "dim_names": list(device_mesh.mesh_dim_names or ())}
        params[name] = entry
    return {"format_version": FORMAT_VERSION, "world_size": world_size, "generation": generation, "mesh": mesh,
            "parameters": params}


def write(doc: dict, directories: list[Path]) -> list[Path]:
    """Write `doc` as strategy.json into each directory (tmp file + rename); returns the paths written."""
    text = json.dumps(doc, indent=1, sort_keys=True)
    written = []
    for directory in dict.fromkeys(Path(d) for d in directories):
        path = directory / FILE_NAME
        tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
            written.append(path)
        except OSError as exc:  # the layout is documentation for a later reader; training goes on
            log.error("could not write %s: %s", path, exc)
    return written


def write_for(session) -> list[Path]:
    """Rank 0 writes the session's layout where recovery and its disk checkpoints live."""
    rt = session.rt
    if rt.rank != 0 or session.state.model is None:
        return []
    dirs = [rt.cfg.recovery_path] if rt.cfg.recovery_path is not None else []
    dirs += [src.root for src in session.disk_sources]
    return write(describe(session.state.model, rt.world_size, rt.generation), dirs) if dirs else []
