"""What a job's start costs: `trainguard run --workers N` of examples/digits.py for one epoch, its workers
forked from the agent's zygote (the default) against fresh interpreters (`--no-zygote`), alternating.

For each run: the wall time of the whole job, and the CPU (user + sys) of every process in it (the agent,
scheduler, zygote and workers: all reaped, so counted in RUSAGE_CHILDREN), and the time from the agent's
start until every worker has joined the first generation (`generation_formed` in events.jsonl). Medians over `--runs`, and the ratios. Hot spares are
off in both, so only the workers' own start differs.

    python bench/startup.py [--runs 5] [--workers 4]
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard.obs.events import EventLog  # noqa: E402


def one_run(workers: int, zygote: bool) -> tuple[float, float, float]:
    """(wall s, CPU s, s from start until the first generation formed)."""
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), "--hot-spares", "0",
               *([] if zygote else ["--no-zygote"]), "--recovery-path", tmp, "examples/digits.py", "--epochs", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start, wall_start = time.time(), time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - wall_start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            sys.exit(f"the job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        formed = [e["ts"] for e in EventLog.read(Path(tmp) / "events.jsonl") if e.get("event") == "generation_formed"]
        first = (min(formed) - start) if formed else float("nan")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return wall, cpu, first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for i in range(args.runs):
        for zygote in (True, False) if i % 2 == 0 else (False, True):
            results[zygote].append(one_run(args.workers, zygote))
            wall, cpu, first = results[zygote][-1]
            print(f"run {i + 1} {'zygote' if zygote else 'fresh '}: wall {wall:.2f} s, CPU {cpu:.2f} s, "
                  f"formed after {first:.2f} s", flush=True)
    med = {z: [statistics.median(r[k] for r in results[z]) for k in range(3)] for z in results}
    for z, label in ((True, "forked from the zygote"), (False, "fresh interpreters (--no-zygote)")):
        wall, cpu, first = med[z]
        print(f"{args.workers} workers, {label}, median of {args.runs}: wall {wall:.2f} s, CPU {cpu:.2f} s, "
              f"first generation formed after {first:.2f} s")
    print(f"zygote / fresh: wall {med[True][0] / med[False][0]:.2f}, CPU {med[True][1] / med[False][1]:.2f}, "
          f"first generation {med[True][2] / med[False][2]:.2f}")


if __name__ == "__main__":
    main()
