"""A job's timeline from its events: each recovery split into phases, faults, checkpoints, graceful
stops and the step rate; and the summary a manager asks for. Pure: events in, data out. The text
report (report.py), the picture (plot.py), `trainguard status` and the Prometheus metrics all read it.

The phases of one recovery, each ending at an event:

| phase      | from                                   | to                                                   |
|------------|----------------------------------------|------------------------------------------------------|
| detect     | the fault (`fault_injected`; else the detection itself) | the scheduler sees it (`failure_detected`) |
| fence      | detection                              | every survivor left the failed group (`left_generation`) |
| regroup    | fenced                                 | the next generation formed (`generation_formed`)     |
| agree      | formed                                 | the ranks agreed on the step and sources (`agreed_restore`) |
| restore    | agreed                                 | the last rank has its state (`restored`)             |
| first step | restored                               | every rank finished a step (`step_finished`)         |

A phase whose end event is missing (the job ended first) is left out. A survivor whose collective
failed before the scheduler noticed left early: its fence phase takes no time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from .events import (
    FAILURE_DETECTED,
    GENERATION_FORMED,
    RESTORED,
    STEP_FINISHED,
    divergence,
    summarize_recovery,
)

PHASES = ("detect", "fence", "regroup", "agree", "restore", "first step")
LEFT_GENERATION = "left_generation"
AGREED_RESTORE = "agreed_restore"
PROGRESS = "progress"
CHECKPOINT_SAVED = "checkpoint_saved"
GRACEFUL_EXIT = "graceful_exit"
SPARES = "spares"


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Recovery:
    index: int  # 1, 2, ...
    failed_generation: int | None
    generation: int | None  # None: not recovered
    failures: list[dict]  # node, rank, kind or signal; the dead first
    start: float  # the fault, else its detection
    fault_known: bool  # a fault_injected event gave the moment of the fault itself
    phases: list[Phase]
    total_s: float | None  # start -> every rank finished a step; None if it never did
    mttr_s: float | None  # start -> the first rank finished a step (what the launcher prints)
    from_step: int | None
    to_step: int | None
    lost_steps: int | None
    sources: list[str]
    rank_marks: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> left/restored/stepped ts

    @property
    def cause(self) -> str:
        first = self.failures[0] if self.failures else {}
        return str(first.get("signal") or first.get("kind") or "unknown")

    @property
    def end(self) -> float:
        return self.phases[-1].end if self.phases else self.start


@dataclass
class Timeline:
    t0: float
    t1: float
    ranks: list[int]
    recoveries: list[Recovery]
    faults: list[dict]  # ts, rank, how
    checkpoints: list[dict]  # ts, step, seconds, bytes
    stops: list[dict]  # ts, rank, step, signal
    progress: list[tuple[float, int]]  # (ts, committed step) samples from rank 0
    lifetimes: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> first, last event naming it
    verdicts: list[dict] = field(default_factory=list)  # replay mismatches, desyncs and hangs (their events)
    worlds: list[tuple[float, int, int]] = field(default_factory=list)  # (ts, generation, world size) at each change

    @property
    def wall_s(self) -> float:
        return self.t1 - self.t0


def _at(events: list[dict], kind: str, **match: Any) -> list[dict]:
    return [e for e in events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]


def _recovery(index: int, rec: dict, evs: list[dict]) -> Recovery:
    gen, failed = rec["generation"], rec["failed_generation"]
    start = rec["fault_ts"] if rec["fault_ts"] is not None else rec["failure_ts"]
    later = [e for e in evs if e["ts"] >= start]
    formed = next(iter(_at(later, GENERATION_FORMED, generation=gen)), None) if gen is not None else None
    cutoff = formed["ts"] if formed else float("inf")
    left = [e for e in _at(later, LEFT_GENERATION, generation=failed) if e["ts"] <= cutoff]
    agreed = next(iter(_at(later, AGREED_RESTORE, generation=gen)), None) if gen is not None else None
    restored = _at(later, RESTORED, generation=gen) if gen is not None else []
    stepped = _at(later, STEP_FINISHED, generation=gen) if gen is not None else []
    ends = [("detect", rec["failure_ts"]),
            ("fence", max([rec["failure_ts"], *(e["ts"] for e in left)])),
            ("regroup", formed["ts"] if formed else None),
            ("agree", agreed["ts"] if agreed else None),
            ("restore", max(e["ts"] for e in restored) if restored else None),
            ("first step", max(e["ts"] for e in stepped) if stepped else None)]
    phases, t = [], start
    for name, end in ends:
        if end is None:
            break
        end = max(t, end)
        phases.append(Phase(name, t, end))
        t = end
    marks: dict[int, dict[str, float]] = {}
    for kind, events in (("left", left), ("restored", restored), ("stepped", stepped)):
        for e in events:
            if isinstance(e.get("rank"), int):
                marks.setdefault(e["rank"], {}).setdefault(kind, e["ts"])
    complete = len(phases) == len(PHASES)
    return Recovery(index, failed, gen, rec["failures"], start, rec["fault_ts"] is not None, phases, t - start if complete else None,
                    rec["mttr_s"], rec["from_step"], rec["to_step"], rec["lost_steps"], rec["sources"], marks)


def build(events: list[dict[str, Any]]) -> Timeline:
    evs = sorted((e for e in events if isinstance(e.get("ts"), (int, float)) and isinstance(e.get("event"), str)),
                 key=lambda e: e["ts"])
    if not evs:
        return Timeline(0.0, 0.0, [], [], [], [], [], [])
    recoveries = [_recovery(i + 1, rec, evs) for i, rec in enumerate(summarize_recovery(evs))]
    ranks = sorted({e["rank"] for e in evs if isinstance(e.get("rank"), int) and e["rank"] >= 0})
    faults = [{"ts": e["ts"], "rank": e.get("rank"), "how": e.get("how", "")} for e in evs
              if e["event"] == "fault_injected"]
    for e in evs:  # a failure nobody injected (a real kill, a crash): its detection is all we know
        if e["event"] == FAILURE_DETECTED and e.get("kind") != "collective" and not any(
                f["rank"] == e.get("rank") and 0 <= e["ts"] - f["ts"] < 60 for f in faults):
            faults.append({"ts": e["ts"], "rank": e.get("rank"), "how": e.get("signal") or e.get("kind", "")})
    checkpoints = [{"ts": e["ts"], "step": e.get("step"), "seconds": e.get("seconds"), "bytes": e.get("bytes")}
                   for e in evs if e["event"] == CHECKPOINT_SAVED]
    stops = [{"ts": e["ts"], "rank": e.get("rank"), "step": e.get("step"), "signal": e.get("signal")}
             for e in evs if e["event"] == GRACEFUL_EXIT]
    progress = [(e["ts"], int(e["step"])) for e in evs if e["event"] in (PROGRESS, STEP_FINISHED)
                and isinstance(e.get("step"), int) and e.get("rank", 0) == 0]
    lifetimes: dict[int, tuple[float, float]] = {}
    for e in evs:
        r = e.get("rank")
        if isinstance(r, int) and r >= 0:
            lifetimes[r] = (lifetimes.get(r, (e["ts"],))[0], e["ts"])
    verdicts = [e for e in evs if e["event"] in VERDICT_EVENTS]
    worlds: list[tuple[float, int, int]] = []  # elastic: where a generation formed with another size
    for e in _at(evs, GENERATION_FORMED):
        if isinstance(e.get("world_size"), int) and (not worlds or worlds[-1][2] != e["world_size"]):
            worlds.append((e["ts"], e.get("generation", 0), e["world_size"]))
    return Timeline(evs[0]["ts"], evs[-1]["ts"], ranks, recoveries, sorted(faults, key=lambda f: f["ts"]),
                    checkpoints, stops, progress, lifetimes, verdicts, worlds)


VERDICT_EVENTS = ("replay_mismatch", "desync", "hang_detected")


def verdict_line(e: dict) -> str:
    """One line of `trainguard report` for a replay mismatch (train/engine/audit.py), a desync or a hang
    (control/waits.py)."""
    if e["event"] == "replay_mismatch":
        if e.get("what") == "tail":
            return f"NOT bit-identical from step {e.get('step')}: rank {e.get('rank')}: {divergence(e)} (replay audit)"
        return (f"NOT bit-identical from step {e.get('step')}: the {e.get('what')} of rank {e.get('rank')}'s training "
                f"forward {e.get('forward')} {'differ' if e.get('what') == 'inputs' else 'differs'} from its first run "
                "(replay audit)")
    if e["event"] == "desync":
        then = "every rank went back once" if e.get("action") == "rewind" else "the job ended"
        return f"{e.get('detail', 'desync')} ({then})"
    return f"rank {e.get('rank')} hung: no progress for {e.get('idle_s')} s while its peers waited; replaced"


def step_rate(progress: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """(time, steps per second) between consecutive samples; a step count that went back (steps lost
    to a recovery) counts as 0 steps done."""
    out = []
    for (t0, s0), (t1, s1) in zip(progress, progress[1:]):
        if t1 > t0:
            out.append(((t0 + t1) / 2, max(0, s1 - s0) / (t1 - t0)))
    return out


def step_seconds(progress: list[tuple[float, int]]) -> float | None:
    """The median time of one step while training ran (samples with progress only)."""
    rates = [r for _, r in step_rate(progress) if r > 0]
    return 1 / statistics.median(rates) if rates else None


def summary(tl: Timeline) -> dict[str, Any]:
    """Failures, time lost to recovery (recovering, and redoing the steps lost), its share of the run,
    and goodput (the share of the run that made progress that was kept)."""
    per_step = step_seconds(tl.progress)
    recovering = sum(r.total_s if r.total_s is not None else (tl.t1 - r.start) for r in tl.recoveries)
    redo = sum((r.lost_steps or 0) * per_step for r in tl.recoveries) if per_step else 0.0
    lost = recovering + redo
    wall = tl.wall_s
    return {"failures": sum(len([f for f in r.failures if f.get("kind") != "collective"]) or 1
                            for r in tl.recoveries),
            "recoveries": len(tl.recoveries),
            "unrecovered": sum(1 for r in tl.recoveries if r.total_s is None),
            "wall_s": wall, "recovering_s": recovering, "redo_s": redo, "lost_s": lost,
            "lost_share": lost / wall if wall > 0 else 0.0,
            "goodput": 1 - lost / wall if wall > 0 else 1.0,
            "step_s": per_step,
            "mttr_s": [r.mttr_s for r in tl.recoveries],
            "lost_steps": sum(r.lost_steps or 0 for r in tl.recoveries)}
