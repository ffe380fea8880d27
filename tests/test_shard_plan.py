"""The restore decision of sharded jobs (control/shard_plan.py) and the mesh layout (meshspec.py): pure."""

from __future__ import annotations

import pytest

from trainguard import ConfigError, MeshSpec
from trainguard.control.decisions import decide_agreement
from trainguard.control.outcomes import CopyKind, Source, SourceKind
from trainguard.control.reports import RestoreReport, ShardedRestoreReport
from trainguard.control.shard_plan import choose_sharded_restore

DPxTP = MeshSpec((2, 2), ("dp", "tp"), replicate=("dp",))  # shards 0 1 0 1
FSDP4 = MeshSpec((4,), ("fsdp",))


def rep(spec: MeshSpec, r: int, step, memory=None, disk=()):
    return ShardedRestoreReport(step=step, shard=spec.shard_of(r), memory=memory or {}, disk=list(disk), node=str(r))


SELF, MEMORY = Source(kind=SourceKind.SELF), Source(kind=SourceKind.MEMORY)


def peer(q: int, origin: str) -> Source:
    return Source(kind=SourceKind.PEER, peer=q, origin=CopyKind(origin))


def kinds(d):
    return {s.kind.value for s in d.sources}


def test_mesh_spec_shards_replicas_and_buddies():
    assert [DPxTP.shard_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert DPxTP.replicas(1) == [1, 3] and DPxTP.coords(3) == (1, 1)
    assert [DPxTP.buddy(r) for r in range(4)] == [1, 2, 3, 0]  # each copy on a rank of the other shard
    assert [DPxTP.ward(r) for r in range(4)] == [3, 0, 1, 2]
    tp_first = MeshSpec((2, 2), ("tp", "dp"), replicate=("dp",))  # replicas adjacent: shift by 2
    assert [tp_first.shard_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [tp_first.buddy(r) for r in range(4)] == [2, 3, 0, 1]
    assert [FSDP4.buddy(r) for r in range(4)] == [1, 2, 3, 0] and FSDP4.replicas(2) == [2]
    assert MeshSpec((4,), ("dp",), replicate=("dp",)).buddy(0) is None  # every rank the same: no copies needed
    hsdp = MeshSpec((2, 2), ("replicate", "shard"), replicate=("replicate",))
    assert [hsdp.shard_of(r) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("bad, words", [
    (dict(shape=(2, 2), names=("dp",)), "one name per dimension"),
    (dict(shape=(2, 0), names=("dp", "tp")), ">= 1"),
    (dict(shape=(2, 2), names=("dp", "dp")), "repeat"),
    (dict(shape=(2, 2), names=("dp", "tp"), replicate=("pp",)), "not dimensions"),
])
def test_mesh_spec_refuses_bad_layouts(bad, words):
    with pytest.raises(ConfigError, match=words):
        MeshSpec(**bad)


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(ConfigError, match="needs 4 workers, but the job has 2; run it with --workers 4"):
        DPxTP.check_world(2)


def test_a_dead_rank_takes_its_live_replica_and_survivors_keep_theirs():
    reports = {0: rep(DPxTP, 0, 7), 1: rep(DPxTP, 1, None), 2: rep(DPxTP, 2, 7), 3: rep(DPxTP, 3, 7)}
    d = decide_agreement("restore", reports)  # sharded reports: routed here by their type
    assert d.step == 7 and d.from_step == 7
    assert d.sources == [SELF, peer(3, "live"), SELF, SELF]


def test_a_job_whose_ranks_report_different_layouts_fails_naming_them_and_never_starts_over():
    reports = {0: rep(DPxTP, 0, 7), 1: RestoreReport(step=7, disk=[]), 2: rep(DPxTP, 2, 7), 3: rep(DPxTP, 3, 7)}
    d = decide_agreement("restore", reports, known_step=7)
    assert d.step is None and d.sources == [] and d.from_step == 7
    assert "ranks [0, 2, 3] report a sharded state" in d.error and "same script" in d.error


def test_no_live_holder_of_a_shard_rolls_everyone_back_to_the_newest_common_copy():
    # FSDP over 4: rank 2 died; rank 3 holds its copy at 4 and 6 (ward = 2); the others their own
    mem = {r: {str(r): [4, 6], str((r - 1) % 4): [4, 6]} for r in (0, 1, 3)}
    reports = {r: rep(FSDP4, r, 7, mem[r]) for r in (0, 1, 3)} | {2: rep(FSDP4, 2, None)}
    d = choose_sharded_restore(reports)
    assert d.step == 6 and d.from_step == 7
    assert d.source(2) == peer(3, "memory")
    assert all(d.source(r) == MEMORY for r in (0, 1, 3))


def test_a_death_mid_exchange_falls_back_to_the_previous_round():
    # FSDP over 4: rank 2 died while the copies of step 6 went round; its buddy, rank 3, got only step 4's
    mem = {0: {"0": [4, 6], "3": [4, 6]}, 1: {"1": [4, 6], "0": [4, 6]}, 3: {"3": [4, 6], "2": [4]}}
    reports = {r: rep(FSDP4, r, 7, mem[r]) for r in (0, 1, 3)} | {2: rep(FSDP4, 2, None)}
    d = choose_sharded_restore(reports)
    assert d.step == 4
    assert d.source(2) == peer(3, "memory")


def test_a_half_finished_last_collective_rolls_the_newer_shard_back_too():
    # dp x tp: shard 0's survivor reached 8, shard 1's only survivor stayed at 7 (its holder at 8 died)
    reports = {0: rep(DPxTP, 0, 8, {"0": [6], "1": [6]}), 1: rep(DPxTP, 1, 7, {"1": [6], "0": [6]}),
               2: rep(DPxTP, 2, None), 3: rep(DPxTP, 3, None)}
    d = choose_sharded_restore(reports)
    assert d.step == 6  # no shard-0 holder at 7 and no shard-1 holder at 8: the newest copy of both
    assert d.source(0) == MEMORY and d.source(1) == MEMORY
    assert {d.source(2).peer, d.source(3).peer} <= {0, 1}


def test_live_beats_copies_and_holders_share_the_sending():
    spec = MeshSpec((4, 1), ("dp", "tp"), replicate=("dp",))  # pure DP: one shard, four holders
    reports = {0: rep(spec, 0, 5), 1: rep(spec, 1, None), 2: rep(spec, 2, None), 3: rep(spec, 3, 5)}
    d = choose_sharded_restore(reports)
    assert d.source(1).peer != d.source(2).peer


def test_without_copies_the_newest_common_disk_checkpoint_else_an_error_not_a_silent_restart():
    reports = {0: rep(FSDP4, 0, 9, disk=[4, 8]), 1: rep(FSDP4, 1, None, disk=[4, 8]),
               2: rep(FSDP4, 2, 9, disk=[4, 8]), 3: rep(FSDP4, 3, 9, disk=[4])}
    d = choose_sharded_restore(reports)
    assert d.step == 4 and d.from_step == 9 and kinds(d) == {"disk"}
    no_disk = {r: v.model_copy(update={"disk": []}) for r, v in reports.items()}
    err = choose_sharded_restore(no_disk)
    assert err.step is None and "no step can be restored on every shard" in err.error
    assert "checkpoint directory" in err.error


def test_a_fresh_job_starts_fresh():
    d = choose_sharded_restore({r: rep(FSDP4, r, None) for r in range(4)})
    assert d.fresh and d.step == 0 and kinds(d) == {"init"}


def test_every_process_fresh_after_committed_steps_is_an_error_not_a_silent_restart():
    """Found with tests/jobs/sharded_trainer.py (fsdp, 3 ranks): a kill, then a kill of the rank sending the
    replacement its shard; the survivors failed the restore and were restarted, and the new processes, all
    fresh, started the job over from step 0 and exited 0 with other weights. The scheduler knows the job
    committed steps (its earlier decisions, the heartbeats), as for data parallelism."""
    fresh = {r: rep(FSDP4, r, None) for r in range(4)}
    err = decide_agreement("restore", fresh, known_step=3)
    assert err.step is None and "committed 3 steps" in err.error and "TG_CHECKPOINT_DIR" in err.error
    assert choose_sharded_restore({**fresh, 0: rep(FSDP4, 0, None, disk=[2])}, known_step=3).error  # not every rank
    d = choose_sharded_restore({r: rep(FSDP4, r, None, disk=[2]) for r in range(4)}, known_step=3)
    assert d.step == 2 and d.from_step == 3 and kinds(d) == {"disk"}


def test_a_shard_map_from_the_ranks_keys_numbers_shards_in_rank_order_and_rings_buddies_across_shards():
    from trainguard.meshspec import ShardMap

    hsdp = ShardMap.of_keys([901, 77, 901, 77])  # two replicas of two shards, as HSDP (2, 2) reports them
    assert hsdp.ids == (0, 1, 0, 1) and hsdp.replicas(3) == [1, 3]
    assert [hsdp.buddy(r) for r in range(4)] == [1, 2, 3, 0] and [hsdp.ward(r) for r in range(4)] == [3, 0, 1, 2]
    fsdp = ShardMap.of_keys([5, 6, 7])
    assert fsdp.shift() == 1 and fsdp.buddy(2) == 0
    assert ShardMap.of_keys([3, 3, 3]).buddy(0) is None  # every rank holds the same state: no copy is needed
    assert DPxTP.shards() == ShardMap((0, 1, 0, 1)) and DPxTP.buddy(3) == 0
