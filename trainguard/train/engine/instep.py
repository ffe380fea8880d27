"""Recovery inside the step: a fault in the gradient exchange costs the survivors a step, not the script's setup.

Under `trainguard run` a fault sends every rank back to the committed step by running the script again (rewind.py),
so every survivor paid the script's setup again: building and wrapping the model, the optimizer, the loaders, a
compiled model's graphs. The most common fault does not need that. A rank killed in the middle of a step leaves
the survivors in that step's gradient exchange, which fails at the end of their backward; each of them holds the
committed step k, has computed its own gradients for step k+1 from the committed position, and has run nothing of
the script past the backward. Such a rank stays where it is:

1. its exchange kept its own gradients as it launched them (gradsync.py, `on_failure`; one copy of the gradients
   per step, made only while such a recovery is possible: after the job's first recovery, see below);
2. the moves its forward made to the buffers (BatchNorm) are put aside and the committed ones put back, so what it
   sends a replacement is step k;
3. it regroups, agrees on the restore step and, if the job's step is its own k (`SourceKind.SELF`), serves the
   replacement and attaches the new group (recovery.py, `in_step`); its position, streams and loaders stay where
   the step has them;
4. its buffers' moves go back, and the exchange runs again from its own gradients in the new group, where the
   replacement (the script run from the top, resumed at step k: its step k+1's batch, seeds and gradients are the
   ones the dead rank had) and every rank that ran the script again meet it with their step k+1 exchange.
   The backward returns with the mean, as in a run without a fault: the script's code after it, its clipping,
   `optimizer.step()` and everything after, run once, as they would have.

Why it is exact: the gradients a survivor sends again are the bits it computed from the same parameters, batch and
seeds; the exchange's layout and order are fixed by the model and the world size (gradsync.py), so the sum is the
one the run without a fault made. Every other rank comes to the same exchange from the committed step k, as after
any rewind.

The replay audit. A rewind makes every survivor replay the step it was in, and the replay audit (audit.py) compares
each replay with its first run: that is how a script with state trainguard does not see (a generator or counter of
its own) is caught, since the replacement runs the same resume code and its first step has no first run to compare
with. A rank that stays replays nothing. So a job recovers inside the step only once it was seen to resume exactly:
its first fault in a step rewinds every rank, and once a replayed forward matched its first run (audit.verified(),
told to every rank in the next exchange, and to a replacement with the state) the later ones stay. With the audit
off (`--exact off`, for a script `trainguard verify` found exact) it stays from the first fault.

When it is not used, and the rank rewinds as before: the job's step is not its own (a peer finished step k+1: it
takes that state and runs the script again), the recovery failed (a second fault: every rank goes through the
script), the rank's pass is not its committed position's (the step after an epoch's last: a replacement resumed at
the epoch's end runs the eval and barriers after it, which the ranks that stay have run), a sharded model (its
shards' copies move in collectives the script's setup makes), `elastic` (a new world size splits the data again),
and a script that makes collectives of its own in its setup or inside a step (worker/prologue.py: a replacement's
would pair with nothing while the others wait in their exchange; one that calls such a collective only on a resume
says so, and every rank rewinds).
"""

from __future__ import annotations

import torch

from ...errors import Rewind
from ...worker import prologue
from ..parallel.riders import Flag
from . import audit


def arm(session) -> None:
    """A data-parallel session of the user's own loop under `trainguard run`: its exchange may recover in the step
    (when `_armed` says so, at the failure)."""
    if session.sync is None:
        return
    session.sync.after_exchange = prologue.exchange_done
    prologue.resuming()  # the session starts: the script's setup is over
    if session.rewinds and session.live is None and not session.strategy.elastic:
        session.sync.on_failure = lambda error: _recover(session, error)
        session.sync.keeps_local = lambda: _armed(session)  # no copy of the gradients until a fault could use it
        # what one rank learnt, every rank knows after the next exchange: that the job resumes exactly, that the
        # script makes collectives of its own before its first exchange or inside a step
        session.sync.ride(Flag(audit.verified, audit.trust))
        session.sync.ride(Flag(prologue.made_collectives, prologue.learn_made))


def recover_between(session, guard) -> bool:
    """At the training loader's next batch, a recovery due (the job regrouped, or a collective failed) is carried out
    here, in place, where this rank stands exactly at its committed position: nothing of the next step fetched, the
    same pass. True if it did and stays; False if nothing was due or the rank cannot stay (the caller rewinds)."""
    if not _armed(session) or guard.in_step or guard.batches.pending():
        return False
    reason = session.take_pending()
    if reason is None and not session.rt.broken():
        return False
    reason = reason or f"generation {session.rt.generation} is over"
    if not _recover(session, reason):
        raise Rewind(f"{reason}; the job's step is not this rank's")
    return True


def _armed(session) -> bool:
    """Whether a fault now may be recovered without running the script: the script makes no collective of its own in
    its setup or inside a step; the job was seen to resume exactly (or its audit is off); and this rank's pass is its
    committed position's (a replacement resumed at an epoch's end would run the code after the epoch, its eval and
    barriers, which the ranks that stay have run)."""
    trusted = audit.verified() or session.rt.cfg.exact == "off"
    at_commit = session.passes.committed[:2] == (session.epoch, session.in_epoch) and not session.passes.ended
    return (session.sync is not None and session.sync.on_failure is not None and trusted and at_commit
            and session.holds_state and not prologue.made_collectives())


def _recover(session, error: BaseException | str) -> bool:
    """Called by the failed exchange at the end of backward: True if this rank stays in its step and the exchange
    runs again (see the module docstring)."""
    if not _armed(session):  # learnt since: the replacement's setup would call collectives nobody pairs
        return False
    buffers = session.buffers
    moved = [b.detach().clone() for b in buffers.buffers] if buffers is not None else []
    if buffers is not None:
        buffers.rollback()  # the step's forward moved them: a replacement takes the committed ones
    session.rt.in_step = True  # said to the new generation as it forms (prologue.py)
    reason = error if isinstance(error, str) else f"step {session.step + 1}: {type(error).__name__}: {str(error)[:300]}"
    try:
        stays = session.recovery.run(form=True, reason=reason, in_step=True)
    finally:
        session.rt.in_step = False
    if stays and moved:
        with torch.no_grad():
            torch._foreach_copy_(buffers.buffers, moved)
    return stays
