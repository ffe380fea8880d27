"""Plain variables of the script's that a rewind starts again: a best score, an early-stop counter.

A rewind runs the script again from the top, so a number the loop keeps in a plain variable (`best_val_loss =
float("inf")`, `patience = 0`, imagenet's `best_acc1`) starts again from its first value, while the model, the
optimizer and the position come back as they were. What the script then decides from it differs from the run
without the fault: an early stop at another epoch, a `model_best` file written again with other weights (a blind
port: exit 0, other weights, and `trainguard verify` identical, since the stop came after its last step). Nothing
in the replayed forwards shows it.

So each rank notes, as each step begins, the int and float variables of the script's frames on the stack (the loop's
and its callers', up to four; not trainguard's, torch's or an installed package's). When a rewind has run the script
again and the step it resumed at begins, a survivor compares them with what it noted as that step began before the
fault, and names those that differ, with the fix (`register_state`). A variable that changed at each of the two
step beginnings before (a running sum, a timer, a per-process counter) is left out: it was never a value to keep,
and it would be said after every fault. A clock's reading is left out too (a Unix timestamp, or a value of
`time.perf_counter()`/`monotonic()` since this process started: an epoch's start time). Costs a few microseconds a
step.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
import time

from ...worker.ledger import OURS

_SKIP = tuple({*OURS, *(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "purelib", "platlib"))})
FRAMES = 4  # the script's frames looked at, innermost first
KEPT = 3  # step beginnings noted in this run of the script
_STARTED = time.perf_counter() - 1.0  # a float between this and now is a clock's reading (Linux: both CLOCK_MONOTONIC)

_recent: list[tuple[int, dict]] = []  # (step, variables) at this run's last KEPT step beginnings
_before: list[tuple[int, dict]] | None = None  # the run before the rewind's, until the step it resumed at begins


def variables(frame) -> dict[str, float]:
    """{"name (function)": value} of the int and float variables in the script's frames from `frame` outwards."""
    found: dict[str, float] = {}
    seen = 0
    while frame is not None and seen < FRAMES:
        code = frame.f_code
        if not code.co_filename.startswith(_SKIP) and not code.co_filename.startswith("<"):
            seen += 1
            for name, value in frame.f_locals.items():
                if type(value) in (int, float) and not name.startswith("_") and not _clock(value):
                    found.setdefault(f"{name} ({code.co_name})", value)
        frame = frame.f_back
    return found


def _clock(value: float) -> bool:
    if type(value) is not float:
        return False
    return (1e9 <= value < 1e10 and value != int(value)) or _STARTED <= value <= time.perf_counter() + 1.0


def differing(before: list[tuple[int, dict]], step: int, now: dict) -> list[tuple[str, float, float]]:
    """(name, before, now) of the variables that held another value as `step` began before the fault, leaving out
    those that changed at each of the two step beginnings before it (pure)."""
    notes = dict(before)
    then = notes.get(step)
    if then is None:
        return []
    older = [notes[s] for s in (step - 1, step - 2) if s in notes]
    found = []
    for name, value in then.items():
        moving = len(older) == 2 and not _same(value, older[0].get(name)) and not _same(older[0].get(name),
                                                                                       older[1].get(name))
        if name in now and not moving and not _same(value, now[name]):
            found.append((name, value, now[name]))
    return found


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def step_begins(session) -> None:
    """A step begins: note the script's variables; after a rewind, at the step it resumed at, say which differ."""
    global _before
    try:
        now = variables(sys._getframe(2))
    except Exception:  # never in the way of training
        return
    before, _before = _before, None
    if before is not None and (found := differing(before, session.step, now)):
        say(session.rt, session.step, found)
    _recent.append((session.step, now))
    del _recent[:-KEPT]


def rewound() -> None:
    """This run of the script is over (a rewind): its notes are what the next run is compared with."""
    global _before, _recent
    _before, _recent = _recent, []


def say(rt, step: int, found: list[tuple[str, float, float]]) -> None:
    listed = ", ".join(f"{name}: {old!r} before, {new!r} now" for name, old, new in found[:6])
    rt.events.emit("plain_variables", rank=rt.rank, step=step, names=[name for name, _, _ in found][:16],
                   generation=rt.generation)
    print(f"trainguard: rank {rt.rank}: after the rewind to step {step}, the script's plain variables differ from "
          f"what they held at that step before the fault ({listed}). The script ran again from the top and they "
          "started again from their first values; trainguard does not hold them. If one decides the training (a best "
          "score, an early-stop counter), the run after a fault no longer decides as the run without one: keep it in "
          "an object with state_dict()/load_state_dict() given to trainguard.register_state(), or derive it from "
          "trainguard.start_step(); a value only printed (a sum for a log line) changes what is printed",
          file=sys.stderr, flush=True)
