"""Modules that change during training and that trainguard does not hold are named at the run's start.

The job's state is the held model (its parameters and buffers), the optimizer, the schedulers and what is registered
or found (AveragedModel, GradScaler). A module outside it that training moves comes back after a fault as the script
builds it: a DINO teacher updated from the student by EMA, a loss with a running center (DINOLoss's `center`, all
reduced in its forward), an EMA class of the script's own, a metric. The run then goes on from other values, exit 0,
and the replay audit does not see it (the student's replayed forward is the same). So rank 0 takes a sampled digest
of every such module at this run's 2nd commit and again at its 4th, once a process, and names those that changed,
with the fix (`register_state`). A module is held when all its tensors' storages are the held state's (a wrapper, a
registered EMA's shadow module); one inside another unheld module is named through it.

Cost: two walks of the garbage collector's objects (about 50 ms with transformers loaded) and a digest of the unheld
modules, on rank 0, in the first steps. Any failure here is logged and ignored: it must never stop training.
"""

from __future__ import annotations

import gc
import logging
import sys

import torch
from torch import nn

from .audit import tensors
from .callbacks import Callback
from .probe import digest

log = logging.getLogger("trainguard.session")

FIRST, THEN = 2, 4  # this run's commits at which the digests are taken, then compared
_checked = False  # once a process: a run of the script after a fault builds its modules again


def _storage(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its local shard
    return t.untyped_storage().data_ptr()


def _all_tensors(state) -> list:
    return tensors(state, [], limit=None, deepest=None)


def unheld_modules(model, extras: dict) -> list[nn.Module]:
    """The outermost modules with tensors of their own that none of the held state shares (all of them: gc)."""
    held = {_storage(t) for t in _all_tensors(model.state_dict())}
    skip = {id(m) for m in model.modules()}  # the held model's modules: nothing to walk there
    for obj in extras.values():
        held.update(_storage(t) for t in _all_tensors(obj.state_dict()))
        if isinstance(obj, nn.Module):
            skip.update(id(m) for m in obj.modules())
    found = []
    for obj in gc.get_objects():  # type(): isinstance would ask each object's __class__, which some warn on
        if issubclass(type(obj), nn.Module) and id(obj) not in skip:
            own = [*obj.parameters(), *obj.buffers()]
            if own and not all(_storage(t) in held for t in own):
                found.append(obj)
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


def name_of(module: nn.Module) -> str:
    """A name the script gave it: a variable of the script's, or an attribute of an object of its; else its class."""
    main = getattr(sys.modules.get("__main__"), "__dict__", {})
    for key, value in main.items():
        if value is module and not key.startswith("_"):
            return repr(key)
    for ref in gc.get_referrers(module):
        if isinstance(ref, dict):
            for key, value in ref.items():
                if value is module and isinstance(key, str) and not key.startswith("_"):
                    return repr(key)
    return f"a {type(module).__name__}"


class UnheldWatch(Callback):
    """On rank 0: the digests at this run's FIRST and THEN commits, compared (see the module docstring)."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.first: dict[int, tuple[nn.Module, str]] = {}

    def on_step_end(self, session) -> None:
        global _checked
        if _checked or session.rt.rank != 0:
            return
        if self.start is None:
            self.start = session.step - 1
        ran = session.step - self.start
        try:
            if ran == FIRST:
                modules = unheld_modules(session.state.model, session.state.extra)
                self.first = {id(m): (m, digest(m.state_dict(), sampled=True)) for m in modules}
            elif ran == THEN:
                _checked = True
                moved = [m for m, seen in self.first.values() if digest(m.state_dict(), sampled=True) != seen]
                self.first = {}
                if moved:
                    say(session, [f"{name_of(m)} ({type(m).__name__})" for m in moved], self.start)
        except Exception as exc:  # noqa: BLE001 - a check, never a reason to stop training
            _checked, self.first = True, {}
            log.debug("the check of unheld modules failed: %r", exc)


def say(session, names: list[str], start: int) -> None:
    rt = session.rt
    rt.events.emit("unheld_state", rank=rt.rank, step=session.step, modules=names[:16])
    print(f"trainguard: the module(s) {', '.join(names)} changed between steps {start + FIRST} and {start + THEN} and "
          "trainguard does not hold them: after a fault they come back as the script builds them, and the run is no "
          "longer the one without a fault (a teacher updated by EMA, a loss with a running center, an EMA class of "
          "your own, a metric). Give each to trainguard.register_state(name, module) (a module has state_dict()), or "
          "make it part of the model", file=sys.stderr, flush=True)
