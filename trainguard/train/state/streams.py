"""The rule for randomness: where a rank's global random streams are keyed, and what a restore sets them to.

A script draws from Python's, NumPy's and torch's (and CUDA's) global generators anywhere: dropout in a
forward, a random batch (`torch.randint` offsets), a batch drawn during the step for the next one (a
prefetch), an eval on one rank between steps, a loader iterator's base seed. Saving those states per rank
would need a collective per step and dies with the rank. Instead the streams are *keyed*: at fixed points
of every step they are seeded from (job seed, rank, a point of the step), so the stream at any point is a
function of where the rank is, known to a replacement without having been saved.

The points (`k` = committed steps before the step; `m` = its training forwards so far):

- the step begins (once its first training batch from a trainguard loader is fetched, or at its first training
  forward): key ``k``;
- a training forward (the model in train mode, grad enabled) returns: key ``k/m``;
- a step commits without a training forward the guard saw (the Session API, a model trainguard does not
  wrap): key ``k+1/c``;
- the training loader (trainguard's, or a framework's) fetches a batch (each `next()` on its pass): key
  ``fetch/L/e/j`` for loader ``L``'s ``j``-th batch of its pass over epoch ``e``; before the first commit (the
  training loader not known yet) every pass of a trainguard loader is keyed so;
- under virtual shards (`--virtual-shards`), keyed by the shard ``s`` instead of the rank, so a shard draws the same
  numbers at every world size: `trainguard.micro_batches` hands out ``s``'s micro-batch: key ``shard/s/k/batch``;
  ``s``'s training forward begins: key ``shard/s/k``;
- a restore to committed step ``c`` sets the streams as the end of step ``c``'s last training forward left
  them: key ``c-1/M`` (``M``, that step's forwards, travels with the state), or ``c/c`` where the step had
  none; a fresh start (``c`` = 0): key ``start``.

The script's own `torch.Generator`s (worker/generators.py) are keyed at every commit and restore to ``c``, from
the seed the script gave them instead of the rank: key ``own/c``. What the script draws from one between two commits
(the next batch, at the top of its loop) is then the same in every run that reaches that step.

A loader is asked for the next batch at other points than the step's beginning: a framework's loader fetches ahead
(Accelerate's and Lightning's fetch the next batch as they hand out this one), a prefetcher takes the next batch
during the step, and a loader with no position to set (a framework's, a stream) is read again from its pass's
start after a restore. What a fetch draws in this process (an augmentation in `__getitem__`, a stream's draws)
is then the same in every run; the step's own draws (a forward's dropout) come after a fetch or a forward's key.

So whatever the script draws after a step's last forward and before the next step begins, other than a fetch
(the optimizer, the code after the step, an eval on one rank, a loader's next pass), comes from key ``k/M`` in the
run without a fault and in every run that comes back to step ``c``: the script, run again from the top, passes
`start_step()` (the restore), then draws the same numbers in the same order. What the script drew before the
restore (its model's initialisation, a value drawn before `start_step()` and kept) is not covered: it is redrawn
from the script's own seed, or from another stream.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from ...worker.generators import script_generators
from ...worker.ledger import ledger

SEED_RANGE = 1 << 63
START = "start"


def key_seed(seed: int, rank: int | str, point: str) -> int:
    """The seed of `rank`'s streams at `point` (pure; `rank` may name another owner: a generator of the script's)."""
    digest = hashlib.blake2b(f"{seed}:{rank}:{point}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_RANGE


def seed_streams(s: int) -> None:
    """Seed Python's, NumPy's, torch's (and CUDA's, once initialised) global random streams with `s`."""
    random.seed(s)
    np.random.seed(s % (1 << 32))
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed(s)


def stream_states() -> dict:
    """Python's, NumPy's and torch's global random states now (a loader worker's, kept with a stream's position:
    train/data/streamstate.py)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_stream_states(states: dict) -> None:
    """Set what `stream_states()` took."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def restore_point(step: int, forwards: int) -> str:
    """The key a restore to committed step `step` sets (pure); see the module docstring."""
    if step == 0:
        return START
    return f"{step - 1}/{forwards}" if forwards else f"{step}/c"


def fetch_pass(loader: int, epoch: int) -> str:
    """The key of the training loader's pass over `epoch` (pure; see the module docstring)."""
    return f"{loader}/{epoch}"


class Streams:
    """One rank's keyed streams: the session calls it at the points of the module docstring."""

    def __init__(self, rt):
        self.seed: int | None = None  # the job's seed; None: nothing is keyed (before the job agreed on one)
        self.rt = rt  # the worker runtime: its rank is this generation's
        self.forwards = 0  # training forwards of the step in flight
        self.committed_forwards = 0  # training forwards of the last committed step (travels with the state)

    def _seed(self, point: str) -> None:
        ledger.progressed()  # every point of a step is progress (a hang: worker/ledger.py)
        if self.seed is not None:
            seed_streams(key_seed(self.seed, self.rt.rank, point))

    def step_begins(self, step: int) -> None:
        self.forwards = 0
        self._seed(str(step))

    def shard_begins(self, step: int, shard: int) -> None:
        """Under virtual shards, a training forward of `shard` begins: its draws (dropout) are the shard's, the same
        on whichever rank and world it runs (train/parallel/exactsum.py)."""
        if self.seed is not None:
            seed_streams(key_seed(self.seed, 0, f"shard/{shard}/{step}"))

    def shard_batch(self, step: int, shard: int) -> None:
        """Under virtual shards, `trainguard.micro_batches` hands out `shard`'s micro-batch: what the loop draws
        before its forward is the shard's too (another key than the forward's, so the two do not repeat each other)."""
        if self.seed is not None:
            seed_streams(key_seed(self.seed, 0, f"shard/{shard}/{step}/batch"))

    def forward_done(self, step: int) -> None:
        self.forwards += 1
        self._seed(f"{step}/{self.forwards}")

    def committed(self, step: int) -> None:
        """`step` is the new count of committed steps."""
        self.committed_forwards, self.forwards = self.forwards, 0
        if not self.committed_forwards:
            self._seed(f"{step}/c")
        self.own_generators(step)

    def own_generators(self, step: int) -> None:
        """Key the script's own generators for what it draws after committed step `step` (worker/generators.py)."""
        if self.seed is not None:
            for g, script_seed in script_generators():
                g.manual_seed(key_seed(self.seed, f"generator {script_seed}", f"own/{step}"))

    def fetch(self, point: str, j: int) -> None:
        """The fetch of batch `j` of the training loader's pass `point` (`fetch_pass`) begins."""
        self._seed(f"fetch/{point}/{j}")

    def skipped(self) -> None:
        self.forwards = 0

    def restored(self, step: int) -> None:
        """Restored to committed step `step`, whose training forwards are `committed_forwards`."""
        self.forwards = 0
        self._seed(restore_point(step, self.committed_forwards))
        self.own_generators(step)
