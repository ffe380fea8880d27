"""Graceful exit for a hand-written training loop (no Session), e.g. DP x TP with DTensor.

The same contract as the session's (graceful.py): SIGTERM, SIGINT or SIGUSR1, sent to the
launcher or to any one worker, stops every rank at the same step, each saves a dying-gasp
checkpoint within the grace period, and the job exits 75; the same command run again resumes.

    stop = trainguard.GracefulStop()              # arms the signal handlers
    for step in range(start + 1, steps + 1):
        train_one_step(step)
        if stop.requested(step):                 # collective: every rank gets the same answer
            stop.exit(step, lambda: trainguard.save_sharded(folder(step), state(), step=step))

`requested` is one all-reduce (max) of a single integer per call, so every rank learns at the
same step that some rank was signalled. `exit` runs the save on every rank under a watchdog: at
the deadline (signal + grace period, less a margin) the process leaves with os._exit, so a cut
save never writes its manifest and never looks complete; the next run resumes from the newest
complete checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from ...errors import JobStopped
from ...exitcodes import EXIT_PREEMPTED
from ...signals import signal_name
from .dump import run_before
from .graceful import GOODBYE_PATIENCE_S, StopRequest, resume_hint


class GracefulStop:
    """Signals → a stop agreed at a step boundary → a dying-gasp save → exit 75."""

    def __init__(self, *, grace_period: float | None = None, group: dist.ProcessGroup | None = None):
        from ...worker import runtime

        self.rt = runtime.current()
        self.grace = self.rt.cfg.grace_period if grace_period is None else grace_period
        self.group = group
        self.request = StopRequest()
        self._armed = self.request.armed()
        self._armed.__enter__()

    def close(self) -> None:
        """Put the previous signal handlers back."""
        self._armed.__exit__(None, None, None)

    def requested(self, step: int) -> int:
        """Collective: the signal number some rank got (the largest), or 0 to go on."""
        flag = torch.tensor([self.request.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        signum = int(flag.item())
        self.observe(signum)
        return signum

    def observe(self, signum: int) -> None:
        """The stop vote said `signum`: if another rank was signalled, its grace period is ours too."""
        if signum and not self.request.signum:
            self.request.signum, self.request.at = signum, time.monotonic()

    def exit(self, step: int, save: Callable[[], object]) -> NoReturn:
        """Run `save` (it may be collective) before the deadline, say goodbye, and exit 75."""
        rt, name = self.rt, signal_name(self.request.signum)
        deadline = self.request.deadline(self.grace)
        if not run_before(deadline, save):
            print(f"trainguard: rank {rt.rank}: {name}: the dying-gasp save of step {step} did not finish "
                  f"within the grace period ({self.grace:g} s); it is left incomplete", file=sys.stderr, flush=True)
            rt.finish(ok=True, stopped=True, detail=f"stopped on {name} at step {step} (the save was cut)",
                      patience=GOODBYE_PATIENCE_S)  # else the job waits for this worker to come back
            sys.stdout.flush()
            os._exit(EXIT_PREEMPTED)
        rt.events.emit("graceful_exit", rank=rt.rank, step=step, signal=name, saved=[step], pending=False)
        print(f"trainguard: rank {rt.rank}: {name}: stopped at step {step}; saved a dying-gasp checkpoint; "
              f"{resume_hint()}", file=sys.stderr, flush=True)
        self.close()
        rt.finish(ok=True, stopped=True, detail=f"stopped on {name} at step {step}", patience=GOODBYE_PATIENCE_S)
        raise JobStopped(EXIT_PREEMPTED, f"{name} at step {step}", step)
