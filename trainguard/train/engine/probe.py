"""What `trainguard verify` (launch/verify.py) reads from each run of a script: set by TG_VERIFY_DIR and
TG_VERIFY_STEPS, installed with the test hooks (faults.env_callbacks).

At every commit the probe takes a digest (sha256 of every tensor's bytes and every other value) of the state a
restore fills (model, optimizer, scheduler, registered objects): the first step whose digest differs between two
runs is where they parted. At commit N it writes DIR/rank_R.state (pickle-free, checkpoint/blob.py: the state,
the digests, and the facts verify plans its faults with: the step that ended the first epoch, the first collective
this rank made outside a step) and the rank leaves the script with exit 0, as every rank does at the same commit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from ...checkpoint.blob import pack
from ...checkpoint.codec import WALLCLOCK
from .audit import mark
from .callbacks import Callback

VERIFY_DIR_ENV, VERIFY_STEPS_ENV = "TG_VERIFY_DIR", "TG_VERIFY_STEPS"

_digests: dict[int, str] = {}  # committed step -> digest, in this process (a rewind keeps them)
_facts: dict = {"epoch_end": None, "outside": None}
_in_step = [False]
_installed = [False]
_first_epoch: list[int | None] = [None]  # the epoch of the run's first step: 0, or 1 for a loop numbered from 1


def digest(obj, sampled: bool = False) -> str:
    """sha256 over every tensor's dtype, shape and bytes and every other value of `obj` (nested dicts, lists), in a
    fixed order: the same state gives the same digest on any rank (also testing.consistency's replica check).
    `sampled`: a tensor's bytes are the replay audit's ~1,024 sampled elements (a large EMA costs microseconds)."""
    h = hashlib.sha256()

    def walk(x) -> None:
        if isinstance(x, torch.Tensor) and sampled:
            m = mark(x)
            data = m.sample if isinstance(m.sample, bytes) else m.sample.cpu().reshape(-1).view(torch.uint8).numpy()
            h.update(f"{m.dtype}{list(m.shape)}".encode() + bytes(data))
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"{t.dtype}{list(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, np.ndarray):  # a generator's state (NumPy's), whose repr elides the middle of long arrays
            h.update(f"{x.dtype}{list(x.shape)}".encode() + np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                if k == WALLCLOCK:  # what a clock measured: no two runs share it, and verify does not compare it
                    continue
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def in_run_dir(obj, root: str):
    """`obj` with every string (and dict key) under `root` written `<run>/...`: each verify run has its own working
    directory, and a path the script keeps in its state (ModelCheckpoint's best models) names it (pure)."""
    if isinstance(obj, str):
        return "<run>" + obj[len(root):] if obj == root or obj.startswith(root + os.sep) else obj
    if isinstance(obj, dict):
        return {in_run_dir(k, root): in_run_dir(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [in_run_dir(v, root) for v in obj]
    if isinstance(obj, tuple):
        return tuple(in_run_dir(v, root) for v in obj)
    return obj


class VerifyProbe(Callback):
    def __init__(self, out: Path, steps: int):
        self.out, self.steps = out, steps
        if not _installed[0]:  # once per process, counted as faults.py counts TG_FAULT_COLLECTIVE's calls
            _installed[0] = True
            from ...worker import collectives
            from ...worker import runtime as rt_mod

            counts: dict[str, int] = {}

            def observe(name: str) -> None:
                rt = rt_mod.active()
                if rt is None or rt.incarnation != 1:
                    return
                counts[name] = counts.get(name, 0) + 1
                if _facts["outside"] is None and _digests and not _in_step[0]:
                    _facts["outside"] = [name, counts[name], max(_digests)]

            collectives.observers.append(observe)

    def on_step_begin(self, session, step) -> None:
        _in_step[0] = True

    def on_step_end(self, session) -> None:
        _in_step[0] = False
        state = in_run_dir(session.state.capture_shared(), os.getcwd())
        if _first_epoch[0] is None:
            _first_epoch[0] = session.epoch
        if session.epoch > _first_epoch[0] and _facts["epoch_end"] is None:
            _facts["epoch_end"] = max((s for s in _digests if s < session.step), default=None)  # the epoch's last
        _digests[session.step] = digest(state)
        if session.step < self.steps:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"rank_{session.rt.rank}.state"
        Path(str(path) + ".tmp").write_bytes(pack({"step": session.step, "state": state, "digests": dict(_digests),
                                                   "facts": dict(_facts)}))  # pickle-free; copies the tensors
        os.replace(str(path) + ".tmp", path)
        raise SystemExit(0)


def probe_from_env(env) -> list[Callback]:
    out, steps = env.get(VERIFY_DIR_ENV, ""), env.get(VERIFY_STEPS_ENV, "")
    if not out or not steps:
        return []
    return [VerifyProbe(Path(out), int(steps))]
