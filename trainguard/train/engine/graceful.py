"""Leaving a job on purpose: a graceful exit on a signal, or a stop after a fault (strategies exit, dump).

Graceful exit (reference: ModelArts' dying-gasp checkpoint on SIGTERM). SIGTERM, SIGINT and
SIGUSR1 (Slurm's warning before a requeue), sent to the launcher or straight to one worker, only
set a flag here: a handler runs between two bytecodes of the main thread, which may be inside a
collective or a write. The flag rides on the next commit point's all-gather, so every rank
learns it at the same committed step s, whichever rank got the signal. Then every rank:

  1. saves a dying-gasp checkpoint of step s with each saver (ModelCheckpoint with
     CheckpointConfig(exception_save=True), or ExceptionCheckpoint) before its deadline:
     signal time + grace period (TG_GRACE_PERIOD, the launcher's --grace-period) less a margin;
     each rank writes its own file into the checkpoint's shared folder, and rank 0 writes the
     manifest once every rank's file is there (checkpoint/jobsave.py);
  2. tells the scheduler it stopped (the job ends STOPPED, the next run starts a new job);
  3. raises JobStopped(EXIT_PREEMPTED): the process exits with code 75.

A save still running at the deadline is abandoned and the process leaves with os._exit: the
checkpoint format writes the manifest last and renames the folder into place, so a cut save
never looks complete, and the next run resumes from the newest complete one. A second signal
gives up at once (the signal's default action), unless it comes within ECHO_WINDOW_S of the first:
a signal sent to every process of the job (Slurm's scancel, a kill of the process group) reaches a
worker twice, once itself and once forwarded by the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from typing import NoReturn

from ... import rewinding, signals
from ...errors import JobStopped
from ...exitcodes import EXIT_FAULT_STOP, EXIT_PREEMPTED
from ...signals import ECHO_WINDOW_S, signal_name
from .dump import DumpResult, dump_targets, write_dying_gasp

log = logging.getLogger("trainguard.graceful")

MARGIN_FRACTION, MARGIN_MAX_S = 0.2, 1.0  # of the grace period, kept for leaving after the save
GOODBYE_PATIENCE_S = 2.0


class StopRequest:
    """The flag the signal handlers set; `armed()` installs them for the life of the step loop."""

    def __init__(self) -> None:
        self.signum = 0
        self.at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}

    @contextlib.contextmanager
    def armed(self):
        self._previous = signals.install(self._on_signal)
        held = signals.take_held()  # a signal that came while the script started: stop at the first commit
        if held is not None and not self.signum:
            self.signum, self.at = held
        try:
            yield self
        finally:
            self._disarm()

    def _disarm(self) -> None:
        if self._previous and self.signum:  # not acted on (acting ends the process): held again for the next loop
            signals.hold(self.signum, self.at)
        signals.restore(self._previous)
        self._previous = {}

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signum and time.monotonic() - self.at < ECHO_WINDOW_S:
            return  # the same stop twice: Slurm signals every process of a step, and the agent forwards it too
        if self.signum:  # a second signal: no more patience
            self.signum = 0
            self._disarm()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum, self.at = signum, time.monotonic()

    def deadline(self, grace: float) -> float:
        """When a dying-gasp save must be done: the signal's time (else now) + grace, less a margin for leaving."""
        start = self.at if self.at is not None else time.monotonic()
        return start + grace - min(MARGIN_MAX_S, MARGIN_FRACTION * grace)


def _leave(session, code: int, reason: str, result: DumpResult | None) -> NoReturn:
    if result is not None and result.pending:  # the save thread still writes: it must not finish
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise JobStopped(code, reason, session.step)


def resume_hint() -> str:
    """How to resume from the dying gasp, said by each rank: under `trainguard run` the launcher's last line says
    (its recovery folder may be a temporary one, which the same command would not find again)."""
    return ("the launcher's last line says how to resume" if rewinding.available() else
            "run the same command again to resume")


def stop_gracefully(session, signum: int) -> NoReturn:
    """Every rank agreed, at the commit of `session.step`, that the job stops: save, say goodbye, exit 75."""
    rt, step, name = session.rt, session.step, signal_name(signum)
    deadline = session.stop.deadline(rt.cfg.grace_period)
    snap = session.capture()
    result = write_dying_gasp(session.gasp_savers, [(snap, rt.rank, snap.own)], steps_per_epoch=session.steps_per_epoch,
                              world_size=rt.world_size, grace=rt.cfg.grace_period, deadline=deadline)
    reason = f"{name} at step {step}"
    rt.events.emit("graceful_exit", rank=rt.rank, step=step, signal=name, saved=result.saved_steps(),
                   pending=result.pending)
    then = (resume_hint() if result.saved or result.completed else
            "nothing was saved, so running the same command again starts over")
    print(f"trainguard: rank {rt.rank}: {name}: stopped at step {step}; {result.describe()}; {then}",
          file=sys.stderr, flush=True)
    rt.finish(ok=True, stopped=True, detail=f"stopped on {reason}", patience=GOODBYE_PATIENCE_S)
    _leave(session, EXIT_PREEMPTED, reason, result)


def stop_on_fault(session, reason: str, *, verdict: int | None = None) -> NoReturn:
    """A fault that the recover strategy does not recover from: dump if asked, say goodbye, exit 76. A verdict on
    the script (a desync: control/waits.py; a replay that differed: audit.py) always saves the committed state's
    dying gasp, and exits with its own code."""
    rt, strategy = session.rt, session.strategy
    if session.sync is not None:  # trainguard's DDP (a script's model may have a `drop` of its own: a Dropout)
        session.state.model.drop()
    rt.drop_group()  # peers still blocked in a collective with us fail at once
    for saver in session.disk_sources:  # a save waiting for a dead peer's part is left incomplete
        saver.settle(GOODBYE_PATIENCE_S)
    result = None
    if strategy.dump or verdict is not None:
        deadline = session.stop.deadline(rt.cfg.grace_period)
        items, notes = dump_targets(session.capture(), rt, patience=GOODBYE_PATIENCE_S)
        for note in notes:
            print(f"trainguard: rank {rt.rank}: dump: {note}", file=sys.stderr, flush=True)
        savers = [s for s in session.gasp_savers if not s.collective]  # a collective save needs the dead peers
        result = write_dying_gasp(savers, items, steps_per_epoch=session.steps_per_epoch,
                                  world_size=rt.world_size, grace=rt.cfg.grace_period, deadline=deadline,
                                  settle=GOODBYE_PATIENCE_S)
    saved = f"; {result.describe()}" if result is not None else ""
    rt.events.emit("stopped_on_fault", rank=rt.rank, step=session.step, strategy=str(strategy), reason=reason[-500:],
                   saved=result.saved_steps() if result else [])
    print(f"trainguard: rank {rt.rank}: stopping (recover strategy {strategy}): {reason}{saved}",
          file=sys.stderr, flush=True)
    rt.finish(ok=False, detail=f"stopped after a fault ({strategy}): {reason}", patience=GOODBYE_PATIENCE_S)
    _leave(session, verdict or EXIT_FAULT_STOP, reason, result)
