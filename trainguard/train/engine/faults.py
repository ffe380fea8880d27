"""Inject faults at chosen steps: `fail_at(rank, step, how)`, or TG_FAULT="rank:step:how[:life],...".

how: kill (SIGKILL itself), term (SIGTERM), stop (SIGSTOP: a hang), raise (an exception out of the
loop), sched (SIGKILL the scheduler), collective (the next step's gradient exchange fails on every
rank, as when a connection breaks: this rank cuts its group's connections, with every process
alive). A fault fires after step `step` commits, in the process's `life`-th incarnation only
(default 1), so a replacement does not fire it again; a collective fault fires once per process
(a retried step does not fail again).

Inside the next step (the one after `step` commits), SIGKILL at a chosen point of the commit
protocol: kill-before (before the gradient exchange), kill-forward (the step's first training forward returned:
in the middle of gradient accumulation, in the user's own loop), kill-exchange (while it is in flight: after
its first bucket was sent), kill-after (the exchange completed, the update not yet applied),
kill-commit (the update applied, the step not yet counted). Each firing is logged as a `fault_injected` event first, which is what
MTTR is measured from.

TG_FAULT_COLLECTIVE="rank:name:n[:how],..." fires at a collective instead of a step: that rank's n-th
call of `torch.distributed.<name>` (all_reduce, barrier, broadcast, ..., and a pipeline schedule's isend and
irecv; a call with async_op=True, such as trainguard's own gradient exchange, is not counted) in its first
incarnation, just before the call.
how: kill (default) or stop. That is how a test kills a rank inside an eval pass's metric
all_reduce, a barrier, or the broadcast after the script's own save.

TG_FAULT_SLOW_SAVE=S makes every dying-gasp checkpoint file take S seconds longer to write (it
sleeps after each file, before the manifest): a save the grace period cannot hold.

TG_FAULT_SLOW_STEP=S makes every step of every rank take S seconds longer (a sleep after it commits):
a job slow enough that a test's signal surely lands before its end. Results are unchanged.

TG_FAULT_DISK_FULL="rank:step,..." makes that rank's checkpoint file of that step fail as a full
disk does: part of the file is written, then OSError(ENOSPC). Training must go on.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass

from ...config import env_seconds
from ...errors import ConfigError
from .callbacks import Callback
from .probe import probe_from_env

FAULT_ENV = "TG_FAULT"
SLOW_SAVE_ENV = "TG_FAULT_SLOW_SAVE"
DISK_FULL_ENV = "TG_FAULT_DISK_FULL"
SLOW_STEP_ENV = "TG_FAULT_SLOW_STEP"
COLLECTIVE_FAULT_ENV = "TG_FAULT_COLLECTIVE"
PHASES = {"kill-before": "before_exchange", "kill-forward": "after_forward", "kill-exchange": "in_exchange",
          "kill-after": "after_exchange", "kill-commit": "in_commit"}  # Session.phase_point names
HOWS = ("kill", "term", "stop", "raise", "sched", "collective", *PHASES)


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    rank: int
    step: int
    how: str = "kill"
    life: int = 1

    def __post_init__(self) -> None:
        if self.how not in HOWS:
            raise ConfigError(f"fault kind {self.how!r} is unknown; use one of {', '.join(HOWS)}")
        if self.rank < 0 or self.step < 1 or self.life < 1:
            raise ConfigError(f"fault {self}: rank >= 0, step >= 1 and life >= 1 are required")


def fail_at(rank: int, step: int, how: str = "kill", life: int = 1) -> "FaultInjector":
    return FaultInjector([Fault(rank, step, how, life)])


def faults_from_env(env=None) -> list[Fault]:
    raw = (os.environ if env is None else env).get(FAULT_ENV, "").strip()
    faults = []
    for item in filter(None, (x.strip() for x in raw.split(","))):
        parts = item.split(":")
        try:
            rank, step, how = int(parts[0]), int(parts[1]), parts[2]
            life = int(parts[3]) if len(parts) > 3 else 1
        except (IndexError, ValueError):
            raise ConfigError(f"{FAULT_ENV}={raw!r}: expected items like 1:30:kill or 0:12:stop:2") from None
        faults.append(Fault(rank, step, how, life))
    return faults


_FIRED: set[Fault] = set()  # in this process: a script run again after a rewind makes a new injector


class FaultInjector(Callback):
    def __init__(self, faults: list[Fault]):
        self.faults = list(faults)

    def _due(self, f: Fault, session) -> bool:
        """Once per process: a fault the process survives (collective) re-fired at the step the job went back to,
        at every rewind, until the job gave up (a blind port read the README's "first life only" as once)."""
        rt = session.rt
        due = f.rank == rt.rank and f.step == session.step and f.life == rt.incarnation and f not in _FIRED
        if due:
            _FIRED.add(f)
        return due

    def on_step_begin(self, session, step) -> None:
        for f in self.faults:
            if f.how == "collective" and self._due(f, session):
                fire(f, session.rt)
                session.rt.sever(f"injected collective fault in step {f.step + 1} on rank {f.rank}")

    def on_phase(self, session, phase: str) -> None:
        for f in self.faults:
            if PHASES.get(f.how) == phase and self._due(f, session):
                fire(f, session.rt)

    def on_step_end(self, session) -> None:
        for f in self.faults:
            if f.how != "collective" and f.how not in PHASES and self._due(f, session):
                fire(f, session.rt)


class SlowSteps(Callback):
    """Every committed step sleeps `seconds` (TG_FAULT_SLOW_STEP)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, session) -> None:
        time.sleep(self.seconds)


def env_callbacks(env=None) -> list[Callback]:
    """The test hooks the environment asks for (TG_FAULT, TG_FAULT_SLOW_STEP), and the save hooks
    (TG_FAULT_SLOW_SAVE, TG_FAULT_DISK_FULL) installed: chaos-test any job without changing its code."""
    env = os.environ if env is None else env
    callbacks: list[Callback] = probe_from_env(env)  # `trainguard verify`'s (probe.py), first: it sees every commit
    faults = faults_from_env(env)
    if faults:
        callbacks.append(FaultInjector(faults))
    slow = env_seconds(env, SLOW_STEP_ENV, 0.0)
    if slow:
        callbacks.append(SlowSteps(slow))
    slow_saves_from_env(env)
    collective_faults_from_env(env)
    return callbacks


@dataclass(frozen=True, slots=True)
class CollectiveFault:
    rank: int
    name: str
    nth: int
    how: str = "kill"


def parse_collective_faults(raw: str) -> list[CollectiveFault]:
    faults = []
    for item in filter(None, (x.strip() for x in raw.split(","))):
        parts = item.split(":")
        try:
            fault = CollectiveFault(int(parts[0]), parts[1], int(parts[2]), parts[3] if len(parts) > 3 else "kill")
        except (IndexError, ValueError):
            raise ConfigError(f"{COLLECTIVE_FAULT_ENV}={raw!r}: expected items like 1:barrier:2 or 0:all_reduce:3:stop") \
                from None
        if fault.how not in ("kill", "stop") or fault.nth < 1 or fault.rank < 0:
            raise ConfigError(f"{COLLECTIVE_FAULT_ENV}: {item!r}: how is kill or stop, n >= 1, rank >= 0")
        faults.append(fault)
    return faults


_collective_counts: dict[str, int] | None = None  # per process: a rewind does not fire a fault again


def collective_faults_from_env(env=None) -> None:
    global _collective_counts
    faults = parse_collective_faults((os.environ if env is None else env).get(COLLECTIVE_FAULT_ENV, ""))
    if not faults or _collective_counts is not None:
        return
    from ...worker import collectives
    from ...worker import runtime as rt_mod

    _collective_counts = counts = {}

    def observe(name: str) -> None:
        rt = rt_mod.active()
        if rt is None or rt.incarnation != 1:
            return
        counts[name] = counts.get(name, 0) + 1
        for f in faults:
            if f.rank == rt.rank and f.name == name and f.nth == counts[name]:
                rt.events.emit("fault_injected", rank=f.rank, step=max(rt.step, 0), how=f"{f.how}@{name}",
                               node=rt.node_id, generation=rt.generation)
                print(f"trainguard.testing: injecting {f.how} at {name} #{f.nth} on rank {f.rank}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if f.how == "kill" else signal.SIGSTOP)

    collectives.observers.append(observe)


def fire(f: Fault, rt) -> None:
    rt.events.emit("fault_injected", rank=f.rank, step=f.step, how=f.how, node=rt.node_id,
                   generation=rt.generation)
    print(f"trainguard.testing: injecting {f.how} at step {f.step} on rank {f.rank}", flush=True)
    if f.how == "collective":
        return
    if f.how == "raise":
        raise InjectedFault(f"injected fault at step {f.step} on rank {f.rank}")
    if f.how == "sched":
        os.kill(int(rt.client.status()["scheduler_pid"]), signal.SIGKILL)
        return
    sig = signal.SIGKILL if f.how in PHASES else {"kill": signal.SIGKILL, "term": signal.SIGTERM,
                                                   "stop": signal.SIGSTOP}[f.how]
    os.kill(os.getpid(), sig)


@dataclass(frozen=True)
class SlowDyingGasp:
    """Each file of a dying-gasp checkpoint takes `seconds` longer (after writing it, before the manifest): a
    test hook for grace periods too short for the save. Regular saves are untouched."""

    seconds: float

    def opened(self, path, f) -> None:
        pass

    def written(self, path) -> None:
        from .dump import GASP_THREAD

        if threading.current_thread().name == GASP_THREAD:
            time.sleep(self.seconds)


@dataclass(frozen=True)
class DiskFull:
    """The checkpoint file of each (rank, step) in `points` hits a full disk: a few bytes are written, then
    OSError(ENOSPC) is raised, as a real full disk does mid-write."""

    points: frozenset[tuple[int, int]]

    def opened(self, path, f) -> None:
        from ...checkpoint import jobsave

        if jobsave.WRITING.get() in self.points:
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected by " + DISK_FULL_ENV + ")", str(path))

    def written(self, path) -> None:
        pass


def slow_dying_gasp_writes(seconds: float) -> None:
    from ...checkpoint.format import inject_write_fault

    inject_write_fault(SlowDyingGasp(seconds))


def disk_full_at(points: set[tuple[int, int]]) -> None:
    from ...checkpoint.format import inject_write_fault

    inject_write_fault(DiskFull(frozenset(points)))


def disk_full_from_env(env=None) -> None:
    raw = (os.environ if env is None else env).get(DISK_FULL_ENV, "").strip()
    if not raw:
        return
    try:
        points = {(int(r), int(s)) for r, s in (item.split(":") for item in raw.split(",") if item.strip())}
    except ValueError:
        raise ConfigError(f"{DISK_FULL_ENV}={raw!r}: expected items like 1:8 (rank:step)") from None
    disk_full_at(points)


def slow_saves_from_env(env=None) -> None:
    """TG_FAULT_SLOW_SAVE, and TG_FAULT_DISK_FULL (the session installs both through this call)."""
    disk_full_from_env(env)
    seconds = env_seconds(os.environ if env is None else env, SLOW_SAVE_ENV, 0.0)
    if seconds:
        slow_dying_gasp_writes(seconds)
