"""Check that data-parallel replicas hold bit-identical parameters after every step."""

from __future__ import annotations

import torch

from ..errors import TrainguardError
from ..train.engine.callbacks import Callback
from ..train.engine.probe import digest
from ..worker.transfer import all_gather_bytes


class ReplicasDiverged(TrainguardError):
    """Data-parallel ranks hold different parameters after the same step."""


def parameter_digest(module: torch.nn.Module) -> bytes:
    """sha256 over every entry of the module's state_dict: names, dtypes, shapes and bytes (0-dim buffers too)."""
    return bytes.fromhex(digest(module.state_dict()))


class ReplicaCheck(Callback):
    """After every committed step, all-gathers a digest of `module`'s state and raises
    ReplicasDiverged naming the step and the ranks that differ from rank 0."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.checked = 0

    def on_step_end(self, session) -> None:
        digests = all_gather_bytes(parameter_digest(self.module), session.rt.group)
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        if odd:
            raise ReplicasDiverged(f"after step {session.step}, ranks {odd} hold parameters that differ from "
                                   "rank 0's: data-parallel replicas diverged")
        self.checked += 1
