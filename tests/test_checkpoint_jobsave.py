"""A job checkpoint's write protocol in one process: parts, markers, the committer, replicas."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from trainguard.checkpoint import format as fmt
from trainguard.checkpoint import (
    jobsave,
    list_checkpoints,
    prune_checkpoints,
    read_manifest,
    verify_checkpoint,
)
from trainguard.checkpoint.blob import pack
from trainguard.checkpoint.codec import flatten_state
from trainguard.checkpoint.manifest import new_manifest
from trainguard.checkpoint.replicas import recover_rank
from trainguard.errors import CheckpointCorrupt, CheckpointError
from trainguard.launch.cli import main
from trainguard.train.engine.faults import DiskFull, disk_full_at

pytestmark = pytest.mark.timeout(60)

WORLD = 2


def snapshot(step: int):
    shared = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) + step}, "step": step}
    tensors, meta = flatten_state(shared, copy=True)
    blobs = {r: pack({"rng": {"torch": torch.full((4,), r, dtype=torch.uint8)},
                      "progress": {"step": step, "epoch": 0, "in_epoch": step}}) for r in range(WORLD)}
    return tensors, meta, blobs


def save(root, step, *, ranks=range(WORLD), timeout=5.0, give_up=lambda: False):
    tensors, meta, blobs = snapshot(step)
    folder = root / f"ck-1_{step}"
    sid = jobsave.save_id(folder.name, step, blobs)
    tmp = jobsave.temp_for(folder, step, sid)
    for r in ranks:
        jobsave.write_part(tmp, r, step, tensors, meta, sid)
    manifest = new_manifest(folder, meta={}, step=step, epoch=0, world_size=WORLD, append_info={"a": 1},
                            ranks=jobsave.ranks_entry(blobs))
    return jobsave.commit(folder, step, sid, manifest, timeout=timeout, give_up=give_up), tmp


def test_parts_then_manifest_and_both_ranks_load(tmp_path):
    folder, tmp = save(tmp_path, 4)
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "rank_0.safetensors", "rank_1.safetensors"]
    assert not tmp.exists()
    for r in range(WORLD):
        state, source = jobsave.load_rank(folder, r, WORLD)
        assert source == f"rank_{r}.safetensors" and state["shared"]["step"] == 4
        assert torch.equal(state["shared"]["model"]["w"], torch.arange(6.).reshape(2, 3) + 4)
        assert torch.equal(state["own"]["rng"]["torch"], torch.full((4,), r, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match="saved by 2 ranks, this job has 3"):
        jobsave.load_rank(folder, 0, 3)


def test_a_missing_rank_is_never_committed_and_the_wait_is_bounded(tmp_path):
    with pytest.raises(CheckpointError, match=r"waited 0.3 s for rank\(s\) \[1\] to write their part"):
        save(tmp_path, 4, ranks=[0], timeout=0.3)
    assert list_checkpoints(tmp_path, "ck") == []
    with pytest.raises(CheckpointError, match=r"recovering or leaving, and rank\(s\) \[1\] have not written"):
        save(tmp_path, 4, ranks=[0], give_up=lambda: True)
    (tmp,) = tmp_path.glob(".ck-1_4.tmp-*")  # kept: a save of the same step finishes it
    folder, _ = save(tmp_path, 4)
    assert [c.step for c in list_checkpoints(tmp_path, "ck")] == [4] and not tmp.exists()


def test_the_committer_waits_for_a_slower_rank(tmp_path):
    tensors, meta, blobs = snapshot(4)
    folder = tmp_path / "ck-1_4"
    sid = jobsave.save_id(folder.name, 4, blobs)
    tmp = jobsave.temp_for(folder, 4, sid)
    jobsave.write_part(tmp, 0, 4, tensors, meta, sid)
    late = threading.Timer(0.3, jobsave.write_part, (tmp, 1, 4, tensors, meta, sid))
    late.start()
    manifest = new_manifest(folder, meta={}, step=4, epoch=0, world_size=WORLD, ranks=jobsave.ranks_entry(blobs))
    assert jobsave.commit(folder, 4, sid, manifest, timeout=10) == folder
    late.join()


def test_a_failed_part_stops_the_committer_at_once(tmp_path):
    tensors, meta, blobs = snapshot(4)
    folder = tmp_path / "ck-1_4"
    sid = jobsave.save_id(folder.name, 4, blobs)
    tmp = jobsave.temp_for(folder, 4, sid)
    jobsave.write_part(tmp, 0, 4, tensors, meta, sid)
    disk_full_at({(1, 4)})
    try:
        with pytest.raises(CheckpointError, match=r"rank 1 could not write its part of step 4, .*No space left"):
            jobsave.write_part(tmp, 1, 4, tensors, meta, sid)
    finally:
        fmt.remove_write_fault(DiskFull(frozenset({(1, 4)})))
    assert not list(tmp.glob(".rank_1*"))  # the partial file is gone
    manifest = new_manifest(folder, meta={}, step=4, epoch=0, world_size=WORLD, ranks=jobsave.ranks_entry(blobs))
    with pytest.raises(CheckpointError, match="abandoned: rank 1 could not write"):
        jobsave.commit(folder, 4, sid, manifest, timeout=30)
    assert not tmp.exists() and not folder.exists()


def test_a_lost_or_corrupt_file_is_read_from_its_replica_and_rewritten(tmp_path):
    folder, _ = save(tmp_path, 4)
    original = (folder / "rank_0.safetensors").read_bytes()
    (folder / "rank_0.safetensors").unlink()
    assert [c.step for c in list_checkpoints(tmp_path, "ck")] == [4]  # a replica stands in
    state, source = jobsave.load_rank(folder, 0, WORLD)
    assert source == "rank_1.safetensors" and state["shared"]["step"] == 4
    assert (folder / "rank_0.safetensors").read_bytes() == original
    (folder / "rank_1.safetensors").write_bytes(original[:-1] + b"\xff")
    result = verify_checkpoint(folder)
    assert not result.ok and result.damaged_ranks == [1] and not result.unrecoverable
    assert "sha256" in result.problems["rank_1.safetensors"]
    done = recover_rank(folder, 1)
    assert not done.intact and done.sources == (0,) and verify_checkpoint(folder).ok
    for r in range(WORLD):
        (folder / f"rank_{r}.safetensors").write_bytes(b"junk")
    assert list_checkpoints(tmp_path, "ck") == []
    with pytest.raises(CheckpointCorrupt, match=r"rank_0\.safetensors: no intact copy is left"):
        jobsave.load_rank(folder, 0, WORLD)


def test_retention_keeps_the_newest_complete_checkpoint(tmp_path):
    for step in (4, 8, 12):
        save(tmp_path, step)
    save_tmp = tmp_path / ".ck-1_16.tmp-16-0123456789abcdef"  # a save in progress is never pruned
    save_tmp.mkdir()
    prune_checkpoints(tmp_path, "ck", 1)
    assert [c.step for c in list_checkpoints(tmp_path, "ck")] == [12] and save_tmp.exists()


def test_manifest_v3_is_checked(tmp_path):
    folder, _ = save(tmp_path, 4)
    m = json.loads((folder / "manifest.json").read_text())
    assert m["format_version"] == 3 and m["append_info"] == {"a": 1}
    m["ranks"].pop("1")
    (folder / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointCorrupt, match=r"manifest\.json: has format_version 3 but its 'ranks' field"):
        read_manifest(folder)


def test_cli_ls_inspect_verify_recover_on_a_job_checkpoint(tmp_path, capsys):
    folder, _ = save(tmp_path, 4)
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:6] == ["4", "ck-1_4", "0", "2", "job", "2"]
    assert main(["ckpt", "inspect", str(folder)]) == 0
    assert 'rank 1: rank_1.safetensors, data position {"step": 4, "epoch": 0, "in_epoch": 4}' in capsys.readouterr().out
    (folder / "rank_1.safetensors").unlink()
    assert main(["ckpt", "verify", str(folder)]) == 2
    assert f"trainguard ckpt recover {folder} --rank 1" in capsys.readouterr().err
    assert main(["ckpt", "recover", str(folder), "--rank", "1"]) == 0
    assert "rebuilt from rank(s) [0]" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(folder)]) == 0


def test_a_dying_gasp_does_not_rewrite_a_part_a_regular_save_of_the_same_step_wrote(tmp_path):
    """The race of a SIGTERM on a periodic-save step: rank 1's regular save wrote its part, rank 0's commit
    still waits; rank 1's dying gasp must leave that part and its done marker alone."""
    from trainguard.train.state.checkpointing import CheckpointConfig, ModelCheckpoint
    from trainguard.train.engine.snapshots import Snapshot

    tensors, meta, blobs = snapshot(6)
    snap = Snapshot(6, tensors, meta, blobs[1], ranks=blobs)
    saver = ModelCheckpoint("ck", tmp_path, CheckpointConfig(exception_save=True))
    first = saver.save_dying_gasp(snap, 1, blobs[1], None, WORLD)  # as the regular save wrote it
    marker = next(first.parent.glob(".*/rank_1.done.json"))
    stamp = marker.stat().st_mtime_ns
    assert saver.save_dying_gasp(snap, 1, blobs[1], None, WORLD) is None  # already there: not rewritten
    assert marker.exists() and marker.stat().st_mtime_ns == stamp
    assert saver.save_dying_gasp(snap, 0, blobs[0], None, WORLD) is not None
    done, errors = saver.commit_dying_gasp(deadline=__import__("time").monotonic() + 5)
    assert errors == [] and [p.name for p in done] == [first.name]
