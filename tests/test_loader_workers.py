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
import torch
from harness import assert_identical, env

import trainguard as tg

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


AUGMENTED = '''
import sys
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
import trainguard as tg


class Noisy(Dataset):
    """Random augmentation in __getitem__, drawn from torch's and NumPy's global streams (as transforms do)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(96, 6, generator=g), torch.randn(96, 1, generator=g)

    def __len__(self):
        return 96

    def __getitem__(self, i):
        noise = torch.rand(6) * 0.1 + torch.from_numpy(np.random.rand(6).astype("float32")) * 0.1
        return self.x[i] + noise, self.y[i]


def net():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))


def wrappers(ds):  # the user's own loop, ported: trainguard's DataLoader, DDP and Optimizer
    loader = tg.DataLoader(ds, batch_size=8, sampler=tg.DistributedSampler(ds, seed=0), num_workers=2,
                           persistent_workers=True)
    model = tg.DDP(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    opt = tg.Optimizer(opt, lr_scheduler=sched)
    for epoch in range(tg.start_epoch(), 3):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
    return model.module, opt, sched


def session(ds):  # a Session over torch's own DataLoader
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=tg.ShardedSampler(ds, seed=0), num_workers=2)
    model = tg.DataParallel(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    run = tg.Session(tg.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader),
                     tg.SessionConfig(epochs=3))
    for step in run.steps():
        with step:
            x, y = step.batch
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
    return model.module, opt, sched


def main():
    tg.init()
    torch.manual_seed(0)
    module, opt, sched = {"wrappers": wrappers, "session": session}[sys.argv[2]](Noisy())
    torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
               f"{sys.argv[1]}/final_{tg.get_rank()}.pt")


if __name__ == "__main__":
    main()
'''


def augmented_run(base: Path, style: str, fault: str) -> list[dict]:
    out = base / f"{style}-{fault.replace(':', '_') or 'clean'}"
    out.mkdir()
    path = base / "augmented.py"
    path.write_text(AUGMENTED)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "1",
                           "--recovery-path", str(out / "recovery"), str(path), str(out), style],
                          env=env(TG_FAULT=fault), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not fault or "restarting worker" in proc.stderr, proc.stderr[-3000:]  # it did recover
    return [torch.load(out / f"final_{r}.pt", weights_only=True) for r in range(3)]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    base, runs = tmp_path_factory.mktemp("clean"), {}

    def get(style: str) -> list[dict]:
        if style not in runs:
            runs[style] = augmented_run(base, style, "")
        return runs[style]
    return get


@pytest.mark.parametrize("style, fault", [("wrappers", "1:5:kill"), ("session", "2:6:kill")])
def test_random_augmentation_in_loader_workers_is_the_same_after_a_kill_mid_epoch(tmp_path, clean, style, fault):
    """3 ranks, 2 loader workers each, noise drawn in __getitem__; rank 1 (or 2) is killed in epoch 1 and the
    training iterators start again mid-epoch (the replacement's; under the wrappers the survivors run the script
    again too): every tensor of model, buffers, optimizer and scheduler ends equal to an uninterrupted run's."""
    killed = augmented_run(tmp_path, style, fault)
    for rank in range(3):
        assert_identical(killed[rank], clean(style)[rank], f"rank {rank}")


def test_a_sample_key_is_an_int_that_keeps_its_seed_across_pickling():
    import pickle

    from trainguard.train.data.loaderseed import SampleKey, sample_seed

    key = SampleKey(7, sample_seed(123, 2, 7))
    back = pickle.loads(pickle.dumps([key]))[0]
    assert back == 7 and isinstance(back, SampleKey) and back.seed == key.seed
    assert [10, 20, 30, 40, 50, 60, 70, 80][key] == 80 and torch.arange(10)[key] == 7
    assert sample_seed(123, 2, 7) == key.seed != sample_seed(123, 3, 7) != sample_seed(124, 2, 7)


def test_a_rewind_ends_the_loader_workers_of_the_run_it_leaves():
    """The script's earlier run is freed by the collector (its objects form cycles), which finalises a loader
    iterator only after multiprocessing closed its queues: torch then waited 5 s per worker for a stop that never
    came, 10 s of every recovery with 2 workers. A rewind ends them first (plainloaders.end_workers, called by
    rewind.prepare), as __del__ would: trainguard's loaders and torch's alike."""
    import gc
    import multiprocessing
    import time

    from trainguard.train.data import plainloaders

    class Run:  # the run's objects, in a cycle as a script's globals and functions are
        pass

    ds = torch.utils.data.TensorDataset(torch.randn(64, 4))
    run = Run()
    run.self = run
    run.ours = tg.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    run.theirs = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1)
    run.iterators = [run.ours.plain_iter(), iter(run.theirs)]
    for it in run.iterators:
        next(it)
    assert len(multiprocessing.active_children()) == 3
    del run
    assert plainloaders.end_workers() == 2
    assert multiprocessing.active_children() == []  # ended and joined, not left to the collector
    t0 = time.monotonic()
    gc.collect()
    assert time.monotonic() - t0 < 4.0  # the collector has nothing left to wait for (it took 10 s)
