"""Signals in one place for the launcher and the workers: their names for messages, and the
handlers for the signals that ask a job to stop (SIGTERM, SIGINT, SIGUSR1: Slurm's warning).

A worker of `trainguard run` holds a stop signal for its whole life (`hold_for_process`), not only while
its step loop runs: a signal that arrives while the script starts (imports, the first rendezvous), between
two runs of it (a rewind), or after its training loop has ended, never kills it with the signal's default
action, which the launcher would take for a crash and restart. A signal held before a loop starts is
taken by that loop (`take_held`), which then stops at its first commit point; one after the loop is only
noted: the training is complete and the script ends as it would have (the launcher's grace period still
bounds it). A second signal, outside ECHO_WINDOW_S of the first, takes the default action at once.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
ECHO_WINDOW_S = 1.0  # a second signal this soon after the first is the same stop arriving twice (the agent
# forwards the launcher's signal, and Slurm signals every process of a step)
_held: tuple[int, float] | None = None  # a stop signal no step loop has taken: (signum, time.monotonic())


def hold_for_process() -> None:
    """Hold stop signals for the life of this process (a worker of `trainguard run`)."""
    install(_hold)


def _hold(signum: int, _frame) -> None:
    global _held
    if _held is not None and time.monotonic() - _held[1] < ECHO_WINDOW_S:
        return
    if _held is not None:  # a second signal: no more patience
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        return
    _held = (signum, time.monotonic())
    print(f"trainguard: {signal_name(signum)} received outside the training loop: held; the next commit point "
          "stops the job, and a script past its loop ends as it would", file=sys.stderr, flush=True)


def take_held() -> tuple[int, float] | None:
    """The held stop signal, if any, for a step loop that starts now (it is no longer held)."""
    global _held
    held, _held = _held, None
    return held


def hold(signum: int, at: float) -> None:
    """Give back a stop signal a loop took but did not act on (the loop ended, or the script runs again)."""
    global _held
    if _held is None:
        _held = (signum, at)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def install(handler: Callable, signals=STOP_SIGNALS) -> dict[int, object]:
    """Install `handler` for each of `signals`; the previous handlers, for `restore`. Only the main thread
    may install handlers: anywhere else this does nothing and returns {}."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals}


def restore(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
