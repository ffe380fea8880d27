"""A sharded-checkpoint test group: ``python sharded_job.py SCENARIO WORLD STORE OUT``.

The parent imports torch once and forks WORLD ranks, which meet through a FileStore and a
gloo group. Layouts (all the same 16-32-10 MLP; 10 rows do not divide by 4, so FSDP over
4 ranks shards the last layer unevenly, 3/3/3/1):

- ``dp``: plain replicated tensors on every rank (data parallel);
- ``tp``: ColwiseParallel / RowwiseParallel on a 1-D mesh of all ranks;
- ``dptp-AxB``: the same plan on the "tp" dim of a 2-D ("dp", "tp") mesh of A x B ranks;
- ``fsdp``: fully_shard on a 1-D mesh; ``hsdp-AxB``: fully_shard on a (replicate, shard) mesh.

Every rank asserts what it can see itself (bit-exact full tensors against the reference the
saving group wrote) and exits non-zero with a traceback on failure.
"""

import importlib
import logging
import os
import shutil
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import trainguard as tg
from trainguard.checkpoint.codec import flatten_state, unflatten_state
from trainguard.checkpoint.reshard import init_optimizer_state

HIDDEN = 32
OUT = 10


# --- layouts ---------------------------------------------------------------------------------


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def build(layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model, world = mlp(seed), dist.get_world_size()
    kind, _, dims = layout.partition("-")
    shape = tuple(int(d) for d in dims.split("x")) if dims else (world,)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    if kind == "tp":
        model = parallelize_module(model, init_device_mesh("cpu", shape, mesh_dim_names=("tp",)), plan)
    elif kind == "dptp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        model = parallelize_module(model, mesh["tp"], plan)
    elif kind in ("fsdp", "hsdp"):
        names = ("shard",) if kind == "fsdp" else ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        assert kind == "dp", layout
    return model, torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))


def train(model: nn.Module, opt: torch.optim.Optimizer, layout: str, steps: int = 2) -> None:
    # FSDP ranks see different data (FSDP reduces the gradients); TP/DP ranks must see the same
    seed = 10 + dist.get_rank() if layout.startswith(("fsdp", "hsdp")) else 10
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def full(state) -> dict:
    """The state with every DTensor gathered whole (collective)."""
    def gather(_, t):
        return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t

    return unflatten_state(*flatten_state(state, copy=True, tensor_hook=gather))


def assert_same(a, b, where: str) -> None:
    ta, ma = flatten_state(a)
    tb, mb = flatten_state(b)
    assert ma == mb, f"{where}: non-tensor state differs"
    assert ta.keys() == tb.keys(), f"{where}: names differ {sorted(ta.keys() ^ tb.keys())}"
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), f"{where}: {k} differs"


def load_into(layout: str, folder: Path, ref: dict, where: str,
              dump: Path | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Build `layout` afresh (other weights), load `folder` into it, check it equals `ref` bit for
    bit; rank 0 writes what it loaded, gathered whole, to `dump`."""
    model, opt = build(layout, seed=99)
    init_optimizer_state(opt)
    loaded = tg.load_sharded(folder, state_of(model, opt))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    got = full(state_of(model, opt))
    assert_same(got, ref, f"{where} rank {dist.get_rank()}")
    if dump is not None and dist.get_rank() == 0:
        dump.parent.mkdir(parents=True, exist_ok=True)
        tg.save_state(dump, got)
    return model, opt


def save_layout(layout: str, out: Path) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """Train `layout` for 2 steps; write OUT/layout/{ref.safetensors, sliced/, full/}."""
    model, opt = build(layout, seed=1)
    train(model, opt, layout)
    ref = full(state_of(model, opt))
    if dist.get_rank() == 0:
        (out / layout).mkdir(parents=True, exist_ok=True)
        tg.save_state(out / layout / "ref.safetensors", ref)
    for kind in ("sliced", "full"):
        tg.save_sharded(out / layout / kind, state_of(model, opt), step=2, epoch=1, integrated=kind == "full",
                        append_info={"layout": layout})
    return model, opt, ref


# --- scenarios ----------------------------------------------------------------------------------


def roundtrip(out: Path) -> None:
    """Save every layout integrated and sliced, and load each back into the same layout."""
    for layout in ("dp", "tp", "dptp-2x2", "fsdp", "hsdp-2x2"):
        model, opt, ref = save_layout(layout, out)
        for kind in ("sliced", "full"):
            load_into(layout, out / layout / kind, ref, f"{layout}/{kind}")
        if layout == "dptp-2x2":
            check_training_goes_on(model, opt, layout, out)
            check_replica_load(layout, out, ref)
    check_failures(out)


def check_training_goes_on(model, opt, layout: str, out: Path) -> None:
    """One more step from the loaded state gives exactly what one more step of the original gives."""
    loaded_model, loaded_opt = load_into(layout, out / layout / "sliced", full(state_of(model, opt)), "continue")
    train(model, opt, layout, steps=1)
    train(loaded_model, loaded_opt, layout, steps=1)
    assert_same(full(state_of(loaded_model, loaded_opt)), full(state_of(model, opt)), "one step after loading")


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_replica_load(layout: str, out: Path, ref: dict) -> None:
    """With rank 0's file gone, every rank still loads; rank 0 reads rank 2's copy and says so."""
    copy = out / layout / "sliced_no_rank0"
    if dist.get_rank() == 0:
        shutil.copytree(out / layout / "sliced", copy)
        (copy / "rank_0.safetensors").unlink()
    dist.barrier()
    records = Records()
    logging.getLogger("trainguard.checkpoint").addHandler(records)
    load_into(layout, copy, ref, "without rank_0.safetensors")
    logging.getLogger("trainguard.checkpoint").removeHandler(records)
    if dist.get_rank() == 0:
        assert any("rank_0.safetensors" in m and "replicas" in m for m in records.messages), records.messages


def check_failures(out: Path) -> None:
    """A rank that cannot write, or that holds other tensors, makes every rank raise; nothing is left."""
    import errno

    from trainguard.checkpoint import sharded

    rank, model = dist.get_rank(), mlp(0)
    real = sharded.write_shard

    def full_disk(path, tensors):
        raise OSError(errno.ENOSPC, "No space left on device")

    sharded.write_shard = full_disk if rank == 1 else real
    try:
        tg.save_sharded(out / "failed", model.state_dict(), step=1)
        raise AssertionError("a failed write was not reported")
    except tg.CheckpointError as exc:
        expected = "rank_1.safetensors: No space left" if rank == 1 else "rank(s) [1] could not write"
        assert expected in str(exc), exc
    finally:
        sharded.write_shard = real
    state = model.state_dict()
    if rank == 2:
        state["extra"] = torch.zeros(1)
    try:
        tg.save_sharded(out / "failed", state, step=1)
        raise AssertionError("ranks with different tensors were not refused")
    except tg.CheckpointError as exc:
        assert "rank(s) [2] hold different tensors" in str(exc), exc
    dist.barrier()
    assert not any(p.name.startswith((".failed", "failed")) for p in out.iterdir()), sorted(out.iterdir())


def reshard_source(out: Path) -> None:
    """4 ranks: save (dp=2, tp=2), a 4-rank DP and an HSDP state; load (dp=2, tp=2) as (dp=4, tp=1)."""
    for layout in ("dptp-2x2", "dp", "hsdp-2x2"):
        save_layout(layout, out)
    ref = tg.load_state(out / "dptp-2x2" / "ref.safetensors")
    for kind in ("sliced", "full"):
        load_into("dptp-4x1", out / "dptp-2x2" / kind, ref, f"(2,2)->(4,1) {kind}",
                  dump=out / "loaded" / f"dptp-2x2_to_dptp-4x1_{kind}.safetensors")


def reshard_target(out: Path) -> None:
    """2 ranks: (dp=2, tp=2) -> (dp=1, tp=2) and -> FSDP; 4-rank DP -> 2 ranks; HSDP -> TP."""
    cases = [("dptp-2x2", "dptp-1x2"), ("dptp-2x2", "fsdp"), ("dp", "dp"), ("hsdp-2x2", "tp")]
    for source, target in cases:
        ref = tg.load_state(out / source / "ref.safetensors")
        for kind in ("sliced", "full"):
            load_into(target, out / source / kind, ref, f"{source}->{target} {kind}",
                      dump=out / "loaded" / f"{source}_to_{target}_{kind}.safetensors")


def ckpt_cli(out: Path) -> None:
    """2 ranks: a DP and a TP sliced checkpoint for the CLI tests."""
    for layout in ("dp", "tp"):
        save_layout(layout, out)


SCENARIOS = {f.__name__: f for f in (roundtrip, reshard_source, reshard_target, ckpt_cli)}


def run_rank(scenario: str, rank: int, world: int, store: str, out: Path) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        SCENARIOS[scenario](out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Import torch once, then fork the ranks; exit 1 (killing the others) as soon as one fails."""
    scenario, world, store, out, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), 50
    torch.set_num_threads(1)
    for name in ("torch.distributed.fsdp", "torch.distributed.tensor.parallel", "trainguard.checkpoint.reshard",
                 "trainguard.checkpoint.sharded"):
        importlib.import_module(name)  # once, before the fork

    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run_rank(scenario, rank, world, store, out)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank

    def stop(*_):
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        print(f"sharded_job: {scenario} did not finish in {limit} s", file=sys.stderr)
        os._exit(1)

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(limit)
    failed = []
    while children:
        pid, status = os.waitpid(-1, 0)
        rank = children.pop(pid)
        if status != 0:
            failed.append(rank)
            for other in children:  # they would wait in a collective for the dead rank
                os.kill(other, signal.SIGKILL)
    sys.exit(f"sharded_job: {scenario}: rank(s) {failed} failed" if failed else 0)


if __name__ == "__main__":
    main()
