"""Where a script goes back to its committed step (no torch): the worker entry asks, the training side answers.

`trainguard run` runs every worker's script through `launch/worker_main.py`. When the script ends with
a fault (a failed collective, `Rewind`), the entry calls `rewind(exc)`; the training side, which
registered itself with `set_handler` when the job's state started, prepares the process (keeps the
committed state, leaves the broken generation) and answers True: the entry then runs the script
again, from the top, in the same process. Without a handler, or for any other exception, the answer
is False and the script's error ends the process as before.
"""

from __future__ import annotations

import weakref
from typing import Callable

_handler: Callable[[BaseException], bool] | None = None
_at_end: Callable[[], bool] | None = None
_same_everywhere: Callable[[str], str] | None = None
_holding: Callable[[], bool] | None = None
_context: Callable[[], str] | None = None
_available = False
wrapped: weakref.WeakSet = weakref.WeakSet()  # the torch optimizers a trainguard.Optimizer wraps in this process


def set_handler(handler: Callable[[BaseException], bool] | None, at_end: Callable[[], bool] | None = None,
                holding: Callable[[], bool] | None = None) -> None:
    """`handler(exc)`: prepare a run after the script raised `exc`; `at_end()`: after it ended, must it run again?
    `holding()`: does this run of the script hold the job's state (a trainguard wrapper started it)?"""
    global _handler, _at_end, _holding
    _handler, _at_end, _holding = handler, at_end, holding


def protected(optimizer=None) -> bool:
    """A fault would bring this process back to its committed step: the job's state is held, or `optimizer` is one
    a trainguard.Optimizer wraps (held once the loop starts: torch's distributed state dicts step it, at LR 0, to
    make its state before that)."""
    if optimizer is not None and optimizer in wrapped:
        return True
    return _handler is not None and _holding is not None and _holding()


def allow() -> None:
    """The worker entry can run the script again: a failure between commit points rewinds."""
    global _available
    _available = True


def available() -> bool:
    return _available


def rewind(exc: BaseException) -> bool:
    """True if the process is ready to run the script again after `exc`."""
    return _available and _handler is not None and _handler(exc)


def set_error_vote(vote: Callable[[str], str] | None) -> None:
    """`vote(signature)`: why an error with this signature is deterministic (`raised_everywhere`), or ""."""
    global _same_everywhere
    _same_everywhere = vote


def set_error_context(context: Callable[[], str] | None) -> None:
    """`context()`: where this run of the script stands, when that explains an error it raised ("" otherwise)."""
    global _context
    _context = context


def error_context() -> str:
    return _context() if _context is not None else ""


def raised_everywhere(signature: str) -> str:
    """Why the script's error is deterministic (every rank raised it at the same point, or it was raised there again
    after the job resumed): a restart would raise it again. "" if it is not known to be."""
    return _same_everywhere(signature) if _same_everywhere is not None else ""


def again_at_end() -> bool:
    """The script ended: True if it must run again (a peer failed before the job agreed to finish)."""
    return _available and _at_end is not None and _at_end()
