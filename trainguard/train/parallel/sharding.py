"""Sharded models on the one engine: the user's own FSDP2, HSDP and DP x TP, in the user's own loop.

    from trainguard import fully_shard, init_device_mesh        # torch's calls, the same arguments
    trainguard.init()
    mesh = init_device_mesh("cpu", (world_size,))                # or (2, 2) with names, for HSDP / DP x TP
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)                                # or parallelize_module(model, mesh["tp"], plan)
    optimizer = trainguard.Optimizer(torch.optim.AdamW(model.parameters()), lr_scheduler=sched)

The drop-ins call torch's functions and note the module, so the optimizer's wrapper finds the model
whose state is the job's (as it finds a `trainguard.DDP`), and `init_device_mesh` lets the mesh's
own groups be cut with the generation's (a collective blocked in one fails at once, not at gloo's
timeout). Everything else is the data-parallel engine's: a fault sends the script back to its
committed step (train/engine/rewind.py), where it builds its mesh, modules and optimizer again and they are
refilled from the committed state; the position, seeds, loaders and scheduler come back the same way.

What differs is that ranks hold different state. Each rank's part is its local tensors (a DTensor's
local shard, nothing gathered: train/state/shardstate.py), and the ranks tell which of them hold the same
part (`shard_key`): replicas, such as HSDP's replicate dimension, can restore each other, and every
rank keeps an in-memory copy of one other shard (train/parallel/livecopies.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ...meshspec import ShardMap

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # a torch without DTensor: nothing is sharded
    DTensor = Replicate = ()  # type: ignore[assignment,misc]

_noted: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_stages: "weakref.WeakKeyDictionary[nn.Module, tuple[int, int]]" = weakref.WeakKeyDictionary()  # pipeline stages
_schedule_hooks: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()  # the guard's
_inferring = [0]  # depth of a pipeline stage's shape inference
_meshes: list = []  # the last DeviceMesh made by init_device_mesh: the job's whole mesh


def fully_shard(module, *args, **kwargs):
    """torch's `fully_shard`, the module noted as a candidate for the job's model."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = torch_fully_shard(module, *args, **kwargs)
    for m in out if isinstance(out, list) else [out]:
        note(m)
    return out


def note(module: nn.Module) -> None:
    """`module`, sharded with torch's own calls (a framework's), is a candidate for the job's model."""
    _noted.add(module)


def note_stage(module: nn.Module, index: int, count: int) -> None:
    """`module` is stage `index` of a `count`-stage pipeline (train/parallel/pipeline.py): a candidate for the job's
    model, whose ranks hold different layers."""
    _noted.add(module)
    _stages[module] = (int(index), int(count))


@contextlib.contextmanager
def inferring_shapes():
    """A pipeline stage runs its module to learn the shapes it sends (train/parallel/pipeline.py), not to train."""
    _inferring[0] += 1
    try:
        yield
    finally:
        _inferring[0] -= 1


def inferring() -> bool:
    return _inferring[0] > 0


def on_schedule_step(module: nn.Module, hook) -> None:
    """`hook(training)` (a bound method, held weakly: its object may hold `module`, which must not outlive the
    script's run) runs as a schedule's step begins on the stage of `module` (before its first receive)."""
    _schedule_hooks[module] = weakref.WeakMethod(hook)


def schedule_step(module: nn.Module, training: bool) -> None:
    """A pipeline schedule's step begins on the stage of `module` (`training`: it runs backward)."""
    ref = _schedule_hooks.get(module)
    hook = ref() if ref is not None else None
    if hook is not None:
        hook(training)


def stage_of(model: nn.Module | None) -> tuple[int, int] | None:
    """(stage index, stages) of a pipeline stage's module; None: not a stage."""
    return _stages.get(model) if model is not None else None


def parallelize_module(module, *args, **kwargs):
    """torch's `parallelize_module`, the module noted as a candidate for the job's model."""
    from torch.distributed.tensor.parallel import (
        parallelize_module as torch_parallelize,
    )

    out = torch_parallelize(module, *args, **kwargs)
    note(out)
    return out


def init_device_mesh(device_type: str, mesh_shape, *args, **kwargs):
    """torch's `init_device_mesh`, kept as the job's mesh (the sockets of the groups it opens are cut with this
    generation's, as every group's: worker/collectives.py)."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    return keep_mesh(torch_init_device_mesh(device_type, tuple(mesh_shape), *args, **kwargs))


def keep_mesh(mesh):
    """`mesh` (made with torch's own call: a framework's) is the job's mesh."""
    _meshes[:] = [mesh]
    return mesh


def job_mesh():
    """The job's whole DeviceMesh: the last one `init_device_mesh` made (None: none was made). Parameters may
    live on sub-meshes of it (DP x TP: the DTensors on "tp", data parallelism by hand over "dp")."""
    return _meshes[0] if _meshes else None


def model_of(optimizer: torch.optim.Optimizer) -> nn.Module | None:
    """The outermost noted module holding the optimizer's parameters (None: no sharded model is noted)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    best, most = None, 0
    for m in list(_noted):
        n = sum(1 for p in m.parameters() if id(p) in params)
        if n > most:
            best, most = m, n
    return best


def is_sharded_tensor(t) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def is_sharded(model: nn.Module | None) -> bool:
    """The model holds DTensors, or is a pipeline stage: its ranks hold parts of the state, not the same state."""
    if stage_of(model) is not None:
        return True
    return model is not None and bool(DTensor) and any(isinstance(t, DTensor) for t in model.state_dict().values())


def shard_key(model: nn.Module, rank: int) -> int:
    """What identifies the part of the state this rank holds: two ranks with the same key hold the same part.

    A DTensor's local part depends on this rank's coordinates along the mesh dimensions it is not replicated
    on. A plain tensor in the model's state (a BatchNorm's statistics, a parameter outside any sharding) may
    differ between ranks, so a model with one counts every rank as its own shard. A pipeline stage's key starts
    with its stage: two stages never hold the same part, whatever their tensors are named."""
    h = hashlib.blake2b(digest_size=8)
    stage = stage_of(model)
    if stage is not None:
        h.update(f"stage {stage[0]} of {stage[1]};".encode())
    for name, t in model.state_dict().items():
        if not isinstance(t, DTensor):
            if t.is_floating_point() or t.is_complex():
                h.update(f"rank {rank}".encode())
                break
            continue
        coords = t.device_mesh.get_coordinate() or ()
        mine = [c for c, p in zip(coords, t.placements) if not isinstance(p, Replicate)]
        h.update(f"{name}:{mine};".encode())
    return int.from_bytes(h.digest(), "little") >> 1  # fits an int64


def shard_map(model: nn.Module, group: dist.ProcessGroup, rank: int, world_size: int) -> ShardMap:
    """Every rank's shard id in this generation (one small all-gather; collective)."""
    from ...worker.transfer import all_gather_ints

    return ShardMap.of_keys(all_gather_ints(shard_key(model, rank), group, world_size))
