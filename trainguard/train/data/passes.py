"""The training loader's passes over the epochs, and the position a commit fixes.

The script numbers its epochs as it likes (from 0, from 1, from its own snapshot) and hands the number to
`set_epoch(n)`: that number is the pass's *label*, the key of its shuffle, never a position. The position
(epoch, batches of the epoch taken by committed steps) is the job's, counted by the session, and what a peer,
a rewind or a checkpoint takes is the position *at the last commit*: a rank that has already begun the next
epoch's pass (the others had not) never makes the ranks resume at different positions.

When the pass over the committed epoch ends, the code after it runs (a scheduler stepped per epoch, an eval, a
save). A job that comes back to that position runs that code again, so what it takes is the hyperparameters
as the pass's end left them (`end_state`, until the next commit). The same within a step: what the loop body
moves before the update runs again after a fault in the step, so what a rank takes back is the hyperparameters
as the step began (`step_state`).
"""

from __future__ import annotations

from ...errors import ConfigError


def pass_length(loader) -> int | None:
    """Batches in one pass of `loader`; None for a stream (an IterableDataset without a length)."""
    try:
        return len(loader)
    except TypeError:
        return None


def pass_done(in_epoch: int, loader) -> bool:
    """A pass that stopped after `in_epoch` batches has ended (a stream ends when it says so)."""
    steps = pass_length(loader)
    return steps is None or in_epoch >= steps


class Passes:
    def __init__(self) -> None:
        self.label: int | None = None  # set_epoch() of the current epoch's pass, once one began
        self.ended = False  # the pass over the current epoch ran to its end in this process
        self.end_state: dict | None = None  # TrainState.hyperparameters() at that end, until the next commit
        self.step_state: dict | None = None  # the same as the step in flight began, until it commits
        self.committed: tuple[int, int, int | None] = (0, 0, None)  # (epoch, in_epoch, label) at the last commit
        self.ahead = 0  # and the batch its step took ahead (train/engine/batches.py), which travels with it
        self.begun_at_end = False  # a restored position's pass began at its end: the loop took no batch since

    def commit(self, epoch: int, in_epoch: int, state=None, ahead: int = 0) -> None:
        """The position is committed as it stands (a commit with its `state`, a restore, a fresh job's first epoch).
        A pass that ended before its last step committed (the loop took the next batch during that step, and there
        was none) ends at this commit: the code after it starts from the hyperparameters as they are now."""
        self.committed, self.ahead, self.begun_at_end = (epoch, in_epoch, self.label), ahead, False
        self.end_state = state.hyperparameters() if self.ended and state is not None else None
        self.step_state = None

    def begin_step(self, state) -> None:
        """A step begins: the hyperparameters as the committed step's code left them. What the loop body moves
        before the update (a scheduler stepped on an eval's loss at the top of the body, where the docs put an
        eval) runs again after a fault in it, so a rank that goes back to the committed position gives up those
        moves: it keeps, serves and saves these (a blind trainer's ReduceLROnPlateau stepped twice)."""
        if self.end_state is None and state is not None:
            self.step_state = state.hyperparameters(light=True)

    @property
    def held(self) -> dict | None:
        """The hyperparameters of the committed position, where the script has moved them on since; else None."""
        return self.end_state if self.end_state is not None else self.step_state

    def restore(self, label: int | None) -> None:
        """A restored position's pass, as its label; it has not ended in this process."""
        self.label, self.ended, self.end_state, self.step_state = label, False, None, None

    def roll(self) -> None:
        """The next epoch's pass begins: its label is unknown until its loader starts."""
        self.label, self.ended = None, False

    def end(self, state) -> None:
        """The pass over the committed epoch ran to its end: the next pass begins the next epoch, and the
        hyperparameters as they are now are those of the committed position."""
        if not self.ended:
            self.ended = True
            self.end_state = state.hyperparameters()

    def name(self, label: int) -> None:
        """The current epoch's pass, already under way, is shuffled with `label` (the first commit named its loader)."""
        if self.label is None:
            self.label = label

    def next_pass(self, label: int, done: bool) -> bool:
        """A pass shuffled with `label` begins at a restored position whose pass is `done`: True if it is the next
        epoch's (the label after the restored one; a loop that counts its epochs from its steps resumes there, at
        the same batch), which then begins as it would have without the fault."""
        return done and self.label is not None and label == self.label + 1

    def begin(self, label: int, *, step: int, epoch: int, in_epoch: int) -> None:
        """The training loader starts a pass shuffled with `label`: the first pass of the epoch names it; one that
        differs from the restored position's label means the script's loop resumed at another epoch (ConfigError)."""
        if self.label is None:
            self.label = label
        elif label != self.label:
            raise ConfigError(
                f"this process resumed at step {step}, in epoch {epoch} of the job (batch {in_epoch}), whose pass the "
                f"loop shuffled with set_epoch({self.label}), but the loop now calls set_epoch({label}): start the "
                "epoch loop where the job is, `for epoch in range(trainguard.start_epoch(), epochs)` (a generator that "
                "cycles over the epochs: start it at trainguard.start_epoch()), and number its epochs as before")
