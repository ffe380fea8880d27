"""Check that data-parallel replicas hold bit-identical parameters after every step."""

from __future__ import annotations

import hashlib

import torch

from ..errors import TrainguardError
from ..train.engine.callbacks import Callback
from ..worker.transfer import all_gather_bytes


class ReplicasDiverged(TrainguardError):
    """Data-parallel ranks hold different parameters after the same step."""


def parameter_digest(module: torch.nn.Module) -> bytes:
    """sha256 over every parameter's name, dtype, shape and bytes, in state_dict order."""
    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


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
