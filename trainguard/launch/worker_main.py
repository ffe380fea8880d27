"""Every worker the agent starts runs the user's script through here, cold or from a hot spare.

    python -u -m trainguard.launch.worker_main SCRIPT [ARGS...]

It runs SCRIPT as `python SCRIPT ARGS...` would, except that a fault (a failed collective, a peer's
death) sends the script back to its committed step: it runs again from the top in this same
process, with its state kept (train/engine/rewind.py). Otherwise: as `__main__`, with the script's folder first on
`sys.path`, the same exit codes, and a traceback of the script's own frames through `sys.excepthook`
(which `trainguard.init()` chains). One difference: an uncaught *deterministic* error, one that a
restart would only raise again, exits `EXIT_CONFIG_ERROR` (78) instead of 1, after one more line
(`DETERMINISTIC_MARK` and the error) that the agent quotes in its final message. The agent then
ends the job at once rather than restarting the worker (policy.py).

Deterministic means by type, never by message text:

- `SyntaxError` (with `IndentationError`, `TabError`): the code does not compile; raised by runpy
  before the first line runs, or by an import.
- `ImportError` (with `ModuleNotFoundError`): a missing package or name.
- `trainguard.ConfigError`: trainguard refused a setting or a use (a loader without ShardedSampler,
  a bad TG_* variable, a bad SessionConfig). Subclass it for your own configuration errors.
- Any other error that every rank of the job raises at the same step, from the same line: the ranks
  compare their errors through the scheduler (`Runtime.raised_everywhere`, at most 30 s; a rank
  that alone fails cuts its group first, so its peers regroup and end the vote at once).
- An error one rank raises alone, raised again at the same step from the same line after the job
  recovered from it and resumed there (the scheduler remembers each error's line and step): the
  first time it is taken for a fault, the second ends the job (control/decisions.py, `raised_again`).

An error wrapped in another type (`raise RuntimeError(...) from exc`) is classified by the outer type.

The process ends as the interpreter would end it, without the teardown of its modules: once the
script is over, its non-daemon threads are joined, the atexit handlers run, every open file is
flushed (those the script left open too), and `os._exit` ends it with the script's exit code. As
Python itself says, `__del__` of objects alive at the end need not run. Tearing down torch's
modules costs about 0.8 s of CPU per process, for nothing: seconds at the end of every job whose
ranks share cores, and of every test here.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.abc
import importlib.machinery
import io
import os
import runpy
import sys
import threading
import traceback
from typing import NoReturn

from .. import rewinding, signals
from ..errors import ClusterFailed, ConfigError, Rewind
from ..exitcodes import EXIT_CONFIG_ERROR, EXIT_FAULT_STOP
from ..frameworks import explain, unsupported_framework

PGINIT, PGINIT_AFTER = "trainguard.worker.pginit", "torch.distributed.distributed_c10d"
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (SyntaxError, ImportError, ConfigError)
DETERMINISTIC_MARK = f"trainguard: a deterministic error, so exit code {EXIT_CONFIG_ERROR} and no restart: "


def is_deterministic(exc: BaseException) -> bool:
    return isinstance(exc, DETERMINISTIC_ERRORS)


def describe_error(exc: BaseException, script: str = "") -> str:
    """One line: the type as Python's traceback names it, the message, and where in `script` it came
    from (for a SyntaxError, the message already says where)."""
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    text = " ".join(str(exc).split())
    line = f"{name}: {text}" if text else name
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == script] if script else []
    if frames and not isinstance(exc, SyntaxError):
        line += f" ({os.path.basename(script)}, line {frames[-1].lineno})"
    return line


def deterministic_error(tail: list[str] | tuple[str, ...]) -> str:
    """The error a worker that exited EXIT_CONFIG_ERROR named in its last stderr lines, or ""."""
    for line in reversed(tail):
        if line.startswith(DETERMINISTIC_MARK):
            return line[len(DETERMINISTIC_MARK):]
    return ""


def run_script(script: str) -> None:
    """Run `script` (an absolute path; sys.argv already set) as __main__, again from the top whenever a fault
    sends it back to its committed step (rewinding.py). An uncaught exception is printed from the script's own
    frames on, as python prints it, then ends the process: exit 1, or 78 if the error is deterministic."""
    rewinding.allow()
    arm_process_group_join()
    argv = list(sys.argv)
    while True:
        sys.argv = list(argv)  # the script may have changed it
        if not _run_once(script):
            return


def arm_process_group_join() -> None:
    """The script's own `torch.distributed.init_process_group()` joins trainguard's group (worker/pginit.py): now if
    torch.distributed is loaded (the zygote, a hot spare), else the moment the script imports it. By name: the
    launcher imports no torch, and a script that never uses torch.distributed never loads it."""
    if PGINIT_AFTER in sys.modules:
        importlib.import_module(PGINIT).install()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(PGINIT_AFTER, lambda: importlib.import_module(PGINIT).install()))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` right after the module `name` is executed, once."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader, then) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name: str):  # get_source and the rest: the real loader's (tracebacks, inspect)
        return getattr(self.loader, name)


def _run_once(script: str) -> bool:
    """One run of the script; True if it must run again."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        if rewinding.rewind(exc):
            return True
        if isinstance(exc, ClusterFailed):
            _job_ended(exc)
        if isinstance(exc, KeyboardInterrupt):  # as python would (a stop signal is trainguard's: signals.py)
            raise
        _fail(script, exc)  # a BaseException of the script's or a library's too (torch DCP's CheckpointException):
        # raised as python would, it ended the process after the worker had said it finished, and the job exited 0
    try:
        return rewinding.again_at_end()
    except ClusterFailed as exc:
        _job_ended(exc)


def _job_ended(exc: ClusterFailed) -> NoReturn:
    """The job ended elsewhere (a verdict on the script, or the launcher gave up): a consequence here, in one line."""
    print(f"trainguard: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(exc.verdict or EXIT_FAULT_STOP) from None


def _fail(script: str, exc: BaseException) -> NoReturn:
    """Print the script's error from its own frames on, then exit 1, or 78 if it is deterministic."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:  # runpy's and ours
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    sys.excepthook(type(exc), exc, tb)  # trainguard.init() chains its hook here
    line = describe_error(exc, script)
    framework = None if isinstance(exc, ConfigError) else unsupported_framework(sys.modules)  # ours names its cause
    if framework is not None:  # a framework trainguard does not run live: every restart would fail alike
        line = f"{explain(framework)} (the error: {line})"
    elif not is_deterministic(exc):
        if not (why := rewinding.raised_everywhere(signature(exc))):
            raise SystemExit(1) from None
        line += f" ({why})"
    if context := rewinding.error_context():
        line += f"; {context}"
    print(DETERMINISTIC_MARK + line, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG_ERROR) from None


def signature(exc: BaseException) -> str:
    """What the same error raised by every rank has in common: its type and the line that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__module__}.{type(exc).__qualname__} at {where}"


def run_and_exit(script: str) -> NoReturn:
    """`run_script`, then the end of the process (see the module docstring). A stop signal never kills the
    worker with its default action (signals.py): the launcher would take that for a crash."""
    signals.hold_for_process()
    try:
        run_script(script)
        code = 0
    except SystemExit as exc:
        code = exc.code
    end_process(code)


def end_process(code, *, collect: bool = True) -> NoReturn:
    """Exit as `sys.exit(code)` would after the script: status 0 for None, the int, else 1 after printing it.
    Without the interpreter's teardown, which takes over 2 s of CPU once torch and torch._dynamo are
    imported (module by module); `collect=False` for a process that ran no script (a zygote, a dismissed
    spare): nothing of a script's is left to finalise."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    try:
        wait_for_threads()
        if collect:
            gc.collect()  # what the script no longer holds goes now (open files in it are flushed and closed)
        atexit._run_exitfuncs()  # trainguard's goodbye, logging's flush, multiprocessing's clean-up, the script's
        flush_open_files()  # what the interpreter's teardown would flush: files the script left open
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
                pass
        os._exit(status)


def wait_for_threads() -> None:
    """What the interpreter's end does first (Py_FinalizeEx calls threading._shutdown): threading's exit hooks,
    which wait for work still in a daemon thread (a checkpoint's last save: train/state/checkpointing.py), then the
    script's own threads, joined. Without the hooks, os._exit cut that save half-committed."""
    shutdown = getattr(threading, "_shutdown", None)  # CPython's own; absent elsewhere
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


FILES = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def flush_open_files() -> None:
    """Flush every open buffered file of the process (the script's globals still hold some: it ended, but
    its functions, kept by atexit or a thread, keep its module's dict alive)."""
    for obj in gc.get_objects():
        if issubclass(type(obj), FILES):  # not isinstance: some objects' __class__ warns (torch's reduce_op)
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):  # a full disk or a closed pipe: the interpreter would lose it too
                pass


def script_path(script: str) -> str:
    """The script's absolute path, and its real folder first on sys.path, as `python SCRIPT` has it."""
    path = os.path.abspath(script)
    if not sys.flags.safe_path:  # `python -m` put the cwd first
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m trainguard.launch.worker_main SCRIPT [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    path = script_path(argv[0])
    sys.argv = [path, *argv[1:]]  # runpy makes argv[0] the absolute path anyway (python leaves it as given)
    run_and_exit(path)


if __name__ == "__main__":
    main()
