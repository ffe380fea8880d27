"""The agent's side of the zygote (zygote.py): start it, have it fork workers and spares, learn their exits.

`start_process(cmd, ...)` is the agent's one way to start a worker or a spare: forked from the zygote when
`cmd` is `python -u -m MODULE ...` for a module the zygote runs and the zygote is ready, else a fresh
process (`subprocess.Popen`), exactly as before. Either way the caller gets an object with Popen's pid,
stdin/stdout/stderr, poll(), wait() and send_signal().

A forked process is the zygote's child, so its exit status reaches the agent as a message from the
zygote (`ForkedProcess`). Should the zygote itself die, no one can tell its live children's statuses any
more: the agent kills them (SIGKILL to each one's group) and sees them exit as killed, so the recovery
replaces them as it would any dead worker, with fresh processes from then on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence, Union

from ..errors import ProtocolError
from . import forkwire
from .children import pump_lines
from .forkwire import MAINS, MAX_TARGET, ZYGOTE_MODULE

READY_WAIT_S = 300.0  # a zygote still importing after this is given up on (a hung import in the script?)
REPLY_WAIT_S = 30.0
STOP_WAIT_S = 5.0
FD_ROOM = 8  # digits of a passed descriptor's number that a child's command line may need


class ForkedProcess:
    """A process the zygote forked, as the agent sees it: the part of subprocess.Popen the agent uses."""

    def __init__(self, args: list[str], stdin, stdout, stderr) -> None:
        self.args, self.stdin, self.stdout, self.stderr = args, stdin, stdout, stderr
        self.pid = 0  # set once the zygote says it forked
        self.returncode: int | None = None
        self._done = threading.Condition()

    def exited(self, returncode: int) -> None:
        with self._done:
            if self.returncode is None:
                self.returncode = returncode
            self._done.notify_all()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._done:
            if not self._done.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close_pipes(self) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()


Process = Union[subprocess.Popen, ForkedProcess]


class ZygoteLink:
    """One zygote process and the agent's end of its socket; thread-safe."""

    def __init__(self, script: str, script_args: Sequence[str], env: dict[str, str], *,
                 say: Callable[[str], None], err, lock: threading.Lock, room: int = 0) -> None:
        self._say = say
        self._sock, theirs = forkwire.pair()
        cmd = [sys.executable, "-u", "-m", ZYGOTE_MODULE, "--fd", str(theirs.fileno())]
        short = len("\0".join([*cmd, script, *script_args])) + 1
        if room > short:
            cmd.append("--room=" + "." * (room - short))
        try:
            self.popen = subprocess.Popen([*cmd, script, *script_args], env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self.started = time.monotonic()
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self.state = "starting"  # then "ready", or "gone" with self.why
        self.why = ""
        self._closing = False
        self._next_id = 0
        self._pending: dict[int, ForkedProcess | str] = {}  # order id -> process, or why it was refused
        self._live: dict[int, ForkedProcess] = {}
        threading.Thread(target=pump_lines, args=(self.popen.stderr, "[zygote] ", err, lock, None, None),
                         name="tg-zygote-err", daemon=True).start()
        threading.Thread(target=self._read, name="tg-zygote", daemon=True).start()

    def wait_ready(self, timeout: float = READY_WAIT_S, give_up: Callable[[], bool] = lambda: False) -> bool:
        """True once the zygote can fork; False if it cannot, or after `timeout`, or once `give_up()`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.state == "starting" and time.monotonic() < deadline and not give_up():
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            late = self.state == "starting" and time.monotonic() >= deadline
        if late:
            self._gone(f"not ready after {timeout:g} s")
        return self.state == "ready"

    def spawn(self, module: str, argv: list[str], env: dict[str, str], *, stdin_pipe: bool,
              pass_fds: Sequence[int] = (), give_up: Callable[[], bool] = lambda: False) -> ForkedProcess | None:
        """A forked `python -u -m module argv...` with pipes for stdout and stderr (and stdin if asked, else
        /dev/null) and `pass_fds` at the same numbers; None if the zygote cannot fork it (not ready before
        `give_up()`, refused, gone): the caller then starts a fresh process."""
        if module not in MAINS or not all(3 <= fd <= MAX_TARGET for fd in pass_fds) \
                or not self.wait_ready(give_up=give_up):
            return None
        try:
            ends, proc = _pipes([sys.executable, "-u", "-m", module, *argv], stdin_pipe)
        except OSError as exc:  # out of descriptors: a fresh process will say so in its own words
            self._say(f"no pipes for a forked {module} ({exc}); starting a fresh process")
            return None
        with self._cond:
            req = self._next_id
            self._next_id += 1
            self._pending[req] = proc
        order = {"op": "fork", "id": req, "main": module, "argv": argv, "env": env, "fds": list(pass_fds)}
        try:
            with self._send_lock:
                forkwire.send(self._sock, order, [*ends, *pass_fds])
        except ProtocolError as exc:  # nothing was sent (an environment over the bound)
            self._pending.pop(req, None)
            proc.close_pipes()
            self._say(f"the zygote cannot fork {module} ({exc}); starting a fresh process")
            return None
        except OSError as exc:
            self._pending.pop(req, None)
            proc.close_pipes()
            self._gone(f"a fork order could not be sent: {exc}")
            return None
        finally:
            for fd in ends:
                os.close(fd)
        with self._cond:
            self._cond.wait_for(lambda: proc.pid or self._pending.get(req) is not proc or self.state == "gone",
                                REPLY_WAIT_S)
            refused = self._pending.pop(req, None)
        if proc.pid:
            return proc
        proc.close_pipes()
        why = refused if isinstance(refused, str) else self.why or f"no answer in {REPLY_WAIT_S:g} s"
        self._say(f"the zygote did not fork {module} ({why}); starting a fresh process")
        return None

    def close(self) -> None:
        """End the zygote (its children are left as they are); idempotent."""
        with self._cond:
            self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(2)
        try:
            self.popen.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    # --- inside ---------------------------------------------------------------------------

    def _read(self) -> None:
        why = "it exited"
        try:
            while (got := forkwire.recv(self._sock)) is not None:
                message, fds = got
                for fd in fds:
                    os.close(fd)
                self._handle(message)
        except (OSError, ProtocolError) as exc:
            why = str(exc)
        self._gone(why)

    def _handle(self, message: dict) -> None:
        op = message["op"]
        if op == "exit":
            pid, rc = forkwire.field(message, "pid", int), forkwire.field(message, "returncode", int)
            with self._cond:
                proc = self._live.pop(pid, None)
            if proc is not None:
                proc.exited(rc)
        elif op in ("forked", "refused"):
            req = forkwire.field(message, "id", int)
            with self._cond:
                proc = self._pending.get(req)
                if isinstance(proc, ForkedProcess) and op == "forked":
                    proc.pid = forkwire.field(message, "pid", int)
                    self._live[proc.pid] = proc
                elif proc is not None:
                    self._pending[req] = str(message.get("error", "refused"))
                self._cond.notify_all()
        elif op == "ready":
            unsafe = forkwire.field(message, "unsafe", str)
            if unsafe:
                self._gone(f"forking is not safe: {unsafe}")
                return
            with self._cond:
                self.state = "ready"
                self._cond.notify_all()
            self._say(f"zygote ready (pid {self.popen.pid}, {time.monotonic() - self.started:.1f} s to import); "
                      "workers and spares are forked from it")
        else:
            raise ProtocolError(f"unknown zygote message {op!r}")

    def _gone(self, why: str) -> None:
        """The zygote is no use any more: kill what it forked that still runs (their exits cannot be known)."""
        with self._cond:
            if self.state == "gone":
                return
            was, self.state, self.why = self.state, "gone", why
            live, self._live = list(self._live.values()), {}
            closing = self._closing
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(2)
        if closing:
            return
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.popen.poll() is None and was != "ready":
            self.popen.kill()
        killed = f"; its {len(live)} live children were killed" if live else ""
        self._say(f"the zygote (pid {self.popen.pid}) is not used: {why}{killed}; fresh processes start instead")
        for proc in live:  # said first: the agent's log gives the cause before it handles these exits
            proc.exited(-signal.SIGKILL)


def _pipes(args: list[str], stdin_pipe: bool) -> tuple[list[int], ForkedProcess]:
    """The child's ends (stdin, stdout, stderr: to send, then close) and a ForkedProcess holding ours."""
    ends: list[int] = []
    mine: list[int] = []
    try:
        if stdin_pipe:
            r, w = os.pipe()
            ends.append(r)
            mine.append(w)
        else:
            ends.append(os.open(os.devnull, os.O_RDONLY))
        for _ in range(2):
            r, w = os.pipe()
            ends.append(w)
            mine.append(r)
    except OSError:
        for fd in ends + mine:
            os.close(fd)
        raise
    stdin = os.fdopen(mine[0], "wb") if stdin_pipe else None
    stdout, stderr = (os.fdopen(fd, "rb") for fd in mine[-2:])
    return ends, ForkedProcess(args, stdin, stdout, stderr)


def start_process(zygote: ZygoteLink | None, cmd: Sequence[str], env: dict[str, str], *, stdin_pipe: bool = False,
                  pass_fds: Sequence[int] = (), give_up: Callable[[], bool] = lambda: False) -> Process:
    """`cmd` forked from the zygote where it can, else started fresh; its own session, pipes for its output.
    `give_up()`: stop waiting for a zygote still importing (the agent got a signal)."""
    if zygote is not None and list(cmd[:3]) == [sys.executable, "-u", "-m"] and len(cmd) > 3:
        proc = zygote.spawn(cmd[3], list(cmd[4:]), env, stdin_pipe=stdin_pipe, pass_fds=pass_fds, give_up=give_up)
        if proc is not None:
            return proc
    return subprocess.Popen(list(cmd), env=env, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=tuple(pass_fds),
                            start_new_session=True)  # signals reach it only via the agent


def start_zygote(script: str, script_args: Sequence[str], env: dict[str, str], *, say: Callable[[str], None],
                 err, lock: threading.Lock, room: int = 0) -> ZygoteLink | None:
    """A zygote for `script`, or None (said) if its process cannot start: workers then start fresh."""
    try:
        return ZygoteLink(script, script_args, env, say=say, err=err, lock=lock, room=room)
    except OSError as exc:
        say(f"the zygote could not start ({exc}); workers start as fresh processes")
        return None


def room_for(*cmds: Sequence[str]) -> int:
    """Bytes of command line the zygote must have so that its children can show `cmds` (proctitle.py)."""
    return max(len("\0".join(cmd)) + 1 + FD_ROOM for cmd in cmds)
