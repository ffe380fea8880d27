"""Every collective of the job comes out typed: torch.distributed's functions, wrapped once at init().

gloo reports a lost peer as a plain `RuntimeError` ("Connection closed by peer"), the same type as
a shape mismatch or a DataLoader timeout, so a failure outside trainguard's own exchange could only
be told apart by its text. `install()` wraps the collective functions of `torch.distributed` (the
names users and libraries call: `dist.all_reduce`, `dist.barrier`, `dist.broadcast_object_list`,
...) so that an error raised inside one becomes `CollectiveFailed`, with torch's error as its
cause, and the generation it happened in is marked failed. From then on every collective of that
generation fails at once instead of waiting on peers that left (the heartbeat thread also cuts the
group's connections the moment the scheduler moves on, so one already in flight ends within
milliseconds, not at gloo's timeout). A new generation starts clean.

What this changes for the script: a collective that fails raises `CollectiveFailed` (a
`TrainguardError`) instead of `RuntimeError`. Under `trainguard run` that exception sends the
script back to its committed step (train/engine/rewind.py). An asynchronous call (`async_op=True`, as FSDP2
makes its all-gathers and reduce-scatters) returns a `TypedWork`, a torch `Work` whose `wait()`
raises the same way. DTensor's functional collectives (tensor parallelism) bypass those functions:
their launch and their `wait_tensor` in `torch.distributed._functional_collectives` are wrapped too.

The functions are replaced on the `torch.distributed` module (and `distributed_c10d`, where torch's
own helpers find them), so a name imported before `trainguard.init()` (`from torch.distributed
import all_reduce`) keeps the unwrapped function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..errors import CollectiveFailed
from .ledger import ledger
from .sever import open_sockets

NAMES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "all_gather_object",
         "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
         "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
         "monitored_barrier", "all_gather_single", "reduce_scatter_single",
         "isend", "irecv", "batch_isend_irecv")  # the last three: a pipeline's point-to-point traffic, waited on later
ASYNCHRONOUS = frozenset({"isend", "irecv", "batch_isend_irecv"})  # they return handles whatever their arguments
# DTensor's functional collectives: launched by these, waited for by wait_tensor (module globals, found at call time)
FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
              "wait_tensor", "all_reduce_coalesced", "all_gather_tensor_coalesced", "reduce_scatter_tensor_coalesced")

_lock = threading.Lock()
_installed = False


class Failures:
    """The generation whose collectives failed, and the first error seen in it."""

    def __init__(self) -> None:
        self.generation = -1
        self.first: CollectiveFailed | None = None

    def record(self, generation: int, exc: CollectiveFailed) -> None:
        """Keeps the error's words only: its traceback's frames would keep the whole run of the script alive."""
        if self.generation != generation:
            self.generation, self.first = generation, CollectiveFailed(str(exc))

    def failed(self, generation: int) -> CollectiveFailed | None:
        return self.first if self.generation == generation else None


failures = Failures()
observers: list = []  # callables (name) run before each call but an async_op one: fault injection (train/engine/faults.py)
gate = None  # callable (name) run before each of the script's own collectives, not trainguard's (worker/prologue.py)
before_destroy = None  # weakref to a callable run before the script destroys a process group (the guard's last save)
_own = threading.local()  # depth of trainguard's own collectives in this thread (`internal`)


@contextlib.contextmanager
def internal():
    """Collectives called inside are trainguard's own (its exchange, a state transfer): the gate does not see them."""
    _own.depth = getattr(_own, "depth", 0) + 1
    try:
        yield
    finally:
        _own.depth -= 1
_generation = lambda: -1  # noqa: E731  the current generation (set by install)
_on_group = lambda before, group: None  # noqa: E731  a process group was made (set by install)


def _typed(name: str, gen: int, point, call, *args, **kwargs):
    """`call(*args, **kwargs)` with a RuntimeError as `CollectiveFailed`, and a broken generation failing at once;
    the ledger learns that `point` (worker/ledger.py) is done or failed."""
    first = failures.failed(gen)
    if first is not None:  # the generation is broken: no waiting on peers that left
        ledger.fail(point)
        raise CollectiveFailed(f"{name}: generation {gen} already failed ({first})") from first
    try:
        out = call(*args, **kwargs)
    except CollectiveFailed:
        ledger.fail(point)
        raise
    except RuntimeError as exc:  # gloo and NCCL report a lost peer as a RuntimeError (DistError is one)
        ledger.fail(point)
        failed = CollectiveFailed(f"{name} failed in generation {gen}: {str(exc)[:300]}")
        failures.record(gen, failed)
        raise failed from exc
    ledger.done(point)
    return out


class TypedWork(dist.Work):
    """An asynchronous collective's handle whose `wait()` fails as `CollectiveFailed` (see the module docstring).
    It is a torch `Work`, so code that checks `isinstance(work, dist.Work)` (FSDP2) still waits on it."""

    def __init__(self, work: dist.Work, name: str, generation: int, point=None):
        super().__init__()
        self.work, self.name, self.generation, self.point = work, name, generation, point

    def wait(self, timeout=None) -> bool:
        args = () if timeout is None else (timeout,)
        ledger.wait(self.point)
        return _typed(self.name, self.generation, self.point, self.work.wait, *args)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def is_success(self) -> bool:
        return self.work.is_success()

    def exception(self):
        return self.work.exception()

    def source_rank(self) -> int:
        return self.work.source_rank()

    def result(self):
        return self.work.result()

    def synchronize(self) -> None:
        self.work.synchronize()

    def get_future(self):
        return self.work.get_future()

    def block_current_stream(self) -> None:
        self.work.block_current_stream()


def _typed_work(out, name: str, gen: int, point):
    """An asynchronous call's handle, typed (anything else as it came)."""
    if isinstance(out, dist.Work) and not isinstance(out, TypedWork):
        return TypedWork(out, name, gen, point)
    return out


def _group_index(fn) -> int:
    """The position of `fn`'s `group` parameter (-1: none)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return -1
    return names.index("group") if "group" in names else -1


def _wrap(name: str, fn):
    at = _group_index(fn)

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        asynchronous = kwargs.get("async_op") or name in ASYNCHRONOUS
        own = getattr(_own, "depth", 0)
        if observers and not kwargs.get("async_op") and not (own and name in ASYNCHRONOUS):  # a pipeline's isend
            for observe in observers:  # and irecv count, trainguard's own (the buddy copies) do not
                observe(name)
        if gate is not None and not own:
            gate(name)
        gen = _generation()
        point = ledger.enter(name, kwargs.get("group", args[at] if 0 <= at < len(args) else None), args, kwargs)
        if not asynchronous:
            ledger.wait(point)
        out = _typed(name, gen, point, fn, *args, **kwargs)
        if isinstance(out, list) and name in ASYNCHRONOUS:  # batch_isend_irecv: one handle per operation
            return [_typed_work(w, name, gen, point) for w in out]
        return _typed_work(out, name, gen, point)

    collective.__trainguard_wrapped__ = fn
    return collective


def _wrap_functional(name: str, fn):
    @functools.wraps(fn)
    def functional(*args, **kwargs):
        return _typed(f"functional {name}", _generation(), None, fn, *args, **kwargs)

    functional.__trainguard_wrapped__ = fn
    return functional


def _wrap_group_maker(fn):
    """torch's one maker of process groups after the default one (`new_group`, `new_subgroups`, a DeviceMesh's
    dimensions all come through it): `_on_group(sockets before, group)` learns of each, so that its gloo
    connections are cut with the generation's (worker/sever.py), wherever the script or a library made it."""
    @functools.wraps(fn)
    def maker(*args, **kwargs):
        _generation()  # in the current generation (a script run again after a rewind may not have called init)
        before = open_sockets()
        group = fn(*args, **kwargs)
        _on_group(before, group)
        return group

    maker.__trainguard_wrapped__ = fn
    return maker


def _wrap_destroy(fn):
    """The script's `destroy_process_group()` (of the default group), its last line in many scripts, comes after its
    last step: what the guard still has to do with the group (the last step's checkpoint, due since its commit) is
    done first.
    trainguard's own teardown (`internal()`) passes straight through."""
    @functools.wraps(fn)
    def destroy(*args, **kwargs):
        default = (args[0] if args else kwargs.get("group")) is None  # the job's group, not one of the script's own
        hook = before_destroy() if default and before_destroy is not None and not getattr(_own, "depth", 0) else None
        if hook is not None:
            hook()
        return fn(*args, **kwargs)

    destroy.__trainguard_wrapped__ = fn
    return destroy


def install(generation, on_group=lambda before, group: None) -> None:
    """Wrap the collectives once per process; `generation()` names the current generation, `on_group(sockets
    before, group)` is told of every process group made after the default one."""
    global _installed, _generation, _on_group
    with _lock:
        _generation, _on_group = generation, on_group
        if _installed:
            return
        maker = getattr(c10d, "_new_group_with_tag", None)  # private, so looked up: without it, only the
        if maker is not None and not hasattr(maker, "__trainguard_wrapped__"):  # groups trainguard makes are cut
            c10d._new_group_with_tag = _wrap_group_maker(maker)
        destroy = c10d.destroy_process_group
        if not hasattr(destroy, "__trainguard_wrapped__"):
            c10d.destroy_process_group = dist.destroy_process_group = _wrap_destroy(destroy)
        for name in NAMES:
            fn = getattr(c10d, name, None)
            if fn is None or hasattr(fn, "__trainguard_wrapped__"):
                continue
            wrapped = _wrap(name, fn)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is fn:
                setattr(dist, name, wrapped)
        try:
            from torch.distributed import _functional_collectives as funcol
        except ImportError:  # a torch without DTensor
            funcol = None
        for name in FUNCTIONAL if funcol is not None else ():
            fn = getattr(funcol, name, None)
            if fn is not None and not hasattr(fn, "__trainguard_wrapped__"):
                setattr(funcol, name, _wrap_functional(name, fn))
        _installed = True
