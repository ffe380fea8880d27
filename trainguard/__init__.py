"""trainguard: PyTorch distributed training that survives failures.

Public API; import from here, never from a submodule. Names load lazily, so the scheduler
and the launcher start without importing torch.
"""

from __future__ import annotations

import importlib

from .errors import (CheckpointCorrupt, CheckpointError, ClusterFailed, ClusterStateError, ConfigError,
                     FencedError, JobStopped, ProtocolError, RecoveryError, RegistrationRejected,
                     RendezvousTimeout, Retriable, SchedulerUnavailable, TrainguardError)
from .exitcodes import EXIT_FAULT_STOP, EXIT_PREEMPTED

__version__ = "0.1.0"

_LAZY = {
    "init": "worker.runtime", "get_rank": "worker.runtime", "get_world_size": "worker.runtime",
    "get_local_rank": "worker.runtime",
    "get_group": "worker.runtime",
    "save_state": "checkpoint.blob", "load_state": "checkpoint.blob",
    "CheckpointConfig": "train.checkpointing", "ModelCheckpoint": "train.checkpointing",
    "ExceptionCheckpoint": "train.checkpointing",
    "save_sharded": "checkpoint.sharded", "load_sharded": "checkpoint.reshard",
    "load_checkpoint": "checkpoint.reshard", "load_param_into_net": "checkpoint.reshard",
    "init_optimizer_state": "checkpoint.reshard",
    "restore_group_info_list": "checkpoint.replicas", "recover_rank": "checkpoint.replicas",
    "Callback": "train.callbacks", "LossMonitor": "train.callbacks", "StepTimeMonitor": "train.callbacks",
    "ShardedSampler": "train.data", "Model": "train.model", "DataParallel": "train.parallel",
    "DDP": "train.parallel", "DistributedDataParallel": "train.parallel",
    "Optimizer": "train.guard", "DataLoader": "train.guard", "DistributedSampler": "train.guard",
    "start_epoch": "train.guard",
    "Session": "train.session", "SessionConfig": "train.session", "Step": "train.session",
    "TrainState": "train.state", "GracefulStop": "train.preempt",
}

__all__ = sorted(_LAZY) + [
    "CheckpointCorrupt", "CheckpointError", "ClusterFailed", "ClusterStateError", "ConfigError", "FencedError",
    "ProtocolError", "RecoveryError", "RegistrationRejected", "RendezvousTimeout", "SchedulerUnavailable",
    "TrainguardError", "JobStopped", "Retriable", "EXIT_PREEMPTED", "EXIT_FAULT_STOP",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
