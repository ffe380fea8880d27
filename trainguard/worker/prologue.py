"""The script's own collectives before its first gradient exchange, and inside its steps (train/engine/instep.py).

A rank whose exchange failed may stay in its step while the replacement runs the script from the top (instep.py).
That pairs only if the replacement makes no collective of the script's own before it reaches the same exchange:
not in its setup (a `barrier()` after preparing data, a broadcast of a seed), and not in its first step's forward or
backward (SyncBatchNorm). The survivors waiting in their exchange call none of those, so the replacement would wait
for them forever.

This module watches for such collectives (`collectives.gate`: every collective of torch.distributed that is not
trainguard's own), by where the script is:
- in its *setup* (from the script's start, or its run again after a rewind, to the start of its training session)
  and inside a *step* (from its first batch or forward to the end of its exchange), a collective of the script's own
  means this process never recovers inside a step (`made_collectives`; every rank learns it in the next exchange);
- *resuming* (from the session's start to the end of its first exchange: the head of the epoch it resumed in, its
  first step), in a generation after the first, the first collective of the script's own, and the first of its
  setup, first ask the generation's store whether a rank waits in its step (each rank says so as it forms the
  generation: `Runtime.announce`). If one does, nothing would pair it: this rank rewinds (`Rewind`), which fails
  the generation, every rank runs the script again, as before in-step recovery existed, and the job recovers by
  rewinds from then on. That happens where the head of an epoch makes a collective only in later epochs.
"""

from __future__ import annotations

import enum

from ..errors import Rewind, TrainguardError
from . import collectives


class Phase(enum.Enum):
    SETUP = "setup"  # the script's start, to the start of its training session
    RESUMING = "resuming"  # the session's start, to the end of its first exchange
    STEP = "step"  # a step's first batch or forward, to the end of its exchange
    BETWEEN = "between"  # after an exchange: evals, saves, logging; the script's collectives there are its own affair


_phase = Phase.SETUP
_made = False  # a collective of the script's own was seen in a setup or a step, here or (told) on another rank
_checked = 0  # the generation whose store was asked


def made_collectives() -> bool:
    return _made


def learn_made() -> None:
    """Another rank saw the script make a collective of its own in its setup or a step."""
    global _made
    _made = True


def restarted() -> None:
    """The script runs again from the top (a rewind)."""
    global _phase
    _phase = Phase.SETUP


def resuming() -> None:
    """The script's training session starts (its state restored): what follows to its first exchange depends on
    where it resumed."""
    global _phase
    if _phase is Phase.SETUP:
        _phase = Phase.RESUMING


def step_began() -> None:
    global _phase
    if _phase is Phase.BETWEEN:
        _phase = Phase.STEP


def exchange_done() -> None:
    global _phase
    _phase = Phase.BETWEEN


def install(rt) -> None:
    """Watch the script's collectives of `rt`'s groups (runtime.init)."""
    collectives.gate = lambda name: _gate(rt, name)


def _gate(rt, name: str) -> None:
    global _made, _checked
    if _phase is Phase.BETWEEN:
        return
    if _phase is not Phase.RESUMING:
        _made = True
    if _phase is Phase.STEP or rt.generation < 2 or _checked == rt.generation:
        return
    _checked = rt.generation
    try:
        waiting = rt.peers_in_step()
    except TrainguardError as exc:  # the generation moved on while we asked: a fault like any other
        raise Rewind(f"generation {rt.generation} is over ({exc})") from exc
    if waiting:
        _made = True
        raise Rewind(f"the script calls torch.distributed.{name} before its first step's gradient exchange, while "
                     "the other ranks wait in that exchange (recovery inside a step): every rank runs the script again")
