"""How many of the training loader's batches a step takes: what a commit adds to the position (the batches of the
epoch taken by committed steps), from which a restore reads on.

A step takes the batches fetched from its beginning to its commit (gradient accumulation takes several), except
those fetched after its last training forward: a loop that takes the next batch during the step (a prefetch:
`batch = next(it)` between the backward and `optimizer.step()`) trains it in the next step, which counts it as its
own. Counted in the step that fetched it, the position ran one batch ahead of what was trained, and a restore
skipped a batch. A fetch the guard sees no training forward around (a model trainguard does not wrap) counts in
the step that fetched it.
"""

from __future__ import annotations


class StepBatches:
    def __init__(self) -> None:
        self.fetched = 0  # training batches of this pass since the last commit
        self.after_forward = 0  # of those, fetched after the step's last training forward so far
        self.ahead = 0  # fetched by the last committed step after its last training forward: this step's first
        self.rolled = False  # the training loader began its next pass since the last commit

    def took(self, after_a_forward: bool) -> None:
        """A training batch was fetched; `after_a_forward`: in a step that already ran a training forward."""
        self.fetched += 1
        if after_a_forward:
            self.after_forward += 1

    def forward(self) -> None:
        """A training forward of the step returned: the batches fetched before it were its step's."""
        self.after_forward = 0

    def new_pass(self) -> None:
        """The training loader began its next pass: the position counts the new pass's batches."""
        self.fetched, self.after_forward, self.ahead, self.rolled = 0, 0, 0, True

    def pending(self) -> int:
        """Batches of this pass fetched since the last commit, with the one the last step took ahead."""
        return self.fetched + self.ahead

    def commit(self) -> int:
        """The step commits: the batches it adds to the position (at least one, within a pass)."""
        taken = self.fetched - self.after_forward + self.ahead
        batches = taken if self.rolled else max(1, taken)
        self.fetched, self.ahead, self.after_forward, self.rolled = 0, self.after_forward, 0, False
        return batches
