"""Pipeline parallelism on the one engine: the user's own stages and schedule (torch.distributed.pipelining).

    from trainguard import PipelineStage                  # torch's class, the same arguments
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)   # any stock schedule, torch's own
    optimizer = trainguard.Optimizer(torch.optim.AdamW(stage_module.parameters()), lr_scheduler=scheduler)

The drop-in notes the stage's module and its place in the pipeline, so the optimizer's wrapper finds the job's
model (as it finds a `fully_shard`ed one) and the engine knows its ranks hold different layers: the sharded
path of train/parallel/sharding.py, keyed by stage (`shard_key`). A schedule's traffic is point-to-point
(`isend`/`irecv`/`batch_isend_irecv`, waited on later); those calls are typed like every collective
(worker/collectives.py), so a peer lost at any micro-batch fails the schedule with `CollectiveFailed` at its
`wait()`, and the script goes back to its committed step (train/engine/rewind.py), every rank with it.
The commit point's vote (one small all-reduce over the job's group) is what makes a step count on every stage.
`build_stage` (for `pipeline()`'s split) notes its stage the same way.

**Shape inference is not a step's forward.** A stage built without example inputs runs its module once, at the
schedule's first step, on the first micro-batch (the first stage) or on empty tensors (the others), to learn
the shapes it sends. That first step is step 0 in a run from the start and the resumed step after a rewind, so
the extra forward would land in different steps: its dropout draws, and the forward count that keys the random
streams and the replay audit, would shift every later forward of that step. The drop-in runs it `inferring()`:
its draws come from a forked generator and put nothing back, and the guard does not count it
(`sharding.inferring()`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed import pipelining

from . import sharding
from .sharding import note_stage

INFERENCE = ("_forward_metadata_inference", "_shape_inference")  # torch's name for it, by version (private)


@contextlib.contextmanager
def _inference():
    with sharding.inferring_shapes(), torch.random.fork_rng(devices=[]):
        yield


def _quiet(method):
    @functools.wraps(method)
    def run(*args, **kwargs):
        with _inference():
            return method(*args, **kwargs)
    return run


class PipelineStage(pipelining.PipelineStage):
    """torch's `PipelineStage`, its module noted as stage `stage_index` of the job's pipeline."""

    def __init__(self, submodule, stage_index: int, num_stages: int, *args, **kwargs):
        super().__init__(submodule, stage_index, num_stages, *args, **kwargs)
        watch(self, submodule, stage_index, num_stages)


def build_stage(stage_module, stage_index: int, pipe_info, *args, **kwargs):
    """torch's `build_stage` (a stage of `pipeline()`'s split), its module noted as the job's stage."""
    stage = pipelining.build_stage(stage_module, stage_index, pipe_info, *args, **kwargs)
    watch(stage, stage_module, stage_index, pipe_info.num_stages)
    return stage


def watch(stage, module, index: int, count: int) -> None:
    """`stage` (torch's, of `module`) under the job: its module noted as stage `index` of `count`, its shape
    inference run `inferring()` (torch's method, whatever its name in this version), and every schedule's step
    beginning the job's step where it calls `clear_runtime_states()`, before its first receive: the guard's
    deferred stop or recovery is then taken by every stage alike (a later stage's first forward comes only after a
    receive that a stopped peer would never answer)."""
    for name in INFERENCE:
        method = getattr(stage, name, None)
        if method is not None:
            setattr(stage, name, _quiet(method))
    clear = stage.clear_runtime_states

    @functools.wraps(clear)
    def clear_runtime_states():
        sharding.schedule_step(module, bool(stage.has_backward))
        clear()

    stage.clear_runtime_states = clear_runtime_states
    note_stage(module, index, count)
