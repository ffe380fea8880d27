"""Hugging Face Accelerate: examples/accelerate/train.py is examples/accelerate/train_plain.py, a plain Accelerate
script (digits, a model with BatchNorm and dropout, `prepare`, `accumulate`, `clip_grad_norm_`, a OneCycleLR stepped
per step, `gather_for_metrics` in validation, `save_state` per epoch), changed in at most 3 lines. 3 ranks, real
processes: `trainguard verify` kills rank 1 in a step, after a commit, in validation, right after an epoch's last
step, kills the scheduler, and SIGTERMs then runs the same command again; every tensor of every rank's model,
optimizer, scheduler and loader state is `torch.equal` to the run without a fault. A run to the end with a kill in
validation prints the same validation lines and saves the same weights. The oldest Accelerate the extra accepts
(`trainguard[accelerate]`, installed by scripts/setup.sh beside the pinned one) passes the same check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, assert_identical, changed_lines, env, events

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(400)

ORIGINAL, PORT = REPO / "examples" / "accelerate" / "train_plain.py", REPO / "examples" / "accelerate" / "train.py"
OLDEST = REPO / ".venv" / "accelerate-oldest"  # scripts/setup.sh: the oldest version pyproject's extra accepts
WORKERS, EPOCHS, STEPS = 3, 3, 20
VAL = re.compile(r"epoch \d+: .*")


def verify(tmp_path: Path, faults: str | None = None, **extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "verify", "--steps", str(STEPS), "--keep", str(tmp_path),
           "--workers", str(WORKERS), *(["--faults", faults] if faults else []), str(PORT), "--epochs", str(EPOCHS)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(TG_EXACT="", **extra), capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return proc


def run_to_end(out: Path, **faults: str) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--recovery-path",
           str(out / "recovery"), str(PORT), "--epochs", str(EPOCHS), "--output_dir", str(out / "ckpt"),
           "--save_final", str(out / "final.pt")]
    proc = subprocess.run(cmd, cwd=out, env=env(**faults), capture_output=True, text=True, timeout=240)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = list(dict.fromkeys(line.split("] ", 1)[-1] for line in proc.stdout.splitlines() if VAL.search(line)
                               and line.startswith("[worker 0]")))  # a pass redone after a fault prints again
    return lines, torch.load(out / "final.pt", weights_only=True)


def fresh(path: Path) -> Path:
    path.mkdir()
    return path


def test_the_port_changes_at_most_three_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 3, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain Accelerate


def test_every_fault_verify_makes_is_bit_identical_on_every_rank(tmp_path):
    proc = verify(tmp_path)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    names = [re.split(r"\s{2,}", r)[0] for r in rows]
    assert names == ["kill -9 in a step (rank 1)", "kill -9 after a commit (rank 1)", "kill -9 outside a step (rank 1)",
                     "kill -9 at an epoch's end (rank 1)", "kill -9 of the scheduler", "SIGTERM and a rerun (rank 1)"], \
        proc.stdout
    assert all(" identical" in r for r in rows), proc.stdout
    outside = next(r for r in rows if r.startswith("kill -9 outside"))
    assert "all_gather" in outside, outside  # gather_for_metrics, in validation
    resumed = (tmp_path / "mid-step" / "launcher.log").read_text()
    assert "the training loader resumed at batch" in resumed, resumed[-3000:]


def test_a_kill_in_validation_ends_with_the_same_weights_and_validation_lines(tmp_path):
    ref_lines, ref = run_to_end(fresh(tmp_path / "ref"))
    lines, final = run_to_end(fresh(tmp_path / "faulty"), TG_FAULT_COLLECTIVE="1:all_gather:9")  # epoch 2's validation
    fired = [e for e in events(tmp_path / "faulty") if e["event"] == "fault_injected"]
    assert len(fired) == 1, fired
    assert len(ref_lines) == EPOCHS and lines == ref_lines, (lines, ref_lines)
    assert_identical(final, ref, "the saved model")


@pytest.mark.skipif(not OLDEST.is_dir(), reason="scripts/setup.sh installs the oldest accepted Accelerate there")
def test_the_oldest_accelerate_the_extra_accepts(tmp_path):
    oldest = {"PYTHONPATH": os.pathsep.join(filter(None, [str(OLDEST), os.environ.get("PYTHONPATH", "")]))}
    version = subprocess.run([sys.executable, "-c", "import accelerate; print(accelerate.__version__)"],
                             env=env(**oldest), capture_output=True, text=True, timeout=60).stdout.strip()
    floor = re.search(r'"accelerate>=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert version == floor, (version, floor)
    proc = verify(tmp_path, "mid-step,epoch-end", **oldest)
    assert "every run is identical" in proc.stdout, proc.stdout
