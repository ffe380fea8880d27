"""MTTR and lost steps when 1 of 2 workers is killed with SIGKILL during examples/digits.py (the high
level, which recovers in place), and during examples/trainer.py (a hand-written trainer, 3 workers: every
rank runs the script again in its process, its committed state kept; `--no-trainer` skips it), and
during examples/fsdp2_tutorial.py (PyTorch's FSDP2 tutorial on the one engine, 2 layers, over 2 workers,
side by side with data parallelism; `--no-sharded` skips it), and during bench/setup_cost.py (3 workers, hot
spare) whose setup is trivial, takes 5 seconds (a sleep standing in for a big model's build), or compiles the model
with torch.compile: what a rewind costs when the script's setup is paid again (`--no-setup` skips them; the
phases are `trainguard report`'s).

MTTR runs from the kill itself (the `fault_injected` event the dying worker writes just before
SIGKILLing itself) to the first training step finished after the recovery. Each configuration
runs `--runs` times; the figures are medians. With hot spares (the default) the replacement has
already imported torch and waits; without them it is forked from the agent's zygote, which has imported
torch too; with neither (`--no-zygote`) it is a cold Python process.

    python bench/recovery.py [--runs 5] [--kill-step 60] [--no-trainer] [--no-sharded] [--no-setup] [--only-setup]
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
from trainguard.obs.timeline import build  # noqa: E402


DIGITS = ("2", ["examples/digits.py", "--epochs", "4"])
TRAINER = ("3", ["examples/trainer.py", "--epochs", "2", "--snapshot", "{tmp}/snapshot.pt"])
FSDP2 = ("2", ["examples/fsdp2_tutorial.py", "--steps", "60", "--layers", "2", "--batch-size", "4"])
SETUP = {  # bench/setup_cost.py: 18 steps an epoch; killed at step 25, in epoch 1
    "trivial setup": ("3", ["bench/setup_cost.py"]),
    "a 5-second setup": ("3", ["bench/setup_cost.py", "--setup-sleep", "5"]),
    "torch.compile": ("3", ["bench/setup_cost.py", "--compile"]),
}


def one_run(spares: int, kill_step: int, job=DIGITS, flags=()) -> dict:
    workers, script = job
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", workers, "--hot-spares", str(spares),
               *flags, "--recovery-path", tmp, *(a.format(tmp=tmp) for a in script)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TG_FAULT": f"1:{kill_step}:kill"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"the job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        events = EventLog.read(Path(tmp) / "events.jsonl")
        (rec,) = summarize_recovery(events)
        (timeline,) = build(events).recoveries
        rec["phases"] = {phase.name: phase.seconds for phase in timeline.phases}
        return rec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kill-step", type=int, default=60)
    parser.add_argument("--no-trainer", action="store_true", help="skip examples/trainer.py")
    parser.add_argument("--no-sharded", action="store_true", help="skip examples/fsdp2_tutorial.py (FSDP2)")
    parser.add_argument("--no-setup", action="store_true", help="skip bench/setup_cost.py's cells")
    parser.add_argument("--only-setup", action="store_true", help="only bench/setup_cost.py's cells")
    args = parser.parse_args()
    results = {}
    runs = [(1, "hot spare", DIGITS, args.kill_step, ()), (0, "forked from the zygote", DIGITS, args.kill_step, ()),
            (0, "cold process", DIGITS, args.kill_step, ("--no-zygote",))]
    if args.only_setup:
        runs, args.no_trainer, args.no_sharded = [], True, True
    if not args.no_trainer:  # step 17 of 24: in the middle of epoch 1's training
        runs.append((1, "examples/trainer.py, 3 workers, hot spare", TRAINER, 17, ()))
    if not args.no_sharded:  # step 30 of 60
        runs += [(1, "FSDP2 (fsdp2_tutorial.py), hot spare", FSDP2, 30, ()),
                 (0, "FSDP2 (fsdp2_tutorial.py), forked from the zygote", FSDP2, 30, ()),
                 (0, "FSDP2 (fsdp2_tutorial.py), cold process", FSDP2, 30, ("--no-zygote",))]
    if not args.no_setup:
        runs += [(1, f"bench/setup_cost.py, {what}, 3 workers, hot spare", job, 25, ()) for what, job in SETUP.items()]
    for spares, label, job, kill_step, flags in runs:
        recs = [one_run(spares, kill_step, job, flags) for _ in range(args.runs)]
        mttr = [r["mttr_s"] for r in recs]
        lost = [r["lost_steps"] for r in recs]
        detect = [r["detect_s"] for r in recs]
        print(f"{label}: MTTR " + ", ".join(f"{m:.3f}" for m in mttr) + f" s; lost steps {lost}", flush=True)
        phases = {name: statistics.median(r["phases"].get(name, 0.0) for r in recs) for name in recs[0]["phases"]}
        results[label] = (statistics.median(mttr), statistics.median(lost), statistics.median(detect), phases)
    for label, (mttr, lost, detect, phases) in results.items():
        print(f"kill -9 of one worker, {label}, median of {args.runs}: MTTR {mttr:.3f} s "
              f"(detected after {1000 * detect:.0f} ms), lost steps {lost}; phases (medians) "
              + ", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items()))
    if "hot spare" in results:
        hot, forked, cold = (results[k][0] for k in ("hot spare", "forked from the zygote", "cold process"))
        print(f"hot spare vs cold process: {cold / hot:.1f}x faster; forked vs cold process: {cold / forked:.1f}x "
              "faster")
    trivial = next((v[0] for k, v in results.items() if "trivial setup" in k), None)
    for label, (mttr, *_rest) in results.items():
        if trivial and "setup_cost" in label and "trivial" not in label:
            print(f"{label.split(', ')[1]}: MTTR {mttr / trivial:.1f}x the trivial setup's")


if __name__ == "__main__":
    main()
