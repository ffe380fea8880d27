"""What a hand-written loop gives trainguard is held, never changed: buffers a forward moved go back on a skipped
step, an LR scheduler still pickles, and registered Stateful objects are named once; every collective of the
process comes out typed."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.train.state.buffers import BufferGuard, module_buffers

pytestmark = pytest.mark.timeout(60)


def test_a_skipped_steps_batchnorm_statistics_go_back_to_the_committed_ones():
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    guard = BufferGuard(module_buffers(net))
    net(torch.randn(8, 4))
    guard.commit()
    committed = {k: v.clone() for k, v in net.state_dict().items()}
    net(torch.randn(8, 4))  # the forward of a step whose exchange then fails
    assert not torch.equal(net[1].running_mean, committed["1.running_mean"])
    guard.rollback()
    for k, v in net.state_dict().items():
        assert torch.equal(v, committed[k]), k


def test_the_optimizer_wrapper_leaves_the_lr_scheduler_as_it_was():
    from trainguard.train.engine import guard as guard_mod

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    step_before = sched.step
    try:
        wrapped = tg.Optimizer(opt, lr_scheduler=sched)
        assert wrapped.lr_scheduler is sched and sched.step == step_before and "step" not in vars(sched)
        torch.save(sched.state_dict(), io.BytesIO())  # the script's own save still works
        pickle.dumps(sched.state_dict())
        with pytest.raises(tg.ConfigError, match="taken"):
            tg.register_state("scaler", torch.amp.GradScaler("cpu"))
            tg.register_state("scaler", torch.amp.GradScaler("cpu"))
        with pytest.raises(tg.ConfigError, match="no state_dict"):
            tg.register_state("bad", object())
    finally:
        guard_mod._guard = None  # this process has no job: forget the wrapper


def test_checkpoints_given_to_the_optimizer_are_checked_when_the_script_makes_them(tmp_path):
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(tg.ConfigError, match="give trainguard.ShardedCheckpoints"):
        tg.Optimizer(opt, checkpoints=str(tmp_path))
    for bad, match in (({"every": -1}, "must be >= 0"), ({"keep": -2}, "must be >= 0"),
                       ({"prefix": "../x"}, "plain name"), ({"directory": ""}, "needs a directory")):
        with pytest.raises(tg.ConfigError, match=match):
            tg.ShardedCheckpoints(**{"directory": tmp_path, **bad})
    with pytest.raises(AttributeError, match="ShardedJob was removed: sharded models run on the one engine"):
        tg.ShardedJob  # noqa: B018


def test_every_collective_comes_out_typed_and_a_failed_generation_fails_at_once(tmp_path):
    """Two real processes in a gloo group; the peer dies; the survivor's all_reduce raises CollectiveFailed,
    and the next collective of that generation fails at once instead of waiting."""
    script = textwrap.dedent("""
        import os, sys, time, torch, torch.distributed as dist
        from datetime import timedelta
        from trainguard.worker import collectives
        from trainguard.errors import CollectiveFailed
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
        collectives.install(lambda: 7)
        dist.all_reduce(torch.ones(4))
        if rank == 1:
            os._exit(0)
        try:
            dist.all_reduce(torch.ones(1000))
        except CollectiveFailed as exc:
            assert isinstance(exc.__cause__, RuntimeError) and "generation 7" in str(exc)
        t0 = time.monotonic()
        try:
            dist.barrier()
        except CollectiveFailed as exc:
            assert "already failed" in str(exc) and time.monotonic() - t0 < 0.5
            print("typed", flush=True)
    """)
    path = tmp_path / "peer.py"
    path.write_text(script)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(path), str(r), str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(2)]
    outs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0].strip() == "typed", outs


def test_a_state_of_another_layout_is_refused_with_the_reason_before_anything_is_loaded():
    """A data-parallel checkpoint offered to a sharded model (or the reverse) is a deterministic error: ConfigError
    (exit 78, no restart), naming both layouts, and the model is left as it was."""
    from trainguard.train.state.train_state import TrainState

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sharded = TrainState(model=model, optimizer=opt, sharded=True)
    with pytest.raises(tg.ConfigError, match="saved by a data-parallel run and this run's model is sharded"):
        sharded.load_shared({"model": {k: torch.zeros_like(v) for k, v in before.items()}, "optimizer": {}})
    plain = TrainState(model=model, optimizer=opt)
    with pytest.raises(tg.ConfigError, match="saved by a sharded run and this run's model is not sharded"):
        plain.load_shared({"part": {}})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_state_the_script_did_not_give_is_found_and_named_by_its_class():
    """A second scheduler, a GradScaler and an EMA the port did not register change with the steps: trainguard
    finds them (train/state/discover.py), so that a recovery restores them too. In a fresh interpreter: the
    search sees every live object of the process."""
    code = textwrap.dedent("""
        import pytest, torch
        from torch import nn
        import trainguard as tg
        from trainguard.train.state import discover

        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        given = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        warm, decay = torch.optim.lr_scheduler.LinearLR(opt), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
        chain = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[3])
        torch.optim.lr_scheduler.StepLR(other, 2)  # another optimizer's: not this job's state
        ema = torch.optim.swa_utils.AveragedModel(model)
        off = torch.amp.GradScaler("cpu", enabled=False)  # keeps no state
        scaler = torch.amp.GradScaler("cpu")
        found = discover.unregistered(opt, [model, given], rewound=True)
        assert found == {"lr_scheduler:ReduceLROnPlateau": plateau, "lr_scheduler:SequentialLR": chain,
                         "averaged_model:AveragedModel": ema, "grad_scaler:GradScaler": scaler}, found
        assert discover.unregistered(opt, [model, given, plateau, chain, ema, scaler], rewound=False) == {}
        second = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        with pytest.raises(tg.ConfigError, match="more than one lr_scheduler:ReduceLROnPlateau.*register_state"):
            discover.unregistered(opt, [model, given], rewound=True)
        assert discover.unregistered(opt, [model, given, plateau, second, chain, ema, scaler], rewound=False) == {}
        print("checked")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "checked", proc.stdout + proc.stderr
