"""One point of return: a fault anywhere sends every rank back to the committed step, and the script
runs again from the top in the same process.

Why from the top. A hand-written trainer makes collectives everywhere: the step's gradient
exchange, but also an eval pass's metric `all_reduce`, a `barrier()` per epoch, a `broadcast` of a
stop flag, rank 0's own save. After a failure every rank, the replacement included, must come
back to the same point of that sequence, or the next collective pairs different calls (a hang, or
silently wrong sums). A replacement can only start at the top of the script, and a survivor cannot
jump backwards in its own code; but it can run the script again, as the replacement does, with
its committed state kept in memory. Then every rank goes through the same code from the same
committed position: `start_epoch()` gives the epoch, the training loader goes on from the
committed batch, the other loaders (eval) start their pass again, and the script's own setup
collectives, barriers and saves happen again on every rank alike. The process keeps its imports
(torch, the script's modules), its connection to the scheduler and its node id: a rewind costs the
script's setup, not a process start.

The committed position. After the last step of an epoch the job stays *in* that epoch (at its end)
until the training loader starts the next one, so a fault in the eval pass that follows comes back
to before that eval pass, and a fault in the next epoch's first step comes back to after it.

What happens, in order: the exception reaches `trainguard run`'s worker entry
(launch/worker_main.py), which asks `rewinding.rewind(exc)`; `prepare` puts the buffers a
half-done step moved back, keeps the committed state of the run's session (packed, as a peer would
receive it), leaves the generation (its group cut and dropped, the failure reported), forgets the
loaders and ends their worker processes, and the guard disarms (`closers`); the entry runs the script
again; its `trainguard.init()` joins the next generation, and the new session adopts the kept state
before the job agrees on the restore step. Nothing of the run it left stays alive.

Faults, by type only: `Rewind`, `CollectiveFailed` (every collective is typed:
worker/collectives.py) and torch's `DistError`. Anything else ends the process as before. A
rank that rewinds more than the retry limit (TG_MAX_RETRIES) times in a row at the same step with
the same processes gives up (the error ends the process, and the launcher's restart policy takes
over).
"""

from __future__ import annotations

import logging
import sys
import textwrap

import torch.distributed as dist

from ... import rewinding
from ...errors import CollectiveFailed, Rewind
from ...exitcodes import VERDICTS
from ...worker import prologue, runtime as rt_mod
from ..data import plainloaders

log = logging.getLogger("trainguard.rewind")

FAULTS: tuple[type[BaseException], ...] = (Rewind, CollectiveFailed, *((dist.DistError,) if hasattr(dist, "DistError")
                                                                       else ()))

_kept: bytes | None = None
_live = None  # the Session of this run of the script, once it started
_loaders_made = 0  # trainguard.DataLoaders made by this run of the script
_last: tuple[int, frozenset] | None = None  # (step, members) of the last rewind
_in_a_row = 0
_rewound = False  # the script has run again in this process


def take_kept() -> bytes | None:
    """The committed state kept by the last rewind, once."""
    global _kept
    kept, _kept = _kept, None
    return kept


def track(session) -> None:
    """`session` holds this run's committed state from now on (Session.start)."""
    global _live
    _live = session


def rewound() -> bool:
    """True once the script runs again in this process: objects of its earlier run may still wait for the collector."""
    return _rewound


def next_loader_index() -> int:
    """A loader's number in this run of the script: the same loader gets the same number in every run."""
    global _loaders_made
    _loaders_made += 1
    return _loaders_made - 1


def _count(step: int, members: frozenset, limit: int) -> bool:
    """False past `limit` rewinds in a row at the same step with the same processes."""
    global _last, _in_a_row
    same = _last == (step, members)
    _last = (step, members)
    _in_a_row = _in_a_row + 1 if same else 0
    return _in_a_row <= limit


def prepare(exc: BaseException) -> bool:
    """Make this process ready to run the script again (see the module docstring); False if it cannot. The
    caller disarms what belongs to the script's run (the guard's signals and exit barrier)."""
    global _kept, _live
    rt = rt_mod.active()
    if rt is None or rt.finished or rt.rejoin:
        return False
    session = _live
    step = session.step if session is not None else 0
    if not _count(step, rt.members, rt.cfg.recover_strategy.max_retries):
        log.warning("rank %d: %d rewinds in a row at step %d with the same processes; giving up", rt.rank,
                    _in_a_row, step)
        return False
    reason = f"{type(exc).__name__}: {str(exc)[:300]}"
    if session is not None:
        if session.buffers is not None:
            session.buffers.rollback()  # a step cut short moved them
        _kept = session.pack_live() if session.holds_state else None
    _live = None
    global _loaders_made, _rewound
    _loaders_made = 0  # the script's next run makes its loaders again, in the same order
    _rewound = True
    prologue.restarted()
    plainloaders.end_workers()  # this run's loader workers (left to the collector, each cost 5 s)
    copies = session.live if session is not None else None  # a sharded model's copy exchange
    if copies is not None:
        copies.close(0.2)
    rt.leave(reason)
    if copies is not None:
        copies.close()  # a round blocked on a peer ended when the group was cut
    rt.events.emit("rewind", generation=rt.generation, rank=rt.rank, step=step)
    said = textwrap.shorten(reason, 200, placeholder=" ...")  # whole words: gloo's errors run long
    print(f"trainguard: rank {rt.rank}: back to step {step} ({said}); running the script again",
          file=sys.stderr, flush=True)
    return True


# --- the worker entry's questions (rewinding.py) -------------------------------------------------

closers: list = []  # callables run after a successful `prepare`: the guard forgets this run's wrappers
end_of_script = None  # callable: True if the script, having ended, must run again (the guard's finish)


def _handle(exc: BaseException) -> bool:
    session = _live
    if not isinstance(exc, FAULTS) or not prepare(exc):
        return False
    rt = rt_mod.active()
    verdict = rt.heart.verdict or rt.verdict  # as the heartbeat, or the reply to the failure report, said
    if verdict and session is not None:
        # the job ended on a verdict about the script (a desync: control/waits.py): no rewind, but the committed
        # state's dying gasp while this run's savers still exist; the process exits with the verdict's code
        from .graceful import stop_on_fault

        stop_on_fault(session, f"the job ended: {VERDICTS.get(verdict, 'a verdict on the script')}", verdict=verdict)
    for close in closers:
        close()
    return True


def _again_at_end() -> bool:
    return end_of_script is not None and end_of_script()


rewinding.set_handler(_handle, _again_at_end, lambda: _live is not None)
