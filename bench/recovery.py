"""MTTR and lost steps when 1 of 2 workers is killed with SIGKILL during examples/digits.py (the high
level, which recovers in place), and during examples/trainer.py (a hand-written trainer, 3 workers: every
rank runs the script again in its process, its committed state kept; `--no-trainer` skips it), and
during examples/fsdp2_tutorial.py (PyTorch's FSDP2 tutorial on the one engine, 2 layers, over 2 workers,
side by side with data parallelism; `--no-sharded` skips it), and during bench/setup_cost.py (3 workers, hot
spare) whose setup is trivial, takes 5 seconds (a sleep standing in for a big model's build), or compiles the model
with torch.compile, each killed twice: the first fault rewinds every rank (the script's setup paid again everywhere;
the replay audit checks that the job resumes exactly), the later one is recovered inside the step (only the
replacement runs the script: train/engine/instep.py); and a last cell whose second fault is an exchange that fails
with nobody dead (`--no-setup` skips them; the phases are `trainguard report`'s).

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
SETUP = {  # bench/setup_cost.py, 18 steps an epoch: killed at step 10 (epoch 0), then at step 25 (epoch 1)
    "trivial setup": ("3", ["bench/setup_cost.py"]),
    "a 5-second setup": ("3", ["bench/setup_cost.py", "--setup-sleep", "5"]),
    "torch.compile": ("3", ["bench/setup_cost.py", "--compile"]),
}
# The first fault in a step rewinds every rank (the replay audit checks that the job resumes exactly); a later one is
# recovered inside the step: only the replacement runs the script. The last cell's second fault is an exchange that
# fails on every rank with nobody dead (a broken connection): nobody runs the script.
SETUP_FAULTS = "2:10:kill,1:25:kill"
BLIP = ("a 5-second setup, then a failed exchange, nobody dead", SETUP["a 5-second setup"], "2:10:kill,1:25:collective")


def one_run(spares: int, faults: str, job=DIGITS, flags=()) -> list[dict]:
    """The job under `faults` (TG_FAULT); one summary per recovery, in order, with its phases."""
    workers, script = job
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", workers, "--hot-spares", str(spares),
               *flags, "--recovery-path", tmp, *(a.format(tmp=tmp) for a in script)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TG_FAULT": faults}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"the job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        events = EventLog.read(Path(tmp) / "events.jsonl")
        recs = summarize_recovery(events)
        timelines = build(events).recoveries
        assert len(recs) == len(timelines) == len(faults.split(",")), (recs, proc.stdout[-2000:])
        for rec, timeline in zip(recs, timelines):
            rec["phases"] = {phase.name: phase.seconds for phase in timeline.phases}
        return recs


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
    kill = f"1:{args.kill_step}:kill"
    runs = [(1, "hot spare", DIGITS, kill, ()), (0, "forked from the zygote", DIGITS, kill, ()),
            (0, "cold process", DIGITS, kill, ("--no-zygote",))]
    if args.only_setup:
        runs, args.no_trainer, args.no_sharded = [], True, True
    if not args.no_trainer:  # step 17 of 24: in the middle of epoch 1's training
        runs.append((1, "examples/trainer.py, 3 workers, hot spare", TRAINER, "1:17:kill", ()))
    if not args.no_sharded:  # step 30 of 60
        runs += [(1, "FSDP2 (fsdp2_tutorial.py), hot spare", FSDP2, "1:30:kill", ()),
                 (0, "FSDP2 (fsdp2_tutorial.py), forked from the zygote", FSDP2, "1:30:kill", ()),
                 (0, "FSDP2 (fsdp2_tutorial.py), cold process", FSDP2, "1:30:kill", ("--no-zygote",))]
    if not args.no_setup:
        runs += [(1, f"bench/setup_cost.py, {what}, 3 workers, hot spare", job, SETUP_FAULTS, ())
                 for what, job in SETUP.items()]
        runs.append((1, f"bench/setup_cost.py, {BLIP[0]}, 3 workers, hot spare", BLIP[1], BLIP[2], ()))
    for spares, label, job, faults, flags in runs:
        recs = [one_run(spares, faults, job, flags) for _ in range(args.runs)]
        several = len(recs[0]) > 1
        for i in range(len(recs[0])):  # each recovery of the run: the first, then the later one
            when = "first fault (every rank rewinds)" if i == 0 else "later fault"
            name = f"{label}, {when}" if several else label
            mttr = [r[i]["mttr_s"] for r in recs]
            print(f"{name}: MTTR " + ", ".join(f"{m:.3f}" for m in mttr) + f" s; lost steps "
                  f"{[r[i]['lost_steps'] for r in recs]}", flush=True)
            phases = {p: statistics.median(r[i]["phases"].get(p, 0.0) for r in recs) for p in recs[0][i]["phases"]}
            results[name] = (statistics.median(mttr), statistics.median(r[i]["lost_steps"] for r in recs),
                             statistics.median(r[i]["detect_s"] for r in recs), phases)
    for label, (mttr, lost, detect, phases) in results.items():
        print(f"{label}, median of {args.runs}: MTTR {mttr:.3f} s (detected after {1000 * detect:.0f} ms), lost steps "
              f"{lost}; phases (medians) " + ", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items()))
    if "hot spare" in results:
        hot, forked, cold = (results[k][0] for k in ("hot spare", "forked from the zygote", "cold process"))
        print(f"hot spare vs cold process: {cold / hot:.1f}x faster; forked vs cold process: {cold / forked:.1f}x "
              "faster")
    for when in ("first fault (every rank rewinds)", "later fault"):
        trivial = next((v[0] for k, v in results.items() if "trivial setup" in k and k.endswith(when)), None)
        for label, (mttr, *_rest) in results.items():
            if trivial and "setup_cost" in label and "trivial" not in label and label.endswith(when):
                print(f"{label.split(', ', 1)[1]}: MTTR {mttr / trivial:.1f}x the trivial setup's")


if __name__ == "__main__":
    main()
