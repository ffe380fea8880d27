"""Progress that others can see: `progress` events for the timeline (every session), and a tqdm bar
on rank 0 for Model.train.

ProgressEvents: rank 0 writes `progress` (generation, step, epoch) to events.jsonl at most twice a
second, at a commit; `trainguard report` draws the step rate from them. The cost on the step path is
one clock read per step.

ProgressBar: the step, the epoch, the loss and the step rate, on stderr. It is on when stderr is a
terminal (`progress=None`, the default), off with `progress=False`, on with `progress=True`. Under
`trainguard run` a worker's stderr is a pipe to the agent (which prefixes each line), so the agent
names its own terminal in TG_TERMINAL and rank 0 draws the bar there. A
recovery is printed above the bar ("recovered: generation 2, resumed at step 40"), and the bar
goes back to the resumed step.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from ...config import TERMINAL_ENV
from .callbacks import Callback

PROGRESS_EVERY_S = 0.5


class ProgressEvents(Callback):
    def __init__(self, every_s: float = PROGRESS_EVERY_S):
        self.every_s = every_s
        self._last = 0.0

    def on_step_end(self, session) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s or session.rt.rank != 0:
            return
        self._last = now
        session.rt.events.emit("progress", generation=session.rt.generation, rank=0, step=session.step,
                               epoch=session.epoch)


def terminal(env=None):
    """The terminal `trainguard run` was started on (TG_TERMINAL), opened for the bar; None if unset or not a
    character device (the variable names a path we write to: only a terminal is taken)."""
    path = (env if env is not None else os.environ).get(TERMINAL_ENV, "")
    try:
        if not path or not stat.S_ISCHR(os.stat(path).st_mode):
            return None
        return open(path, "w", buffering=1)
    except OSError:
        return None


def wants_bar(progress: bool | None, rank: int, stream=None, env=None) -> bool:
    """Pure but for isatty: draw a bar? Rank 0 only; None means when stderr is a terminal, or the launcher's is."""
    if rank != 0 or progress is False:
        return False
    if progress is None:
        stream = stream if stream is not None else sys.stderr
        return bool(getattr(stream, "isatty", lambda: False)()) or bool(
            (env if env is not None else os.environ).get(TERMINAL_ENV))
    return True


class ProgressBar(Callback):
    def __init__(self, total: int, stream=None):
        from tqdm import tqdm

        if stream is None:  # under `trainguard run` stderr is a pipe to the agent: draw on its terminal instead
            stream = sys.stderr if sys.stderr.isatty() else terminal() or sys.stderr
        self.stream = stream
        self.bar = tqdm(total=total, file=stream, unit="step", mininterval=0.2)
        self._restores = None

    def on_step_end(self, session) -> None:
        if self._restores is not None and session.restores != self._restores:
            self.bar.write(f"recovered: generation {session.rt.generation}, resumed at step {session.step - 1} "
                           f"from {session.source}", file=self.stream)
        self._restores = session.restores
        loss, step = session.last_loss, session.last_step
        epoch = (step.epoch if step is not None else session.epoch) + 1  # the step's: after an epoch's last, not the next
        self.bar.set_postfix_str(f"epoch {epoch}/{session.cfg.epochs}" + (f", loss {float(loss):.4f}" if loss is not None
                                                                          else ""), refresh=False)
        self.bar.update(session.step - self.bar.n)  # negative after steps were lost

    def on_train_end(self, session) -> None:
        self.bar.close()
