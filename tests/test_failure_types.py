"""Failures are classified by type, never by message text (train/engine/step.py)."""

import pytest
import torch.distributed as dist

from trainguard.errors import CollectiveFailed, Retriable
from trainguard.train.engine.step import Step, is_collective_failure


class Loop:
    """What Step asks of its session: whether the retry strategy covers an exception."""

    def __init__(self, retry: bool):
        self.retry = retry

    def is_retriable(self, exc: BaseException) -> bool:
        return self.retry and isinstance(exc, Retriable)


def test_a_dataloader_timeout_is_not_a_collective_failure():
    assert not is_collective_failure(RuntimeError("DataLoader timed out after 5 seconds"))
    assert not is_collective_failure(RuntimeError("gloo: Connection closed by peer; socket timeout"))
    assert is_collective_failure(CollectiveFailed("the gradient exchange failed"))
    assert is_collective_failure(dist.DistNetworkError("store timed out"))


def test_a_step_catches_only_typed_failures():
    step = Step(Loop(retry=False).is_retriable, 0, 0, 0, None)
    with step:
        raise CollectiveFailed("peer gone")
    assert isinstance(step.failure, CollectiveFailed)
    with pytest.raises(RuntimeError, match="DataLoader timed out"):
        with Step(Loop(retry=False).is_retriable, 0, 0, 0, None):
            raise RuntimeError("DataLoader timed out after 5 seconds")


def test_retriable_is_caught_only_under_the_retry_strategy():
    step = Step(Loop(retry=True).is_retriable, 0, 0, 0, None)
    with step:
        raise Retriable("flaky input")
    assert isinstance(step.failure, Retriable)
    with pytest.raises(Retriable):
        with Step(Loop(retry=False).is_retriable, 0, 0, 0, None):
            raise Retriable("flaky input")
