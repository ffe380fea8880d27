"""The agent's hot spares: warm `trainguard.launch.spare_main` processes that replace dead workers
(forked from the agent's zygote where it can be: forked.py).

Each spare has its own session and three pipes: stdin (its activation order, or EOF to dismiss
it), stdout and stderr (left unread until it becomes a worker), plus a readiness pipe on which
it writes one byte once its imports are done and which closes when it dies or is activated.
A thread per spare watches that pipe, so a spare that dies while idle is seen at once and
replaced; `MAX_IDLE_DEATHS` deaths in a row turn the pool off. If the agent itself dies, its
end of every stdin closes and the spares exit on their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping, Sequence

from ..obs.events import EventLog
from .forked import Process, start_process
from .policy import describe_exit, spare_cmd

MAX_IDLE_DEATHS = 3  # in a row, with no successful take() between them
DISMISS_WAIT_S = 0.5  # a warm spare exits on EOF at once; one still importing is terminated
KILL_WAIT_S = 2.0
REAP_WAIT_S = 5.0


@dataclass(eq=False)
class _Spare:
    popen: Process
    ready_fd: int
    started: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)


def activate(popen: Process, env: Mapping[str, str], argv: Sequence[str]) -> None:
    """Hand a taken spare its worker env and script args; OSError if it died meanwhile."""
    assert popen.stdin is not None
    try:
        popen.stdin.write((json.dumps({"env": dict(env), "argv": list(argv)}) + "\n").encode())
    finally:
        with contextlib.suppress(OSError):
            popen.stdin.close()


class SparePool:
    """Keeps `size` spares for `script` alive; `take()` hands one out and starts its successor."""

    def __init__(self, script: str, env: Mapping[str, str], size: int, *, say: Callable[[str], None],
                 max_idle_deaths: int = MAX_IDLE_DEATHS, events: EventLog | None = None, agent: int = 0,
                 start: Callable[..., Process] = partial(start_process, None)) -> None:
        self.script, self.env, self.size = os.path.abspath(script), dict(env), size
        self._start = start  # the agent's: forked from its zygote where it can be (forked.py)
        self._say, self._max_deaths = say, max_idle_deaths
        self._events, self._agent = events or EventLog.null(), agent  # `spares` events: ready count per agent
        self._lock = threading.Condition()
        self._idle: list[_Spare] = []
        self._spawning = 0
        self._busy = 0  # spawns and dismissals in flight; close() waits for them
        self._deaths = 0
        self.closed = self.disabled = False

    @property
    def ready_count(self) -> int:
        with self._lock:
            return sum(1 for s in self._idle if s.ready.is_set())

    def _report(self) -> None:
        """A `spares` event (trainguard status, metrics): how many are ready on this agent now."""
        self._events.emit("spares", agent=self._agent, ready=self.ready_count)

    @property
    def idle_pids(self) -> list[int]:
        with self._lock:
            return [s.popen.pid for s in self._idle]

    def start(self) -> None:
        for _ in range(self.size):
            self._spawn()

    def wait_ready(self, timeout: float) -> bool:
        """True once some idle spare is warm (for tests and measurements)."""
        with self._lock:
            return self._lock.wait_for(lambda: any(s.ready.is_set() for s in self._idle), timeout)

    def take(self, *, replace: bool = True) -> Process | None:
        """A live spare (warm ones first) or None; a successor starts in the background."""
        with self._lock:
            if self.closed or self.disabled:
                return None
            live = [s for s in self._idle if s.popen.poll() is None]  # a dead one is its watcher's business
            spare = max(live, key=lambda s: s.ready.is_set(), default=None)
            if spare is None:
                return None
            self._idle.remove(spare)
            self._deaths = 0
        self._report()
        if replace:
            threading.Thread(target=self._spawn, name="tg-spare-spawn", daemon=True).start()
        return spare.popen

    def close(self) -> None:
        """Dismiss every spare and wait for them; idempotent. No spare outlives this call."""
        with self._lock:
            self.closed = True
            spares, self._idle = self._idle, []
            self._lock.wait_for(lambda: self._busy == 0, REAP_WAIT_S + KILL_WAIT_S)
        _dismiss(spares)

    # --- inside ---------------------------------------------------------------------------

    def _spawn(self) -> None:
        with self._lock:
            if self.closed or self.disabled or len(self._idle) + self._spawning >= self.size:
                return
            self._spawning += 1
            self._busy += 1
        error = None
        try:
            spare = _popen(self._start, self.script, self.env)
            with self._lock:
                keep = not (self.closed or self.disabled)
                if keep:
                    self._idle.append(spare)
            if keep:
                threading.Thread(target=self._watch, args=(spare,), name=f"tg-spare-{spare.popen.pid}",
                                 daemon=True).start()
            else:
                os.close(spare.ready_fd)
                _dismiss([spare])
        except OSError as exc:
            error = f"a hot spare could not start: {exc}"
        finally:
            with self._lock:
                self._spawning -= 1
            self._done()
        if error:
            self._died(error)

    def _done(self) -> None:
        with self._lock:
            self._busy -= 1
            self._lock.notify_all()

    def _watch(self, spare: _Spare) -> None:
        """Block on the readiness pipe: a byte means warm, EOF means activated, dismissed or dead."""
        try:
            while os.read(spare.ready_fd, 1):
                with self._lock:
                    spare.ready.set()
                    idle = spare in self._idle
                    self._lock.notify_all()
                if idle:
                    self._say(f"hot spare ready (pid {spare.popen.pid}, "
                              f"{time.monotonic() - spare.started:.1f} s to import)")
                    self._report()
        finally:
            os.close(spare.ready_fd)
        with self._lock:
            if spare not in self._idle:
                return  # taken or dismissed
            self._idle.remove(spare)
            self._busy += 1
        try:
            try:
                spare.popen.wait(REAP_WAIT_S)
            except subprocess.TimeoutExpired:  # closed its pipe without being activated: not usable
                pass
            last = _last_line(spare.popen)
            _dismiss([spare])
        finally:
            self._done()
        rc = spare.popen.returncode if spare.popen.returncode is not None else -signal.SIGKILL
        self._died(describe_exit("a hot spare", spare.popen.pid, rc) + (f": {last}" if last else ""))

    def _died(self, what: str) -> None:
        self._report()
        with self._lock:
            if self.closed or self.disabled:
                return
            self._deaths += 1
            give_up = self._deaths >= self._max_deaths
            if give_up:
                self.disabled = True
                spares, self._idle = self._idle, []
                self._busy += 1
        if not give_up:
            self._say(f"{what}; starting another")
            self._spawn()
            return
        self._say(f"hot spares disabled: {self._deaths} died in a row while idle (last: {what}); "
                  "restarts start a fresh process")
        try:
            _dismiss(spares)
        finally:
            self._done()


def _popen(start: Callable[..., Process], script: str, env: Mapping[str, str]) -> _Spare:
    read_fd, write_fd = os.pipe()
    try:
        popen = start(spare_cmd(script, write_fd), dict(env), stdin_pipe=True, pass_fds=(write_fd,))
    except OSError:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return _Spare(popen, read_fd)


def _last_line(popen: Process) -> str:
    """The last line a dead spare wrote to stderr (its pipe is never read while it is idle)."""
    if popen.stderr is None:
        return ""
    try:
        os.set_blocking(popen.stderr.fileno(), False)
        data = popen.stderr.read() or b""
    except (OSError, ValueError):
        return ""
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1].strip() if lines else ""


def _dismiss(spares: Sequence[_Spare]) -> None:
    """EOF on stdin (a warm spare exits 0), then SIGTERM, then SIGKILL to its group; reap; close pipes."""
    for spare in spares:
        with contextlib.suppress(OSError):
            spare.popen.stdin.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + DISMISS_WAIT_S
    for sig, wait_s in ((signal.SIGTERM, None), (signal.SIGKILL, KILL_WAIT_S)):
        for spare in spares:
            try:
                spare.popen.wait(max(0.0, deadline - time.monotonic()) if wait_s is None else wait_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # not reaped yet, so its group id is still its own
                    os.killpg(spare.popen.pid, sig)
    for spare in spares:
        with contextlib.suppress(subprocess.TimeoutExpired):
            spare.popen.wait(KILL_WAIT_S)
        for stream in (spare.popen.stdin, spare.popen.stdout, spare.popen.stderr):
            if stream is not None:
                stream.close()
