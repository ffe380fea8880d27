"""Data parallelism that survives regrouping.

`DataParallel(net)` stands where `DistributedDataParallel(net)` stood. It wraps the same
parameters, so the optimizer is untouched, and rebuilds torch's DDP for each new process
group. Its gradient hook:
  - sums the ranks' gradients in rank order (all-gather, then add), so the result does not
    depend on DDP's bucket layout, which changes when DDP is rebuilt: that keeps a resumed run
    bit-identical to one that never failed;
  - never raises from inside backward: a failed collective is recorded, and the session decides
    at the step's commit point (torchft's report-then-commit pattern).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("trainguard.parallel")

ErrorSink = Callable[[BaseException], None]


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def make_grad_hook(group: dist.ProcessGroup, on_error: ErrorSink, *, deterministic: bool = True):
    world = dist.get_world_size(group)

    def hook(_state, bucket):  # no annotations: DDP compares them to real types
        grad = bucket.buffer()
        try:
            if deterministic:
                parts = [torch.empty_like(grad) for _ in range(world)]
                fut = dist.all_gather(parts, grad, group=group, async_op=True).get_future()
            else:
                fut = dist.all_reduce(grad, group=group, async_op=True).get_future()
        except RuntimeError as exc:
            on_error(exc)
            return _done(grad)

        def finish(f: torch.futures.Future) -> torch.Tensor:
            try:
                f.wait()
            except RuntimeError as exc:  # the peer is gone; the session rolls this step back
                on_error(exc)
                return grad
            if deterministic:
                total = parts[0].clone()
                for part in parts[1:]:
                    total.add_(part)
                return total.div_(world)
            return grad.div_(world)

        return fut.then(finish)

    return hook


class DataParallel(nn.Module):
    """A DDP that can be rebuilt for a new process group; state_dict keys are the wrapped net's."""

    def __init__(self, module: nn.Module, *, deterministic: bool = True, **ddp_kwargs):
        super().__init__()
        self.module = module
        self.deterministic = deterministic
        self._ddp_kwargs = ddp_kwargs
        object.__setattr__(self, "_ddp", None)  # not a registered child: no duplicate state

    def rebuild(self, group: dist.ProcessGroup, on_error: ErrorSink) -> None:
        """Wrap the same parameters in a DDP for `group` (broadcasts rank 0's state)."""
        ddp = DDP(self.module, process_group=group, **self._ddp_kwargs)
        ddp.register_comm_hook(None, make_grad_hook(group, on_error, deterministic=self.deterministic))
        object.__setattr__(self, "_ddp", ddp)

    def drop(self) -> None:
        object.__setattr__(self, "_ddp", None)

    def forward(self, *args, **kwargs):
        ddp = self._ddp
        return ddp(*args, **kwargs) if ddp is not None else self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
