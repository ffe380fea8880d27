"""What trainguard holds of a job's training: one model (the one whose parameters `trainguard.Optimizer` steps), its
optimizer, and the objects registered or found beside them. Checked once, as the job's state starts (guard.py):
what would train outside it is refused there, naming the fix, instead of training unprotected or apart.
"""

from __future__ import annotations

import gc

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
            stepped = any(id(p) in params for p in dp.module.parameters())
            why = ("the optimizer steps both, but trainguard holds one model: put the networks in one module (an "
                   "nn.ModuleDict) under one trainguard.DDP" if stepped else "its gradients would not be averaged "
                   "over the ranks, nor its state recovered")
            raise ConfigError(f"a second trainguard.DDP ({type(dp.module).__name__}, {n} parameters) trains beside the "
                              f"model trainguard holds (the one whose parameters trainguard.Optimizer steps): {why}. "
                              "trainguard holds one model and one optimizer a process, one update a batch: two "
                              "networks with updates of their own (a GAN's generator and discriminator) are not "
                              "covered")
    loose = {id(p) for p in model.parameters() if p.requires_grad} - params if model is not None else set()
    for other in _optimizers() if loose else ():  # the model's parameters the optimizer does not step: does another?
        if other is not optimizer and any(id(p) in loose for g in other.param_groups for p in g["params"]):
            raise ConfigError(f"another torch optimizer ({type(other).__name__}) steps parameters of the model "
                              "trainguard holds that trainguard.Optimizer does not: its state would be neither "
                              "committed nor recovered, and the run would differ after a fault. trainguard holds one "
                              "optimizer a process: give every parameter to the one trainguard.Optimizer wraps (a "
                              "DLRM's embedding tables as dense ones under the same optimizer)")


def _optimizers() -> list:
    return [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]
