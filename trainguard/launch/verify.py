"""`trainguard verify [--steps N] [--faults LIST] [--keep DIR] [run flags] SCRIPT [ARGS]`: a pre-flight check of
the user's own script. It runs the script under `trainguard run` for N committed steps, once without a fault and
once per fault, and compares every tensor of every rank's state at step N with the run without a fault.

The faults (rank 1, or 0 alone; steps about the middle of the N):
    mid-step      kill -9 after the step's first training forward (the middle of a step)
    after-commit  kill -9 right after a commit
    outside       kill -9 at the first collective it made outside a step in the clean run (an eval all_reduce,
                  a barrier), if it made one
    epoch-end     kill -9 right after the first epoch's last step, if the N steps reach one
    scheduler     kill -9 of the scheduler right after a commit (the launcher restarts it, the job goes on)
    sigterm       SIGTERM (a graceful stop and its dying gasp), then the same command again
    at:OP:N       kill -9 just before the rank's N-th call of torch.distributed.OP in its first run (at:all_reduce:20:
                  a metric's all_reduce inside a validation), where no named fault lands

Each run has its own working directory (the script's own relative files, such as its snapshot, do not leak from
one run into the next); an argument that names an existing path is made absolute. The probe that takes the
state is train/engine/probe.py. Exit 0 when every row is identical and the replay audit said nothing, 1 otherwise
(a row with the same tensors whose audit speaks is "same state, audit differs": the run lost what the state does
not hold, an eval line or a save), 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..exitcodes import EXIT_PREEMPTED

FAULTS = ("mid-step", "after-commit", "outside", "epoch-end", "scheduler", "sigterm")
OWN = {"--steps", "--faults", "--keep", "--timeout", "--recovery-path"}  # not passed on to each run


@dataclass
class Case:
    name: str
    moment: str
    env: dict
    rerun: bool = False  # sigterm: the same command again, in the same directory
    before: int = 0  # the last step committed before the fault (a difference there is no fault's)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=40, help="committed steps a run (default 40)")
    parser.add_argument("--faults", type=faults_list, default=list(FAULTS),
                        help=f"which faults, comma-separated (default all: {','.join(FAULTS)})")
    parser.add_argument("--keep", type=Path, help="keep every run's directory here (default: a temporary one, "
                                                  "removed when every run is identical)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take (default 600)")


AT = re.compile(r"at:([a-z_]+):([1-9][0-9]*)")  # kill -9 at that rank's n-th call of torch.distributed.<op>


def faults_list(text: str) -> list[str]:
    names = [f for f in text.split(",") if f]
    bad = [f for f in names if f not in FAULTS and not AT.fullmatch(f)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {bad} (known: {', '.join(FAULTS)}, and at:OP:N, e.g. "
                                         "at:all_reduce:20)")
    return names


def case_name(fault: str) -> str:
    """A fault's run directory and row key (pure)."""
    found = AT.fullmatch(fault)
    return f"at-{found.group(1)}-{found.group(2)}" if found else fault


def run_flags(argv: list[str], script_args: list[str]) -> list[str]:
    """The flags given before the script, less verify's own and --recovery-path (each run has its own): the
    script is the first argument after them, and everything after it is its arguments."""
    given = argv[1:len(argv) - 1 - len(script_args)]  # argv[0] is "verify"
    out, skip = [], False
    for i, item in enumerate(given):
        flag, _, inline = item.partition("=")
        if skip:
            skip = False
        elif flag in OWN:
            skip = not inline
        else:
            out.append(item)
    return out


def plan(facts: dict, steps: int, rank: int, wanted: list[str]) -> list[Case]:
    """The fault runs, from what the clean run saw (pure)."""
    k = max(2, steps // 2)
    cases = []
    for name in wanted:
        if name == "mid-step":
            cases.append(Case(name, f"at step {k}, after its first training forward",
                              {"TG_FAULT": f"{rank}:{k}:kill-forward"}, before=k - 1))
        elif name == "after-commit":
            cases.append(Case(name, f"right after step {k}", {"TG_FAULT": f"{rank}:{k}:kill"}, before=k))
        elif name == "outside" and facts.get("outside"):
            op, n, after = facts["outside"]
            cases.append(Case(name, f"{op} #{n}, after step {after}", {"TG_FAULT_COLLECTIVE": f"{rank}:{op}:{n}"},
                              before=after))
        elif name == "epoch-end" and facts.get("epoch_end") and facts["epoch_end"] < steps:
            e = facts["epoch_end"]
            cases.append(Case(name, f"right after step {e}, the first epoch's last", {"TG_FAULT": f"{rank}:{e}:kill"},
                              before=e))
        elif name == "scheduler":
            cases.append(Case(name, f"right after step {k}", {"TG_FAULT": f"{rank}:{k}:sched"}, before=k))
        elif AT.fullmatch(name):
            op, n = AT.fullmatch(name).groups()
            cases.append(Case(case_name(name), f"{op} #{n}", {"TG_FAULT_COLLECTIVE": f"{rank}:{op}:{n}"}))
        elif name == "sigterm":
            cases.append(Case(name, f"after step {k} (stops at the next commit), then the same command again",
                              {"TG_FAULT": f"{rank}:{k}:term"},
                              rerun=True, before=k))
    return cases


def first_difference(a, b, path: str = "") -> str | None:
    """The path of the first value that differs between two loaded states (tensors bit for bit), or None."""
    import numpy as np
    import torch

    from ..checkpoint.codec import WALLCLOCK

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return path or "."
        same = torch.equal(*(t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))) if a.numel() else True
        return None if same else path
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # a generator's state (NumPy's)
        same = isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        return None if same else (path or ".")
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k == WALLCLOCK:
                continue  # what a clock measured (a framework's runtimes), kept with the state but never the same
            if k not in a or k not in b:
                return f"{path}.{k}"
            found = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if a == b else (path or ".")


def compare(clean: Path, other: Path) -> tuple[str, int | None]:
    """"identical", or where the run in `other` first differs from the clean run; and that step."""
    from ..checkpoint.blob import unpack  # pickle-free (train/engine/probe.py writes it)

    ranks = sorted(p.name for p in clean.glob("rank_*.state"))
    missing = [r for r in ranks if not (other / r).exists()]
    if not ranks or missing:
        return f"no state at the last step from {', '.join(missing) or 'any rank'}", None
    worst: tuple[int, str] | None = None
    for name in ranks:
        a, b = (unpack((d / name).read_bytes(), str(d / name)) for d in (clean, other))
        where = differences(a["state"], b["state"])
        if where is None:
            continue
        common = sorted(set(a["digests"]) & set(b["digests"]))
        step = next((s for s in common if a["digests"][s] != b["digests"][s]), None)
        rank = name[len("rank_"):-len(".state")]
        found = (step if step is not None else a["step"], f"rank {rank}: {where}", a["step"])
        worst = found if worst is None or found < worst else worst
    if worst is None:
        return "identical", None
    return f"differs from step {worst[0]} (at step {worst[2]}, first in each part: {worst[1]})", worst[0]


def differences(a: dict, b: dict) -> str | None:
    """The first differing path of each part of two states (model, optimizer, scheduler, each extra), joined: a lost
    update shows in the model and the optimizer, not only in the first part in sorted order."""
    from ..checkpoint.codec import WALLCLOCK

    found = []
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if k == "extra" and isinstance(x, dict) and isinstance(y, dict):  # each registered object is a part
            found.append(differences({f"extra.{n}": v for n, v in x.items()}, {f"extra.{n}": v for n, v in y.items()}))
        elif k != WALLCLOCK:
            found.append(first_difference(x, y, str(k)))
    return ", ".join(f for f in found if f is not None) or None


def diagnosis(recovery: Path) -> str:
    """What the replay audit, or the desync watch, said first in that run ("" if nothing)."""
    from ..obs.events import EventLog
    from ..obs.timeline import VERDICT_EVENTS, verdict_line

    try:
        events = EventLog.read(recovery / "events.jsonl")
    except OSError:
        return ""
    said = sorted((e for e in events if e.get("event") in VERDICT_EVENTS), key=lambda e: e.get("ts", 0))
    return verdict_line(said[0]) if said else ""



def came(recovery: Path) -> bool:
    """Whether that run's fault was injected (its `fault_injected` event)."""
    from ..obs.events import EventLog

    try:
        return any(e.get("event") == "fault_injected" for e in EventLog.read(recovery / "events.jsonl"))
    except OSError:
        return False


def main(args: argparse.Namespace) -> int:
    if args.script is None or (args.nnodes or 1) > 1:
        raise ConfigError("trainguard verify runs one host's job: give the script (and no --nnodes)")
    if args.steps < 4:
        raise ConfigError(f"--steps {args.steps}: at least 4 committed steps")
    own = {"steps": args.steps, "faults": args.faults, "keep": args.keep, "timeout": args.timeout}
    flags = run_flags(args.argv, args.script_args)
    script_args = [str(Path(a).resolve()) if a and not a.startswith("-") and Path(a).exists() else a
                   for a in args.script_args]
    rank = 1 if (args.workers or 1) > 1 else 0
    root = (own["keep"] or Path(tempfile.mkdtemp(prefix="trainguard-verify-"))).resolve()  # each run has its own cwd
    root.mkdir(parents=True, exist_ok=True)

    def run(case: str, env: dict) -> tuple[int, float, str]:
        where = root / case
        where.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "trainguard", "run", *flags, "--recovery-path", str(where / "recovery"),
               str(Path(args.script).resolve()), *script_args]
        full = {**os.environ, "TG_VERIFY_DIR": str(where / "state"), "TG_VERIFY_STEPS": str(own["steps"]),
                "TG_EXACT": os.environ.get("TG_EXACT") or "warn", "TG_FAULT": "", "TG_FAULT_COLLECTIVE": "", **env}
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=where, env=full, capture_output=True, text=True, timeout=own["timeout"])
        except subprocess.TimeoutExpired:
            return -1, time.monotonic() - t0, f"still running after {own['timeout']:g} s (--timeout)"
        with open(where / "launcher.log", "a") as log:
            log.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        return proc.returncode, time.monotonic() - t0, proc.stderr.strip().splitlines()[-1:][0] if proc.stderr.strip() else ""

    print(f"trainguard verify: {args.script}, {own['steps']} committed steps a run, runs in {root}", flush=True)
    code, took, last = run("clean", {})
    clean = root / "clean" / "state"
    if code != 0 or not any(clean.glob("rank_*.state")):
        print(f"the run without a fault did not reach step {own['steps']} (exit {code}): {last}\n"
              f"its log: {root / 'clean' / 'launcher.log'}", file=sys.stderr)
        return 1
    from ..checkpoint.blob import unpack

    facts = unpack((clean / f"rank_{rank}.state").read_bytes(), "the clean run's state")["facts"]
    rows = [["none (the reference)", "-", f"{took:.1f} s", "reference", ""]]
    print(f"  {rows[0][0]}: {took:.1f} s", flush=True)
    failed = False
    cases = plan(facts, own["steps"], rank, own["faults"])
    for case in cases:
        code, took, last = run(case.name, case.env)
        if case.rerun and code == EXIT_PREEMPTED:
            code, again, last = run(case.name, {})
            took += again
        result, step = compare(clean, root / case.name / "state") if code == 0 else (f"exit {code}: {last[:160]}", None)
        if code == 0 and not came(root / case.name / "recovery"):  # a step or a call past the run's end, say
            result, step = (f"the fault never came: {case.moment} is not in the run's first {own['steps']} steps "
                            "(a larger --steps, or another N)"), None
        if step is not None and step <= case.before:
            result += (", before the fault: the script does not make the same steps twice (an unseeded generator, the "
                       "clock, a file it reads): seed it, then verify again")
        audit = diagnosis(root / case.name / "recovery")
        if result == "identical" and audit:  # the same tensors, but the run lost what they do not hold (an eval line)
            result = "same state, audit differs"
        failed |= result != "identical"
        what = {"mid-step": "kill -9 in a step", "after-commit": "kill -9 after a commit",
                "outside": "kill -9 outside a step", "epoch-end": "kill -9 at an epoch's end",
                "scheduler": "kill -9 of the scheduler", "sigterm": "SIGTERM and a rerun"}.get(case.name,
                                                                                             "kill -9 at a collective")
        rows.append([what if case.name == "scheduler" else f"{what} (rank {rank})", case.moment, f"{took:.1f} s", result,
                     audit])
        print(f"  {what}: {result}", flush=True)
    skipped = [f for f in own["faults"] if case_name(f) not in {c.name for c in cases}]
    from ..obs.report import table

    print("\n" + table(["fault", "moment", "took", "result", "audit"], rows, left=True))
    for name in skipped:
        print(f"not run: {name} ({'no collective outside a step' if name == 'outside' else 'no epoch ended'} "
              f"within {own['steps']} steps)")
    asked = any(a == "--faults" or a.startswith("--faults=") for a in args.argv[:len(args.argv) - len(args.script_args)])
    if skipped and asked:  # asked for by name: a CI line must not pass on faults never tried
        print(f"NOT verified: {', '.join(skipped)} asked for and not run; give a larger --steps (an epoch's end or a "
              "collective outside a step must come within it; code at the top of the loop body, after the batch is "
              "taken, is the step's own, so a script whose collectives are all there has none outside a step: at:OP:N "
              f"kills in it), or leave {', '.join(skipped)} out of --faults")
    if failed:
        audited = any(row[3] == "same state, audit differs" for row in rows)
        differ = [row for row in rows[1:] if row[3] != "identical" and not row[3].startswith("the fault never came")]
        print(f"NOT {'identical' if differ else 'verified'}: see the rows above; each run's log is in {root}/<fault>/launcher.log" + (
              " (\"same state, audit differs\": every tensor is the same, but the run skipped or changed what the state "
              "does not hold, such as an eval line, a logged metric or a save; the audit column says what and the fix)"
              if audited else ""))
    if failed or (skipped and asked):
        return 1
    print("every run is identical to the one without a fault")
    if own["keep"] is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0
