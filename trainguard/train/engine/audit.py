"""The replay audit: a step a rank runs a second time after a fault is checked against its first run.

trainguard promises a result bit-identical to a run without faults, but a script can hold state it does not
see (a counter in a closure, a batch drawn before `start_step()` and kept, a file it reads back, a framework's
cache). Then the replay of a step differs from its first run, and so does everything after it. The audit
makes that visible the moment it happens instead of leaving a silently different result.

What is fingerprinted: every training forward (the model in train mode, grad enabled), its inputs (the
tensors among the forward's arguments) and its output, keyed by (committed step, the forward's number in
that step). A fingerprint is each tensor's dtype and shape and about a thousand of its elements, evenly
spaced, copied on the tensor's own device; their bits are compared (`torch.equal` on an integer view), so
-0.0 and NaN payloads count. The first run's fingerprints stay in this process across a rewind (the script
runs again in the same process), for the last KEEP_STEPS steps.

The update too: when the optimizer is about to step, its param groups' hyperparameters (the LR, momentum, betas,
weight decay: what the script or its scheduler wrote) are fingerprinted as the step's forward 0, so a script that
computes its LR from a counter of its own that started again from 0 after the restore is seen at the replayed
step, though its forwards match.

What it covers: every step a surviving rank runs again, the in-flight step of a data-parallel job and the
steps since a sharded job's last in-memory copy alike. What it cannot: a step nobody ran before on that
rank (a replacement's steps: its first run died with it), steps older than KEEP_STEPS, a job restarted
from a checkpoint by new processes, a world-size change (elastic: other batches by design), and a
difference that neither the inputs' nor the output's sampled elements show (a state read only by the
backward or the optimizer; the next step's forward shows it).

State carried from step to step outside the committed state (an RNN's hidden state kept between batches) differs
after any fault, and after a SIGTERM and a rerun nothing can compare it. So in the first CARRY_STEPS steps of each
run of the script a forward's inputs are also compared with what the forward before it returned, when that was an
earlier step's: the same bits (not all one value) are said once, by rank 0, with the fix (a `carried_state` event).

Modes (TG_EXACT, `trainguard run --exact`, job file `exact`): `warn` (the default) prints what differed,
its likely causes and fixes, records a `replay_mismatch` event, and the launcher says "not bit-identical
from step N"; `strict` ends the job (EXIT_NOT_EXACT, after the committed state's dying gasp); `off` records
nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...control import protocol as p
from ...exitcodes import EXIT_NOT_EXACT
from .graceful import stop_on_fault

SAMPLE = 1024  # elements kept of each tensor
MAX_TENSORS = 8  # tensors kept of a forward's inputs, and of its output
KEEP_STEPS = 64  # steps whose first run stays comparable
CARRY_STEPS = 8  # steps of a run whose forwards' inputs are compared with the outputs of the forward before
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

INPUT_CAUSES = ("the batch came from state trainguard does not restore: a data iterator or counter of the script's "
                "own, a generator made before trainguard.init(), a batch drawn before `start_step()` and kept, or a "
                "file read back. Fix: draw batches from trainguard.DataLoader / DistributedSampler, or from a "
                "torch.Generator after `start_step()` (torch's global one, or the script's own made after "
                "trainguard.init(): both are keyed at every commit), or derive the position from "
                "`trainguard.start_step()` (an iterator advanced to it, a counter set from it)")
OUTPUT_CAUSES = ("the model computed something else from the same inputs: state outside what trainguard restores (a "
                 "plain attribute of a module or of the script, a tensor not registered as a buffer, a framework's "
                 "cache), or nondeterministic kernels. Fix: `trainguard.register_state()` the object, "
                 "`register_buffer()` the tensor, or `torch.use_deterministic_algorithms(True)`")


class Mark(NamedTuple):
    """One tensor's fingerprint: the sampled elements' bytes (a CPU tensor) or a copy of them (on its device)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    sample: bytes | torch.Tensor

    def varied(self) -> bool:
        """Whether the sampled elements are not all one value (zeros, a constant mask say nothing of where they came
        from)."""
        a = self.sample
        if isinstance(a, bytes):
            n = max(1, self.dtype.itemsize)
            return a != a[:n] * (len(a) // n)
        return a.numel() > 1 and not bool((a == a[0]).all())

    def same(self, other: "Mark") -> bool:
        if (self.dtype, self.shape) != (other.dtype, other.shape):
            return False
        a, b = self.sample, other.sample
        if isinstance(a, bytes) or isinstance(b, bytes):
            return a == b
        size = a.element_size()
        if size in _INT and not a.is_complex():
            a, b = a.view(_INT[size]), b.view(_INT[size])
        return torch.equal(a, b)


def mark(t: torch.Tensor) -> Mark:
    """About SAMPLE evenly spaced elements of `t`, their bits. On the CPU a NumPy view of the integers of the same
    width (no copy but the sample's bytes: a few microseconds); elsewhere a copy on the tensor's device, so that
    nothing waits for it (it is compared only after a fault)."""
    d = t.detach()
    size = d.element_size()
    if d.device.type == "cpu" and d.is_contiguous() and size in _INT and not d.is_complex():
        a = d.view(_INT[size]).numpy().reshape(-1)
        return Mark(t.dtype, tuple(t.shape), a[::max(1, a.size // SAMPLE)][:SAMPLE].tobytes())
    flat = d.reshape(-1)
    return Mark(t.dtype, tuple(t.shape), flat[::max(1, flat.numel() // SAMPLE)][:SAMPLE].clone())


def tensors(obj, out: list, depth: int = 0, *, limit: int | None = MAX_TENSORS, deepest: int | None = 3) -> list:
    """The first `limit` tensors in `obj` (nested lists, tuples and dicts, a model output's fields) down to `deepest`
    levels; None: all of them (unheld.py's walk of a state dict)."""
    if (limit is not None and len(out) >= limit) or (deepest is not None and depth > deepest):
        return out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            tensors(item, out, depth + 1, limit=limit, deepest=deepest)
    elif isinstance(obj, dict):
        for item in obj.values():
            tensors(item, out, depth + 1, limit=limit, deepest=deepest)
    return out


def marks(obj) -> tuple[Mark, ...]:
    return tuple(mark(t) for t in tensors(obj, []))


def same(a: tuple[Mark, ...], b: tuple[Mark, ...]) -> bool:
    return len(a) == len(b) and all(x.same(y) for x, y in zip(a, b))


@dataclass(frozen=True, slots=True)
class Finding:
    """A replayed forward that differs from its first run."""

    step: int
    forward: int  # the forward's number in the step; for "tail", the collectives entered before the fault
    what: str  # "inputs", "output", "hyperparameters" (the update's), or "tail" (tail.py: code after the step's
    # update skipped by the run after)
    again: int = 0  # for "tail": the collectives entered after the restore, before the next step began

    def describe(self, rank: int) -> str:
        if self.what == "hyperparameters":
            return (f"not bit-identical: rank {rank}'s optimizer was about to step at step {self.step} with other "
                    "hyperparameters (the LR, momentum, weight decay) than in its first run, before the fault. Likely "
                    "cause: the script computes them from a counter of its own that started again after the restore "
                    "(`global_step = 0`, `iter_num = 0`). Fix: count from where the job is, "
                    "`global_step = trainguard.start_step()`, or hand the object that holds the counter to "
                    "`trainguard.register_state()`")
        if self.what == "carried":
            return (f"rank {rank}'s training forward at step {self.step} takes as an input what its forward of an "
                    "earlier step returned: state carried from step to step (an RNN's hidden state kept between "
                    "batches, word_language_model's `repackage_hidden`; a memory of past segments). The committed state "
                    "does not hold it: after a fault, or a SIGTERM and the same command again, it starts from its first "
                    "value, and the run is no longer the one without a fault. Fix: keep it in an object given to "
                    "`trainguard.register_state()` whose values are the same on every rank (all_gather each rank's "
                    "part into it), or start it afresh at each batch")
        if self.what == "tail":
            return (f"not bit-identical: rank {rank} entered {self.forward} collective(s) after step {self.step}'s "
                    f"update before the fault (code after `optimizer.step()`: a logged all_reduce, an eval, a save), "
                    f"but after the restore it began the next step having entered {self.again}: the loop resumed past "
                    f"that code, so for step {self.step} it did not run again (an eval line, a checkpoint, a metric "
                    "went missing). Fix: put it before the step's first batch, at the top of the loop body (as "
                    "nanoGPT's eval), or after the epoch's batches")
        causes = INPUT_CAUSES if self.what == "inputs" else OUTPUT_CAUSES
        verb = "differ" if self.what == "inputs" else "differs"
        return (f"not bit-identical: the {self.what} of rank {rank}'s training forward {self.forward} at step "
                f"{self.step} {verb} from its first run, before the fault. Likely cause: {causes}")


_first: dict[tuple[int, int], tuple[tuple[Mark, ...], tuple[Mark, ...]]] = {}  # (step, forward) -> (inputs, output)


_carried_said = False  # a forward's input that an earlier step's forward returned was said (once a process)
_verified = False  # a replayed forward of this process (or of the peer it took its state from) was its first run's


def verified() -> bool:
    """Whether this job was seen to resume exactly: a step replayed after a fault matched its first run here, or on
    the peer this rank took its state from. Until then a fault in a step rewinds every rank, so that the replays are
    audited (instep.py)."""
    return _verified


def trust() -> None:
    """A peer's state says the job was seen to resume exactly (recovery.py)."""
    global _verified
    _verified = True


class Audit:
    """One run of the script's view of the audit: it numbers the forwards of each step."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.at: tuple[int, int] | None = None  # (step, restores) the count belongs to
        self.n = 0
        self.found: Finding | None = None  # the first difference (one is said; everything after follows from it)
        self.last: tuple[int, tuple[Mark, ...]] = (-1, ())  # the last forward's step and output
        self.start: int | None = None  # the step of this run's first forward

    def forward(self, step: int, restores: int, inputs, out) -> Finding | None:
        """A training forward returned: its first run is recorded, its replay compared."""
        if not self.enabled:
            return None
        if self.at != (step, restores):
            self.at, self.n = (step, restores), 0
        self.n += 1
        now = (marks(inputs), marks(out))
        carried = self._carried(step, now)
        key = (step, self.n)
        first = _first.get(key)
        if first is None or self.found is not None:
            _first[key] = now
            if self.n == 1 and step % KEEP_STEPS == 0:
                for old in [k for k in _first if k[0] < step - KEEP_STEPS]:
                    del _first[old]
            return carried
        what = "inputs" if not same(first[0], now[0]) else "output" if not same(first[1], now[1]) else ""
        if not what:
            trust()
            return carried
        self.found = Finding(step, self.n, what)
        _first.clear()  # from here on this run is the reference
        return self.found

    def _carried(self, step: int, now: tuple[tuple[Mark, ...], tuple[Mark, ...]]) -> Finding | None:
        """An input of this forward with the bits an earlier step's forward returned (once a process; looked for in
        the first CARRY_STEPS steps a run of the script makes, where it shows: on a GPU each look waits for it)."""
        global _carried_said
        (before, returned), self.start = self.last, step if self.start is None else self.start
        self.last = (step, now[1] if step < self.start + CARRY_STEPS else ())
        if _carried_said or before >= step or not any(x.same(y) and x.varied() for x in now[0] for y in returned):
            return None
        _carried_said = True
        return Finding(step, self.n, "carried")

    def update(self, step: int, groups: list[dict]) -> Finding | None:
        """The optimizer is about to apply step `step`'s update: its hyperparameters' first run is recorded (as the
        step's forward 0), their replay compared."""
        if not self.enabled:
            return None
        now = (marks(hyperparameters(groups)), ())
        first = _first.get((step, 0))
        if first is None or self.found is not None:
            _first[(step, 0)] = now
            return None
        if same(first[0], now[0]):
            return None
        self.found = Finding(step, 0, "hyperparameters")
        _first.clear()
        return self.found


def hyperparameters(groups: list[dict]) -> torch.Tensor:
    """The numbers of the optimizer's param groups (all but the parameters), in a fixed order, as float64."""
    values: list[float] = []
    for group in groups:
        for key in sorted(k for k in group if k != "params"):
            v = group[key]
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(x, torch.Tensor) and x.numel() == 1:
                    x = x.item()
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    values.append(float(x))
    return torch.tensor(values, dtype=torch.float64)


def report(session, found: Finding) -> None:
    """Say what differed (and, under --exact strict, end the job: the scheduler ends it for every rank)."""
    rt = session.rt
    text = found.describe(rt.rank)
    if found.what == "carried":  # not yet a difference: one after any fault (every rank finds it; rank 0 says it)
        if rt.rank == 0:
            rt.events.emit("carried_state", rank=rt.rank, step=found.step, generation=rt.generation)
            print(f"trainguard: {text}", file=sys.stderr, flush=True)
        return
    rt.events.emit("replay_mismatch", rank=rt.rank, step=found.step, forward=found.forward, what=found.what,
                   again=found.again, generation=rt.generation)
    print(f"trainguard: {text}", file=sys.stderr, flush=True)
    if rt.cfg.exact == "strict":
        rt.report_failure(text, kind=p.FailureKind.NOT_EXACT)
        stop_on_fault(session, text, verdict=EXIT_NOT_EXACT)
