"""DataLoader workers (`num_workers > 0`) under `trainguard run`, as users run them, with real processes: the
fork start method (Linux's default) and spawn (a script with the `__main__` guard trains the same weights; one
without it is told the cause and the fix at once, instead of a refused registration under its parent's
node id)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import env

pytestmark = pytest.mark.timeout(240)

BODY = """
    tg.init()
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), num_workers=NUM,
                        multiprocessing_context=CTX, persistent_workers=True)
    model = DDP(torch.nn.Linear(4, 1))
    opt = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for epoch in range(tg.start_epoch(), 2):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    print("weights", model.module.weight.detach().tolist(), flush=True)
"""


def script(tmp_path: Path, ctx: str, workers: int, guarded: bool) -> Path:
    body = textwrap.dedent(BODY).replace("NUM", str(workers)).replace("CTX", repr(ctx))
    if guarded:
        body = "def main():\n" + textwrap.indent(body, "    ") + "\n\nif __name__ == '__main__':\n    main()\n"
    path = tmp_path / f"loaders_{ctx}_{guarded}.py"
    path.write_text("import torch\nfrom torch.utils.data import TensorDataset\nimport trainguard as tg\n"
                    "from trainguard import DDP, DataLoader, DistributedSampler\n" + body)
    return path


def run(tmp_path: Path, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                           "--max-restarts", "0", "--recovery-path", str(tmp_path / path.stem), str(path)],
                          env=env(), capture_output=True, text=True, timeout=200)


def weights(out: str) -> set[str]:
    return {line.split("weights", 1)[1] for line in out.splitlines() if " weights " in line}


def test_loader_workers_by_fork_and_by_spawn_train_the_same_weights(tmp_path):
    forked = run(tmp_path, script(tmp_path, "fork", 2, guarded=False))
    assert forked.returncode == 0, forked.stderr[-3000:]
    # a forked loader worker inherits the worker's heartbeat thread; Python's after-fork clean-up calls each
    # inherited thread's _stop(), which a Thread subclass must not shadow
    assert "Exception ignored" not in forked.stderr, forked.stderr[-3000:]
    spawned = run(tmp_path, script(tmp_path, "spawn", 1, guarded=True))
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    assert len(weights(forked.stdout)) == 1 and weights(forked.stdout) == weights(spawned.stdout), (
        forked.stdout[-1000:], spawned.stdout[-1000:])


def test_a_script_without_the_main_guard_under_spawn_is_told_the_fix(tmp_path):
    proc = run(tmp_path, script(tmp_path, "spawn", 1, guarded=False))
    assert proc.returncode != 0
    assert "ran the script again in a child process" in proc.stderr and '__name__ == "__main__"' in proc.stderr
    assert "already registered" not in proc.stderr, proc.stderr[-3000:]
