"""Training state the script did not hand to trainguard: found, so that it is restored all the same.

A ported trainer gives `trainguard.Optimizer` one LR scheduler, yet it may step a second one (a warm-up per
step and a `ReduceLROnPlateau` per epoch), keep a `GradScaler`, or average its weights in an
`AveragedModel` (EMA, SWA). Each of them changes with the steps. Left out of the committed state, it would
come back after a recovery as the script builds it, and the job would end with other weights than a run
without a fault, silently.

So when training starts, trainguard looks among the script's live objects (`gc.get_objects`: the objects
made since the zygote's or the spare's `gc.freeze`, a few thousand; in a process that froze nothing, torch's
too, a search of about 0.1 s; after a rewind, a collection first) for:
- LR schedulers (torch's `LRScheduler`, `ReduceLROnPlateau` included) bound to the wrapped optimizer;
- `torch.amp.GradScaler`s (and the older `torch.cuda.amp` one, a subclass);
- `torch.optim.swa_utils.AveragedModel`s;

and adds each one that is neither given nor registered, nor part of one that is (a scheduler inside a
`SequentialLR` or `ChainedScheduler`; an `AveragedModel` inside a registered module), to the registered
objects, named by its kind and class (`naming` below; a pure function). Two found objects of the same
class cannot be told apart from one run of the script to the next, so they are a `ConfigError` that asks
for `register_state` names. The search runs in every run of the script (a rewind, a replacement), so
every rank finds the same names.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.optim.swa_utils import AveragedModel

from ...errors import ConfigError

try:
    from torch.amp import GradScaler
except ImportError:  # torch < 2.3: only the CUDA one
    from torch.cuda.amp import GradScaler  # type: ignore[assignment,no-redef]

log = logging.getLogger("trainguard.guard")

KINDS = (("lr_scheduler", (LRScheduler, ReduceLROnPlateau)), ("grad_scaler", (GradScaler,)),
         ("averaged_model", (AveragedModel,)))
ANY = tuple(t for _, types in KINDS for t in types)


def naming(found: Iterable[tuple[str, str]]) -> list[str]:
    """The registered name of each found object, given (kind, class name) in any order: "kind:Class"
    (pure). Two of one class: a ConfigError that names the fix."""
    found = list(found)
    names = [f"{kind}:{cls}" for kind, cls in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"the script has more than one {', '.join(twice)} that it did not give trainguard, and "
                          "trainguard cannot tell them apart from one run of the script to the next: register each "
                          "before training starts, e.g. trainguard.register_state('warmup', warmup_scheduler)")
    return names


def _children(obj) -> list:
    """What a composite scheduler or a module holds of the kinds searched for (restored with it)."""
    if issubclass(type(obj), LRScheduler):
        return list(vars(obj).get("_schedulers", ()))  # SequentialLR's and ChainedScheduler's own
    if issubclass(type(obj), nn.Module):
        return [m for m in obj.modules() if m is not obj]
    return []


def bound_to(candidate, optimizer: torch.optim.Optimizer) -> bool:
    """`candidate` is `optimizer`, or wraps it (a scheduler a framework made on its own wrapper, as the transformers
    Trainer does on Accelerate's `AcceleratedOptimizer` around trainguard's `Optimizer`)."""
    for _ in range(4):
        if candidate is optimizer:
            return True
        candidate = vars(candidate).get("optimizer") if hasattr(candidate, "__dict__") else None
    return False


def _kind(obj, optimizer: torch.optim.Optimizer) -> str | None:
    for kind, types in KINDS:
        if issubclass(type(obj), types):
            if kind == "lr_scheduler" and not bound_to(getattr(obj, "optimizer", None), optimizer):
                return None  # another optimizer's (or a previous run of the script's)
            if kind == "grad_scaler" and not obj.is_enabled():
                return None  # a disabled scaler keeps no state
            return kind
    return None


def unregistered(optimizer: torch.optim.Optimizer, given: Iterable[object], *, rewound: bool) -> dict[str, object]:
    """{name: object} of the state objects the script made and did not give (see the module docstring).
    `given`: the objects trainguard has (the model, the scheduler given, the registered ones). `rewound`: the
    script runs again in this process, and its earlier run's objects, garbage now, are collected first."""
    if rewound:
        gc.collect()
    given = [o for o in given if o is not None]
    known = {id(o) for o in given} | {id(c) for o in given for c in _children(o)}
    of_a_kind: dict[type, bool] = {}  # by type: a process holds a few hundred thousand objects of few types
    found = []
    for obj in gc.get_objects():
        cls = type(obj)  # not isinstance: some objects' __class__ warns (torch's reduce_op)
        hit = of_a_kind.get(cls)
        if hit is None:
            hit = of_a_kind[cls] = issubclass(cls, ANY)
        if hit and id(obj) not in known and (kind := _kind(obj, optimizer)) is not None:
            found.append((kind, obj))
    inside = {id(c) for _, obj in found for c in _children(obj)}
    found = [(kind, obj) for kind, obj in found if id(obj) not in inside]
    names = naming((kind, type(obj).__qualname__) for kind, obj in found)
    for name in names:
        log.info("restoring %s with the rest of the state (the script did not give it to trainguard)", name)
    return dict(zip(names, (obj for _, obj in found)))


def resumed_schedulers(objects: Iterable[object]) -> None:
    """The job's optimizer has stepped before this run of the script: each LR scheduler among `objects` (and inside
    them) is told so, as the schedulers of the run before the fault were. torch warns "Detected call of
    `lr_scheduler.step()` before `optimizer.step()`" at a scheduler's first `step()` if its optimizer has not stepped
    since the scheduler was made, which is the case of a job that resumes at an epoch's end, where a per-epoch
    scheduler steps before the next epoch's first update. The mark (torch's own `_opt_called`, set by the wrapper a
    scheduler puts on `optimizer.step`) is in no state_dict."""
    for obj in objects:
        for scheduler in (obj, *_children(obj)):
            if issubclass(type(scheduler), LRScheduler) and getattr(scheduler, "optimizer", None) is not None:
                scheduler.optimizer._opt_called = True
