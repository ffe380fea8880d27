"""trainguard: PyTorch distributed training that survives failures.

Public API; import from here, never from a submodule.
"""

from .errors import (CheckpointCorrupt, CheckpointError, ClusterFailed, ClusterStateError, ConfigError,
                     FencedError, ProtocolError, RecoveryError, RegistrationRejected, RendezvousTimeout,
                     SchedulerUnavailable, TrainguardError)
from .runtime import get_group, get_local_rank, get_rank, get_world_size, init

__version__ = "0.1.0"
