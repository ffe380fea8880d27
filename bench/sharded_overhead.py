"""What live recovery costs a sharded job: FSDP2 on trainguard's one engine (`trainguard run`, its
defaults: a hot spare, in-memory buddy copies at the cadence the ranks vote, the per-step stop vote)
against plain torchrun + the same FSDP2 loop, bench/fsdp_step.py, on 2 and 4 workers. The two
setups alternate, --runs times each; each run reports its mean step time over the steps after the
warm-up (a mean, so that the steps that start an in-memory copy count; the timed steps span several
copy intervals), and a cell's figure is the median over the runs. The warm-up (about 5 s) covers start-up work
that is not a per-step cost: torch's first iterations, and the hot spare importing torch.

    python bench/sharded_overhead.py [--runs 5] [--cells 1m:2,5m:4]

It also reports the peak RSS of each setup: the largest ru_maxrss of any rank, median over the runs.
"""

import argparse
import re
import statistics
import sys
import time

from overhead import parse_cells, run, torchrun, trainguard

STEP_TIME = re.compile(r"mean step time: ([0-9.]+) ms, median [0-9.]+ ms \((\d+) steps after \d+ warm-up(?:, an in-memory copy "
                       r"every (\d+) steps)?\)")
CELLS = {("1m", 2): (120, 100), ("1m", 4): (60, 60), ("5m", 2): (35, 180), ("5m", 4): (20, 120)}  # (warm-up, timed)


PEAK_RSS = re.compile(r"peak rss: rank (\d+) ([0-9.]+) MB")


def one(cmd: list[str], workers: int) -> tuple[float, int | None, float]:
    """(mean step time in ms, steps between in-memory copies, peak RSS in MB: the largest of any rank)."""
    out = run(cmd)
    found = STEP_TIME.findall(out)
    rss = {int(r): float(mb) for r, mb in PEAK_RSS.findall(out)}
    if len(found) != 1 or sorted(rss) != list(range(workers)):
        sys.exit(f"expected one step time and {workers} peak RSS lines from {' '.join(cmd)}:\n{out[-2000:]}")
    ms, _, every = found[0]
    return float(ms), int(every) if every else None, max(rss.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5, help="runs of each setup per cell")
    parser.add_argument("--cells", type=lambda text: parse_cells(text, CELLS), default=list(CELLS), help="e.g. 1m:2,5m:4 (default: all four)")
    args = parser.parse_args()
    started = time.monotonic()
    rows = []
    for params, workers in args.cells:
        warmup, steps = CELLS[params, workers]
        flags = ["--params", params, "--warmup", str(warmup), "--steps", str(steps)]
        tg, plain, every, tg_rss, plain_rss = [], [], [], [], []
        for i in range(args.runs):
            first, second = (0, 1) if i % 2 == 0 else (1, 0)  # which setup goes first alternates too
            for which in (first, second):
                if which == 0:
                    ms, n, mb = one(trainguard(workers, "bench/fsdp_step.py", *flags, "--trainguard"), workers)
                    tg.append(ms)
                    every.append(n)
                    tg_rss.append(mb)
                else:
                    ms, _, mb = one(torchrun(workers, "bench/fsdp_step.py", *flags), workers)
                    plain.append(ms)
                    plain_rss.append(mb)
            print(f"FSDP2 {params} x {workers} run {i + 1}: trainguard {tg[-1]:.2f} ms (a copy every {every[-1]} "
                  f"steps, peak RSS {tg_rss[-1]:.0f} MB), plain {plain[-1]:.2f} ms ({plain_rss[-1]:.0f} MB)", flush=True)
        if any(n and 2 * n > steps for n in every):
            print(f"note: fewer than two in-memory copies fell in the {steps} timed steps of {params} x {workers}; "
                  "raise its timed steps in CELLS", flush=True)
        rows.append((f"{params.upper()} x {workers}", statistics.median(tg), statistics.median(plain), every,
                     statistics.median(tg_rss), statistics.median(plain_rss)))
    print(f"\nFSDP2, median of {args.runs} runs each, alternating; step time in ms; peak RSS in MB (max over ranks)")
    print(f"{'cell':<10} {'trainguard':>10} {'plain':>9} {'ratio':>6} {'RSS tg':>7} {'RSS plain':>9} {'ratio':>6}  "
          "copy every (steps, per run)")
    for cell, a, b, every, ra, rb in rows:
        print(f"{cell:<10} {a:>10.2f} {b:>9.2f} {a / b:>6.3f} {ra:>7.0f} {rb:>9.0f} {ra / rb:>6.3f}  {every}")
    print(f"took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
