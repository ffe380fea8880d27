"""The zygote: one warm Python per agent, from which every worker and hot spare of the host is forked.

    python -u -m trainguard.launch.zygote --fd FD [--room=...] SCRIPT [ARGS...]

A fresh worker pays several seconds of CPU before the script's first line: torch, torch.distributed,
the torch._dynamo that the first optimizer imports, trainguard's worker side, the script's own
third-party imports. The zygote pays that once (spare_main.preload; none of torch for a script whose
top-level imports are all from the standard library), then forks, in about 30 ms,
a process that is what `python -u -m MODULE ARGV` would be (MODULE: worker_main or spare_main only):
its own session, the stdin, stdout, stderr and descriptors the agent sent, the agent's environment for
it, and that command line in `ps` (proctitle.py). On a shared host this is most of a job's start-up and
of every cold restart; the children also share the zygote's memory until they write to it.

What a fork does not redo, and why the child is still the same as a fresh process:
- Imports ran once, with the zygote's environment: the workers' own, without their per-worker
  variables. Modules that read those at import are the script's own, which are never preloaded.
- The OpenMP runtime read OMP_NUM_THREADS when it loaded: the child sets torch's thread count from its
  own environment. Python's `random` reseeds itself in a forked child; numpy's global generator, if
  loaded, is reseeded here, as a fresh process seeds it. torch's generator was not used by the imports.

Forking is not safe once a preloaded import has started a Python thread or initialised CUDA (a forked
child cannot use it): the zygote then says so in its first message and exits, and the agent starts
fresh processes instead (forked.py).

The zygote ignores the stop signals (SIGTERM, SIGINT, SIGUSR1). A stop is the agent's to handle: it
forwards it to the workers and waits out their dying gasp. But Slurm's scancel, systemd's stop and `kill 0`
signal every process of the job at once, and a zygote that died of it would take the exit statuses of
the stopping workers with it (the agent then kills them). Each child gets back the dispositions a fresh
process has. The zygote still ends at EOF on its socket, or on SIGKILL.

The zygote is single-threaded. It waits on its socket (forkwire.py: who may send there) and on SIGCHLD,
reaps each child and sends its exit status to the agent, which is not the child's parent. At EOF (the
agent closed it, after stopping the workers) it exits. If the agent dies, the zygote and its children die
with it (`die_with_parent`), as the scheduler does (`--parent-pid`).

After the preload the zygote freezes its objects (`gc.freeze`, as CPython's docs advise before a fork):
the children's collector never walks torch's module graph again (a full collection there takes about
0.25 s of CPU, and every worker runs one as it ends), and it never writes to those pages, which stay
shared. At its own end the zygote leaves without the interpreter's teardown, over 2 s of CPU with torch
imported, that held `trainguard run`'s exit back.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import gc
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, NoReturn

from .. import signals
from ..errors import ProtocolError
from . import forkwire, proctitle
from .forkwire import MAINS, MAX_TARGET, ZYGOTE_MODULE
from .spare_main import preload
from .worker_main import end_process, script_path

MAX_FD = 1 << 20


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux's PR_SET_PDEATHSIG; elsewhere
    nothing). The zygote is started by the agent's main thread and forks from its only thread, so an agent
    killed by SIGKILL (the OOM killer, a timeout) takes the zygote, and the zygote its children, with it:
    no worker is left blocked in a collective for good, holding its GPU and ports."""
    parent = os.getppid()
    try:
        ok = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return
    if ok and parent == 1:  # the parent was gone before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def fork_hazard() -> str:
    """Why forking this process would give a broken child, or ""."""
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        return f"a preloaded import started threads ({', '.join(others[:5])})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a preloaded import initialised CUDA, which a forked process cannot use"
    return ""


def parse_order(message: dict[str, Any], nfds: int) -> tuple[str, list[str], dict[str, str], list[int]]:
    """(module, argv, env, targets) of a fork order, or ProtocolError."""
    main = forkwire.field(message, "main", str)
    argv = forkwire.field(message, "argv", list)
    env = forkwire.field(message, "env", dict)
    targets = forkwire.field(message, "fds", list)
    if main not in MAINS:
        raise ProtocolError(f"the zygote runs only {', '.join(MAINS)}, not {main!r}")
    if not all(isinstance(a, str) for a in argv):
        raise ProtocolError("a fork order's argv holds a non-string")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ProtocolError("a fork order's env holds a non-string")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 3 <= t <= MAX_TARGET for t in targets) \
            or len(set(targets)) != len(targets):
        raise ProtocolError(f"a fork order's descriptor targets must be distinct numbers from 3 to {MAX_TARGET}")
    if nfds != 3 + len(targets):
        raise ProtocolError(f"a fork order came with {nfds} descriptors, not stdin, stdout, stderr "
                            f"and {len(targets)} more")
    return main, argv, env, targets


class Zygote:
    """The serving side: fork on order, report exits. Single-threaded by design."""

    def __init__(self, sock: socket.socket, dispositions: dict[int, object]) -> None:
        self.sock = sock
        self.dispositions = dispositions  # the stop signals' handlers before the zygote ignored them
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)

    def serve(self) -> int:
        signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)  # only to wake select()
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        try:
            while True:
                ready, _, _ = select.select([self.sock, self.wake_r], [], [])
                if self.wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 512):
                            pass
                    self.reap()
                if self.sock in ready:
                    got = forkwire.recv(self.sock)
                    if got is None:
                        return 0  # the agent is gone or done with us
                    self.order(*got)
        except (BrokenPipeError, ConnectionResetError):
            return 0
        except ProtocolError as exc:
            print(f"[zygote] {exc}; exiting", file=sys.stderr)
            return 1

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            forkwire.send(self.sock, {"op": "exit", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})

    def order(self, message: dict[str, Any], fds: list[int]) -> None:
        """Fork as ordered; a bad order is refused (the zygote serves on), a packet without an id ends it."""
        try:
            if message["op"] != "fork":
                raise ProtocolError(f"the zygote takes fork orders only, not {message['op']!r}")
            req = forkwire.field(message, "id", int)
        except ProtocolError:
            for fd in fds:
                os.close(fd)
            raise
        try:
            main, argv, env, targets = parse_order(message, len(fds))
        except ProtocolError as exc:
            for fd in fds:
                os.close(fd)
            forkwire.send(self.sock, {"op": "refused", "id": req, "error": str(exc)})
            return
        try:
            pid = os.fork()
        except OSError as exc:
            forkwire.send(self.sock, {"op": "refused", "id": req, "error": f"fork failed: {exc}"})
            pid = -1
        if pid == 0:
            self.become(main, argv, env, fds, targets)
        for fd in fds:
            os.close(fd)
        if pid > 0:
            forkwire.send(self.sock, {"op": "forked", "id": req, "pid": pid})

    def become(self, main: str, argv: list[str], env: dict[str, str], fds: list[int],
               targets: list[int]) -> NoReturn:
        """In the child: shed the zygote, take the order's descriptors and environment, run MODULE's main."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signals.restore(self.dispositions)
            die_with_parent()  # with the zygote (and so with the agent)
            self.sock.close()
            os.setsid()
            place_fds(fds, [0, 1, 2, *targets])
            os.environ.clear()
            os.environ.update(env)
            match_fresh_process(env)
            proctitle.set_cmdline([sys.executable, "-u", "-m", main, *argv])
            sys.argv = [main, *argv]
            code: Any = importlib.import_module(main).main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # noqa: BLE001 - as the interpreter would report it: through sys.excepthook, which
            sys.excepthook(*sys.exc_info())  # trainguard.init() chains, so the goodbye says the process failed
            code = 1
        end_process(code)


def place_fds(fds: list[int], targets: list[int]) -> None:
    """Put fds[i] at targets[i] and close every other descriptor, as Popen's pass_fds and close_fds do."""
    top = max(targets) + 1
    ordered = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top) for fd in fds]  # clear of every target
    high = sorted(ordered)
    low = 0
    for fd in high:
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, MAX_FD)
    for fd, target in zip(ordered, targets):
        os.dup2(fd, target)  # inheritable, as the child's 0, 1, 2 and passed descriptors are
    for fd in high:
        os.close(fd)


def match_fresh_process(env: dict[str, str]) -> None:
    """What a fresh process would have set from `env` at start, where the zygote set it from its own."""
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if torch is not None and threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {ZYGOTE_MODULE}")
    parser.add_argument("--fd", type=int, required=True, help="this zygote's end of the agent's socket pair")
    parser.add_argument("--room", default="", help="padding: room for the children's command lines")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    dispositions = signals.install(signal.SIG_IGN)  # stops are the agent's (see the module's docstring)
    die_with_parent()  # with the agent
    sock = socket.socket(fileno=args.fd)
    sock.set_inheritable(False)
    proctitle.set_cmdline([sys.executable, "-u", "-m", ZYGOTE_MODULE, args.script])
    script = script_path(args.script)
    start = time.monotonic()
    _loaded, failures = preload(script, os.path.dirname(os.path.realpath(script)), lean=True)
    hazard = fork_hazard()
    gc.freeze()  # what the preload made is kept for good: the children's collections skip it
    forkwire.send(sock, {"op": "ready", "unsafe": hazard, "import_s": round(time.monotonic() - start, 3),
                         "failures": failures[:20]})
    if hazard:
        return 0
    return Zygote(sock, dispositions).serve()


if __name__ == "__main__":
    end_process(main(), collect=False)  # torch's teardown would hold the job's end by 2 s
