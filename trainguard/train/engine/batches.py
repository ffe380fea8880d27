"""How many of the training loader's batches a step takes: what a commit adds to the position (the batches of the
epoch taken by committed steps), from which a restore reads on.

Each training forward trains one batch, in the order they were fetched; a batch fetched and not yet trained when
the step commits was taken ahead, and is the next step's. Loops take one ahead in two shapes: the next batch taken
during the step (`batch = next(it)` between the backward and `optimizer.step()`), and a prefetcher that takes the
next batch before it hands out the current one (timm's `PrefetchLoader`, apex's `data_prefetcher`). Counted in the
step that fetched it, the position ran one batch ahead of what was trained, and a restore skipped a batch. The
batch taken ahead travels with the committed position (`ahead`), and after a restore the loop's first fetch of it
neither counts again nor begins a step, as in the run without the fault, where the step began later.

A step that fetched two batches or more beyond its forwards feeds several batches to a forward (a concatenation):
from then on no batch counts as taken ahead (`ahead` is then `SEVERAL`, and travels so). The first such step, alike to a
prefetcher's first, counted one batch short until the next commit. A framework's loader, whose own loop fetches
ahead inside its iterator (Accelerate's) or is accounted by the integration (Lightning's), counts its fetches, as
does a step whose forwards the guard does not see (a model trainguard does not wrap).
"""

from __future__ import annotations

from ...errors import ConfigError

SEVERAL = 2  # `ahead` (else 0 or 1) of a job whose forwards take several batches each: none is ever taken ahead


class StepBatches:
    def __init__(self, ahead: int = 0) -> None:
        self.fetched = 0  # training batches of this pass since the last commit
        self.forwards = 0  # training forwards since the last commit
        self.lookahead = True  # the training loader is trainguard's (a framework's counts its fetches)
        self.rolled = False  # the training loader began its next pass since the last commit
        self.restore(ahead)

    def restore(self, ahead: int) -> None:
        """The committed position's `ahead`: that many of the loop's next fetches are batches the committed step had
        taken, fetched again."""
        self.several = ahead == SEVERAL
        self.ahead = self.carried = 0 if self.several else ahead
        self.fetched = self.forwards = 0
        self.rolled = False

    def took(self, lookahead: bool) -> bool:
        """A training batch was fetched (`lookahead`: from trainguard's loader). False: one taken ahead before the
        restore, fetched again, which neither counts again nor begins a step."""
        self.lookahead = lookahead
        if self.carried:
            self.carried -= 1
            return False
        self.fetched += 1
        return True

    def forward(self) -> None:
        self.forwards += 1

    def new_pass(self) -> None:
        """The training loader began its next pass: the position counts the new pass's batches."""
        self.fetched = self.forwards = self.ahead = self.carried = 0
        self.rolled = True

    def pending(self) -> int:
        """Batches of this pass fetched and not committed: since the last commit, and the one taken ahead."""
        return self.fetched + self.ahead

    def commit(self, known: bool = False) -> int:
        """The step commits: the batches it adds to the position (at least one, within a pass). `known`: the job
        knows its training loader, from which this step then took a batch, else ConfigError (two updates a batch)."""
        pending = self.pending()
        if known and self.lookahead and not (pending or self.rolled or self.several):
            raise ConfigError(TWO_UPDATES)
        extra = pending - self.forwards if self.forwards and self.lookahead and not self.several else 0
        if extra > 1:
            self.several, extra = True, 0
        ahead = max(extra, 0)
        batches = pending - ahead if self.rolled else max(1, pending - ahead)
        self.fetched, self.forwards, self.ahead, self.carried, self.rolled = 0, 0, ahead, 0, False
        return batches

    def committed_ahead(self) -> int:
        """What travels with the position (pure read)."""
        return SEVERAL if self.several else self.ahead


TWO_UPDATES = ("optimizer.step() was called a second time on the same batch: this step took no batch from the loader "
               "that drives the training steps (a GAN's discriminator and generator updates, each a step()). trainguard "
               "commits one update a batch and resumes at the batch after the last commit, so a fault between the two "
               "updates would resume past the batch whose second update never ran. Two updates a batch (a GAN's "
               "alternating ones) are not covered: make one update a batch, or loop over trainguard.start_step() with "
               "each step deriving its batch and its phase from the step number")
