"""examples/nanogpt.py, a trainer in the shape of nanoGPT's train.py ported from examples/nanogpt_torchrun.py
by changing at most 5 lines: it has no DataLoader (random offsets from torch's global generator), draws the
next batch during the step (between the last micro-step's forward and its backward), sets
`require_backward_grad_sync` per micro-step, writes the LR into param_groups from its own `iter_num`, uses
AdamW with two groups, tied embeddings, dropout, bf16 autocast and a (disabled) GradScaler; rank 0 alone
estimates the loss on random batches between steps and saves its own ckpt.pt; it reads RANK and WORLD_SIZE
before it calls torch's own `init_process_group()`. 3 ranks, kill -9 at several moments: every tensor of every
rank's model, optimizer and scaler is `torch.equal` to an uninterrupted run, and so are the eval lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, changed_lines, env, events

pytestmark = pytest.mark.timeout(300)

ORIGINAL, PORT = REPO / "examples" / "nanogpt_torchrun.py", REPO / "examples" / "nanogpt.py"
WORKERS = 3
EVAL = re.compile(r"step \d+: train loss \S+, val loss \S+")


def launch(out: Path, data: Path, faults: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--recovery-path", str(out / "recovery"),
           "--hot-spares", "1" if faults else "0", str(PORT), f"--out_dir={out / 'ckpt'}", f"--data_dir={data}",
           f"--final_out={out / 'final'}"]
    proc = subprocess.run(cmd, cwd=out, env=env(TG_FAULT=faults), capture_output=True, text=True, timeout=240)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def tensors(obj, prefix: str = ""):
    """Every tensor (and plain value) of a nested state, by path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}.{i}")
    else:
        yield prefix, obj


def final(out: Path) -> list[dict]:
    return [dict(tensors(torch.load(out / f"final_rank{r}.pt", weights_only=True))) for r in range(WORKERS)]


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
    assert all(any(k.startswith(".optimizer.state") for k in s) for s in states)
    assert len(eval_lines(proc)) == 5, proc.stdout[-2000:]  # steps 0, 10, 20, 30, 40
    return states, eval_lines(proc)


def test_the_port_changes_at_most_five_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 5, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain torch
    assert "init_process_group(backend=backend)" in PORT.read_text()  # the port keeps torch's own call


@pytest.mark.parametrize("fault", [
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
    for r, (got, want) in enumerate(zip(final(tmp_path), states)):
        assert got.keys() == want.keys()
        differ = [k for k in want if not (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor)
                                          else got[k] == want[k])]
        assert not differ, f"rank {r}: {len(differ)} of {len(want)} differ, e.g. {differ[:5]}"
    assert eval_lines(proc) == lines
