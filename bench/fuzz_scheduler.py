"""Fuzz a real `trainguard scheduler` process for a number of frames (issue "Every field bounded": 1M).

    python bench/fuzz_scheduler.py --frames 1000000 [--seed 1] [--batch 24]

The fuzzer (trainguard/testing/fuzz.py) holds the job secret and also plays strangers without it. It prints
frames sent and answered, frames from strangers, connections, handler exceptions in the scheduler's log,
status queries that did not answer within 10 s (hangs), whether the scheduler died (crashes), and its peak
RSS. `status` is queried at most once a second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainguard.testing.fuzz import fuzz_scheduler  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=24, help="mean frames per connection")
    ap.add_argument("--max-seconds", type=float, default=3 * 3600)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-fuzz-") as tmp:
        out = fuzz_scheduler(tmp, seed=args.seed, frames=args.frames, seconds=args.max_seconds, batch=args.batch,
                             check_every_s=1.0)
        t = out.tally
        print(f"frames: {t.frames + t.unauthenticated} in {out.seconds:.0f} s "
              f"({(t.frames + t.unauthenticated) / out.seconds:.0f}/s)")
        print(f"  admitted (job or worker secret): {t.frames}, answered {t.answered}; by kind {t.kinds}")
        print(f"  from strangers (no or a wrong secret): {t.unauthenticated}; registered by them: {len(out.strangers)}")
        print(f"  connections: {t.connections}, closed by the scheduler mid-batch: {t.dropped}")
        print(f"crashes: {int(out.crashed)}, hangs (status > 10 s): {out.hangs}, slowest status: "
              f"{out.slowest_status_s * 1000:.0f} ms")
        print(f"handler exceptions: {len(out.handler_errors)}")
        for line in out.handler_errors[:10]:
            print("   ", line)
        print(f"scheduler peak RSS: {out.peak_rss_mb:.0f} MiB")
        return 1 if out.crashed or out.hangs or out.handler_errors or out.strangers else 0


if __name__ == "__main__":
    sys.exit(main())
