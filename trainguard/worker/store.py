"""torch.distributed's rendezvous served by the scheduler.

`SchedulerStore` is a torch Store whose data lives in the scheduler, in the namespace of one
generation. A process from an older generation is refused, so a stale worker can never
join a newer group. Each generation also gets its own key prefix.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from ..control import protocol as p
from ..control.client import SchedulerClient
from ..control.msgbase import MAX_WAIT_S
from ..errors import TrainguardError


def _b(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SchedulerStore(dist.Store):
    def __init__(self, client: SchedulerClient, generation: int, timeout: timedelta):
        super().__init__()
        self._client = client
        self._generation = generation
        self._timeout = min(timeout.total_seconds(), MAX_WAIT_S)  # a longer wait is refused by the scheduler

    def _op(self, op: str, keys: list[str], **kw) -> p.StoreReply:
        msg = p.StoreOp(generation=self._generation, op=op, keys=keys, timeout=self._timeout, **kw)
        return self._client.store(msg)

    def set(self, key, value):
        self._op("set", [key], value=_b(value))

    def get(self, key):
        return self._op("get", [key]).value

    def add(self, key, amount):
        return self._op("add", [key], amount=int(amount)).number

    def check(self, keys):
        return self._op("check", list(keys)).flag

    def wait(self, keys, timeout=None):
        # gloo passes the group's build timeout (short); the scheduler ends a wait as soon as the
        # generation changes, so the store's own (collective) timeout only bounds a live, slow peer
        self._op("wait", list(keys))

    def compare_set(self, key, expected, desired):
        return self._op("compare_set", [key], expected=_b(expected), value=_b(desired)).value

    def delete_key(self, key):
        return self._op("delete", [key]).flag

    def num_keys(self):
        return self._op("num_keys", []).number

    def set_timeout(self, timeout):
        self._timeout = min(timeout.total_seconds(), MAX_WAIT_S)  # a longer wait is refused by the scheduler


def leave_together(store: SchedulerStore, generation: int, rank: int, world_size: int, seconds: float) -> bool:
    """An exit barrier in the scheduler's store: this rank says it leaves, then waits (at most `seconds`) until every
    rank of the generation has said so, so that no rank severs its connections while a peer still finishes the last
    collective with it (gloo ends such a peer with std::terminate, SIGABRT). Whether all arrived."""
    key = f"trainguard/leaving/g{generation}"
    keys, deadline = [f"{key}/{r}" for r in range(world_size)], time.monotonic() + seconds
    try:
        store.set(f"{key}/{rank}", b"1")
        while not store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
    except (TrainguardError, OSError):  # the generation or the job is over: nobody to wait for
        return False
    return True


def generation_prefix(generation: int) -> str:
    return f"trainguard/g{generation}"
