"""`trainguard report --plot timeline.png`: the picture of a job's timeline (timeline.py).

Top left, the whole run: one row per rank, time across. A red cross is a fault (the rank that was
killed or failed), a blue tick a checkpoint, a black square a graceful stop, and each recovery is a
coloured span. Below it, the step rate over the run: the dips are what failures cost. On the right,
one panel per recovery (the first three), zoomed in: its phases as coloured bands, and for each rank
when it left the failed group (o), had its state back (^) and finished its first step (diamond).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .timeline import PHASES, Timeline, step_rate, summary

COLORS = dict(zip(PHASES, ("#d62728", "#ff7f0e", "#bcbd22", "#9467bd", "#1f77b4", "#2ca02c")))
ZOOMED = 3  # recoveries drawn in detail


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'trainguard[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(tl: Timeline, path: str | Path) -> Path:
    plt = _pyplot()
    zoom = tl.recoveries[:ZOOMED]
    fig = plt.figure(figsize=(12 if zoom else 8, 6), dpi=80, layout="constrained")
    grid = fig.add_gridspec(2, 1 + len(zoom), height_ratios=(3, 1.3), width_ratios=(2.2, *([1] * len(zoom))))
    run = fig.add_subplot(grid[0, 0])
    rate_ax = fig.add_subplot(grid[1, 0], sharex=run)
    t = lambda ts: ts - tl.t0  # noqa: E731
    ranks = tl.ranks or [0]

    for r in ranks:
        start, end = tl.lifetimes.get(r, (tl.t0, tl.t1))
        run.hlines(r, t(start), t(end), color="#cccccc", lw=6, zorder=1)
    for rec in tl.recoveries:
        for ph in rec.phases:
            run.axvspan(t(ph.start), t(ph.end), color=COLORS[ph.name], alpha=0.6, lw=0, zorder=0)
        run.annotate(f"#{rec.index}", (t(rec.start), ranks[0] - 0.45), ha="center", va="bottom", fontsize=8)
    if tl.faults:
        run.scatter([t(f["ts"]) for f in tl.faults], [f["rank"] for f in tl.faults], marker="X", s=90,
                    color="#d62728", zorder=3, label="fault")
    if tl.checkpoints:
        run.scatter([t(c["ts"]) for c in tl.checkpoints], [ranks[0] - 0.3] * len(tl.checkpoints), marker="|",
                    s=120, color="#1f77b4", zorder=3, label="checkpoint")
    if tl.stops:
        run.scatter([t(s["ts"]) for s in tl.stops], [s["rank"] for s in tl.stops], marker="s", s=40,
                    color="black", zorder=3, label="graceful stop")
    run.set_yticks(ranks, [f"rank {r}" for r in ranks])
    run.set_ylim(ranks[0] - 0.7, ranks[-1] + 0.7)
    run.invert_yaxis()
    s = summary(tl)
    n = len(tl.recoveries)
    run.set_title(f"{n} recover{'y' if n == 1 else 'ies'}: {s['lost_s']:.2f} s lost of {s['wall_s']:.1f} s "
                  f"(goodput {100 * s['goodput']:.1f}%); grey: each rank training", fontsize=10)
    run.set_xlim(0, max(t(tl.t1), 1e-3) * 1.02)
    if tl.faults or tl.checkpoints or tl.stops:
        run.legend(loc="lower right", fontsize=8)
    run.tick_params(labelbottom=False)

    rates = step_rate(tl.progress)
    if rates:
        rate_ax.step([t(x) for x, _ in rates], [y for _, y in rates], where="mid", color="#2ca02c", lw=1.2)
    for rec in tl.recoveries:
        rate_ax.axvspan(t(rec.start), t(rec.end), color="#d62728", alpha=0.25, lw=0)
    rate_ax.set_ylabel("steps/s")
    rate_ax.set_title("step rate (red: recoveries)", fontsize=9, loc="left")
    rate_ax.set_xlabel("seconds since the job started")
    rate_ax.set_ylim(bottom=0)

    for col, rec in enumerate(zoom, start=1):
        ax = fig.add_subplot(grid[:, col])
        ms = lambda ts, rec=rec: 1000 * (ts - rec.start)  # noqa: E731
        for ph in rec.phases:
            ax.axvspan(ms(ph.start), ms(ph.end), color=COLORS[ph.name], alpha=0.55, lw=0,
                       label=f"{ph.name} {1000 * ph.seconds:.0f} ms")
        for kind, marker, label in (("left", "o", "left the failed group"), ("restored", "^", "state restored"),
                                    ("stepped", "D", "first step done")):
            xs = [(ms(rec.rank_marks[r][kind]), r) for r in ranks if kind in rec.rank_marks.get(r, {})]
            if xs:
                ax.scatter([x for x, _ in xs], [r for _, r in xs], marker=marker, s=45, color="black", zorder=3,
                           label=label)
        for f in tl.faults:
            if rec.start - 1e-6 <= f["ts"] <= rec.end:
                ax.scatter([ms(f["ts"])], [f["rank"]], marker="X", s=90, color="#d62728", zorder=3)
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_ylim(ranks[0] - 0.7, ranks[-1] + 0.7)
        ax.invert_yaxis()
        total = f"{1000 * rec.total_s:.0f} ms" if rec.total_s is not None else "not recovered"
        lost = "?" if rec.lost_steps is None else rec.lost_steps
        who = rec.failures[0].get("rank", "?") if rec.failures else "?"
        ax.set_title(f"#{rec.index}: rank {who} failed ({rec.cause})\n{total}, lost {lost} steps, state from "
                     f"{', '.join(rec.sources) or '-'}", fontsize=9)
        ax.margins(x=0.06)
        ax.set_xlabel("ms since the fault" if rec.fault_known else "ms since detection")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=7)
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
