"""Inject faults at chosen steps: `fail_at(rank, step, how)`, or TG_FAULT="rank:step:how[:life],...".

how: kill (SIGKILL itself), term (SIGTERM), stop (SIGSTOP: a hang), raise (an exception out of the
loop), sched (SIGKILL the scheduler). A fault fires after step `step` commits, in the process's
`life`-th incarnation only (default 1), so a replacement does not fire it again.
Each firing is logged as a `fault_injected` event first, which is what MTTR is measured from.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ..errors import ConfigError
from ..train.callbacks import Callback

FAULT_ENV = "TG_FAULT"
HOWS = ("kill", "term", "stop", "raise", "sched")


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


class FaultInjector(Callback):
    def __init__(self, faults: list[Fault]):
        self.faults = list(faults)

    def on_step_end(self, session) -> None:
        rt = session.rt
        for f in self.faults:
            if f.rank == rt.rank and f.step == session.step and f.life == rt.incarnation:
                fire(f, rt)


def fire(f: Fault, rt) -> None:
    rt.events.emit("fault_injected", rank=f.rank, step=f.step, how=f.how, node=rt.node_id,
                   generation=rt.generation)
    print(f"trainguard.testing: injecting {f.how} at step {f.step} on rank {f.rank}", flush=True)
    if f.how == "raise":
        raise InjectedFault(f"injected fault at step {f.step} on rank {f.rank}")
    if f.how == "sched":
        os.kill(int(rt.client.status()["scheduler_pid"]), signal.SIGKILL)
        return
    sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[f.how]
    os.kill(os.getpid(), sig)
