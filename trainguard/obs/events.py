"""A JSON-lines event log, and the recovery summary computed from it.

Each line is one JSON object with ``ts`` (unix seconds, float), ``event`` (str) and the
event's fields. Writers append; ``EventLog.read`` skips a torn (half-written) line.

Events that ``summarize_recovery`` reads, with their fields:

- ``failure_detected``  node, rank, signal or kind, generation (the generation that failed),
  next_generation (the one that replaces it; equal to generation while a regroup is pending)
- ``generation_formed`` generation (the new one), world_size
- ``restore_step``      generation, to_step (the step restored), from_step (the step reached
  before the failure)
- ``restored``          generation, rank, source (where that rank's state came from)
- ``step_finished``     generation, step
- ``fault_injected``    generation, rank, how (trainguard.testing: the moment of the kill itself)

One recovery = the failures of one generation plus everything tagged with the generation
that replaces it: the first ``generation_formed`` (or ``restore_step``/``restored``/
``step_finished``) after the failure whose generation is greater than the failed one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, TrainguardError

log = logging.getLogger(__name__)

FAILURE_DETECTED = "failure_detected"
GENERATION_FORMED = "generation_formed"
RESTORE_STEP = "restore_step"
RESTORED = "restored"
STEP_FINISHED = "step_finished"
FAULT_INJECTED = "fault_injected"
REPLAY_MISMATCH = "replay_mismatch"  # a replayed step differed from its first run (train/engine/audit.py)
_RESERVED = ("ts", "event")


_ENCODE = json.JSONEncoder(default=str, separators=(",", ":")).encode  # one encoder for every line


class EventLog:
    """Appends one JSON object per line to ``path``; safe to share between threads.

    Each line goes out in a single ``write`` on an ``O_APPEND`` descriptor, so it is never
    buffered in the process and lines from several processes do not interleave. With
    ``durable=True`` every event is also fsync'd. Values JSON cannot encode are written as str.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, durable: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.durable = durable
        self._clock = clock
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # A crash may have left a torn last line: end it so the next event starts cleanly.
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._write(b"\n")

    @staticmethod
    def null() -> EventLog:
        """A log that records nothing."""
        return _NullEventLog()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event and return the record written."""
        if not isinstance(event, str) or not event:
            raise ConfigError(f"event must be a non-empty str, got {event!r}")
        clash = [k for k in _RESERVED if k in fields]
        if clash:
            raise ConfigError(f"event fields may not be named {clash}; they are set by EventLog")
        record = {"ts": self._clock(), "event": event, **fields}
        self._append(record)
        return record

    def _append(self, record: dict[str, Any]) -> None:
        line = (_ENCODE(record) + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise TrainguardError(f"event log {self.path} is closed; open a new EventLog")
            self._write(line)
            if self.durable:
                os.fsync(self._fd)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]  # type: ignore[arg-type]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """All events in ``path``, in file order. A torn last line is skipped; any other line
        that is not a JSON object is skipped with a warning."""
        lines = Path(path).read_bytes().split(b"\n")
        events: list[dict[str, Any]] = []
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                last = i == len(lines) - 1 or not any(s.strip() for s in lines[i + 1 :])
                if not last:
                    log.warning("event log %s: skipping bad line %d: %s", path, i + 1, e)
                continue
            if isinstance(obj, dict):
                events.append(obj)
            else:
                log.warning("event log %s: skipping line %d, not a JSON object", path, i + 1)
        return events


class _NullEventLog(EventLog):
    def __init__(self) -> None:  # no file, no lock needed
        self.path = Path(os.devnull)
        self.durable = False
        self._clock = time.time

    def _append(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


# --- summary ---------------------------------------------------------------------------------


def summarize_recovery(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per recovery, in order of failure, with ``generation`` (the new one; None if
    none followed), ``failed_generation``, ``failures`` (node/rank/signal/kind of each),
    ``failure_ts``, ``fault_ts`` (an injected fault's own moment, if one preceded the failure),
    ``detect_s``, ``world_size``, ``recovered_ts``, ``mttr_s`` (from the fault if known, else from
    detection, to the first step finished after), ``from_step``, ``to_step``, ``lost_steps`` and
    ``sources`` (of ``restored`` events).
    Values that the events do not determine are None. Pure: events may come from several
    files, in any order."""
    evs = sorted((e for e in events if "ts" in e and "event" in e), key=lambda e: e["ts"])
    after_kinds = (GENERATION_FORMED, RESTORE_STEP, RESTORED, STEP_FINISHED)
    groups: dict[Any, list[dict[str, Any]]] = {}  # recovery generation -> its failures
    for i, f in enumerate(evs):
        if f["event"] != FAILURE_DETECTED:
            continue
        failed = f.get("generation")
        # the generation that replaces it; a failure during a regroup names the pending one
        target = f.get("next_generation", failed + 1 if failed is not None else None)
        key: Any = ("unrecovered", failed)
        for e in evs[i + 1 :]:
            gen = e.get("generation")
            if e["event"] not in after_kinds or gen is None:
                continue
            if (target is None and e["event"] != STEP_FINISHED) or (target is not None and gen >= target):
                key = gen
                break
        groups.setdefault(key, []).append(f)

    out = []
    for key, failures in sorted(groups.items(), key=lambda kv: kv[1][0]["ts"]):
        gen = None if isinstance(key, tuple) else key
        t_fail = failures[0]["ts"]
        later = [e for e in evs if gen is not None and e.get("generation") == gen and e["ts"] >= t_fail]

        def first(kind: str) -> dict[str, Any] | None:
            return next((e for e in later if e["event"] == kind), None)

        formed, restore, done = first(GENERATION_FORMED), first(RESTORE_STEP), first(STEP_FINISHED)
        failed_gen = failures[0].get("generation")
        fault = next((e for e in reversed(evs) if e["event"] == FAULT_INJECTED and e["ts"] <= t_fail
                      and e.get("generation") == failed_gen), None)
        t_start = fault["ts"] if fault else t_fail
        diverged = next((e for e in later if e["event"] == REPLAY_MISMATCH), None)
        from_step = restore.get("from_step") if restore else None
        to_step = restore.get("to_step") if restore else None
        out.append({
            "generation": gen,
            "failed_generation": failed_gen,
            "failures": [  # the dead first: a survivor's failed collective is a consequence, not a cause
                {k: f[k] for k in ("node", "rank", "signal", "kind") if k in f}
                for f in sorted(failures, key=lambda f: f.get("kind") == "collective")
            ],
            "failure_ts": t_fail,
            "fault_ts": fault["ts"] if fault else None,
            "detect_s": t_fail - fault["ts"] if fault else None,
            "world_size": formed.get("world_size") if formed else None,
            "recovered_ts": done["ts"] if done else None,
            "mttr_s": done["ts"] - t_start if done else None,
            "from_step": from_step,
            "to_step": to_step,
            "lost_steps": from_step - to_step if from_step is not None and to_step is not None else None,
            "sources": sorted({str(e["source"]) for e in later if e["event"] == RESTORED and "source" in e}),
            "diverged": {k: diverged.get(k) for k in ("rank", "step", "forward", "what", "again")} if diverged else None,
        })
    return out


def divergence(e: dict[str, Any]) -> str:
    """What a replay_mismatch event saw, in words (pure)."""
    if e.get("what") == "tail":
        return (f"the code after step {e.get('step')}'s update, {e.get('forward')} collective(s) before the fault, did "
                f"not run again ({e.get('again')} after the restore)")
    if e.get("what") == "hyperparameters":
        return "its optimizer's hyperparameters (the LR) at that step differ from its first run"
    verb = "differ" if e.get("what") == "inputs" else "differs"
    return f"the {e.get('what')} of its training forward {e.get('forward')} {verb} from its first run"


def format_recovery(index: int, rec: dict[str, Any]) -> str:
    """One line for one recovery, as the launcher prints it at the end of a job."""
    who = ", ".join(
        f"rank {f.get('rank', '?')} ({f.get('signal') or f.get('kind') or 'failed'})" for f in rec["failures"])
    if rec["generation"] is None:
        return f"trainguard: recovery {index}: {who} failed in generation {rec['failed_generation']}; not recovered"
    since = "kill" if rec["fault_ts"] is not None else "detection"
    mttr = (f"{rec['mttr_s']:.3f} s ({since} to the first step finished after)" if rec["mttr_s"] is not None else
            "n/a (no step finished after)")
    lost = rec["lost_steps"] if rec["lost_steps"] is not None else "?"
    outcome = f"lost {lost} steps"
    d = rec.get("diverged")
    if d:  # the replay audit saw it: no "lost 0 steps" over a result that is no longer the same
        outcome = f"NOT bit-identical from step {d['step']} (rank {d['rank']}: {divergence(d)})"
    return (f"trainguard: recovery {index}: {who} -> generation {rec['generation']}, resumed at step "
            f"{rec['to_step']}, {outcome}, MTTR {mttr}")


class EventTail:
    """Reads a growing events.jsonl incrementally (the scheduler's status and metrics): each `update()`
    parses only the complete lines appended since the last. It keeps the events a recovery summary
    needs (`kept` kinds) and folds the rest into counters, so a long job's progress samples do not
    pile up in memory."""

    KEPT = frozenset({FAILURE_DETECTED, GENERATION_FORMED, RESTORE_STEP, RESTORED, STEP_FINISHED, FAULT_INJECTED,
                      REPLAY_MISMATCH, "desync", "hang_detected",
                      "left_generation", "agreed_restore"})
    MAX_READ = 16 << 20  # bytes per update: a huge backlog is read over several updates

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path is not None else None
        self.events: list[dict[str, Any]] = []
        self.checkpoints: list[tuple[float, int]] = []  # (seconds, bytes) of each checkpoint_saved
        self.spares: dict[int, int] = {}  # agent (node rank) -> hot spares ready
        self._offset = 0

    def update(self) -> bool:
        """Read what was appended; True if anything was."""
        if self.path is None:
            return False
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(self.MAX_READ)
        except OSError:
            return False
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next update
        self._offset += end
        for raw in data[:end].split(b"\n"):
            try:
                e = json.loads(raw) if raw.strip() else None
            except ValueError:
                continue
            if isinstance(e, dict) and isinstance(e.get("ts"), (int, float)):
                self._take(e)
        return end > 0

    def _take(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind in self.KEPT:
            self.events.append(e)
        elif kind == "checkpoint_saved" and isinstance(e.get("seconds"), (int, float)):
            self.checkpoints.append((float(e["seconds"]), int(e.get("bytes") or 0)))
        elif kind == "spares" and isinstance(e.get("agent"), int) and isinstance(e.get("ready"), int):
            self.spares[e["agent"]] = e["ready"]
