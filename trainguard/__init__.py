"""trainguard: PyTorch distributed training that survives failures.

Public API; import from here, never from a submodule.
"""

from .checkpoint.blob import load_state, save_state
from .checkpoint.manager import CheckpointConfig, ModelCheckpoint
from .errors import (CheckpointCorrupt, CheckpointError, ClusterFailed, ClusterStateError, ConfigError,
                     FencedError, ProtocolError, RecoveryError, RegistrationRejected, RendezvousTimeout,
                     SchedulerUnavailable, TrainguardError)
from .runtime import get_group, get_local_rank, get_rank, get_world_size, init
from .train.callbacks import Callback, LossMonitor, StepTimeMonitor
from .train.data import ShardedSampler
from .train.model import Model
from .train.parallel import DataParallel
from .train.session import Session, SessionConfig, Step
from .train.state import TrainState

__version__ = "0.1.0"
