"""Checkpoints: a pickle-free codec for training state, an atomic verified folder format, and
sliced (per-rank) saves of parallel states that load into any layout.

`load_checkpoint` is MindSpore's (a flat dict of whole tensors, `reshard.py`; also
`trainguard.compat.mindspore.load_checkpoint`); `read_checkpoint` reads a v1 folder's raw files
and manifest.
"""

from .codec import flatten_state, state_nbytes, unflatten_state
from .format import CheckpointInfo, checkpoint_name, read_checkpoint, save_checkpoint
from .layout import CheckpointLayout, Piece, Slice, TensorLayout
from .manifest import read_manifest
from .replicas import recover_rank, restore_group_info_list, verify_checkpoint
from .reshard import (
    init_optimizer_state,
    load_checkpoint,
    load_param_into_net,
    load_sharded,
)
from .retention import list_checkpoints, prune_checkpoints
from .sharded import save_sharded

__all__ = [
    "CheckpointInfo",
    "CheckpointLayout",
    "Piece",
    "Slice",
    "TensorLayout",
    "checkpoint_name",
    "flatten_state",
    "init_optimizer_state",
    "list_checkpoints",
    "load_checkpoint",
    "load_param_into_net",
    "load_sharded",
    "prune_checkpoints",
    "read_checkpoint",
    "read_manifest",
    "recover_rank",
    "restore_group_info_list",
    "save_checkpoint",
    "save_sharded",
    "state_nbytes",
    "unflatten_state",
    "verify_checkpoint",
]
