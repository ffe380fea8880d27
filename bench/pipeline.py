"""What live recovery costs a pipeline-parallel job, and how fast it comes back: bench/pipeline_step.py (an MLP in 2
stages, 1F1B, 4 micro-batches, gloo on CPU) on trainguard (`trainguard run`, its defaults: a hot spare, in-memory
copies of each stage at the cadence the ranks vote, the commit vote) against plain torchrun with the same script.
The two alternate, --runs times each; a run's figure is its mean step time after the warm-up, the table's the
median over the runs. Then --mttr-runs runs with rank 1 killed (kill -9) just before a receive in the middle of a
schedule (TG_FAULT_COLLECTIVE=1:irecv:N): the launcher's MTTR, from the kill to the first step finished after it
on every rank, median over the runs.

    python bench/pipeline.py [--runs 5] [--mttr-runs 3] [--width 512]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from overhead import REPO, run, torchrun, trainguard

STEP_TIME = re.compile(r"mean step time: ([0-9.]+) ms")
MTTR = re.compile(r"^trainguard: recovery \d+: .* MTTR ([0-9.]+) s", re.M)


def step_ms(cmd: list[str]) -> float:
    found = STEP_TIME.findall(run(cmd))
    if len(found) != 1:
        sys.exit(f"expected one step time from {' '.join(cmd)}")
    return float(found[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mttr-runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    started = time.monotonic()
    flags = ["--width", str(args.width), "--steps", str(args.steps), "--warmup", "10"]
    tg, plain = [], []
    for i in range(args.runs):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):  # which setup goes first alternates
            if which == 0:
                tg.append(step_ms(trainguard(2, "bench/pipeline_step.py", *flags, "--trainguard")))
            else:
                plain.append(step_ms(torchrun(2, "bench/pipeline_step.py", *flags)))
        print(f"run {i + 1}: trainguard {tg[-1]:.2f} ms, plain {plain[-1]:.2f} ms", flush=True)
    mttr = []
    for i in range(args.mttr_runs):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TG_FAULT_COLLECTIVE": f"1:irecv:{4 * 20 + 2}"}  # step 20,
        proc = subprocess.run(trainguard(2, "bench/pipeline_step.py", *flags, "--trainguard"), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)  # micro-batch 2's receive
        out = proc.stdout + proc.stderr
        found = MTTR.findall(out)
        if len(found) != 1:
            sys.exit(f"expected one recovery, got {found}:\n{out[-2000:]}")
        mttr.append(float(found[0]))
        print(f"kill -9 mid-schedule {i + 1}: MTTR {mttr[-1]:.3f} s", flush=True)
    a, b = statistics.median(tg), statistics.median(plain)
    print(f"\npipeline 2 stages, width {args.width}, 1F1B x 4 micro-batches; median of {args.runs} runs each, alternating")
    print(f"step time: trainguard {a:.2f} ms, plain torchrun {b:.2f} ms, ratio {a / b:.3f}")
    if mttr:
        print(f"MTTR (kill -9 of rank 1 mid-schedule, hot spare): median {statistics.median(mttr):.3f} s of {mttr}")
    print(f"took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
