"""kill -9 to the next step for a framework's script (Accelerate, the transformers Trainer, Lightning:
bench/frameworks.py):
examples/<framework>/train.py under `trainguard run` (a hot spare, its defaults) against
examples/<framework>/train_plain.py under `torchrun --standalone --max-restarts 3`, 3 workers on CPU.
Each run trains until rank 0 has made --at steps, then rank 1 is killed with SIGKILL from outside; the figure is the
time from the kill to rank 0's next optimizer step (bench/steptimer/sitecustomize.py stamps every step with the wall
clock, without a wrapper script in front of the example, which would hide its imports from the hot spare), which
is what trainguard's report calls MTTR. torchrun restarts every worker, and the plain script starts again from its
first epoch (it resumes only when told `--resume_from_checkpoint`); trainguard's survivors go on from the last commit.
The two alternate, --runs times each; medians.

    python bench/framework_mttr.py [--framework accelerate|transformers|lightning] [--runs 3]
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frameworks import NAMES, REPO, scripts

TIMER = REPO / "bench" / "steptimer"  # a sitecustomize: on PYTHONPATH, with STEPTIMER=1
HANG_S = 120  # a run still going this long after the kill is stopped and counted as one that did not step again


def stamps(folder: Path) -> list[float]:
    path = folder / "steps_0"
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def _end(proc: subprocess.Popen, folder: Path) -> None:
    """The launcher and everything it started: its session, and any process whose command line names the run's
    folder (workers torchrun restarted in sessions of their own, left behind when it is killed)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(folder).encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def one(make, at: int) -> float | str:
    """Seconds from the kill to rank 0's next step, or why there was none (`make(folder)`: the command)."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        cmd = make(folder)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TG_FAULT": "",
               "STEPTIMER_DIR": str(folder), "STEPTIMER": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(TIMER), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + 300
        while len(stamps(folder)) < at:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the run ended or stalled before step {at}: {' '.join(cmd)}\n{proc.stderr.read()[-2000:]}")
            time.sleep(0.01)
        os.kill(int((folder / "pid_1").read_text()), signal.SIGKILL)
        killed = time.time()
        try:
            err = proc.communicate(timeout=HANG_S)[1]
        except subprocess.TimeoutExpired:
            _end(proc, folder)
            proc.wait()
            after = [t for t in stamps(folder) if t > killed]
            return after[0] - killed if after else f"no step within {HANG_S} s of the kill (still running: killed)"
        _end(proc, folder)  # a launcher that exited can leave workers behind (torchrun's restarted ones did)
        after = [t for t in stamps(folder) if t > killed]
        if not after:
            last = [ln for ln in err.splitlines() if "Error" in ln or "error" in ln][-1:]
            return f"no step after the kill (exit {proc.returncode}; last error: {last[0][:160] if last else '-'})"
        return after[0] - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=NAMES, default="accelerate")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--at", type=int, default=30, help="rank 0's steps before the kill (default 30)")
    args = parser.parse_args()

    def plain(folder: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                "--max-restarts", "3", *scripts(args.framework, 10, 16, str(folder / "out"))[0]]

    def guarded(folder: Path) -> list[str]:
        return [sys.executable, "-m", "trainguard", "run", "--workers", "3",
                *scripts(args.framework, 10, 16, str(folder / "out"))[1]]

    setups = {"torchrun --max-restarts 3": plain, "trainguard run": guarded}
    took: dict[str, list[float | str]] = {name: [] for name in setups}
    for i in range(args.runs):
        for name in (list(setups) if i % 2 == 0 else list(reversed(setups))):
            took[name].append(one(setups[name], args.at))
            value = took[name][-1]
            print(f"run {i + 1}: {name}: " + (f"{value:.3f} s from the kill to the next step"
                                              if isinstance(value, float) else value), flush=True)
    print(f"\n{args.framework}: kill -9 of rank 1 after rank 0's step {args.at}, 3 workers, {args.runs} runs each, "
          "alternating")
    for name, values in took.items():
        times = [v for v in values if isinstance(v, float)]
        median = f"median {statistics.median(times):.3f} s" if times else "no run stepped again"
        print(f"{name:28s} {median}  ({len(times)} of {len(values)} runs stepped again: "
              f"{', '.join(f'{v:.3f}' for v in times)})")


if __name__ == "__main__":
    main()
