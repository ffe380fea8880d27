"""examples/pipeline.py: torch.distributed.pipelining (PipelineStage, GPipe and 1F1B) on the one engine, real
processes under `trainguard run`, real kill -9, SIGSTOP, the scheduler's kill and SIGTERM.

Each kill lands inside a schedule: TG_FAULT_COLLECTIVE="rank:irecv:n" kills a rank just before its n-th
receive, which with 4 micro-batches a step is a micro-batch in the middle of a step's schedule (and not its
first: n is not 1 more than a multiple of 4), and TG_FAULT's kill-forward once its step's first micro-batch forward
returned. Every rank goes back to the committed step, the lost stage comes back from its buddy's in-memory copy, and the final model and optimizer of every stage (`--out`), and every loss
the last stage printed, are torch.equal to an uninterrupted run's. The port is counted: the lines marked
`# trainguard`.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from harness import REPO, env

import trainguard as tg


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
    """The uninterrupted runs: 2 ranks (PP2) with GPipe, 4 ranks (PP2 x DP2) with 1F1B, the last with sliced
    checkpoints at steps 6 and 12."""
    tmp = tmp_path_factory.mktemp("pipeline")
    for workers, schedule in ((2, "gpipe"), (4, "1f1b")):
        ckpt = ("--ckpt-dir", str(tmp / "ckpt"), "--save-steps", "6") if workers == 4 else ()
        _, log = run(tmp, f"clean-{workers}-{schedule}", workers, schedule, *ckpt)
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


def test_kill_9_of_each_stage_mid_schedule_at_2_ranks_is_bit_identical(clean):
    """GPipe: rank 1 (the last stage) dies before its 10th receive (step 3, micro-batch 2 of 4 forward), and rank 0
    (the first stage, whose receives are the gradients) before its 30th (step 8, in its backward). Both stages come
    back live. (1F1B's kills are at PP2 x DP2 below.)"""
    schedule = "gpipe"
    name = f"kill-2-{schedule}"
    _, log = run(clean, name, 2, schedule, TG_FAULT_COLLECTIVE="1:irecv:10,0:irecv:30")
    assert log.count("was killed by signal SIGKILL") == 2, log[-4000:]
    assert "injecting kill at irecv #10 on rank 1" in log and "injecting kill at irecv #30 on rank 0" in log
    assert_same_run(clean, name, f"clean-2-{schedule}", log)


def test_kill_9_of_every_rank_position_at_pp2_dp2_is_bit_identical(clean):
    """PP2 x DP2 (1F1B; the stages' gradients averaged over their data-parallel peers by all_reduce): each of the
    four ranks is killed once, mid-schedule (kill-forward: its step's first micro-batch forward has returned), at a
    different step. (Step-based, not at the n-th receive: a kill while a live peer runs its first step's shape
    exchange after a restore can leave that peer's send blocked past the cut, which the left-behind watchdog ends
    10 s later with a second death; a known gloo limit, see docs/ARCHITECTURE.md.)"""
    name = "kill-4-1f1b"
    _, log = run(clean, name, 4, "1f1b", TG_FAULT="0:2:kill-forward,1:5:kill-forward,2:8:kill-forward,3:10:kill-forward")
    assert log.count("was killed by signal SIGKILL") == 4, log[-4000:]
    assert_same_run(clean, name, "clean-4-1f1b", log)


def test_pp2_x_fsdp2_kill_9_mid_schedule_is_bit_identical(clean):
    """PP2 x FSDP2 (each stage `fully_shard`ed over its data-parallel pair, torchtitan's layout; trainguard's
    `fully_shard`): rank 2 (stage 0's second shard) killed in its backward. Its shard comes back from its buddy's
    copy; every gathered tensor and loss equals the uninterrupted run's. The reference is the PP2 x DP2 run: over two
    data-parallel ranks FSDP2's reduce-scatter and the all_reduce average the same two values, so an uninterrupted
    FSDP2 run gives its bits exactly (checked once, 122 tensors)."""
    name = "kill-fsdp"
    _, log = run(clean, name, 4, "1f1b", "--fsdp", TG_FAULT_COLLECTIVE="2:irecv:22")
    assert log.count("was killed by signal SIGKILL") == 1, log[-4000:]
    events = [json.loads(line) for line in (clean / f"{name}-recovery" / "events.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "restored" and e["rank"] == 2 and e["source"] == "peer" for e in events), events[-8:]
    assert_same_run(clean, name, "clean-4-1f1b", log)


def test_sigstop_and_the_schedulers_kill_at_2_ranks(clean):
    """Rank 1 is stopped (SIGSTOP: its heartbeat stops; the scheduler fences and kills it) after step 3, and the
    scheduler is killed after step 7 (the launcher restarts it; the job goes on)."""
    name = "stop-sched-gpipe"
    _, log = run(clean, name, 2, "gpipe", TG_FAULT="1:3:stop,0:7:sched", TG_HEARTBEAT_TIMEOUT="2")
    assert "injecting stop at step 3 on rank 1" in log and "injecting sched at step 7 on rank 0" in log, log[-4000:]
    assert "scheduler (pid" in log and "was killed by signal SIGKILL" in log, log[-4000:]
    assert_same_run(clean, name, "clean-2-gpipe", log)


def test_sigterm_then_the_same_command_again(clean):
    """SIGTERM to rank 1 after step 5: every stage stops at the same commit (step 6) and writes its slices of the
    dying-gasp checkpoint (exit 75); the same command again resumes there, and ends as the uninterrupted run did."""
    name = "term-gpipe"
    ckpt = ("--ckpt-dir", str(clean / "term-ckpt"), "--save-steps", "100")  # only the dying gasp: sliced
    code, first = run(clean, name, 2, "gpipe", *ckpt, check=False, TG_FAULT="1:5:term")
    assert code == 75, first[-4000:]
    assert "SIGTERM: stopped at step" in first, first[-4000:]
    assert [p.name for p in (clean / "term-ckpt").glob("pipeline-1_*")] == ["pipeline-1_6"], first[-4000:]
    _, second = run(clean, name, 2, "gpipe", *ckpt)
    assert "resumed at step" in second and "from the checkpoint on disk" in second, second[-4000:]
    combined = {**losses(first), **losses(second)}
    assert combined == losses((clean / "clean-2-gpipe.log").read_text())
    assert_same_run(clean, name, "clean-2-gpipe", first + second)


def test_pp2_dp2_sliced_checkpoint_names_each_stages_replicas_and_rebuilds_a_lost_rank(clean, tmp_path):
    """The checkpoint holds the whole model's tensors, each stage's written by its two data-parallel ranks: the
    group info of ranks 0 and 2 (stage 0 of pipelines 0 and 1) names both, and so for ranks 1 and 3 (stage 1).
    Rank 2's files deleted are rebuilt from rank 0's, bit for bit."""
    folder = tmp_path / "pipeline-1_12"
    shutil.copytree(clean / "ckpt" / "pipeline-1_12", folder)
    assert [tg.restore_group_info_list(folder, r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    whole = tg.load_checkpoint(folder)
    assert {"model/tok.weight", "model/layers.0.mlp.0.weight", "model/layers.1.ln1.weight", "model/head.weight",
            "optim/state/tok.weight/exp_avg", "optim/state/head.weight/exp_avg_sq"} <= set(whole)
    (folder / "rank_2.safetensors").unlink()
    (folder / "rank_2.group_info.json").unlink()
    tg.recover_rank(folder, 2)
    assert tg.restore_group_info_list(folder / "rank_2.group_info.json") == [0, 2]
    again = tg.load_checkpoint(folder)
    assert again.keys() == whole.keys() and all(torch.equal(again[k], whole[k]) for k in whole)


@pytest.mark.parametrize("pp", [2, 1])
def test_a_pp2_dp2_checkpoint_resumes_on_pp2_dp1_and_on_one_rank(clean, tmp_path, pp):
    """Step 12's checkpoint, resumed on 2 ranks (PP2 x DP1) or on 1 (the whole model, --pp 1) with nothing left to
    train: every tensor of every stage's model and optimizer, by parameter name, is the checkpoint's."""
    shutil.copytree(clean / "ckpt" / "pipeline-1_12", tmp_path / "ckpt" / "pipeline-1_12")
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(pp), "--hot-spares", "0", "examples/pipeline.py",
           "--pp", str(pp), *SMALL, "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed at step 12 (epoch 0, batch 12) from the checkpoint on disk" in proc.stdout, proc.stdout[-3000:]
    saved = tg.load_checkpoint(tmp_path / "ckpt" / "pipeline-1_12")
    got = {}
    for stage in range(pp):
        state = torch.load(tmp_path / "out" / f"stage{stage}.pt", weights_only=True)
        names = [k for k in state["model"] if not k.endswith(".mask")]  # the parameters, in the optimizer's order
        got.update({f"model/{k}": v for k, v in state["model"].items()})
        got.update({f"optim/state/{names[i]}/{k}": v for i, s in state["optim"]["state"].items() for k, v in s.items()})
    assert got.keys() == saved.keys()
    assert [k for k in got if not torch.equal(got[k], saved[k])] == []


def test_a_trainer_written_blind_ported_in_6_lines_is_exact_after_a_kill_mid_schedule(tmp_path):
    """tests/jobs/pp_blind.py (1F1B, grad-norm clipping over both stages by all_reduce, batches from a generator of
    its own drawn at the top of every step, dropout from per-stage seeds): rank 0 killed before its 14th receive
    (step 3, in its backward). Every tensor of both stages equals the uninterrupted run's; before trainguard keyed
    the script's own generators, the replayed steps drew other batches (NOT bit-identical)."""
    small = ("--schedule", "1f1b", "--steps", "10", "--batch-size", "8", "--block-size", "16", "--d-model", "32",
             "--n-layers", "2", "--n-heads", "2", "--log-every", "1")
    outs = {}
    for name, faults in (("clean", ""), ("faulty", "0:irecv:14")):
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "1", "tests/jobs/pp_blind.py",
               *small, "--out-dir", str(tmp_path / name)]
        proc = subprocess.run(cmd, cwd=REPO, env=env(TG_FAULT_COLLECTIVE=faults), capture_output=True, text=True,
                              timeout=150)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-4000:]
        assert "NOT bit-identical" not in log, log[-4000:]
        outs[name] = {}
        for stage in (0, 1):
            outs[name].update(flat(torch.load(tmp_path / name / f"stage{stage}.pt", weights_only=True), f"{stage}/"))
    assert "was killed by signal SIGKILL" in log, log[-4000:]
    got, want = outs["faulty"], outs["clean"]
    assert got.keys() == want.keys() and any("optimizer" in k for k in got)
    assert [k for k in got if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))] == []
