"""What the scheduler's blocking requests (join, agree, a store wait) wait on: one notification after every
change of the state they read. `notify` is a plain call, so a handler that changes the state and answers
at once runs in one go, without a task (conn.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Changes:
    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    def notify(self) -> None:
        """Every waiter re-checks its predicate."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_for(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Return True once `predicate()` holds (checked now and after each notification), False if it does
        not by `deadline` (time.monotonic())."""
        loop = asyncio.get_running_loop()
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            waiter = loop.create_future()
            self._waiters.append(waiter)
            timer = loop.call_later(left, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
        return True


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
