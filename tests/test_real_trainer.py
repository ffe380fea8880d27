"""examples/trainer.py (and examples/lm.py, a language model with an eval pass), a trainer written the way people write them for torchrun (train and eval loaders,
BatchNorm and dropout, an LR schedule stepped every step, gradient accumulation with no_sync, clipping,
an eval metric all_reduce, an early-stop broadcast, a barrier per epoch, rank 0's own torch.save snapshot),
ported by changing imports and a few lines. A kill -9 or SIGSTOP anywhere (in a step, right after an
epoch's last step, in the eval pass's all_reduce, in the barrier, during the recovery) must end with every
model, optimizer and scheduler tensor of every rank equal to an uninterrupted run's, and the same eval
metrics. 3 and 4 ranks: with 2, every summation order gives the same bits."""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import REPO, assert_identical, env, events, run_logged

pytestmark = pytest.mark.timeout(300)

ORIGINAL, PORT = REPO / "examples" / "trainer_torchrun.py", REPO / "examples" / "trainer.py"
LM_ORIGINAL, LM = REPO / "examples" / "lm_torchrun.py", REPO / "examples" / "lm.py"
EPOCHS = 2  # 3 ranks: 24 batches of 20 a rank an epoch, 2 per step: 12 steps an epoch; 4 ranks: 9


def run(out: Path, workers: int, *, fault: str = "", at_collective: str = "", spares: int = 0, script: Path = PORT):
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc = run_logged(
        [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), "--hot-spares", str(spares),
         "--recovery-path", str(out / "recovery"), str(script), "--epochs", str(EPOCHS),
         "--snapshot", str(out / "snapshot.pt"), "--out", str(out / "final")],
        out, env(TG_FAULT=fault, TG_FAULT_COLLECTIVE=at_collective), 240)
    took = time.monotonic() - t0
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    states = [torch.load(out / "final" / f"rank_{r}.pt", weights_only=True) for r in range(workers)]
    evals = {}
    for line in proc.stdout.splitlines():  # an eval pass a fault interrupted is done again: the last one counts
        m = re.search(r"epoch (\d+) eval_loss (\S+) (?:accuracy|ema_loss) (\S+)(?: lr (\S+))?", line)
        if m:
            evals[int(m.group(1))] = m.groups()[1:]
    return states, evals, took, proc


def why_slow(out: Path, took: float, fault_free: float) -> str:
    """What a run that took too long spent its time on (evaluated only when the bound fails): the recovery
    phases (`trainguard report`) and the launcher's last lines."""
    report = subprocess.run([sys.executable, "-m", "trainguard", "report", str(out / "recovery")], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    return (f"{took:.1f} s against {fault_free:.1f} s without a fault\n{report.stdout}{report.stderr}\n"
            + (out / "launcher.log").read_text()[-20000:])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cache = {}

    def get(workers: int):
        if workers not in cache:
            states, evals, took, _ = run(tmp_path_factory.mktemp(f"uninterrupted-{workers}"), workers)
            assert sorted(evals) == list(range(EPOCHS))
            assert {"model", "optimizer", "scheduler"} <= set(states[0])
            cache[workers] = states, evals, took
        return cache[workers]

    return get


@pytest.mark.parametrize("original,port", [(ORIGINAL, PORT), (LM_ORIGINAL, LM)], ids=["trainer", "lm"])
def test_the_port_changes_at_most_ten_lines(original, port):
    original, port = original.read_text().splitlines(), port.read_text().splitlines()
    changed = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in
                  difflib.SequenceMatcher(None, original, port, autojunk=False).get_opcodes() if tag != "equal")
    assert 0 < changed <= 10, "\n".join(difflib.unified_diff(original, port, lineterm=""))
    assert not re.search(r"^(import|from) trainguard", "\n".join(original), re.M)


# (workers, TG_FAULT, TG_FAULT_COLLECTIVE, hot spares, what it covers): two or three faults a run, one recovery each
CASES = [
    (3, "1:5:kill,0:12:kill", "", 2,
     "kill -9 of rank 1 in the middle of an epoch's training, then of rank 0 right after epoch 0's last step"),
    (3, "", "1:all_reduce:1,2:barrier:2", 2,
     "kill -9 of rank 1 at the eval pass's metric all_reduce, then of rank 2 at epoch 1's barrier"),
    (3, "1:5:kill,2:17:stop", "0:send:1", 2,
     "kill -9 of rank 0 while it sends its state to rank 1's replacement, then SIGSTOP of rank 2"),
    (4, "3:9:kill", "2:all_reduce:2", 2,
     "4 ranks: kill -9 of rank 3 right after epoch 0's last step, then of rank 2 at epoch 1's eval all_reduce"),
]


@pytest.mark.parametrize("workers,fault,at_collective,spares,what", CASES, ids=["step-and-epoch-end", "eval-and-barrier",
                                                                               "during-recovery-and-sigstop", "4-ranks"])
def test_a_fault_anywhere_ends_bit_identical(tmp_path, baseline, workers, fault, at_collective, spares, what):
    want_states, want_evals, fault_free, = baseline(workers)
    states, evals, took, proc = run(tmp_path, workers, fault=fault, at_collective=at_collective, spares=spares)
    fired = [e for e in events(tmp_path) if e["event"] == "fault_injected"]
    assert len(fired) == len([f for f in (fault + "," + at_collective).split(",") if f]), fired
    assert "recovery 1:" in proc.stdout  # the launcher's summary names each recovery
    assert "resumed at step 0 " not in proc.stdout  # nobody started over
    for r in range(workers):
        assert_identical(states[r], want_states[r], f"rank {r}")
    assert evals == want_evals  # the metrics every epoch printed
    assert took < 2 * fault_free + 20, f"{what}: {why_slow(tmp_path, took, fault_free)}"


def test_an_error_every_rank_raises_at_the_same_step_ends_the_job_at_once(tmp_path):
    """A bug in the script is raised by every rank at the same point: restarting would only raise it again (and,
    with every rank restarted, lose the live state). The ranks compare their errors and the job ends, exit 78."""
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "0", "--recovery-path",
         str(tmp_path / "recovery"), str(PORT), "--epochs", "1", "--snapshot", str(tmp_path / "snapshot.pt")],
        cwd=REPO, env=env(TG_FAULT="0:3:raise,1:3:raise,2:3:raise"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "every rank raised it at the same step" in proc.stderr
    assert "InjectedFault" in proc.stderr and "restarting worker" not in proc.stderr


def test_the_language_model_survives_a_kill_in_a_step_and_in_the_eval_of_its_moving_average(tmp_path):
    """examples/lm.py: a registered mask buffer, a LambdaLR schedule, an EMA, two eval passes an epoch. Kill -9
    of rank 1 in a step, then of rank 0 at the EMA's eval all_reduce. The faulty run's script leaves out the port's
    `register_state("ema", ema)`: trainguard finds the AveragedModel itself (train/state/discover.py)."""
    want_states, want_evals, fault_free, _ = run(tmp_path / "uninterrupted", 3, script=LM)
    registered = 'tg.register_state("ema", ema)\n'
    assert registered in LM.read_text()
    unregistered = tmp_path / "lm_unregistered.py"
    unregistered.write_text(LM.read_text().replace(registered, ""))
    states, evals, took, proc = run(tmp_path / "faulty", 3, fault="1:10:kill", at_collective="0:all_reduce:2",
                                    spares=2, script=unregistered)
    assert "recovery 2:" in proc.stdout and {"model", "ema", "optimizer", "scheduler"} <= set(states[0])
    for r in range(3):
        assert_identical(states[r], want_states[r], f"rank {r}")
    assert evals == want_evals and sorted(evals) == list(range(EPOCHS))
    assert took < 2 * fault_free + 20, why_slow(tmp_path / "faulty", took, fault_free)


# a fault inside a step (train/engine/instep.py): the first one rewinds every rank (the replay audit checks that the job
# resumes exactly); from then on the survivors stay in their step, and only the replacement runs the script
IN_STEP = [
    (3, "1:4:kill-forward,0:9:kill-exchange,2:15:collective",
     "kill -9 of rank 1 between two accumulated micro-batches (every rank rewinds and replays: audited), of rank 0 "
     "while its exchange is in flight, then an exchange that fails on every rank with nobody dead"),
    (4, "1:3:kill-exchange,2:5:kill-after,3:13:kill-before",
     "4 ranks: kill -9 of rank 1 in its exchange (every rank rewinds: audited), of rank 2 once its exchange "
     "completed, before its update, and of rank 3 before its exchange"),
]


def test_an_injected_collective_fault_fires_once_in_a_process_that_runs_the_script_again(tmp_path, baseline):
    """TG_FAULT's collective kind fails a step without killing anyone; the job's first fault rewinds every rank to
    the step before it, and the script's new run made a new injector that fired again, at every rewind, until the
    job gave up (a blind port's finding). Once per process now: one fault, one recovery, the clean run's bits."""
    want_states, want_evals, _ = baseline(3)
    states, evals, _, proc = run(tmp_path, 3, fault="1:5:collective")
    assert len([e for e in events(tmp_path) if e["event"] == "fault_injected"]) == 1, proc.stderr[-3000:]
    for r in range(3):
        assert_identical(states[r], want_states[r], f"rank {r}")
    assert evals == want_evals


@pytest.mark.parametrize("workers,fault,what", IN_STEP, ids=["3-ranks", "4-ranks"])
def test_a_fault_in_a_step_is_recovered_inside_it_and_ends_bit_identical(tmp_path, baseline, workers, fault, what):
    """After the first recovery (a rewind whose replays the audit found identical) no survivor runs the script again:
    each one that stayed in its step says so in its `restored` event, and the weights, buffers, optimizer and
    scheduler are those of the run without a fault."""
    want_states, want_evals, fault_free = baseline(workers)
    states, evals, took, proc = run(tmp_path, workers, fault=fault, spares=2)
    log = events(tmp_path)
    assert len([e for e in log if e["event"] == "fault_injected"]) == len(fault.split(",")), what
    rewinds = [e for e in log if e["event"] == "rewind"]
    first = [e for e in rewinds if e["generation"] == 1]
    assert len(first) == workers - 1, (what, rewinds)
    # after that, each survivor of a fault stays in its step, unless its heartbeat told it of the fault only after
    # it had taken its next batch (a race with the step: seen once in a loaded suite run); then it runs the script
    # again, and nobody else does
    late = [e for e in rewinds if e["generation"] > 1]
    stayed = [e for e in log if e["event"] == "restored" and e.get("in_step")]
    later_kills = fault.count("kill") - 1
    want = later_kills * (workers - 1) + (workers if "collective" in fault else 0)
    assert len(stayed) + len(late) == want and len(late) <= later_kills, (what, stayed, late)
    for r in range(workers):
        assert_identical(states[r], want_states[r], f"rank {r}")
    assert evals == want_evals
    assert took < 2 * fault_free + 20, f"{what}: {why_slow(tmp_path, took, fault_free)}"


def test_a_collective_the_script_calls_only_on_resume_sends_every_rank_through_the_script(tmp_path, baseline):
    """A script whose epochs after the first begin with a barrier. After a first recovery (audited), the survivors of a
    kill in epoch 1 wait in their step (their own run never called the barrier before a step), but the replacement,
    resumed in epoch 1, calls it first. It asks the generation whether a rank waits in its step, rewinds, and every
    rank runs the script again: the barrier pairs, nothing hangs, and the result is still the uninterrupted run's."""
    want_states, want_evals, fault_free = baseline(3)
    head = "    train_loader.sampler.set_epoch(epoch)\n"
    assert head in PORT.read_text()
    script = tmp_path / "trainer_epoch_barrier.py"
    shutil.copy(PORT.parent / "digits_data.py", tmp_path)  # what the script imports from its folder
    script.write_text(PORT.read_text().replace(head, "    if epoch > 0:\n        dist.barrier()\n" + head))
    states, evals, took, proc = run(tmp_path / "faulty", 3, fault="1:4:kill-exchange,2:16:kill-exchange", spares=2,
                                    script=script)
    assert "calls torch.distributed.barrier before its first step's gradient exchange" in proc.stderr
    rewinds = [e for e in events(tmp_path / "faulty") if e["event"] == "rewind"]
    assert {e["generation"] for e in rewinds} > {1}, "nobody ran the script again at the second fault"
    for r in range(3):
        assert_identical(states[r], want_states[r], f"rank {r}")
    assert evals == want_evals
    assert took < 2 * fault_free + 20, why_slow(tmp_path / "faulty", took, fault_free)


# once the job recovers inside its steps: faults elsewhere still rewind, and a fault during such a recovery too
ARMED = [
    ("1:4:kill-exchange,0:15:kill", "2:all_reduce:1", 2,
     "after a first recovery (audited), kill -9 of rank 2 at epoch 0's eval all_reduce (everyone rewinds: outside a "
     "step), then of rank 0 right after step 15 commits (the survivors stay)"),
    ("2:4:kill-exchange,1:6:kill-exchange", "0:send:3", None,
     "4 ranks: after a first recovery in which rank 0 served the replacement, kill -9 of rank 1 in its exchange, and "
     "of rank 0 while it serves rank 1's replacement from inside its step: a second fault before the first recovery "
     "finished (4 ranks: a holder is left even if a survivor blocked in a cut generation is killed by its watchdog)"),
]


@pytest.mark.parametrize("fault,at_collective,stayed,what", ARMED, ids=["eval-then-step", "during-the-recovery"])
def test_faults_around_a_recovery_inside_the_step_end_bit_identical(tmp_path, baseline, fault, at_collective, stayed,
                                                                   what):
    """`stayed`: the `restored` events of ranks that stayed in their step (None: whichever the timing gives)."""
    workers = 4 if what.startswith("4 ranks") else 3
    want_states, want_evals, fault_free = baseline(workers)
    states, evals, took, proc = run(tmp_path, workers, fault=fault, at_collective=at_collective, spares=2)
    log = events(tmp_path)
    assert len([e for e in log if e["event"] == "fault_injected"]) == 3, what
    if stayed is not None:  # or one ran the script again: it heard of the fault after its next batch (as above)
        kept = [e for e in log if e["event"] == "restored" and e.get("in_step")]
        assert kept, what
        late = [e for e in log if e["event"] == "rewind" and e["generation"] == kept[0]["generation"]]
        assert len(kept) + len(late) == stayed, (what, kept, late)
    assert [e for e in log if e["event"] == "rewind" and e["generation"] > 1], f"{what}: nobody rewound after the first"
    for r in range(workers):
        assert_identical(states[r], want_states[r], f"rank {r}")
    assert evals == want_evals
    assert took < 2 * fault_free + 20, f"{what}: {why_slow(tmp_path, took, fault_free)}"
