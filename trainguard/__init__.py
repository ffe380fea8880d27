"""trainguard: PyTorch distributed training that survives failures.

The core API; import from here, never from a submodule. Names load lazily, so the scheduler
and the launcher start without importing torch. The MindSpore-style names (Model, ModelCheckpoint,
load_checkpoint, ...) live in `trainguard.compat.mindspore` and are reachable here as well.
"""

from __future__ import annotations

import importlib

from .errors import (
    CheckpointCorrupt,
    CheckpointError,
    ClusterFailed,
    ClusterStateError,
    CollectiveFailed,
    ConfigError,
    FencedError,
    JobStopped,
    ProtocolError,
    RecoveryError,
    RegistrationRejected,
    RendezvousTimeout,
    Retriable,
    Rewind,
    SchedulerUnavailable,
    TrainguardError,
)
from .exitcodes import EXIT_FAULT_STOP, EXIT_PREEMPTED

__version__ = "0.1.0"

_LAZY = {
    "init": "worker.runtime", "get_rank": "worker.runtime", "get_world_size": "worker.runtime",
    "get_local_rank": "worker.runtime", "get_group": "worker.runtime",
    "DDP": "train.parallel.ddp", "DistributedDataParallel": "train.parallel.ddp", "DataParallel": "train.parallel.ddp",
    "Optimizer": "train.engine.optimizer", "DataLoader": "train.data.loaders", "micro_batches": "train.data.loaders", "DistributedSampler": "train.data.loaders",
    "start_epoch": "train.engine.resume", "start_step": "train.engine.resume", "start_batch": "train.engine.resume", "register_state": "train.engine.guard", "ShardedSampler": "train.data.sampler",
    "Session": "train.engine.session", "SessionConfig": "train.engine.session", "Step": "train.engine.session",
    "TrainState": "train.state.train_state", "GracefulStop": "train.engine.preempt", "StepTimeMonitor": "train.engine.callbacks",
    "save_state": "checkpoint.blob", "load_state": "checkpoint.blob",
    "save_sharded": "checkpoint.sharded", "load_sharded": "checkpoint.reshard",
    "init_optimizer_state": "checkpoint.reshard", "recover_rank": "checkpoint.replicas",
    "fully_shard": "train.parallel.sharding", "parallelize_module": "train.parallel.sharding", "init_device_mesh": "train.parallel.sharding",
    "PipelineStage": "train.parallel.pipeline", "build_stage": "train.parallel.pipeline",
    "MeshSpec": "meshspec", "ShardedCheckpoints": "train.state.shardckpt",
}
# MindSpore-style names (compat/mindspore.py), reachable here too for scripts written before it
_MINDSPORE = ("Callback", "CheckpointConfig", "ExceptionCheckpoint", "LossMonitor", "Model", "ModelCheckpoint",
              "load_checkpoint", "load_param_into_net", "restore_group_info_list")
_LAZY.update(dict.fromkeys(_MINDSPORE, "compat.mindspore"))

__all__ = sorted(set(_LAZY) - set(_MINDSPORE)) + [
    "CheckpointCorrupt", "CheckpointError", "ClusterFailed", "ClusterStateError", "CollectiveFailed", "ConfigError", "FencedError",
    "ProtocolError", "RecoveryError", "RegistrationRejected", "RendezvousTimeout", "SchedulerUnavailable",
    "TrainguardError", "JobStopped", "Retriable", "Rewind", "EXIT_PREEMPTED", "EXIT_FAULT_STOP",
]


_REMOVED = {
    "ShardedJob": "trainguard.ShardedJob was removed: sharded models run on the one engine. Build the model once "
                  "with trainguard.fully_shard / parallelize_module on a trainguard.init_device_mesh, wrap the "
                  "optimizer in trainguard.Optimizer(..., checkpoints=trainguard.ShardedCheckpoints(...)) and loop "
                  "from trainguard.start_step() (examples/transformer_tp.py)",
}


def __getattr__(name: str):
    if name in _REMOVED:
        raise AttributeError(_REMOVED[name])
    if name not in _LAZY:
        raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__ + list(_MINDSPORE)
