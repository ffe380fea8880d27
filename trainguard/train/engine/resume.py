"""Where the script's loop starts: the job's position, handed to a loop over epochs or over steps.

    for epoch in range(trainguard.start_epoch(), epochs): ...        # a loop over epochs
    for step in range(trainguard.start_step(), steps): ...           # a loop over steps
    overall_step = trainguard.start_batch(len(loader), overall_step)  # a counter of batches

Either call joins the job's state first (guard.py: fresh, from a peer, or from disk)."""

from __future__ import annotations

import sys

from ... import rewinding
from . import guard as guard_mod
from .guard import current


_first_default: dict[str, int] = {}  # what this process's first run of the script passed to start_epoch(), start_step()


def _own_resume_point(what: str, default: int) -> bool:
    """Whether `default` is the script's own resume point (computed or loaded) rather than its loop's first epoch or
    step: it differs from what this process's first run of the script passed, or, in that run, is past 1 (a loop
    numbered from 1 passes 1 every time; a resume point of 1 goes unmentioned)."""
    if what not in _first_default:
        _first_default[what] = default
        return default > 1
    return default != _first_default[what]


def _say_not_own(session, what: str, default: int) -> None:
    if session.rt.rank == 0:  # the script's own resume point, computed or loaded, is not where it starts
        print(f"trainguard: the loop starts where the job is (step {session.step}: epoch {session.epoch}, batch "
              f"{session.in_epoch}, from {session.source}), not at the script's own resume point ({what} {default}); "
              "a snapshot the script loaded was replaced by trainguard's state (keep that loading for runs without "
              "trainguard)", file=sys.stderr, flush=True)


def start_epoch(default: int = 0) -> int:
    """The epoch this process's loop starts at: where the job is (a replacement, a rerun), else `default`.
    A `default` from the script's own resume code is not used (rank 0 says so)."""
    guard = current()
    guard.epochs_asked = True  # a step whose batch no trainguard loader gave is refused (guard.NO_EPOCHS)
    session = guard.ensure_started()
    own = _own_resume_point("epoch", default)
    if not session.step:  # a fresh job: the script's own resume point (its weights were broadcast from rank 0)
        session.epoch = max(session.epoch, default)
        session.passes.commit(session.epoch, session.in_epoch)
        return session.epoch
    if own:
        _say_not_own(session, "epoch", default)
    return session.epoch


def start_step(default: int = 0) -> int:
    """The step this process's loop starts at, for a loop over steps rather than epochs
    (`for step in range(trainguard.start_step(), steps)`): the committed steps where the job is (a
    replacement, a rerun, the script run again after a fault), else `default`. On a fresh job the job counts its
    steps from `default` (the script's own resume point: its checkpoint's step), so a run after a fault starts where
    the script's counter was (it started at the job's own count, 60 for 180: a blind DDPM port trained 60 steps
    more, and wrote its step-named saves again with other weights)."""
    session = current().ensure_started()
    own = _own_resume_point("step", default)
    if not session.step:
        session.step = max(default, 0)
        return session.step
    if own:
        _say_not_own(session, "step", default)
    return session.step


def start_batch(per_epoch: int, default: int = 0) -> int:
    """The training loader's batches the job's committed steps took since it began, for a loop that counts its
    batches itself (Accelerate's complete examples count `overall_step`, which names and times their step
    checkpoints): where the job is (a replacement, a rerun), else `default`. `per_epoch`: the batches of one pass
    (`len(train_dataloader)`). A counter left at 0 after a fault saved the later step checkpoints at other steps, with
    other weights, while the training itself stayed exact. Not under `elastic` (a pass split again mid-epoch)."""
    session = current().ensure_started()
    return session.epoch * per_epoch + session.in_epoch if session.step else default


def restored() -> bool:
    """True once this process's state came from a restore (a replacement, a run of the script after a fault, a
    resume from disk): what the script writes now may be written again, where its run before the fault wrote it."""
    return bool(current().ensure_started().source)


def error_context() -> str:
    """Beside an error the script raised (launch/worker_main.py): a run that resumed after an epoch's last batch, whose
    loop took no batch, leaves a value the script sums over the epoch's batches as it started (docs/porting.md)."""
    guard = guard_mod.active()
    session = guard.session if guard is not None else None
    if session is None or not session.passes.begun_at_end:
        return ""
    return (f"this run of the script resumed after epoch {session.epoch}'s last batch (the fault came after it, in the "
            "code that follows the loop), so its loop took no batch: a value summed over the epoch's batches in a plain "
            "variable (`total_loss += loss`) still holds its first value, if the error comes from one; log one that "
            "holds with no batch (`float(total_loss)`), or keep it in an object given to trainguard.register_state "
            "(docs/porting.md)")


rewinding.set_error_context(error_context)
