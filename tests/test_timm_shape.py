"""timm's train.py in small (tests/jobs/timm_shape.py, the shape a blind helper ported from the docs), 3 real ranks.

- `trainguard verify` kills rank 1 mid-epoch and right after the first epoch's last step: every tensor of every
  rank's model, EMA, optimizer and scheduler is identical to the run without a fault. Before, the resumed pass's
  `enumerate` counted from 0, timm's `last_batch` never came, and the epoch's last update was never made (exit 0,
  "lost 0 steps"); and the EMA copied after `DDP(...)` held each rank's own initial weights, because
  trainguard.DDP gave every rank rank 0's weights only at the first step.
- An EMA copied before `DDP(...)`, as timm makes it, differs between ranks: the job says so at its start, naming the
  object and the fix; the run without that says nothing.
"""

import subprocess
import sys

from harness import REPO, env, verify_identical

from trainguard.train.engine import alike
from trainguard.train.data.numbering import ResumedPass, enumerate as numbered

JOB = REPO / "tests" / "jobs" / "timm_shape.py"
WARNING = "the registered object 'model_ema' holds other values on ranks 1, 2 than on rank 0 at the job's start"


def test_unlike_names_the_ranks_that_differ_from_rank_0():
    assert alike.unlike([{"a": "1", "b": "2"}, {"a": "1", "b": "3"}, {"a": "x", "b": "2"}]) == {"a": [2], "b": [1]}
    assert alike.unlike([{"a": "1"}, {"a": "1"}]) == {}
    assert "rank 2 than on rank 0" in alike.message("ema", [2]) and "after DDP(...)" in alike.message("ema", [2])


def test_enumerate_counts_a_resumed_pass_from_its_first_batch_and_anything_else_as_the_builtin():
    class Resumed(ResumedPass):  # a pass that resumed at batch 7 of its epoch
        first = 7

        def __init__(self):
            self.items = iter("ab")

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

    assert list(numbered(Resumed())) == [(7, "a"), (8, "b")]
    assert list(numbered(Resumed(), 1)) == [(8, "a"), (9, "b")]  # numbered from 1 in the run without a fault
    assert list(numbered("xy", start=5)) == [(5, "x"), (6, "y")] and isinstance(numbered([]), enumerate)


def test_enumerate_over_a_generator_counts_from_the_pass_its_first_item_began():
    """torchvision's `enumerate(metric_logger.log_every(loader, ...))` and `enumerate(tqdm(loader))`: the generator
    makes the pass when it is first asked for an item."""
    class Resumed(ResumedPass):
        def __init__(self, first):
            self.first, self.items = first, iter("ab")
            self.begun()

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

    def log_every(make):
        yield from make()

    assert list(numbered(log_every(lambda: Resumed(7)))) == [(7, "a"), (8, "b")]
    assert list(numbered(log_every(lambda: Resumed(7)), 1)) == [(8, "a"), (9, "b")]
    assert list(numbered(log_every(lambda: Resumed(0)))) == [(0, "a"), (1, "b")]
    earlier = Resumed(4)  # a pass begun before the enumerate was asked: not its first item's
    assert list(numbered(x for x in earlier)) == [(0, "a"), (1, "b")]
    assert list(numbered(c for c in "xy")) == [(0, "x"), (1, "y")] and isinstance(numbered(iter(())), enumerate)


def test_a_kill_mid_epoch_and_at_its_end_is_bit_identical(tmp_path):
    proc = verify_identical(tmp_path, JOB, "mid-step,epoch-end", [], steps=20, workers=3)
    assert "right after step 8, the first epoch's last" in proc.stdout, proc.stdout
    assert "holds other values" not in (tmp_path / "clean" / "launcher.log").read_text()


def test_an_ema_copied_before_ddp_differs_between_ranks_and_the_job_says_so_at_its_start(tmp_path):
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "0",
           "--recovery-path", str(tmp_path / "rec"), str(JOB), "--ema-before", "--epochs", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count(WARNING) == 1 and "make it after DDP(...)" in out, out[-3000:]


def test_an_object_some_ranks_did_not_register_is_named():
    assert alike.not_everywhere([{"ema": "1"}, {"ema": "1"}]) is None
    assert "'ema' is registered" in alike.not_everywhere([{"ema": "1"}, {}, {"ema": "1"}])
    assert "rank(s) [0]" in alike.not_everywhere([{}, {"ema": "1"}])
