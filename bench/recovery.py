"""MTTR and lost steps when 1 of 2 workers is killed with SIGKILL during examples/digits.py.

MTTR runs from the kill itself (the `fault_injected` event the dying worker writes just before
SIGKILLing itself) to the first training step finished after the recovery. Each configuration
runs `--runs` times; the figures are medians. With hot spares (the default) the replacement has
already imported torch; without them it is a cold Python process.

    python bench/recovery.py [--runs 5] [--kill-step 60]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard.obs.events import EventLog, summarize_recovery  # noqa: E402


def one_run(spares: int, kill_step: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", str(spares),
               "--recovery-path", tmp, "examples/digits.py", "--epochs", "4"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TG_FAULT": f"1:{kill_step}:kill"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"the job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        (rec,) = summarize_recovery(EventLog.read(Path(tmp) / "events.jsonl"))
        return rec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kill-step", type=int, default=60)
    args = parser.parse_args()
    results = {}
    for spares, label in ((1, "hot spare"), (0, "cold process")):
        recs = [one_run(spares, args.kill_step) for _ in range(args.runs)]
        mttr = [r["mttr_s"] for r in recs]
        lost = [r["lost_steps"] for r in recs]
        detect = [r["detect_s"] for r in recs]
        print(f"{label}: MTTR " + ", ".join(f"{m:.3f}" for m in mttr) + f" s; lost steps {lost}", flush=True)
        results[label] = (statistics.median(mttr), statistics.median(lost), statistics.median(detect))
    for label, (mttr, lost, detect) in results.items():
        print(f"kill -9 of 1 of 2 workers, {label}, median of {args.runs}: MTTR {mttr:.3f} s "
              f"(detected after {1000 * detect:.0f} ms), lost steps {lost}")
    hot, cold = results["hot spare"][0], results["cold process"][0]
    print(f"hot spare vs cold process: {cold / hot:.1f}x faster")


if __name__ == "__main__":
    main()
