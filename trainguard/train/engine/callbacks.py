"""Callbacks for Model.train (and any Session): loss and step-time monitors in the seeds' style.

A callback may define on_train_begin(session), on_step_begin(session, step), on_step_end(session)
and on_train_end(session).
`session.last_loss` holds the loss of the step just committed, `session.last_step` that step.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


class Callback:
    def on_train_begin(self, session) -> None:
        pass

    def on_step_begin(self, session, step) -> None:
        pass

    def on_step_end(self, session) -> None:
        pass

    def on_train_end(self, session) -> None:
        pass


class LossMonitor(Callback):
    """Prints `epoch: 1 step: 20, loss is 2.3025854` every `per_print_times` steps of an epoch."""

    def __init__(self, per_print_times: int = 1):
        if per_print_times < 1:
            raise ValueError(f"per_print_times must be >= 1, got {per_print_times}")
        self.per_print_times = per_print_times

    def on_step_end(self, session) -> None:
        step = session.last_step
        if (step.in_epoch + 1) % self.per_print_times == 0:
            loss = str(np.float32(float(session.last_loss)))
            print(f"epoch: {step.epoch + 1} step: {step.in_epoch + 1}, loss is {loss}", flush=True)


class StepTimeMonitor(Callback):
    """Prints the median step time over the last `per_print_times` steps, and over the whole run
    (less the first `warmup` steps) at its end."""

    def __init__(self, per_print_times: int = 50, warmup: int = 10):
        if per_print_times < 1 or warmup < 0:
            raise ValueError(f"per_print_times must be >= 1 and warmup >= 0, got {per_print_times}, {warmup}")
        self.per_print_times = per_print_times
        self.warmup = warmup
        self.times: list[float] = []
        self._t = None

    def on_train_begin(self, session) -> None:
        self._t = time.perf_counter()

    def on_step_end(self, session) -> None:
        now = time.perf_counter()
        if self._t is not None:
            self.times.append(now - self._t)
        self._t = now
        if len(self.times) and len(self.times) % self.per_print_times == 0:
            window = self.times[-self.per_print_times:]
            print(f"step time: {1000 * statistics.median(window):.2f} ms (median of {len(window)})", flush=True)

    def on_train_end(self, session) -> None:
        window = self.times[self.warmup:]
        if window:
            print(f"step time: {1000 * statistics.median(window):.2f} ms (median of {len(window)}, whole run)",
                  flush=True)
