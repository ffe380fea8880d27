"""examples/nanogpt.py, a trainer in the shape of nanoGPT's train.py ported from examples/nanogpt_torchrun.py
by changing at most 5 lines: it has no DataLoader (random offsets from torch's global generator), draws the
next batch during the step (between the last micro-step's forward and its backward), sets
`require_backward_grad_sync` per micro-step, writes the LR into param_groups from its own `iter_num`, uses
AdamW with two groups, tied embeddings, dropout, bf16 autocast and a (disabled) GradScaler; rank 0 alone
estimates the loss on random batches between steps and saves its own ckpt.pt; it reads RANK and WORLD_SIZE
before it calls torch's own `init_process_group()`. 3 ranks, kill -9 at several moments: every tensor of every
rank's model, optimizer and scaler is `torch.equal` to an uninterrupted run, and so are the eval lines."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from harness import REPO, assert_identical, changed_lines, env, events

pytestmark = pytest.mark.timeout(300)

ORIGINAL, PORT = REPO / "examples" / "nanogpt_torchrun.py", REPO / "examples" / "nanogpt.py"
WORKERS = 3
EVAL = re.compile(r"step \d+: train loss \S+, val loss \S+")


def command(out: Path, data: Path, spares: int) -> list[str]:
    return [sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--recovery-path",
            str(out / "recovery"), "--hot-spares", str(spares), str(PORT), f"--out_dir={out / 'ckpt'}",
            f"--data_dir={data}", f"--final_out={out / 'final'}"]


def launch(out: Path, data: Path, faults: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.run(command(out, data, 1 if faults else 0), cwd=out, env=env(TG_FAULT=faults),
                          capture_output=True, text=True, timeout=240)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def final(out: Path) -> list[dict]:
    return [torch.load(out / f"final_rank{r}.pt", weights_only=True) for r in range(WORKERS)]


def eval_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """Rank 0's eval lines, once each (a pass redone after a fault prints its line again, with the same values)."""
    return list(dict.fromkeys(EVAL.findall(proc.stdout)))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = launch(out, data)
    states = final(out)
    assert all(s["optimizer"]["state"] for s in states)
    assert len(eval_lines(proc)) == 5, proc.stdout[-2000:]  # steps 0, 10, 20, 30, 40
    return states, eval_lines(proc)


def test_the_port_changes_at_most_five_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 5, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain torch
    assert "init_process_group(backend=backend)" in PORT.read_text()  # the port keeps torch's own call


@pytest.mark.parametrize("fault", [
    "2:23:kill-forward",  # in the middle of gradient accumulation: after the first micro-step's forward
    "1:13:kill-exchange",  # in the last micro-step's backward: the next batch already drawn (the prefetch)
    "2:17:kill",  # right after an optimizer step
    "1:20:kill",  # rank 0 is in its own loss estimate (random batches) and its save, the others go on
    "0:10:kill",  # rank 0 itself, right before its estimate and its save
])
def test_kill_9_is_bit_identical(tmp_path, data, baseline, fault):
    states, lines = baseline
    proc = launch(tmp_path, data, fault)
    rank, step, how = fault.split(":")
    fired = [(e["rank"], e["step"]) for e in events(tmp_path) if e["event"] == "fault_injected"]
    assert fired == [(int(rank), int(step))], fired
    assert_identical(final(tmp_path), states, "every rank's final state")
    assert eval_lines(proc) == lines


def test_kill_9_of_rank_0_inside_its_own_save_is_bit_identical(tmp_path, data, baseline):
    """Rank 0's ckpt.pt is a FIFO at first: its torch.save blocks inside the open until the test has killed it,
    while the others went on into the next step. Then the FIFO goes, and the replacement saves a plain file."""
    states, lines = baseline
    (tmp_path / "ckpt").mkdir()
    fifo = tmp_path / "ckpt" / "ckpt.pt"
    os.mkfifo(fifo)
    proc = subprocess.Popen(command(tmp_path, data, 1), cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    saving, pid = threading.Event(), {}
    registered = re.compile(r"registered 0 as incarnation 1 \(pid (\d+)")

    def read() -> None:
        for line in proc.stdout:
            out.append(line)
            if (m := registered.search(line)) is not None:
                pid["rank0"] = int(m.group(1))
            if "[worker 0] saving checkpoint to" in line:
                saving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert saving.wait(180), "".join(out)[-3000:]
        os.kill(pid["rank0"], signal.SIGKILL)  # blocked in torch.save's open of the FIFO
        fifo.unlink()
        assert proc.wait(240) == 0, "".join(out)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    (tmp_path / "launcher.log").write_text("".join(out))
    assert "lost" in "".join(out)  # a recovery happened
    assert_identical(final(tmp_path), states, "every rank's final state")
    assert list(dict.fromkeys(EVAL.findall("".join(out)))) == lines
