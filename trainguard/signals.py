"""Signals in one place for the launcher and the workers: their names for messages, and the
handlers for the signals that ask a job to stop (SIGTERM, SIGINT, SIGUSR1: Slurm's warning)."""

from __future__ import annotations

import signal
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


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
