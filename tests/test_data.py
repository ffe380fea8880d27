import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard.errors import ConfigError
from trainguard.train.data import sampler as data_mod
from trainguard.train.data.sampler import ShardedSampler

pytestmark = pytest.mark.timeout(30)


def shards(n, s, **kw):
    return [list(ShardedSampler(n, num_shards=s, shard_id=k, **kw)) for k in range(s)]


def test_deterministic_and_epoch_dependent():
    a, b = ShardedSampler(50, num_shards=1, shard_id=0, seed=3), ShardedSampler(50, num_shards=1, shard_id=0, seed=3)
    assert list(a) == list(b)
    assert sorted(a) == list(range(50))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(50))
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    assert list(a) == expected
    assert list(ShardedSampler(50, num_shards=1, shard_id=0, seed=4)) != first


def test_no_shuffle_is_identity():
    assert shards(6, 2, shuffle=False) == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize("n,s", [(48, 4), (12, 3), (7, 7)])
def test_shards_disjoint_and_cover(n, s):
    parts = shards(n, s, seed=9)
    flat = [i for p in parts for i in p]
    assert len(flat) == n and sorted(flat) == list(range(n))
    assert all(len(p) == n // s for p in parts)


def test_padding_repeats_from_start():
    parts = shards(10, 4, seed=1)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    padded = order + order[:2]
    assert parts == [padded[k::4] for k in range(4)]
    assert all(len(p) == 3 for p in parts)
    assert set(i for p in parts for i in p) == set(range(10))


def test_padding_when_fewer_samples_than_shards():
    parts = shards(2, 5, shuffle=False)
    assert parts == [[0], [1], [0], [1], [0]]


def test_drop_last_truncates():
    parts = shards(10, 4, seed=1, drop_last=True)
    flat = [i for p in parts for i in p]
    assert all(len(p) == 2 for p in parts) and len(set(flat)) == 8
    assert len(ShardedSampler(10, num_shards=4, shard_id=0, drop_last=True)) == 2
    assert shards(3, 4, drop_last=True) == [[], [], [], []]


def test_len_and_dataset_argument():
    ds = TensorDataset(torch.arange(11))
    assert len(ShardedSampler(ds, num_shards=3, shard_id=2)) == 4
    assert list(ShardedSampler(0, num_shards=2, shard_id=1)) == []


@pytest.mark.parametrize("batch", [1, 4, 5])
@pytest.mark.parametrize("stop", [0, 1, 3])
def test_resume_with_dataloader_matches_uninterrupted_run(batch, stop):
    ds = TensorDataset(torch.arange(37))
    full = ShardedSampler(ds, num_shards=3, shard_id=1, seed=7)
    full.set_epoch(2)
    expected = [b[0].tolist() for b in DataLoader(ds, batch_size=batch, sampler=full)]

    run = ShardedSampler(ds, num_shards=3, shard_id=1, seed=7)
    run.set_epoch(2)
    it = iter(DataLoader(ds, batch_size=batch, sampler=run))
    seen = [next(it)[0].tolist() for _ in range(stop)]
    state = run.state_dict()
    position = min(stop * batch, len(run))  # a short last batch ends the epoch
    assert state == {"epoch": 2, "position": position, "num_shards": 3, "shard_id": 1, "seed": 7}
    del it

    resumed = ShardedSampler(ds, num_shards=3, shard_id=1, seed=0)
    resumed.load_state_dict(state)
    resumed.set_position(stop * batch)  # what a loop that counts batches would pass; same result
    resumed.set_epoch(2)  # the training loop's usual call for the current epoch keeps the position
    rest = [b[0].tolist() for b in DataLoader(ds, batch_size=batch, sampler=resumed)]
    assert seen + rest == expected
    # the resume position applies once: the next epoch starts from the beginning
    resumed.set_epoch(3)
    assert len(list(resumed)) == len(resumed)


def test_set_position_is_one_shot():
    s = ShardedSampler(20, num_shards=2, shard_id=0, seed=2)
    whole = list(s)
    s.set_position(4)
    assert list(s) == whole[4:]
    assert s.state_dict()["position"] == 10
    assert list(s) == whole  # same epoch again without a new position: from the start
    s.set_position(10)
    assert list(s) == []
    s.set_position(13)  # past the end: the epoch is done
    assert s.state_dict()["position"] == 10 and list(s) == []


def test_state_dict_round_trip():
    s = ShardedSampler(30, num_shards=2, shard_id=1, seed=5, drop_last=True)
    s.set_epoch(4)
    s.set_position(6)
    t = ShardedSampler(30, num_shards=2, shard_id=1, drop_last=True)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    assert list(t) == list(s)


def test_load_state_keeps_own_shard_and_rejects_mid_epoch_world_change():
    saved = ShardedSampler(40, num_shards=4, shard_id=0, seed=1)
    saved.set_position(3)
    other_rank = ShardedSampler(40, num_shards=4, shard_id=2, seed=1)
    other_rank.load_state_dict(saved.state_dict())
    assert other_rank.shard_id == 2 and other_rank.state_dict()["position"] == 3
    smaller = ShardedSampler(40, num_shards=2, shard_id=0)
    with pytest.raises(ConfigError, match="mid-epoch"):
        smaller.load_state_dict(saved.state_dict())
    saved.set_position(0)
    smaller.load_state_dict(saved.state_dict())
    assert smaller.num_shards == 2 and smaller.seed == 1


def test_reshard_at_epoch_boundary():
    s = ShardedSampler(12, num_shards=2, shard_id=0, shuffle=False)
    assert list(s) == [0, 2, 4, 6, 8, 10]
    s.set_epoch(1)
    s.reshard(3, 2)
    assert (s.num_shards, s.shard_id, len(s)) == (3, 2, 4)
    assert list(s) == [2, 5, 8, 11]
    it = iter(s)
    next(it)
    with pytest.raises(ConfigError, match="mid-epoch"):
        s.reshard(2, 0)
    with pytest.raises(ConfigError, match="shard_id"):
        s.reshard(2, 2)
    with pytest.raises(ConfigError, match="num_shards"):
        s.reshard(0, 0)


def test_lazy_shard_info_hook(monkeypatch):
    monkeypatch.setattr(data_mod, "default_shard_info", None)
    s = ShardedSampler(8, shuffle=False)
    monkeypatch.setattr(data_mod, "default_shard_info", lambda: (4, 3))  # set after construction
    assert list(s) == [3, 7]
    assert ShardedSampler(8).state_dict()["num_shards"] == 4
    monkeypatch.setattr(data_mod, "default_shard_info", None)
    assert (ShardedSampler(8).num_shards, ShardedSampler(8).shard_id) == (1, 0)
    monkeypatch.setattr(data_mod, "default_shard_info", lambda: (2, 2))
    with pytest.raises(ConfigError, match="default_shard_info"):
        len(ShardedSampler(8))


def test_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    s = ShardedSampler(100, num_shards=2, shard_id=1, seed=11)
    for e in range(3):
        s.set_epoch(e)
        list(s)
    s.state_dict()
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_shards": 0, "shard_id": 0}, "num_shards"),
        ({"num_shards": 2, "shard_id": 2}, "shard_id"),
        ({"num_shards": 2, "shard_id": -1}, "shard_id"),
        ({"num_shards": 2}, "shard_id"),
        ({"shard_id": 0}, "num_shards"),
        ({"num_shards": 2.0, "shard_id": 0}, "num_shards"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        ShardedSampler(10, **kwargs)


def test_bad_runtime_arguments():
    s = ShardedSampler(10, num_shards=2, shard_id=0)
    with pytest.raises(ConfigError, match="position"):
        s.set_position(-1)
    with pytest.raises(ConfigError, match="epoch"):
        s.set_epoch(-1)
    with pytest.raises(ConfigError, match="dataset_or_len"):
        ShardedSampler(-3)
    with pytest.raises(ConfigError, match="missing"):
        s.load_state_dict({"epoch": 0})
    with pytest.raises(ConfigError, match="position"):
        s.load_state_dict({"epoch": 0, "position": 99, "num_shards": 2, "shard_id": 0, "seed": 0})
