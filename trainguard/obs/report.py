"""`trainguard report`: the text of a job's timeline (timeline.py), one table row per recovery, then
the summary."""

from __future__ import annotations

from typing import Any

from .timeline import PHASES, Recovery, Timeline, summary, verdict_line


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def _who(rec: Recovery) -> str:
    dead = [f for f in rec.failures if f.get("kind") != "collective"] or rec.failures
    return ", ".join(f"rank {f.get('rank', '?')} ({f.get('signal') or f.get('kind') or '?'})" for f in dead)


def recovery_rows(tl: Timeline) -> list[list[str]]:
    rows = []
    for rec in tl.recoveries:
        took = {p.name: p.seconds for p in rec.phases}
        rows.append([str(rec.index), f"{rec.start - tl.t0:.2f}", _who(rec), *(_ms(took.get(n)) for n in PHASES),
                     _ms(rec.total_s), ",".join(rec.sources) or "-",
                     "-" if rec.lost_steps is None else str(rec.lost_steps),
                     "-" if rec.to_step is None else str(rec.to_step)])
    return rows


def table(header: list[str], rows: list[list[str]], *, left: bool = False) -> str:
    """Columns as wide as their widest cell, right-aligned (numbers), or left-aligned (text) with `left`."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) if left else c.rjust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header, *rows])


def render(tl: Timeline) -> str:
    if not tl.ranks and not tl.recoveries:
        return "no events yet"
    s = summary(tl)
    out = [f"run: {s['wall_s']:.1f} s, ranks {tl.ranks[0] if tl.ranks else '?'}-{tl.ranks[-1] if tl.ranks else '?'}"
           f", {len(tl.checkpoints)} checkpoint(s), {len(tl.stops)} graceful stop(s)"]
    if tl.recoveries:
        header = ["#", "at s", "failed", *(f"{n} ms" for n in PHASES), "total ms", "source", "lost", "resumed at"]
        out += ["", "recoveries (phases: detect = fault -> scheduler knows; fence = -> survivors left the group; "
                "regroup = -> next generation formed; agree = -> step and sources agreed; restore = -> every rank "
                "has its state; first step = -> every rank finished a step):", table(header, recovery_rows(tl))]
        unknown = [str(r.index) for r in tl.recoveries if not r.fault_known]
        if unknown:
            out.append(f"recovery {', '.join(unknown)}: the moment of the fault is unknown (only injected faults log "
                       "it), so detect shows 0 and the total counts from the detection")
    else:
        out += ["", "no recoveries"]
    if len(tl.worlds) > 1:  # elastic: the job shrank or grew
        out += ["", "world size: " + " -> ".join(f"{w} (generation {g}, {ts - tl.t0:.1f} s)" for ts, g, w in tl.worlds)]
    if tl.verdicts:
        out += ["", "verdicts (replay audit, desyncs, hangs):",
                *(f"  {e['ts'] - tl.t0:.2f} s: {verdict_line(e)}" for e in tl.verdicts)]
    step = f"{1000 * s['step_s']:.1f} ms" if s["step_s"] else "unknown"
    out += ["", f"failures: {s['failures']} ({s['recoveries']} recoveries, {s['unrecovered']} not recovered); "
            f"median step {step}",
            f"time lost to recovery: {s['lost_s']:.2f} s = {s['recovering_s']:.2f} s recovering + {s['redo_s']:.2f} s "
            f"redoing {s['lost_steps']} lost steps; {100 * s['lost_share']:.2f}% of the run",
            f"goodput: {100 * s['goodput']:.2f}% of {s['wall_s']:.1f} s made progress that was kept"]
    return "\n".join(out)


def as_json(tl: Timeline) -> dict[str, Any]:
    return {"t0": tl.t0, "t1": tl.t1, "ranks": tl.ranks, "summary": summary(tl),
            "recoveries": [{"index": r.index, "start": r.start, "failed_generation": r.failed_generation,
                            "generation": r.generation, "failures": r.failures, "cause": r.cause,
                            "phases": {p.name: p.seconds for p in r.phases}, "total_s": r.total_s,
                            "mttr_s": r.mttr_s, "from_step": r.from_step, "to_step": r.to_step,
                            "lost_steps": r.lost_steps, "sources": r.sources} for r in tl.recoveries],
            "checkpoints": tl.checkpoints, "stops": tl.stops, "faults": tl.faults, "verdicts": tl.verdicts,
            "worlds": [{"ts": ts, "generation": g, "world_size": w} for ts, g, w in tl.worlds]}
