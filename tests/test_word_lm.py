"""A word_language_model-shaped trainer (tests/jobs/word_lm.py: batches sliced from a tensor by index, a hidden state
carried from batch to batch), 3 real ranks: what trainguard cannot hold is said at the job's first steps, not
left to differ after a fault.

- `start_epoch()` with no trainguard.DataLoader giving the batches ends the job at its first step, exit 78, naming
  the fix (before: a kill sent the loop back to its first epoch, 240 steps instead of 144, exit 0).
- The fix it names, a loop from `start_step()`, runs; the hidden state it carries across steps is named at once,
  with what to do (rank 0, once).
- The other fix, the chunks as a dataset under `tg.DataLoader(batch_size=None)` (a TypeError at the second epoch
  before), is bit-identical after a kill mid-epoch and at an epoch's end.
"""

import subprocess
import sys

from harness import REPO, env, verify_identical

from trainguard.exitcodes import EXIT_CONFIG_ERROR

JOB = REPO / "tests" / "jobs" / "word_lm.py"


def run(tmp_path, loop: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "0", "--recovery-path",
           str(tmp_path / "rec"), str(JOB), "--loop", loop, "--epochs", "1"]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)


def test_start_epoch_without_a_trainguard_loader_ends_the_job_at_its_first_step_naming_the_fix(tmp_path):
    proc = run(tmp_path, "epochs")
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CONFIG_ERROR, out[-3000:]
    assert "no trainguard.DataLoader gave this step its batch" in out and "step0 // steps_per_epoch" in out, out[-3000:]
    assert "epoch 1 done" not in out


def test_a_hidden_state_carried_across_steps_is_named_at_once(tmp_path):
    proc = run(tmp_path, "steps")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    said = [line for line in out.splitlines() if "takes as an input what its forward of an earlier step returned" in line]
    assert len(said) == 1 and said[0].startswith("[worker 0]") and "register_state" in said[0], out[-3000:]
    assert "at step 1 " in said[0] and "epoch 0 done" in out, said


def test_the_chunks_as_a_dataset_under_a_loader_without_batching_are_bit_identical_after_kills(tmp_path):
    proc = verify_identical(tmp_path, JOB, "mid-step,epoch-end", ["--loop", "loader", "--epochs", "3"], steps=14,
                            workers=3)
    assert "right after step 6, the first epoch's last" in proc.stdout, proc.stdout
