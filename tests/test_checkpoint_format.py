import errno
import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from trainguard.checkpoint.codec import flatten_state, unflatten_state
from trainguard.checkpoint.format import (
    CheckpointInfo,
    checkpoint_name,
    read_checkpoint,
    save_checkpoint,
)
from trainguard.checkpoint.manifest import Kind, read_manifest
from trainguard.checkpoint.retention import list_checkpoints, prune_checkpoints
from trainguard.errors import CheckpointCorrupt, CheckpointError

pytestmark = pytest.mark.timeout(60)
SHARD = "rank_0.safetensors"


def sample_shards(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        SHARD: {"w": torch.randn(5, 3, generator=g), "bf": torch.randn(4, generator=g).bfloat16(),
                "i": torch.tensor(seed), "mask": torch.rand(7, generator=g) > 0.5, "empty": torch.empty(0, 2),
                "u8": torch.arange(10, dtype=torch.uint8), "h": torch.ones(3, dtype=torch.float16)},
        "rank_1.safetensors": {"nc": torch.arange(12, dtype=torch.int64).reshape(3, 4).t()},
    }


def save(folder, seed=0, step=1, **kw):
    return save_checkpoint(folder, sample_shards(seed), meta={"seed": seed}, step=step, epoch=kw.pop("epoch", 0),
                           world_size=2, **kw)


def same_shards(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for k, t in a[name].items():
            u = b[name][k]
            assert t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u), (name, k)


def visible(directory):
    return sorted(p.name for p in Path(directory).iterdir() if not p.name.startswith("."))


def hidden(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("."))


# --- round trip ---------------------------------------------------------------------------------


def test_save_load_round_trip_is_bit_exact(tmp_path):
    folder = save(tmp_path / "ck-1_1", step=7, epoch=1, append_info={"run": "a"})
    shards, manifest = read_checkpoint(folder)
    same_shards(sample_shards(), shards)
    assert manifest["format_version"] == 1 and manifest["step"] == 7 and manifest["epoch"] == 1
    assert manifest["world_size"] == 2 and manifest["meta"] == {"seed": 0} and manifest["append_info"] == {"run": "a"}
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        with safe_open(folder / name, "pt") as f:  # a standard safetensors file
            assert set(f.keys()) == set(sample_shards()[name])
    assert read_manifest(folder) == manifest
    assert visible(tmp_path) == ["ck-1_1"] and hidden(tmp_path) == []


def test_codec_state_through_disk(tmp_path):
    state = {"opt": {"state": {0: {"step": torch.tensor(2.0)}}, "betas": (0.9, 0.99)}, "x": float("-inf")}
    tensors, meta = flatten_state(state)
    save_checkpoint(tmp_path / "c-0_1", {SHARD: tensors}, meta=meta, step=1, epoch=0, world_size=1)
    shards, manifest = read_checkpoint(tmp_path / "c-0_1")
    back = unflatten_state(shards[SHARD], manifest["meta"])
    assert back["opt"]["betas"] == (0.9, 0.99) and back["x"] == float("-inf")
    assert torch.equal(back["opt"]["state"][0]["step"], torch.tensor(2.0))


def test_files_written_by_safetensors_itself_load(tmp_path):
    folder = save(tmp_path / "ck-0_1")
    data = st_save({"a": torch.arange(5), "b": torch.ones(2, 2, dtype=torch.bfloat16)})
    rewrite(folder, SHARD, data)
    shards, _ = read_checkpoint(folder)
    assert torch.equal(shards[SHARD]["a"], torch.arange(5))


def test_existing_folder_is_replaced(tmp_path):
    save(tmp_path / "ck-1_1", seed=1)
    save(tmp_path / "ck-1_1", seed=2, step=2)
    shards, manifest = read_checkpoint(tmp_path / "ck-1_1")
    same_shards(sample_shards(2), shards)
    assert manifest["step"] == 2 and visible(tmp_path) == ["ck-1_1"] and hidden(tmp_path) == []


@pytest.mark.parametrize("name", ["../x.safetensors", "a/b.safetensors", "x.bin", "/abs.safetensors",
                                  "a..b.safetensors", "manifest.json"])
def test_bad_shard_names_refused_on_save(tmp_path, name):
    with pytest.raises(CheckpointError, match="file name"):
        save_checkpoint(tmp_path / "c-0_1", {name: {}}, meta={}, step=0, epoch=0, world_size=1)
    assert list(tmp_path.iterdir()) == []


def test_unstorable_dtype_leaves_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="complex128"):
        save_checkpoint(tmp_path / "c-0_1", {SHARD: {"z": torch.zeros(2, dtype=torch.complex128)}},
                        meta={}, step=0, epoch=0, world_size=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kw,what", [({"meta": {"x": float("nan")}}, "plain JSON"), ({"step": True}, "step"),
                                     ({"step": -1}, "step"), ({"world_size": 0}, "world_size"),
                                     ({"meta": [1]}, "meta must be a dict"), ({"epoch": 1.0}, "epoch")])
def test_manifest_fields_are_checked_on_save(tmp_path, kw, what):
    args = {"meta": {}, "step": 0, "epoch": 0, "world_size": 1, **kw}
    with pytest.raises(CheckpointError, match=what):
        save_checkpoint(tmp_path / "c-0_1", {SHARD: {"a": torch.ones(1)}}, **args)
    assert list(tmp_path.iterdir()) == []


# --- corruption -----------------------------------------------------------------------------------


def rewrite(folder, name, data):
    """Replace a shard's bytes and fix the manifest, so only the file's content is wrong."""
    (folder / name).write_bytes(data)
    edit_manifest(folder, lambda m: m["files"].__setitem__(
        name, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))


def edit_manifest(folder, change):
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def header_file(header, body=b"\0" * 16, length=None):
    head = json.dumps(header).encode() if isinstance(header, dict) else header
    return struct.pack("<Q", len(head) if length is None else length) + head + body


def rename_file(m, new):
    m["files"][new] = m["files"].pop(SHARD)


CORRUPTIONS = {
    "missing manifest": (lambda f: (f / "manifest.json").unlink(), "manifest.json", "missing"),
    "manifest not json": (lambda f: (f / "manifest.json").write_text("{not json"), "manifest.json", "not JSON"),
    "wrong version": (lambda f: edit_manifest(f, lambda m: m.update(format_version=2)), "manifest.json",
                      "format_version"),
    "missing field": (lambda f: edit_manifest(f, lambda m: m.pop("step")), "manifest.json", "'step'"),
    "slash in name": (lambda f: edit_manifest(f, lambda m: rename_file(m, "sub/x.safetensors")), "manifest.json",
                      "leaves the checkpoint folder"),
    "dotdot in name": (lambda f: edit_manifest(f, lambda m: rename_file(m, "../rank_0.safetensors")),
                       "manifest.json", "leaves the checkpoint folder"),
    "absolute name": (lambda f: edit_manifest(f, lambda m: rename_file(m, "/etc/x.safetensors")), "manifest.json",
                      "leaves the checkpoint folder"),
    "file missing": (lambda f: (f / SHARD).unlink(), SHARD, "missing"),
    "truncated": (lambda f: (f / SHARD).write_bytes((f / SHARD).read_bytes()[:-3]), SHARD, "truncated"),
    "bit flip": (lambda f: (f / SHARD).write_bytes(flip((f / SHARD).read_bytes())), SHARD, "sha256"),
    "header longer than file": (lambda f: rewrite(f, SHARD, header_file({}, length=10_000)), SHARD, "header claims"),
    "header over 100 MB": (lambda f: rewrite(f, SHARD, header_file({}, length=200 << 20)), SHARD, "header claims"),
    "header not json": (lambda f: rewrite(f, SHARD, header_file(b"{nope}  ")), SHARD, "header is not JSON"),
    "offsets outside": (lambda f: rewrite(f, SHARD, header_file(
        {"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})), SHARD, "outside"),
    "offsets overlap": (lambda f: rewrite(f, SHARD, header_file(
        {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})), SHARD, "overlap"),
    "shape size mismatch": (lambda f: rewrite(f, SHARD, header_file(
        {"a": {"dtype": "F64", "shape": [3], "data_offsets": [0, 16]}})), SHARD, "spans 16 bytes"),
    "unknown dtype": (lambda f: rewrite(f, SHARD, header_file(
        {"a": {"dtype": "Q7", "shape": [16], "data_offsets": [0, 16]}})), SHARD, "unknown dtype"),
    "gap in data": (lambda f: rewrite(f, SHARD, header_file(
        {"a": {"dtype": "U8", "shape": [8], "data_offsets": [8, 16]}})), SHARD, "safetensors could not parse"),
}


def symlink_manifest(folder, target):
    """manifest.json becomes a symbolic link (to a copy outside the folder, or to a device)."""
    if target is None:
        target = folder.parent / "outside.json"
        target.write_bytes((folder / "manifest.json").read_bytes())
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").symlink_to(target)


def fifo_manifest(folder):
    (folder / "manifest.json").unlink()
    os.mkfifo(folder / "manifest.json")  # nobody ever writes to it: a read would block forever


def deep_manifest(folder):
    (folder / "manifest.json").write_text('{"format_version": 1, "meta": ' + "[" * 200_000 + "]" * 200_000 + "}")


# a stranger's checkpoint: each is refused with CheckpointCorrupt naming the file, without hanging, following a
# link or reading more than the manifest says
CORRUPTIONS.update({
    "hostile: manifest links outside": (lambda f: symlink_manifest(f, None), "manifest.json", "symbolic link"),
    "hostile: manifest links to /dev/zero": (lambda f: symlink_manifest(f, Path("/dev/zero")), "manifest.json",
                                             "symbolic link"),
    "hostile: manifest is a FIFO": (fifo_manifest, "manifest.json", "not a regular file"),
    "hostile: deeply nested manifest": (deep_manifest, "manifest.json", "not JSON"),
    "hostile: world_size 10**10": (lambda f: edit_manifest(f, lambda m: m.update(world_size=10**10)),
                                   "manifest.json", "out of range"),
    "hostile: sparse 4 GiB shard": (lambda f: os.truncate(f / SHARD, 4 << 30), SHARD,
                                    "is 4294967296 bytes, the manifest says"),
    "header with a dimension of 2**63 (hostile)": (lambda f: rewrite(f, SHARD, header_file(
        {"a": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}})), SHARD, "bad shape"),
    "header nested 100000 deep (hostile)": (lambda f: rewrite(f, SHARD, header_file(b"[" * 100_000 + b"]" * 100_000)),
                                      SHARD, "header is not JSON"),
})


def flip(data):
    data = bytearray(data)
    data[len(data) // 2] ^= 0x10
    return bytes(data)


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_is_detected_and_named(tmp_path, case):
    damage, culprit, what = CORRUPTIONS[case]
    folder = save(tmp_path / "ck-0_1")
    damage(folder)
    with pytest.raises(CheckpointCorrupt, match=what) as info:
        read_checkpoint(folder)
    message = str(info.value)
    assert str(folder / culprit) in message and "fall back to an earlier checkpoint" in message
    assert list_checkpoints(tmp_path, "ck") == [] or case in ("bit flip",) or case.startswith(
        ("header", "offsets", "shape", "unknown", "gap"))  # size-correct damage needs hashing to find


def test_verify_false_skips_hash_but_not_size(tmp_path):
    folder = save(tmp_path / "ck-0_1")
    data = bytearray((folder / SHARD).read_bytes())
    data[-1] ^= 1
    (folder / SHARD).write_bytes(bytes(data))
    read_checkpoint(folder, verify=False)  # a flipped data bit is not seen without hashing
    (folder / SHARD).write_bytes((folder / SHARD).read_bytes() + b"x")
    with pytest.raises(CheckpointCorrupt, match="bytes"):
        read_checkpoint(folder, verify=False)


# --- failures while writing -------------------------------------------------------------------------


@pytest.mark.parametrize("fail_at", range(5))  # fsyncs: shard 0, shard 1, manifest, temp dir, parent dir
def test_enospc_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, fail_at):
    folder = save(tmp_path / "ck-1_1", seed=1)
    calls, real_fsync = [], os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == fail_at + 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if fail_at == 4:  # the rename already happened: the new checkpoint is in place, but flagged
        with pytest.raises(CheckpointError, match="No space left on device.*power loss"):
            save(folder, seed=2)
        monkeypatch.undo()
        same_shards(sample_shards(2), read_checkpoint(folder)[0])
    else:
        with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint is unchanged"):
            save(folder, seed=2)
        monkeypatch.undo()
        same_shards(sample_shards(1), read_checkpoint(folder)[0])
    assert visible(tmp_path) == ["ck-1_1"] and hidden(tmp_path) == []


def test_failed_write_names_the_file_and_creates_nothing(tmp_path, monkeypatch):
    real_open = open

    def failing_open(path, mode="r", *a, **kw):
        if str(path).endswith("rank_1.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(CheckpointError, match=r"rank_1\.safetensors: No space left"):
        save(tmp_path / "ck-0_3")
    assert list(tmp_path.iterdir()) == []


def test_failed_swap_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    folder = save(tmp_path / "ck-1_1", seed=1)
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError(errno.EIO, "I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="I/O error"):
        save(folder, seed=2)
    monkeypatch.undo()
    same_shards(sample_shards(1), read_checkpoint(folder)[0])
    assert visible(tmp_path) == ["ck-1_1"] and hidden(tmp_path) == []


# Imports torch once, then for each (directory, delay) forks a child that saves in a loop
# (replacing folders, so the swap is hit too) and SIGKILLs it after `delay` seconds.
KILLER = """
import os, pathlib, signal, sys, time, torch
torch.set_num_threads(1)
from trainguard.checkpoint.format import save_checkpoint
big = torch.randn(6_000_000)
for d, delay in zip(sys.argv[1::2], sys.argv[2::2]):
    pid = os.fork()
    if pid == 0:
        try:
            for i in range(10**9):
                save_checkpoint(pathlib.Path(d) / f"ck-1_{i % 3}", {"rank_0.safetensors": {"w": big,
                                "i": torch.tensor(i)}}, meta={"i": i}, step=i, epoch=1, world_size=1)
        finally:
            os._exit(1)
    time.sleep(float(delay))
    os.kill(pid, signal.SIGKILL)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    print("killed", d, flush=True)
"""


def test_kill_9_mid_save_never_leaves_a_complete_looking_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = {tmp_path / f"run{k}": delay for k, delay in enumerate([0.01, 0.05, 0.12, 0.2, 0.3, 0.45, 0.6])}
    args = [str(a) for d, delay in runs.items() for a in (d, delay)]
    done = subprocess.run([sys.executable, "-c", KILLER, *args], env=env, capture_output=True, timeout=50)
    assert done.returncode == 0 and done.stdout.count(b"killed") == len(runs), done.stderr.decode()[-2000:]
    leftovers = 0
    for d in runs:
        d.mkdir(exist_ok=True)
        infos = list_checkpoints(d, "ck")
        assert sorted(i.path.name for i in infos) == visible(d)  # every visible folder is complete
        for info in infos:
            shards, manifest = read_checkpoint(info.path)  # and verifies
            assert shards[SHARD]["i"].item() == manifest["step"] == manifest["meta"]["i"] == info.step
        leftovers += len(hidden(d))
        prune_checkpoints(d, "ck", 10, stale_temp_seconds=-1)  # what the killed save left behind goes
        assert hidden(d) == []
        save(d / "ck-1_0", step=99)  # and the directory is usable again
        assert list_checkpoints(d, "ck")[-1].step == 99
    assert leftovers > 0, "no kill landed in the middle of a save; the test proved nothing"


# --- listing and pruning ------------------------------------------------------------------------


def test_checkpoint_name():
    assert checkpoint_name("resnet", 3, 17) == "resnet-3_17"


def test_list_checkpoints_sorts_by_step_and_ignores_the_rest(tmp_path):
    for n in (10, 9, 2):
        save(tmp_path / checkpoint_name("ck", 1, n), step=n, epoch=1)
    save(tmp_path / "other-1_5", step=5)
    save(tmp_path / "ck-1_3x", step=3)
    (tmp_path / ".ck-1_4.tmp-12-abcd").mkdir()
    (tmp_path / "ck-1_6").mkdir()  # no manifest
    broken = save(tmp_path / "ck-1_7", step=7)
    (broken / SHARD).write_bytes(b"short")
    (tmp_path / "ck-1_8").write_text("a file")
    infos = list_checkpoints(tmp_path, "ck")
    assert [(i.path.name, i.step) for i in infos] == [("ck-1_2", 2), ("ck-1_9", 9), ("ck-1_10", 10)]
    assert infos[0] == CheckpointInfo(tmp_path / "ck-1_2", 2, 1, 2, Kind.SINGLE)
    assert list_checkpoints(tmp_path / "nope", "ck") == []


def test_prune_keeps_the_newest(tmp_path):
    for n in range(1, 6):
        save(tmp_path / f"ck-0_{n}", step=n)
    assert [p.name for p in prune_checkpoints(tmp_path, "ck", 2)] == ["ck-0_1", "ck-0_2", "ck-0_3"]
    assert [i.step for i in list_checkpoints(tmp_path, "ck")] == [4, 5]
    assert [p.name for p in prune_checkpoints(tmp_path, "ck", 0)] == ["ck-0_4"]
    assert [i.step for i in list_checkpoints(tmp_path, "ck")] == [5]
    assert prune_checkpoints(tmp_path, "ck", 0) == []
    assert visible(tmp_path) == ["ck-0_5"] and hidden(tmp_path) == []


def test_prune_removes_only_stale_temp_folders(tmp_path):
    save(tmp_path / "ck-0_1")
    old, fresh, foreign = (tmp_path / ".ck-0_2.tmp-1-aa", tmp_path / ".ck-0_3.old-1-bb", tmp_path / ".x-0_2.tmp-1-aa")
    for d in (old, fresh, foreign):
        d.mkdir()
        (d / "part").write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    for p in (old, old / "part", foreign, foreign / "part"):
        os.utime(p, (two_hours_ago, two_hours_ago))
    assert prune_checkpoints(tmp_path, "ck", 5) == [old]
    assert hidden(tmp_path) == sorted([fresh.name, foreign.name])
