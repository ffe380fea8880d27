"""examples/ddp_tutorial.py, a typical DDP tutorial script ported to trainguard: the port stays small,
and under kill -9, or SIGTERM followed by the same command again, its final state is bit-identical
to an uninterrupted run. 3 workers: with 2 every summation order is exact, so an order bug would hide."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, changed_lines, assert_identical, env, events, wait_for
from safetensors.torch import load_file

from trainguard.exitcodes import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(360)

ORIGINAL, PORT = REPO / "examples" / "ddp_tutorial_torchrun.py", REPO / "examples" / "ddp_tutorial.py"
WORKERS, EPOCHS = 3, 6  # 1797 digits over 3 ranks, batch 32: 19 steps an epoch, 114 in all
KILL_STEP = 40  # in epoch 2, after the script's own snapshot of epoch 1 (so a replacement finds it)


def command(out: Path, spares: int = 0) -> list[str]:
    """`spares`: warm processes to replace a killed worker (none where nothing will be replaced: a spare
    only takes CPU from the workers' start)."""
    return [sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--recovery-path",
            str(out / "recovery"), "--hot-spares", str(spares), str(PORT), "--total-epochs", str(EPOCHS), "--save-every", "2",
            "--snapshot-path", str(out / "snapshot.pt"), "--out", str(out / "final.safetensors")]


def launch(out: Path, faults: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.run(command(out, spares=1 if "kill" in faults else 0), cwd=REPO, env=env(TG_FAULT=faults),
                          capture_output=True, text=True,
                          timeout=240)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the script's own destroy_process_group() at the end is harmless and silent
    assert "Process group cannot be None" not in proc.stderr and "AssertionError" not in proc.stderr
    return proc


def final(out: Path) -> dict:
    return load_file(out / "final.safetensors")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    launch(out)
    state = final(out)
    assert any(k.startswith("optimizer.") for k in state) and any(k.startswith("model.") for k in state)
    return state


def test_the_port_changes_at_most_ten_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 10, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain torch


def test_kill_9_of_a_worker_is_bit_identical(tmp_path, baseline):
    launch(tmp_path, faults=f"1:{KILL_STEP}:kill")
    fired = [e for e in events(tmp_path) if e["event"] == "fault_injected"]
    assert [(e["rank"], e["step"], e["how"]) for e in fired] == [(1, KILL_STEP, "kill")]
    assert_identical(final(tmp_path), baseline, "final state")


def test_sigterm_then_the_same_command_again_is_bit_identical(tmp_path, baseline):
    # 0.15 s more per step (results unchanged): the whole job takes well under a second, so without it the
    # SIGTERM could land after the last step (then there is nothing to stop)
    proc = subprocess.Popen(command(tmp_path), cwd=REPO, env=env(TG_FAULT_SLOW_STEP="0.15"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "snapshot.pt").exists(), 180, "the script's snapshot of epoch 1")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    (tmp_path / "stopped.log").write_text(out + "\n--- stderr ---\n" + err)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:] + err[-3000:]
    assert not (tmp_path / "final.safetensors").exists()  # it stopped before the end

    again = launch(tmp_path)  # the same command again
    assert_identical(final(tmp_path), baseline, "final state")
    stopped = [e for e in events(tmp_path) if e["event"] == "graceful_exit"][0]["step"]
    assert f"trainguard: resumed at step {stopped} " in again.stdout  # a rerun says where it resumes
    assert "from the checkpoint on disk" in again.stdout
    # the script's own snapshot (saved every 2 epochs) was loaded too, and trainguard says it overrode it
    assert re.search(r"not at the script's own resume point \(epoch [1-9]\d*\)", again.stderr), again.stderr[-2000:]
