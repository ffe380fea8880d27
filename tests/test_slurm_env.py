"""What `trainguard run` takes from a Slurm task's environment (launch/slurm.py), and what wins over it.
Pure; tests/test_slurm.py runs the same under real Slurm daemons."""

from __future__ import annotations

import pytest

from trainguard.errors import ConfigError
from trainguard.launch import cli, slurm

TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NODELIST": "gpu[07-09]"}


@pytest.mark.parametrize("nodelist,first", [
    ("node1", "node1"), ("node1,node2", "node1"), ("gpu[07-09,12],cpu1", "gpu07"), ("n[3]", "n3"),
    ("rack[2-3]-node[01-04]", "rack2-node01"), ("a[5-6]b", "a5b"), ("10.0.0.1", "10.0.0.1"),
])
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert slurm.first_host(nodelist) == first


def test_a_task_of_a_step_gives_rank_count_host_and_port():
    assert slurm.defaults(TASK) == {"nnodes": 3, "node_rank": 1, "sched_host": "gpu07",
                                    "sched_port": 20000 + 4242 % 12000}
    assert slurm.defaults({k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}) == {}  # the batch script
    assert "sched_port" not in slurm.defaults({**TASK, "TG_SCHED_PORT": "9000"})  # the environment wins
    assert "sched_host" not in slurm.defaults({**TASK, "MS_SCHED_HOST": "10.0.0.9"})
    with pytest.raises(ConfigError, match="expected integers"):
        slurm.defaults({**TASK, "SLURM_PROCID": "one"})
    with pytest.raises(ConfigError, match="cannot read its first host; pass --sched-host"):
        slurm.first_host("[1-2]")


def test_flags_win_over_slurm_and_slurm_over_the_defaults(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    env = {**TASK, "TG_JOB_SECRET": "a shared secret of this test"}
    args = cli.build_parser().parse_args(["run", "--workers", "2", str(script)])
    spec = cli.resolve_run(args, env)
    assert (spec.nnodes, spec.node_rank, spec.sched_host, spec.sched_port) == (3, 1, "gpu07", 24242)
    args = cli.build_parser().parse_args(["run", "--workers", "2", "--nnodes", "1", "--node-rank", "0",
                                          "--sched-host", "127.0.0.1", "--sched-port", "29411", str(script)])
    spec = cli.resolve_run(args, env)
    assert (spec.nnodes, spec.node_rank, spec.sched_host, spec.sched_port) == (1, 0, "127.0.0.1", 29411)
