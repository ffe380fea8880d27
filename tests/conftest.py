"""Shared fixtures: uninterrupted reference runs, made once per test session."""

from __future__ import annotations

import pytest
from harness import baselines


@pytest.fixture(scope="session")
def baseline_runs(tmp_path_factory):
    """`get(workers, level="low", epochs=2)`: the final states of an uninterrupted tests/jobs/dp_job.py run."""
    return baselines(tmp_path_factory)
