"""Checkpoints: a pickle-free codec for training state and an atomic, verified folder format."""

from .codec import flatten_state, state_nbytes, unflatten_state
from .format import (
    CheckpointInfo,
    checkpoint_name,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_manifest,
    save_checkpoint,
)

__all__ = [
    "CheckpointInfo",
    "checkpoint_name",
    "flatten_state",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_manifest",
    "save_checkpoint",
    "state_nbytes",
    "unflatten_state",
]
