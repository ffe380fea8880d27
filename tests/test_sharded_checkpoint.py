"""Sliced and integrated checkpoints of DP, TP, DP x TP, FSDP2 and HSDP states, and their replicas.

One group of 4 real gloo processes (tests/jobs/sharded_job.py, scenario `roundtrip`) trains each
layout for 2 steps with Adam, saves it integrated and sliced, and loads both back into a fresh
model of the same layout, asserting bit-exact model and optimizer state on every rank. The
tests here then check the files it left in this process.
"""

import hashlib
import json
import logging
import re
import shutil
import struct

import pytest
import torch
from shard_group import run_group
from torch import nn

import trainguard as tg
from trainguard.checkpoint.codec import flatten_state
from trainguard.checkpoint.format import save_checkpoint
from trainguard.checkpoint.layout import (
    Slice,
    TensorLayout,
    check_placements,
    group_pieces,
    mesh_slices,
    replica_groups,
)
from trainguard.checkpoint.manifest import read_manifest
from trainguard.errors import CheckpointCorrupt, CheckpointError

pytestmark = pytest.mark.timeout(90)
LAYOUTS = ("dp", "tp", "dptp-2x2", "fsdp", "hsdp-2x2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("roundtrip")
    run_group("roundtrip", 4, out)
    return out


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


def flat_ref(folder):
    return flatten_state(tg.load_state(folder / "ref.safetensors"))[0]


def same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def copy(saved, tmp_path, layout, kind="sliced"):
    return shutil.copytree(saved / layout / kind, tmp_path / f"{layout}-{kind}")


def fix_manifest(folder, name):
    """Make the manifest agree with a file's new bytes, so only its content is wrong."""
    m = json.loads((folder / "manifest.json").read_text())
    data = (folder / name).read_bytes()
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / "manifest.json").write_text(json.dumps(m))


def edit_manifest(folder, change):
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


# --- round trips (asserted inside the ranks) and what they left --------------------------------


def test_every_layout_round_trips_bit_exact_in_4_processes(saved):
    """Also, inside the ranks: one more training step from the loaded state equals one more step of
    the original; without rank_0.safetensors every rank still loads; a rank that cannot write, or
    holds other tensors, makes every rank raise and leaves no folder."""
    log = (saved / "roundtrip.log").read_text()
    assert "Traceback" not in log
    for layout in LAYOUTS:
        for kind in ("sliced", "full"):
            m = read_manifest(saved / layout / kind)
            assert m["format_version"] == 2 and m["step"] == 2 and m["epoch"] == 1 and m["world_size"] == 4
            assert m["append_info"] == {"layout": layout}
            assert m["layout"]["kind"] == {"sliced": "sliced", "full": "integrated"}[kind]
    assert sorted(p.name for p in (saved / "dptp-2x2" / "full").iterdir()) == ["full.safetensors", "manifest.json"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_integrated_and_sliced_load_whole_in_one_process(saved, layout):
    ref = flat_ref(saved / layout)
    same_tensors(tg.load_checkpoint(saved / layout / "full"), ref)
    same_tensors(tg.load_checkpoint(saved / layout / "sliced"), ref)


def test_sliced_files_hold_only_their_own_slices(saved):
    manifest = read_manifest(saved / "fsdp" / "sliced")
    pieces = manifest["layout"]["tensors"]["model/2.weight"]["pieces"]  # 10 rows over 4 ranks: uneven
    assert [(p["offsets"], p["lengths"], p["ranks"]) for p in pieces] == [
        ([0, 0], [3, 32], [0]), ([3, 0], [3, 32], [1]), ([6, 0], [3, 32], [2]), ([9, 0], [1, 32], [3])]
    from safetensors import safe_open
    with safe_open(saved / "fsdp" / "sliced" / "rank_3.safetensors", "pt") as f:
        assert f.get_slice("model/2.weight").get_shape() == [1, 32]
        assert f.get_slice("optim/state/2/exp_avg").get_shape() == [1, 32]


GROUPS = {
    "dp": [[0, 1, 2, 3]] * 4,                      # pure data parallel: every rank a replica
    "tp": [[0], [1], [2], [3]],                    # pure model parallel: each alone
    "fsdp": [[0], [1], [2], [3]],
    "dptp-2x2": [[0, 2], [1, 3], [0, 2], [1, 3]],  # DP x TP: the ranks across dp
    "hsdp-2x2": [[0, 2], [1, 3], [0, 2], [1, 3]],
}


@pytest.mark.parametrize("layout", list(GROUPS))
def test_group_info_files(saved, layout):
    folder = saved / layout / "sliced"
    for rank, expected in enumerate(GROUPS[layout]):
        assert tg.restore_group_info_list(folder / f"rank_{rank}.group_info.json") == expected
        assert tg.restore_group_info_list(folder, rank) == expected
    assert read_manifest(folder)["layout"]["group_info"] == GROUPS[layout]


def test_group_info_falls_back_to_the_manifest(saved, tmp_path, caplog):
    folder = copy(saved, tmp_path, "dptp-2x2")
    (folder / "rank_1.group_info.json").write_text("{broken")
    (folder / "rank_2.group_info.json").unlink()
    with caplog.at_level(logging.WARNING, "trainguard.checkpoint"):
        assert tg.restore_group_info_list(folder, 1) == [1, 3]
        assert tg.restore_group_info_list(folder, 2) == [0, 2]
    assert "rank_1.group_info.json" in caplog.text and "rank_2.group_info.json" in caplog.text
    with pytest.raises(CheckpointCorrupt, match="rank_1.group_info.json"):
        tg.restore_group_info_list(folder / "rank_1.group_info.json")


def test_load_param_into_net_plain_module(saved):
    net = mlp()
    not_loaded, unused = tg.load_param_into_net(net, tg.load_checkpoint(saved / "dptp-2x2" / "sliced"))
    assert not_loaded == [] and unused == []
    same_tensors(net.state_dict(), tg.load_state(saved / "dptp-2x2" / "ref.safetensors")["model"])
    bigger = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10), nn.Linear(10, 3))
    params = tg.load_checkpoint(saved / "dp" / "full")
    assert tg.load_param_into_net(bigger, params, prefix="model/") == (["3.weight", "3.bias"], [])
    with pytest.raises(CheckpointError, match=r"3\.weight"):
        tg.load_param_into_net(bigger, params, strict=True)
    with pytest.raises(CheckpointError, match=r"model/0\.weight.*\[32, 16\].*\[8, 16\]"):
        tg.load_param_into_net(nn.Sequential(nn.Linear(16, 8)), params)


# --- replicas: loading around a lost file, and rebuilding it -------------------------------------


def test_missing_file_loads_from_its_replica_and_recover_rebuilds_it(saved, tmp_path, caplog):
    folder = copy(saved, tmp_path, "dptp-2x2")
    original = (folder / "rank_0.safetensors").read_bytes()
    (folder / "rank_0.safetensors").unlink()
    with caplog.at_level(logging.WARNING, "trainguard.checkpoint"):
        same_tensors(tg.load_checkpoint(folder), flat_ref(saved / "dptp-2x2"))
    assert "rank_0.safetensors" in caplog.text and "replicas" in caplog.text
    done = tg.recover_rank(folder, 0)
    assert done.sources == (2,) and not done.intact
    entry = read_manifest(folder)["files"]["rank_0.safetensors"]
    assert (folder / "rank_0.safetensors").read_bytes() == original
    assert hashlib.sha256(original).hexdigest() == entry["sha256"]
    assert tg.recover_rank(folder, 0).intact
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_bit_flip_is_healed_from_the_replica(saved, tmp_path, caplog):
    folder = copy(saved, tmp_path, "hsdp-2x2")
    data = bytearray((folder / "rank_1.safetensors").read_bytes())
    data[-5] ^= 0x40
    (folder / "rank_1.safetensors").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "trainguard.checkpoint"):
        same_tensors(tg.load_checkpoint(folder), flat_ref(saved / "hsdp-2x2"))
    assert "rank_1.safetensors" in caplog.text and "sha256" in caplog.text
    assert tg.recover_rank(folder, 1).sources == (3,)
    same_tensors(tg.load_checkpoint(folder), flat_ref(saved / "hsdp-2x2"))


def test_both_replicas_lost_names_both_files(saved, tmp_path):
    folder = copy(saved, tmp_path, "dptp-2x2")
    (folder / "rank_1.safetensors").unlink()
    (folder / "rank_3.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointCorrupt, match=r"no intact copy.*rank_1\.safetensors.*rank_3\.safetensors"):
        tg.load_checkpoint(folder)


def test_recover_refuses_without_a_replica(saved, tmp_path):
    folder = copy(saved, tmp_path, "tp")
    (folder / "rank_2.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank_2\.safetensors: rank 2 alone holds"):
        tg.recover_rank(folder, 2)
    with pytest.raises(CheckpointError, match="integrated"):
        tg.recover_rank(saved / "tp" / "full", 0)


def test_recover_refuses_replicas_that_differ(saved, tmp_path):
    folder = copy(saved, tmp_path, "dp")
    shard = folder / "rank_1.safetensors"
    from safetensors.torch import load_file
    tensors = load_file(shard)
    tensors["model/2.bias"][0] += 1  # a replica that is valid but not bit-identical
    from trainguard.checkpoint.format import write_shard
    shard.unlink()
    write_shard(shard, tensors)
    fix_manifest(folder, "rank_1.safetensors")
    (folder / "rank_0.safetensors").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"rank_0\.safetensors: rebuilt it from rank_1.*not bit-identical"):
        tg.recover_rank(folder, 0)
    assert not (folder / "rank_0.safetensors").exists()


# --- damage and hostile input: clear errors naming the file ----------------------------------------


def hostile_header(folder):
    head = json.dumps({"model/0.bias": {"dtype": "F32", "shape": [8], "data_offsets": [0, 1 << 60]}}).encode()
    (folder / "rank_1.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 32)
    fix_manifest(folder, "rank_1.safetensors")


def dotdot(folder):
    def change(m):
        m["files"]["../rank_1.safetensors"] = m["files"].pop("rank_1.safetensors")
        m["layout"]["rank_files"][1] = "../rank_1.safetensors"
    edit_manifest(folder, change)


def huge_shape(folder):
    def change(m):
        spec = m["layout"]["tensors"]["model/0.bias"]
        spec["shape"] = [1 << 40]
        spec["pieces"] = [{"offsets": [0], "lengths": [1 << 40], "ranks": [0, 1, 2, 3]}]
        m["layout"]["group_info"] = [[0], [1], [2], [3]]
    edit_manifest(folder, change)


def overlapping_pieces(folder):
    def change(m):
        m["layout"]["tensors"]["model/0.weight"]["pieces"][1]["offsets"] = [4, 0]
    edit_manifest(folder, change)


DAMAGE = {  # applied to the pure tensor-parallel checkpoint: nothing is replicated there
    "truncated": (lambda f: (f / "rank_1.safetensors").write_bytes((f / "rank_1.safetensors").read_bytes()[:-9]),
                  "rank_1.safetensors", "truncated"),
    "bit flip": (lambda f: (f / "rank_1.safetensors").write_bytes(
        (f / "rank_1.safetensors").read_bytes()[:-1] + b"\xff"), "rank_1.safetensors", "sha256"),
    "missing manifest": (lambda f: (f / "manifest.json").unlink(), "manifest.json", "missing"),
    "dotdot path": (dotdot, "manifest.json", "leaves the checkpoint folder"),
    "hostile header": (hostile_header, "rank_1.safetensors", "outside the"),
    "overlapping pieces": (overlapping_pieces, "manifest.json", "overlap"),
    "huge shape": (huge_shape, "rank_0.safetensors", r"model/0\.bias' is F32 \[8\], the manifest says F32 "
                   r"\[1099511627776\]"),
    "group info lies": (lambda f: edit_manifest(f, lambda m: m["layout"]["group_info"].__setitem__(0, [0, 1])),
                        "manifest.json", "group_info"),
    "version 3": (lambda f: edit_manifest(f, lambda m: m.update(format_version=3)), "manifest.json",
                  "format_version 3"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_named(saved, tmp_path, case):
    damage, culprit, what = DAMAGE[case]
    folder = copy(saved, tmp_path, "tp")
    damage(folder)
    with pytest.raises(CheckpointCorrupt, match=what) as info:
        tg.load_checkpoint(folder)
    assert str(folder / culprit) in str(info.value)


def test_shape_mismatch_names_the_tensor_and_manifest(saved):
    net = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 10))
    with pytest.raises(CheckpointError, match=r"manifest\.json: tensor 'model/0\.bias' is F32 \[32\] in the "
                                              r"checkpoint but F32 \[24\] in the target"):
        tg.load_sharded(saved / "dptp-2x2" / "sliced", {"model": net.state_dict()}, strict=False)


# --- pure layout arithmetic -------------------------------------------------------------------------


def test_group_info_of_the_three_layout_cases_without_processes():
    from torch.distributed.tensor import Replicate, Shard

    dp_tp = torch.arange(8).view(2, 4)  # dp=2 x tp=4, tp fastest
    weight = mesh_slices((32, 16), dp_tp, [Replicate(), Shard(0)])
    bias = mesh_slices((16,), dp_tp, [Replicate(), Replicate()])
    layouts = [TensorLayout("F32", s, group_pieces([m[r] for r in range(8)])) for s, m in
               (((32, 16), weight), ((16,), bias))]
    groups = replica_groups(layouts, 8)
    assert groups[0] == [0, 4] and groups[5] == [1, 5] and groups[3] == [3, 7]
    assert weight[5] == Slice((8, 0), (8, 16))
    pure_dp = [TensorLayout("F32", (4,), group_pieces([Slice.full((4,))] * 8))]
    assert replica_groups(pure_dp, 8) == [list(range(8))] * 8
    pure_mp = mesh_slices((16,), torch.arange(8), [Shard(0)])
    assert replica_groups([TensorLayout("F32", (16,), group_pieces([pure_mp[r] for r in range(8)]))], 8) == \
        [[r] for r in range(8)]


def test_unsupported_placements_are_refused():
    from torch.distributed.tensor import Partial

    with pytest.raises(CheckpointError, match="'w'.*Partial"):
        check_placements([Partial()], "w")


# --- a single process, no process group ------------------------------------------------------------


def trained():
    torch.manual_seed(0)
    net = mlp()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(4, 16)).sum().backward()
    opt.step()
    return net, opt


@pytest.mark.parametrize("integrated", [False, True])
def test_single_process_save_and_load(tmp_path, integrated):
    net, opt = trained()
    tg.save_sharded(tmp_path / "ck", {"model": net.state_dict(), "optim": opt.state_dict()}, step=1,
                    integrated=integrated)
    net2 = mlp()
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    tg.init_optimizer_state(opt2)
    loaded = tg.load_sharded(tmp_path / "ck", {"model": net2.state_dict(), "optim": opt2.state_dict()})
    net2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    same_tensors(net.state_dict(), net2.state_dict())
    a, b = flatten_state(opt.state_dict()), flatten_state(opt2.state_dict())
    same_tensors(a[0], b[0])
    assert a[1] == b[1] and opt2.param_groups[0]["lr"] == 0.01


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from trainguard.checkpoint import sharded

    def full_disk(path, tensors):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded, "write_shard", full_disk)
    net, _ = trained()
    with pytest.raises(CheckpointError, match="No space left"):
        tg.save_sharded(tmp_path / "ck", net.state_dict(), step=1)
    assert list(tmp_path.iterdir()) == []


def test_version_1_checkpoints_still_load(tmp_path):
    net, opt = trained()
    tensors, meta = flatten_state({"model": net.state_dict()})
    save_checkpoint(tmp_path / "v1", {"rank_0.safetensors": tensors}, meta=meta, step=3, epoch=0, world_size=1)
    assert read_manifest(tmp_path / "v1")["format_version"] == 1
    same_tensors(tg.load_sharded(tmp_path / "v1")["model"], net.state_dict())
    assert tg.load_param_into_net(mlp(), tg.load_checkpoint(tmp_path / "v1")) == ([], [])


def test_a_checkpoints_training_position_is_checked_as_untrusted_input():
    """The position a sliced checkpoint of a job records (its manifest's append_info.own) is read before any
    tensor is loaded: a damaged or foreign one is refused with what is wrong, never half-used."""
    from trainguard.train.state.shardckpt import position

    good = {"progress": {"step": 8, "epoch": 0, "in_epoch": 8}, "seed": 7, "loader": 0}
    assert position({"append_info": {"own": good}}, 8) == good
    bad = [({}, "no training position"), ({"progress": {**good["progress"], "step": "8"}}, "progress.step = '8'"),
           ({"progress": {**good["progress"], "epoch": -1}}, "progress.epoch = -1"),
           ({"progress": {**good["progress"], "in_epoch": True}}, "progress.in_epoch = True"),
           ({"progress": good["progress"], "seed": 1 << 63}, "seed = 9223372036854775808"),
           ({"progress": {**good["progress"], "step": 9}}, "does not belong to its folder"),
           ({"progress": {**good["progress"], "phase": 1}}, "unknown position fields")]
    for own, match in bad:
        with pytest.raises(tg.CheckpointError, match=re.escape(match)):
            position({"append_info": {"own": own}}, 8)
