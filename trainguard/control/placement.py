"""Where a dead worker starts again under the `recover` strategy: pure decisions, no socket, no clock.

Each agent (`trainguard run` on one host) stands for a host. It has a slot capacity (`--slots`, at
least its own worker count) and a history of worker failures. When a worker dies:

    choose_host(hosts, origin, now, policy, in_place_ok)
        MOVE      to the other live, not excluded host with the most free slots (ties: fewest recent
                  failures, then the lowest node rank)
        IN_PLACE  no other host can take it, `recover-in-place` is also chosen, and the origin is not
                  excluded: restart it where it was
        FAIL      nowhere to go; the reason names every host and why it was not chosen

A host with `fail_limit` worker failures within `fail_window_s` is excluded for `cooldown_s` from the
last of them: it takes no moved worker and no in-place restart until then. Callers pass `now`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..config import env_seconds, parse_int
from ..errors import ConfigError

HOST_FAIL_LIMIT_ENV = "TG_HOST_FAIL_LIMIT"
HOST_FAIL_WINDOW_ENV = "TG_HOST_FAIL_WINDOW"
HOST_COOLDOWN_ENV = "TG_HOST_COOLDOWN"
DEFAULT_FAIL_LIMIT = 3
DEFAULT_FAIL_WINDOW_S = 300.0
DEFAULT_COOLDOWN_S = 300.0
DEFAULT_AGENT_TIMEOUT_S = 5.0  # an agent silent this long is not a placement target


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementPolicy:
    fail_limit: int = DEFAULT_FAIL_LIMIT  # --host-fail-limit / TG_HOST_FAIL_LIMIT
    fail_window_s: float = DEFAULT_FAIL_WINDOW_S  # --host-fail-window / TG_HOST_FAIL_WINDOW
    cooldown_s: float = DEFAULT_COOLDOWN_S  # --host-cooldown / TG_HOST_COOLDOWN
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.fail_limit < 1:
            raise ConfigError(f"--host-fail-limit ({HOST_FAIL_LIMIT_ENV}) must be >= 1, got {self.fail_limit}")
        if self.fail_window_s <= 0 or self.cooldown_s < 0:
            raise ConfigError(f"--host-fail-window ({HOST_FAIL_WINDOW_ENV}) must be > 0 and --host-cooldown "
                              f"({HOST_COOLDOWN_ENV}) >= 0 seconds, got {self.fail_window_s:g} and "
                              f"{self.cooldown_s:g}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "PlacementPolicy":
        limit = env.get(HOST_FAIL_LIMIT_ENV, "").strip()
        return cls(fail_limit=parse_int(HOST_FAIL_LIMIT_ENV, limit, lo=1) if limit else DEFAULT_FAIL_LIMIT,
                   fail_window_s=env_seconds(env, HOST_FAIL_WINDOW_ENV, DEFAULT_FAIL_WINDOW_S),
                   cooldown_s=env_seconds(env, HOST_COOLDOWN_ENV, DEFAULT_COOLDOWN_S))

    def env(self) -> dict[str, str]:
        """The variables that hand this policy to the scheduler process."""
        return {HOST_FAIL_LIMIT_ENV: str(self.fail_limit), HOST_FAIL_WINDOW_ENV: f"{self.fail_window_s:g}",
                HOST_COOLDOWN_ENV: f"{self.cooldown_s:g}"}


@dataclass(frozen=True, slots=True)
class HostView:
    """One agent as the scheduler sees it."""

    agent: int  # the agent's node rank
    host: str
    slots: int
    used: int  # workers it runs plus those placed on it and not yet started
    failures: tuple[float, ...] = ()  # times of worker failures on it
    last_seen: float = 0.0

    @property
    def free(self) -> int:
        return max(0, self.slots - self.used)

    def name(self) -> str:
        return f"node rank {self.agent} ({self.host})"


def excluded_until(failures: Sequence[float], now: float, policy: PlacementPolicy) -> float:
    """The end of the host's cooldown if it is excluded at `now`, else 0.0.

    Excluded: some failure t is the `fail_limit`-th within (t - fail_window_s, t], and now < t + cooldown_s."""
    times = sorted(t for t in failures if t <= now)
    k = policy.fail_limit
    for i in range(len(times) - 1, k - 2, -1):  # newest first: the latest qualifying failure decides
        if times[i] - times[i - k + 1] < policy.fail_window_s:
            end = times[i] + policy.cooldown_s
            return end if now < end else 0.0
    return 0.0


def recent_failures(failures: Sequence[float], now: float, policy: PlacementPolicy) -> int:
    return sum(1 for t in failures if now - policy.fail_window_s < t <= now)


class Place(enum.Enum):
    MOVE = "move"
    IN_PLACE = "in_place"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class PlacementDecision:
    action: Place
    target: int | None  # the agent (node rank) that starts the worker; None for FAIL
    reason: str


def why_not(h: HostView, now: float, policy: PlacementPolicy) -> str | None:
    """Why host `h` cannot take a worker now, or None if it can."""
    until = excluded_until(h.failures, now, policy)
    if until:
        return (f"{h.name()} is excluded for another {until - now:.0f} s after {policy.fail_limit} failures "
                f"within {policy.fail_window_s:g} s (--host-cooldown {policy.cooldown_s:g})")
    if now - h.last_seen > policy.agent_timeout_s:
        return f"{h.name()}: its agent has been silent for {now - h.last_seen:.0f} s"
    if h.free <= 0:
        return f"{h.name()}: all {h.slots} slots are used"
    return None


def choose_host(hosts: Sequence[HostView], origin: int, now: float, policy: PlacementPolicy, *,
                in_place_ok: bool) -> PlacementDecision:
    """Where the worker that died on agent `origin` starts again (`origin`'s failure already counted)."""
    others = [h for h in hosts if h.agent != origin]
    able = [h for h in others if why_not(h, now, policy) is None]
    if able:
        best = min(able, key=lambda h: (-h.free, recent_failures(h.failures, now, policy), h.agent))
        return PlacementDecision(Place.MOVE, best.agent, f"moved to {best.name()}: {best.free} of "
                                                         f"{best.slots} slots free")
    reasons = [why_not(h, now, policy) for h in others] or ["there is no other host (agent) in this job"]
    home = next((h for h in hosts if h.agent == origin), None)
    until = excluded_until(home.failures, now, policy) if home else 0.0
    if in_place_ok and not until:
        return PlacementDecision(Place.IN_PLACE, origin, "no other host can take it (" + "; ".join(reasons)
                                 + "): restarting it in place (recover-in-place)")
    if until and home is not None:
        reasons.append(f"its own host {home.name()} is excluded for another {until - now:.0f} s after "
                       f"{policy.fail_limit} failures within {policy.fail_window_s:g} s")
    elif not in_place_ok:
        reasons.append("recover-in-place is not chosen, so it is not restarted where it was")
    return PlacementDecision(Place.FAIL, None, "no host can take it: " + "; ".join(reasons))


def became_excluded(before: Sequence[float], after: Sequence[float], now: float, policy: PlacementPolicy) -> float:
    """The cooldown's end if recording the newest failure (before -> after) excluded the host, else 0.0."""
    end = excluded_until(after, now, policy)
    return end if end and end != excluded_until(before, now, policy) else 0.0
