"""How many restarts the agent may spend: a total cap for the job, and a rate per child.

- `--max-restarts N` (job file `max_restarts:`): restarts of this host's children, all together, for the
  whole job. The default, 32767, is MindCluster's (torchrun's `--max_restarts` there): in practice no cap.
  0 turns recovery off.
- `--restart-limit N` / `--restart-window S` (`TG_RESTART_LIMIT` / `TG_RESTART_WINDOW`, job file
  `restart_limit:` / `restart_window:`): one child (a worker, by node id, or the scheduler) is restarted
  at most N times within any S seconds. Its next failure inside the window is a crash loop: the job
  ends (under `elastic` the worker is left out), saying so and naming these flags. Default: 3 per 3600 s.

Why a rate and not a count: faults on a large cluster are independent and spread over the job's
life, so a long job needs many restarts, and the old default of 3 for the whole job ended a week-long
run at its fourth fault. A worker that dies right after every start fails many times in a short
while, and so does one on a sick host; no healthy worker fails 4 times within an hour. The first
kind ends after 3 restarts, as before; the second never does. The window is long (an hour) because a
restart cycle of a large job (start, imports, CUDA and NCCL set-up, restore) takes minutes: a short
window (systemd's 10 s) would never see such a loop.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..config import env_seconds, parse_int
from ..errors import ConfigError

DEFAULT_MAX_RESTARTS = 32767
DEFAULT_RESTART_LIMIT = 3
DEFAULT_RESTART_WINDOW_S = 3600.0
RESTART_LIMIT_ENV = "TG_RESTART_LIMIT"
RESTART_WINDOW_ENV = "TG_RESTART_WINDOW"
CRASH_LOOP_ADVICE = ("Fix what makes it fail, or allow more with --restart-limit N / --restart-window SECONDS "
                     f"({RESTART_LIMIT_ENV} / {RESTART_WINDOW_ENV}, or restart_limit: / restart_window: in the "
                     "job file)")


@dataclass(frozen=True, slots=True)
class RestartRate:
    """At most `limit` restarts of one child within any `window_s` seconds."""

    limit: int = DEFAULT_RESTART_LIMIT
    window_s: float = DEFAULT_RESTART_WINDOW_S

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ConfigError("--restart-limit must be >= 1 (turn restarts off with --max-restarts 0), "
                              f"got {self.limit}")
        if not self.window_s > 0:
            raise ConfigError(f"--restart-window must be > 0 seconds, got {self.window_s:g}")

    def crash_loop(self, restarts: Sequence[float], now: float) -> str:
        """Why a child that failed at `now` must not be restarted again, or "" if it may be."""
        recent = [t for t in restarts if now - t < self.window_s]
        n = len(recent)
        if n < self.limit:
            return ""
        return (f"crash loop: it failed again after {n} restart{'s' * (n != 1)} of its own in {now - min(recent):.0f} s "
                f"(--restart-limit {self.limit} per --restart-window {self.window_s:g} s)")

    def describe(self) -> str:
        return f"at most {self.limit} per worker within {self.window_s:g} s"


def restart_rate(args: argparse.Namespace, env: Mapping[str, str]) -> RestartRate:
    """--restart-limit / --restart-window (or the job file), else TG_RESTART_LIMIT / TG_RESTART_WINDOW, else the
    defaults."""
    limit = getattr(args, "restart_limit", None)
    if limit is None:
        raw = env.get(RESTART_LIMIT_ENV, "")
        limit = parse_int(RESTART_LIMIT_ENV, raw, lo=1) if raw.strip() else DEFAULT_RESTART_LIMIT
    window = getattr(args, "restart_window", None)
    if window is None:
        window = env_seconds(env, RESTART_WINDOW_ENV, DEFAULT_RESTART_WINDOW_S)
    return RestartRate(int(limit), float(window))
