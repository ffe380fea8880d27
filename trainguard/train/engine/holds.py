"""What trainguard holds of a job's training: one model (the one whose parameters `trainguard.Optimizer` steps), its
optimizer, and the objects registered or found beside them. Checked once, as the job's state starts (guard.py):
what would train outside it is refused there, naming the fix, instead of training unprotected or apart.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ..parallel.ddp import DataParallel


def check(model, optimizer: torch.optim.Optimizer, registered) -> None:
    """`model`: the optimizer's model trainguard found (None: none); `registered`: the objects held beside it."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if model is None:
        held = {id(p) for obj in registered if isinstance(obj, torch.nn.Module) for p in obj.parameters()}
        if not params <= held:
            raise ConfigError("the optimizer's parameters belong to no model trainguard holds, so a recovery could not "
                              "give their values back: wrap the model in trainguard.DDP (it replaces torch's DDP and "
                              "a gradient all_reduce written by hand), shard it with trainguard.fully_shard, or "
                              "register it: trainguard.register_state('model', model)")
    for dp in list(DataParallel.instances):
        if dp is not model and dp.sync.hooked and any(p.requires_grad for p in dp.module.parameters()):
            n = sum(p.numel() for p in dp.module.parameters())
            raise ConfigError(f"a second trainguard.DDP ({type(dp.module).__name__}, {n} parameters) trains beside the "
                              "model trainguard holds (the one whose parameters trainguard.Optimizer steps): its "
                              "gradients would not be averaged over the ranks, nor its state recovered. trainguard "
                              "holds one model and one optimizer a process, one update a step: two networks with "
                              "optimizers of their own (a GAN's generator and discriminator) are not covered")
