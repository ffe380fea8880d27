"""A compiled model (`torch.compile`, nanoGPT's default) survives a kill -9 in a step bit-identically: 3 ranks, an MLP
with BatchNorm and dropout compiled then wrapped for data parallelism, as nanoGPT does (bench/setup_cost.py, the
script of bench/recovery.py's setup cells). The survivors run the script again and find their compiled graph in
Dynamo's cache (the model's classes are torch's, the same in every run); the replacement, a hot spare that preloaded
torch.compile's machinery because the script calls it (launch/spare_main.py), compiles it from Inductor's caches.
`trainguard verify` compares every tensor of every rank with the run without a fault."""

from __future__ import annotations

import shutil

import pytest
from harness import REPO, verify_identical

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(not any(map(shutil.which, ("g++", "c++", "clang++"))),
                                 reason="no C++ compiler here: Inductor's CPU backend needs one (apt install g++)")]


def test_a_compiled_model_is_bit_identical_after_a_kill_in_a_step(tmp_path):
    proc = verify_identical(tmp_path, REPO / "bench" / "setup_cost.py", "mid-step", ["--compile", "--epochs", "2"],
                            steps=24, workers=3)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("kill -9 in a step"))
    assert " identical" in row, proc.stdout
