"""A step past the end of the data: `optimizer.step()` with no batch and no training forward since the last step,
after the training loader's pass over the epoch has ended.

A loop that counts its steps from 0 within an epoch and takes its batches from an iterator of the loader
(`for step in range(steps_per_epoch): micro = [next(it) ...]`, catching StopIteration as a short last step) makes
more steps after a restore in the middle of an epoch than the loader has batches left: the loader goes on from the
committed batch, the count starts again at 0. The run without the fault never made those steps (each of its steps
had a batch). So they are skipped: no update and no commit, and what the script's `scheduler.step()` moves after
them is put back before anything reads it (`settle`): the job stays exact. Rank 0 says so, once a pass.
"""

from __future__ import annotations

import sys

class PastTheData:
    """The hyperparameters before the first step skipped past the data, until they are put back."""

    def __init__(self) -> None:
        self.saved: dict | None = None
        self.told: set[tuple[int, int]] = set()  # (generation, epoch) already said

    def skip(self, session) -> bool:
        """Is a step without a batch or a training forward one past the end of the training loader's pass? Then it
        is skipped, and the hyperparameters as they are are kept to be put back."""
        if not session.passes.ended:
            return False
        if self.saved is None:
            self.saved = session.state.hyperparameters()
        key = (session.rt.generation, session.epoch)
        if key not in self.told and session.rt.rank == 0:
            self.told.add(key)
            print(f"trainguard: optimizer.step() after the training loader's pass over epoch {session.epoch} ended, "
                  "with no batch and no training forward since the last step: skipped, and the LR scheduler's steps "
                  "after it undone. The run without the fault never made such a step: the loop counts its steps from "
                  "0 and resumed in the middle of the epoch (stop it when the loader is exhausted to do without "
                  "these)", file=sys.stderr, flush=True)
        return True

    def settle(self, state) -> None:
        """Put back what the script moved after the skipped steps: at the next batch, forward, `zero_grad()` or
        `optimizer.state_dict()`, and at the end of the script."""
        if self.saved is not None:
            state.put_back(self.saved)
            self.saved = None
