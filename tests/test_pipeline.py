"""examples/pipeline.py: torch.distributed.pipelining (PipelineStage, GPipe and 1F1B) on the one engine, real
processes under `trainguard run`, real kill -9, SIGSTOP, the scheduler's kill and SIGTERM.

Each fault lands inside a schedule: TG_FAULT_COLLECTIVE="rank:irecv:n" kills a rank just before its n-th
receive, which with 4 micro-batches a step is a micro-batch in the middle of a step's schedule (and not its
first: n is not 1 more than a multiple of 4). Every rank goes back to the committed step, the lost stage comes
back from its buddy's in-memory copy, and the final model and optimizer of every stage (`--out`), and every loss
the last stage printed, are torch.equal to an uninterrupted run's. The port is counted: the lines marked
`# trainguard`.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys

import pytest
import torch
from harness import REPO, env


pytestmark = pytest.mark.timeout(240)
STEPS = 12
SMALL = ("--steps", str(STEPS), "--log-every", "1", "--d-model", "32", "--layers", "2", "--seq-len", "16",
         "--batch-size", "2", "--micro-batches", "4")
LOSS = re.compile(r"^\[worker \d+\] step (\d+): loss ([0-9.]+)$", re.M)


def run(tmp, name: str, workers: int, schedule: str, *extra: str, check: bool = True, **more_env):
    out = tmp / name
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), "--hot-spares", "1",
           "--recovery-path", str(tmp / f"{name}-recovery"), "examples/pipeline.py", "--pp", "2",
           "--dp", str(workers // 2), "--schedule", schedule, *SMALL, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env(TG_COLLECTIVE_TIMEOUT="300", **more_env), capture_output=True,
                          text=True, timeout=200)
    log = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    if check:
        assert proc.returncode == 0, log[-5000:]
    return proc.returncode, log


def final(tmp, name: str) -> dict[str, torch.Tensor]:
    out = {}
    for stage in (0, 1):
        out.update(flat(torch.load(tmp / name / f"stage{stage}.pt", weights_only=True), f"stage{stage}/"))
    return out


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        elif isinstance(v, (list, tuple)):
            out.update(flat(dict(enumerate(v)), f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(float(v) if v is not None else 0.0)
    return out


def losses(log: str) -> dict[int, str]:
    return {int(step): loss for step, loss in LOSS.findall(log)}  # a step printed twice: its last print


def assert_same_run(tmp, name: str, clean: str, log: str) -> None:
    got, want = final(tmp, name), final(tmp, clean)
    assert got.keys() == want.keys() and any("/optim/" in k for k in got), sorted(got)[:8]
    differ = [k for k in got if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]  # hyper-
    # parameters (the LR) as 0-d tensors too
    assert not differ, f"differ from the uninterrupted run: {differ[:5]}"
    clean_log = (tmp / f"{clean}.log").read_text()
    assert losses(log) == losses(clean_log) and sorted(losses(log)) == list(range(1, STEPS + 1)), log[-3000:]
    assert "NOT bit-identical" not in log, log[-3000:]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted runs: 2 ranks (PP2) with GPipe and 1F1B, 4 ranks (PP2 x DP2) with 1F1B."""
    tmp = tmp_path_factory.mktemp("pipeline")
    for workers, schedule in ((2, "gpipe"), (2, "1f1b"), (4, "1f1b")):
        _, log = run(tmp, f"clean-{workers}-{schedule}", workers, schedule)
        assert sorted(losses(log)) == list(range(1, STEPS + 1)), log[-3000:]
    return tmp


def test_the_port_changes_at_most_8_lines():
    """examples/pipeline.py is examples/pipeline_torchrun.py with at most 8 lines changed (added, removed or
    edited, blank lines aside), and every line the port adds or edits is marked `# trainguard`."""
    plain = (REPO / "examples" / "pipeline_torchrun.py").read_text().split('"""', 2)[2].splitlines()
    port = (REPO / "examples" / "pipeline.py").read_text().split('"""', 2)[2].splitlines()
    changed, unmarked = 0, []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, plain, port, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        old, new = [x for x in plain[i1:i2] if x.strip()], [x for x in port[j1:j2] if x.strip()]
        changed += max(len(old), len(new))
        unmarked += [x for x in new if not re.search(r"# trainguard(:|$)", x)]
    assert not unmarked, unmarked
    assert 0 < changed <= 8, changed


def test_the_plain_script_runs_under_torchrun_unchanged(tmp_path):
    """The original, as its users run it (torchrun, 2 stages): the reference the port is counted against."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/pipeline_torchrun.py", "--pp", "2", *SMALL, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(int(s) for s, _ in re.findall(r"^step (\d+): loss ([0-9.]+)$", proc.stdout, re.M)) == \
        list(range(1, STEPS + 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_kill_9_of_each_stage_mid_schedule_at_2_ranks_is_bit_identical(clean, schedule):
    """Rank 1 (the last stage) dies before its 10th receive (step 3, micro-batch 2 of 4 forward); its replacement
    is then killed by nothing, and rank 0 (the first stage, whose receives are the gradients) dies before its
    30th (step 8, in its backward). Both stages come back live, twice."""
    name = f"kill-2-{schedule}"
    _, log = run(clean, name, 2, schedule, TG_FAULT_COLLECTIVE="1:irecv:10,0:irecv:30")
    assert log.count("was killed by signal SIGKILL") == 2, log[-4000:]
    assert "injecting kill at irecv #10 on rank 1" in log and "injecting kill at irecv #30 on rank 0" in log
    assert_same_run(clean, name, f"clean-2-{schedule}", log)


def test_kill_9_of_every_rank_position_at_pp2_dp2_is_bit_identical(clean):
    """PP2 x DP2 (1F1B; the stages' gradients averaged over their data-parallel peers by all_reduce): each of the
    four ranks is killed once, mid-schedule, at a different step."""
    name = "kill-4-1f1b"
    _, log = run(clean, name, 4, "1f1b", TG_FAULT_COLLECTIVE="0:irecv:6,1:irecv:15,2:irecv:26,3:irecv:35")
    assert log.count("was killed by signal SIGKILL") == 4, log[-4000:]
    assert_same_run(clean, name, "clean-4-1f1b", log)


def test_sigstop_and_the_schedulers_kill_at_2_ranks(clean):
    """Rank 1 is stopped (SIGSTOP: its heartbeat stops; the scheduler fences and kills it) after step 3, and the
    scheduler is killed after step 7 (the launcher restarts it; the job goes on)."""
    name = "stop-sched-1f1b"
    _, log = run(clean, name, 2, "1f1b", TG_FAULT="1:3:stop,0:7:sched", TG_HEARTBEAT_TIMEOUT="2")
    assert "injecting stop at step 3 on rank 1" in log and "injecting sched at step 7 on rank 0" in log, log[-4000:]
    assert "scheduler (pid" in log and "was killed by signal SIGKILL" in log, log[-4000:]
    assert_same_run(clean, name, "clean-2-1f1b", log)


def test_sigterm_then_the_same_command_again(clean):
    """SIGTERM to rank 1 after step 5: every stage stops at the same commit and writes its dying gasp (exit 75);
    the same command again resumes there, and ends as the uninterrupted run did."""
    name = "term-gpipe"
    code, first = run(clean, name, 2, "gpipe", check=False, TG_FAULT="1:5:term")
    assert code == 75, first[-4000:]
    assert "SIGTERM: stopped at step" in first, first[-4000:]
    _, second = run(clean, name, 2, "gpipe")
    assert "resumed at step" in second and "from the checkpoint on disk" in second, second[-4000:]
    combined = {**losses(first), **losses(second)}
    assert combined == losses((clean / "clean-2-gpipe.log").read_text())
    assert_same_run(clean, name, "clean-2-gpipe", first + second)
