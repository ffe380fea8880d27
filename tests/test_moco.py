"""MoCo v2 in small (tests/jobs/moco.py, 3 real ranks): a key encoder of frozen parameters moved by momentum in the
forward, a queue filled from an all_gather, shuffle BN. A kill -9 in a step and right after a commit are bit-identical
to the run without a fault; before, both exited 0 with other weights (the momentum applied twice at the rewind)."""

import torch
from torch import nn

from harness import REPO, verify_identical

from trainguard.train.state.buffers import moving_frozen

JOB = REPO / "tests" / "jobs" / "moco.py"


def test_frozen_parameters_are_put_back_with_the_buffers_unless_a_frozen_backbone_outweighs_what_trains():
    q, k = nn.Linear(8, 8), nn.Linear(8, 8)
    k.requires_grad_(False)
    moco = nn.ModuleDict({"q": q, "k": k})
    assert {id(p) for p in moving_frozen(moco)} == {id(k.weight), id(k.bias)}
    backbone, head = nn.Linear(64, 64), nn.Linear(64, 2)
    backbone.requires_grad_(False)
    assert moving_frozen(nn.Sequential(backbone, head)) == []  # fine-tuning a head: its copy would cost too much
    assert moving_frozen(nn.Linear(4, 4)) == []
    counts = nn.Linear(2, 2)
    counts.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.long), requires_grad=False)
    assert all(p.is_floating_point() for p in moving_frozen(counts))


def test_a_kill_in_a_step_and_after_a_commit_are_bit_identical(tmp_path):
    verify_identical(tmp_path, JOB, "mid-step,after-commit", [], steps=20, workers=3)
