"""A training loader with a sampler of the script's own (train/data/ownsampler.py): a length-bucketing batch sampler,
a RASampler, torch's own DistributedSampler. Before, each was refused at the first step (exit 78).

- 3 real ranks, loader workers drawing an augmentation in `__getitem__`, VITS' bucketing batch sampler, epochs from
  1, a StepLR made on trainguard.Optimizer: `trainguard verify` kills rank 1 in a step and right after the first
  epoch's last step, and every tensor is identical to the run without a fault. (torch asks a loader's iterator for
  its batch sampler's twice: the resumed position was dropped at the second, and the pass began again at its first
  batch: "differs from step 15".)
- The pure parts: the pass is drawn from its key whatever the global streams hold, a resumed one drops its first
  items, a repeated index gets a seed of its own, and what cannot resume is refused with the fix.
"""

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from harness import REPO, verify_identical

import trainguard as tg
from trainguard.errors import ConfigError
from trainguard.train.data.loaderseed import SampleKey
from trainguard.train.data.ownsampler import OwnSampler, own_sampler, refuse_unresumable, wrap
from trainguard.train.data.sampler import ShardedSampler

JOB = REPO / "tests" / "jobs" / "own_samplers.py"


class Shuffled(torch.utils.data.Sampler):
    """A sampler that draws from the global streams (torch's and Python's), as one that does not seed itself."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        random.shuffle(order)
        return iter(order)

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epoch = epoch


def test_a_pass_is_drawn_from_its_key_whatever_the_global_streams_hold_and_resumes_past_its_first_items():
    own = OwnSampler(Shuffled(12), "sample")
    own.set_epoch(3)  # the script's set_epoch reaches its sampler
    assert own.epoch == 3 and own.inner.epoch == 3 and len(own) == 12
    own.begin(key=7)
    torch.manual_seed(1)
    random.seed(1)
    first = list(own)
    before = torch.get_rng_state()
    torch.manual_seed(2)
    random.seed(2)
    assert list(own) == first and sorted(first) == list(range(12))  # another global state: the same pass
    torch.manual_seed(2)
    assert torch.equal(torch.get_rng_state(), before) is False and list(own) == first
    own.begin(key=8)
    assert list(own) != first  # another pass (another epoch or rank): another key
    own.begin(key=7, skip=5)
    assert list(own) == first[5:] and list(own) == first[5:]  # torch asks for the iterator twice
    own.begin(key=None)
    torch.manual_seed(1)
    random.seed(1)
    plain = list(Shuffled(12))
    torch.manual_seed(1)
    random.seed(1)
    assert list(own) == plain  # not the training pass: the sampler as torch would iterate it


def test_items_go_to_loader_workers_keyed_by_their_place_so_a_repeated_index_is_augmented_anew():
    class Repeats(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([[4, 4, 4], [5, 5, 5]])

        def __len__(self):
            return 2

    own = OwnSampler(Repeats(), "batch")
    own.begin(key=3)
    own.keys_seed = 11  # loader workers seed each sample (loaderseed.py)
    batches = list(own)
    assert batches == [[4, 4, 4], [5, 5, 5]] and all(isinstance(i, SampleKey) for b in batches for i in b)
    seeds = [i.seed for b in batches for i in b]
    assert len(set(seeds)) == 6
    own.begin(key=3, skip=1)
    assert [i.seed for i in list(own)[0]] == seeds[3:]  # a resumed pass: the same seeds at the same places


def test_the_loader_wraps_a_sampler_of_the_scripts_own_and_leaves_the_rest():
    class Items(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return i

    ds = Items()
    mine = Shuffled(10)
    assert isinstance(wrap({"sampler": mine}, ds, ShardedSampler)["sampler"], OwnSampler)
    assert wrap({"batch_sampler": mine}, ds, ShardedSampler)["batch_sampler"].unit == "batch"
    sharded = ShardedSampler(ds, num_shards=1, shard_id=0)
    for kwargs in ({"sampler": sharded}, {"sampler": torch.utils.data.RandomSampler(ds)}, {"batch_size": 2}):
        assert wrap(kwargs, ds, ShardedSampler) == kwargs  # trainguard's own, or torch's whole-dataset ones

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert wrap({"sampler": mine}, Stream(), ShardedSampler) == {"sampler": mine}
    loader = tg.DataLoader(ds, batch_size=2, sampler=mine)
    assert own_sampler(loader).inner is mine and len(loader) == 5
    loader.sampler.set_epoch(4)
    assert mine.epoch == 4
    assert own_sampler(DataLoader(ds, batch_size=2)) is None


def test_an_own_sampler_that_cannot_resume_is_refused_with_the_fix():
    class Endless(torch.utils.data.Sampler):
        def __iter__(self):
            while True:
                yield 0

    with pytest.raises(ConfigError, match="without a length .*Give the sampler __len__"):
        refuse_unresumable(OwnSampler(Endless(), "sample"), elastic=False, virtual=False)
    with pytest.raises(ConfigError, match="Shuffled.*the elastic recover strategy splits it again"):
        refuse_unresumable(OwnSampler(Shuffled(4), "sample"), elastic=True, virtual=False)
    with pytest.raises(ConfigError, match="--virtual-shards"):
        refuse_unresumable(OwnSampler(Shuffled(4), "sample"), elastic=False, virtual=True)
    refuse_unresumable(OwnSampler(Shuffled(4), "sample"), elastic=False, virtual=False)


def test_an_lr_scheduler_made_on_trainguards_optimizer_is_accepted():
    """`optimizer = tg.Optimizer(AdamW(...))` where the script made its optimizer, then its scheduler: torch's
    schedulers refused it ("Optimizer is not an Optimizer", exit 78)."""
    model = torch.nn.Linear(2, 1)
    opt = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert isinstance(opt, torch.optim.SGD) and type(opt) is tg.Optimizer
    assert opt.optimizer.param_groups[0]["initial_lr"] == 1.0 and sched.get_last_lr() == [1.0]


def test_a_bucketing_batch_sampler_with_loader_workers_is_bit_identical_after_a_kill(tmp_path):
    verify_identical(tmp_path, JOB, "mid-step,epoch-end", ["--sampler", "bucket", "--workers", "2"], steps=20,
                     workers=3)


def test_trainguards_distributed_sampler_has_torchs_attributes():
    """A blind port's bucketing sampler subclassed trainguard's DistributedSampler and read `num_replicas`:
    AttributeError, exit 78."""
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    ours = tg.DistributedSampler(ds, num_replicas=3, rank=1, shuffle=False)
    theirs = torch.utils.data.DistributedSampler(ds, num_replicas=3, rank=1, shuffle=False)
    for name in ("num_replicas", "rank", "num_samples", "total_size", "dataset"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert list(ours) == list(theirs)
