"""Recover strategies, named as MindCluster names them: what a job does about a fault.

    retry             a fault inside a step while every process is alive (a failed collective, or an
                      exception marked retriable: `trainguard.Retriable`, `SessionConfig(retriable=...)`)
                      rolls every rank back to its last in-memory snapshot and redoes the step in the
                      same processes, at most `max_retries` times in a row (TG_MAX_RETRIES)
    recover-in-place  a dead worker is restarted on its host, from a hot spare when one is ready, while
                      --max-restarts lasts; the survivors roll back in process. The default.
    recover           a dead worker starts again on another host's agent that has a free slot (--slots);
                      a host with too many worker failures is excluded for a cooldown; with
                      recover-in-place too, it is restarted in place when no other host can take it
                      (trainguard/control/placement.py)
    elastic           alias elastic-training: a dead worker is restarted as with recover-in-place, but
                      if it is not back within `elastic_deadline` seconds (TG_ELASTIC_DEADLINE,
                      --elastic-deadline) the survivors go on without it, the rest of the epoch
                      re-sharded over them; when it comes back the job grows back at a commit point
    dump              on a fault nothing above recovers, save a dying-gasp checkpoint of the last
                      consistent state on the surviving ranks, then stop the job
    exit              stop the whole job on a fault nothing above recovers, naming its root cause

Names combine with commas, e.g. "retry,recover-in-place" or "recover-in-place,dump" (restart while
the budget lasts, then dump). Contradictions: exit with anything that restarts (recover-in-place, recover,
elastic). elastic with recover-in-place is allowed (elastic restarts in place too, it only stops waiting
at the deadline), and elastic with dump (dump only acts on a fault nothing else recovers). Everything
here is pure: parsing returns a value or raises a ConfigError that names where the text came from
and lists the valid names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import ConfigError

DEFAULT_STRATEGY = "recover-in-place"
DEFAULT_MAX_RETRIES = 3
DEFAULT_ELASTIC_DEADLINE_S = 30.0  # seconds a dead worker has to come back before the job shrinks


class Strategy(str, enum.Enum):
    RETRY = "retry"
    RECOVER = "recover"
    RECOVER_IN_PLACE = "recover-in-place"
    ELASTIC = "elastic"
    DUMP = "dump"
    EXIT = "exit"


ALIASES = {"elastic-training": Strategy.ELASTIC}
NOT_IMPLEMENTED: dict[Strategy, str] = {}  # strategies that parse but are refused at start (none now)
_RESTARTING = (Strategy.RECOVER_IN_PLACE, Strategy.RECOVER, Strategy.ELASTIC)
_WHAT = {
    Strategy.RECOVER_IN_PLACE: "recover-in-place restarts the dead worker",
    Strategy.RECOVER: "recover moves the dead worker to another host",
    Strategy.ELASTIC: "elastic goes on with fewer workers",
}


def valid_names() -> str:
    return ", ".join(s.value for s in Strategy) + " (elastic-training = elastic)"


@dataclass(frozen=True, slots=True)
class RecoverStrategy:
    """A validated set of strategies; build it with `parse_strategy`."""

    chosen: frozenset[Strategy]
    max_retries: int = DEFAULT_MAX_RETRIES
    elastic_deadline: float = DEFAULT_ELASTIC_DEADLINE_S

    def __post_init__(self) -> None:
        if not self.chosen:
            raise ConfigError(f"choose at least one recover strategy: {valid_names()}")
        if self.max_retries < 0:
            raise ConfigError(f"the retry limit must be >= 0, got {self.max_retries}")
        if not self.elastic_deadline > 0:
            raise ConfigError(f"the elastic deadline must be > 0 seconds, got {self.elastic_deadline}")

    @property
    def retry(self) -> bool:
        return Strategy.RETRY in self.chosen

    @property
    def restarts(self) -> bool:
        """Dead workers are replaced (so the scheduler keeps the job open when one dies)."""
        return any(s in self.chosen for s in _RESTARTING)

    @property
    def rolls_back(self) -> bool:
        """A rank whose step failed rolls back in process instead of stopping the job."""
        return self.retry or self.restarts

    @property
    def elastic(self) -> bool:
        """A worker not back within `elastic_deadline` is left out; the job grows back when it returns."""
        return Strategy.ELASTIC in self.chosen

    @property
    def moves(self) -> bool:
        """recover: a dead worker may start again on another host's agent."""
        return Strategy.RECOVER in self.chosen

    @property
    def dump(self) -> bool:
        return Strategy.DUMP in self.chosen

    def __str__(self) -> str:
        return ",".join(s.value for s in Strategy if s in self.chosen)


def parse_strategy(text: str | None, *, source: str = "--recover-strategy", max_retries: int = DEFAULT_MAX_RETRIES,
                   elastic_deadline: float = DEFAULT_ELASTIC_DEADLINE_S) -> RecoverStrategy:
    """"retry,recover-in-place" -> RecoverStrategy; empty or None gives the default (recover-in-place).

    An unknown name is an error listing the valid ones; a contradictory pair is an error saying why."""
    raw = DEFAULT_STRATEGY if text is None or not text.strip() else text
    chosen: set[Strategy] = set()
    for part in raw.split(","):
        name = part.strip().lower()
        if not name:
            raise ConfigError(f"{source}={raw!r} has an empty name between commas; valid names: {valid_names()}")
        try:
            chosen.add(ALIASES.get(name) or Strategy(name))
        except ValueError:
            raise ConfigError(f"{source}={raw!r}: unknown recover strategy {name!r}; "
                              f"valid names: {valid_names()}") from None
    if Strategy.EXIT in chosen:
        for other in _RESTARTING:
            if other in chosen:
                raise ConfigError(f"{source}={raw!r} contradicts itself: exit stops the whole job at its first "
                                  f"fault, but {_WHAT[other]}; choose one of them (add dump to exit to save a "
                                  "dying-gasp checkpoint first)")
    return RecoverStrategy(frozenset(chosen), max_retries, elastic_deadline)


def virtual_shards(raw: str, source: str, workers: int | None = None) -> int:
    """TG_VIRTUAL_SHARDS / --virtual-shards (train/parallel/exactsum.py; elastic runs that stay exact): an int >= 0
    (0 or unset: off), at least one shard per worker."""
    text = str(raw).strip()
    if text and not (text.isdigit() and text.isascii()):
        raise ConfigError(f"{source}={raw!r} is invalid: expected an integer >= 0 (the number of virtual shards)")
    shards = int(text or 0)
    if shards and workers is not None and shards < workers:
        raise ConfigError(f"{source}={shards} is fewer than the job's {workers} workers: every worker holds at least "
                          f"one virtual shard. Give at least {workers} (a multiple of the sizes the job may shrink "
                          f"to keeps the shards even, e.g. 12 for 4, 3 and 2 workers)")
    return shards


def require_implemented(strategy: RecoverStrategy, source: str = "--recover-strategy") -> RecoverStrategy:
    """At start: a strategy in NOT_IMPLEMENTED parses, but is refused until it is built (never silently replaced)."""
    missing = [s for s in Strategy if s in strategy.chosen and s in NOT_IMPLEMENTED]
    if missing:
        what = "; ".join(f"{s.value} ({NOT_IMPLEMENTED[s]})" for s in missing)
        raise ConfigError(f"{source}={strategy}: not implemented yet: {what}. Use recover-in-place (restart the "
                          "dead worker on its host), optionally with retry and dump, or exit")
    return strategy
