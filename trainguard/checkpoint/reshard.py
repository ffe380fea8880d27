"""Loading a checkpoint into any parallel layout, or into one process.

`load_sharded(folder, target)` needs no process group: for each tensor of `target` (a DTensor
under any mesh and placements, or a plain tensor) it works out the slice this rank holds,
puts it together from the saved pieces that overlap it, reading only the rank files that
hold them, and copies it into the target in place. So a (dp=2, tp=2) save loads into
(dp=1, tp=2), into (dp=4, tp=1), into FSDP2, or into a plain module in one process.

`load_checkpoint(path)` and `load_param_into_net(net, params)` are MindSpore's pair: a flat
dict of whole tensors, then loaded into a plain module by parameter name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from . import union
from .codec import flatten_state, unflatten_state
from .layout import Slice, is_dtensor, local_slice
from .replicas import open_checkpoint
from .safeheader import dtype_name

log = logging.getLogger("trainguard.checkpoint")

_PLACEHOLDER = torch.empty(0)


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _listing(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def load_sharded(folder: str | Path, target: Any = None, *, strict: bool = True, partial: bool = False) -> Any:
    """Load a checkpoint into `target`'s tensors in place and return the saved state.

    `target` has the structure that was saved (e.g. ``{"model": model.state_dict(), "optim":
    opt.state_dict()}``, after `init_optimizer_state(opt)` so the optimizer's tensors exist).
    The result is the saved state with the target's tensors (now holding the loaded values) in
    it, ready for `model.load_state_dict` / `opt.load_state_dict`, which restore the non-tensor
    values too. Tensors only in the checkpoint come back whole; with strict=True (the default)
    any tensor in only one of the two is an error. `target=None` loads every tensor whole. `partial`: the target
    is one part of the checkpoint (a pipeline's stage, saved with `save_sharded(partial=True)`): only its tensors
    are read, the rest of the checkpoint is left out of the result, and strict=True asks only that every tensor of
    the target be in the checkpoint."""
    reader = open_checkpoint(folder, prefer=_this_rank())
    layout, where = reader.layout, reader.manifest.path
    targets: dict[str, torch.Tensor] = {}
    if target is not None:
        def collect(name: str, t: torch.Tensor) -> torch.Tensor:
            targets[name] = t
            return _PLACEHOLDER

        flatten_state(target, copy=False, tensor_hook=collect)
        missing = sorted(set(targets) - set(layout.tensors))
        unexpected = [] if partial else sorted(set(layout.tensors) - set(targets))
        if strict and (missing or unexpected):
            raise CheckpointError(f"{reader.folder}: the checkpoint and the target differ. Not in the checkpoint: "
                                  f"[{_listing(missing)}]; not in the target: [{_listing(unexpected)}]. Build the "
                                  "target like the saved state (initialise the optimizer first) or pass strict=False")
        for name in missing:
            log.warning("%s: has no tensor %r; the target's is left as it was", reader.folder, name)
    tensors = {}
    for name, spec in layout.tensors.items():
        t = targets.get(name)
        if t is None and partial:
            continue
        if t is None:
            tensors[name] = reader.assemble(name, Slice.full(spec.shape))
            continue
        shape, box = local_slice(t, name)
        if shape != spec.shape or dtype_name(t.dtype) != spec.dtype:
            raise CheckpointError(f"{where}: tensor {name!r} is {spec.dtype} {list(spec.shape)} in the checkpoint but "
                                  f"{dtype_name(t.dtype)} {list(shape)} in the target; build the model with the "
                                  "dimensions and dtype it was saved with")
        if box is not None:
            data = reader.assemble(name, box)
            with torch.no_grad():
                (t.to_local() if is_dtensor(t) else t).copy_(data)
        tensors[name] = t
    if reader.bad:
        log.warning("%s: loaded from replicas in place of %s; run `trainguard ckpt recover` to rebuild them",
                    reader.folder, ", ".join(layout.rank_files[r] for r in sorted(reader.bad)))
    meta = union.prune(reader.manifest.meta, set(tensors)) if partial else reader.manifest.meta
    return unflatten_state(tensors, meta, copy=False)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's state tensors (as torch.distributed.checkpoint does) without changing
    the parameters: one step with zero gradients and a learning rate of 0."""
    if optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


# --- MindSpore's pair ------------------------------------------------------------------------------


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (integrated, sliced or version 1), whole, by its saved name
    (e.g. ``model/fc1.weight``). A missing or corrupt rank file is read from a replica."""
    reader = open_checkpoint(path)
    return {name: reader.assemble(name, Slice.full(spec.shape)) for name, spec in reader.layout.tensors.items()}


def _prefix(names: set[str], params: dict[str, Any]) -> str:
    if names & params.keys():
        return ""
    counts: dict[str, int] = {}
    for key in params:
        head, sep, rest = key.rpartition("/")
        if sep and rest in names:
            counts[head + "/"] = counts.get(head + "/", 0) + 1
    return max(counts, key=counts.get) if counts else ""


def load_param_into_net(net: torch.nn.Module, params: dict[str, torch.Tensor], *, strict: bool = False,
                        prefix: str | None = None) -> tuple[list[str], list[str]]:
    """Copy `params` into `net`'s parameters and buffers by name; returns (param_not_load,
    ckpt_not_load): the net's names that got no value and the checkpoint's names (under the
    prefix) that no tensor of the net took. `prefix` (e.g. ``"model/"``) is found by itself when
    None. strict=True raises CheckpointError when either list is non-empty."""
    own = net.state_dict(keep_vars=True)
    prefix = _prefix(set(own), params) if prefix is None else prefix
    not_loaded, used = [], set()
    for name, t in own.items():
        value = params.get(prefix + name)
        if value is None:
            not_loaded.append(name)
            continue
        t = t.detach()
        shape = tuple(t.shape)
        if tuple(value.shape) != shape or value.dtype != t.dtype:
            raise CheckpointError(f"{prefix + name}: the checkpoint holds {value.dtype} {list(value.shape)}, the net "
                                  f"has {t.dtype} {list(shape)}; build the net with the saved dimensions")
        with torch.no_grad():
            if is_dtensor(t):
                _, box = local_slice(t, name)
                if box is not None:
                    t.to_local().copy_(value[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))])
            else:
                t.copy_(value)
        used.add(prefix + name)
    unused = sorted(k for k in params if k.startswith(prefix) and k not in used)
    if strict and (not_loaded or unused):
        raise CheckpointError(f"load_param_into_net: the net's [{_listing(not_loaded)}] got no value and the "
                              f"checkpoint's [{_listing(unused)}] were not used")
    return not_loaded, unused
