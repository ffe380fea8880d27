"""The scheduler as a child process of a worker: under torchrun or mpirun, rank 0 starts it and restarts it.

Rank 0 starts `python -m trainguard scheduler` (the entry point `trainguard run` starts too) in a session
of its own, so a signal to rank 0's process group (torchrun's, or a terminal's Ctrl-C) does not reach it:
the scheduler ends with the job, after the workers' goodbyes, as it does under `trainguard run`.

- **The port.** Under torchrun without TG_SCHED_PORT the child binds port 0 and writes the port it got, as
  one line, to a pipe it inherits (`--port-fd`); rank 0 reads it and publishes it in torchrun's store. Under
  mpirun the port is fixed (TG_SCHED_PORT, default 8118). A restart binds the same port. Nothing is left
  on disk, whatever kills rank 0.
- **Supervision.** One thread in rank 0 starts the child, waits on it and, if it dies (a signal, a crash),
  starts it again on the same port, logging each restart: at most `restart_limit` times (3) within any
  `restart_window` seconds (3600), the crash-loop rule of `trainguard run`'s defaults. The new scheduler
  reloads `cluster.db` from the recovery path and the workers' clients reconnect with backoff. Without
  recovery (TG_ENABLE_RECOVERY=0) there is no `cluster.db` to reload, so it is not restarted: the error
  is logged, the workers go on training, and the job fails at its next membership change or at its end,
  when the workers cannot reach a scheduler within TG_CONNECT_TIMEOUT.
- **Death of rank 0.** The child asks the kernel (Linux: prctl PR_SET_PDEATHSIG) for SIGTERM when the
  thread that started it ends; that thread lives until the child has exited, so this fires only when rank 0
  dies. Elsewhere, or if prctl fails, a thread in the child polls its parent's pid.

No torch here: the child is the control plane's own process.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from ..config import ClusterConfig, this_host
from ..errors import ConfigError
from ..exitcodes import EXIT_CONFIG, EXIT_JOB_FAILED, EXIT_PREEMPTED
from ..signals import signal_name

log = logging.getLogger("trainguard.sched_child")

SCHEDULER_CMD = ("-m", "trainguard", "scheduler")  # after sys.executable: what `trainguard run` starts
RESTART_LIMIT = 3  # restarts within RESTART_WINDOW_S; one more failure inside the window is a crash loop
RESTART_WINDOW_S = 3600.0
POLL_S = 0.1  # how often rank 0, waiting for the port, checks the child is still alive
PARENT_POLL_S = 0.5  # how often the child checks its parent is alive where prctl is not available
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL when rank 0 stops a scheduler that outlived the wait
PR_SET_PDEATHSIG = 1
DRAIN_EXTRA_S = 5.0  # after a stop signal: the grace period and this long for the workers' goodbyes


# --- the decision (pure) ---------------------------------------------------------------


def decide_restart(returncode: int, *, recent_restarts: int, limit: int, recovery: bool,
                   closing: bool) -> tuple[bool, str]:
    """Whether a scheduler that exited with `returncode` (< 0: killed by that signal) starts again, and why;
    `recent_restarts`: its restarts within the window."""
    if returncode == 0 or returncode == EXIT_PREEMPTED:
        return False, "the job ended"
    if returncode == EXIT_JOB_FAILED:
        return False, "it ended the job as failed"
    if returncode == EXIT_CONFIG:
        return False, "it refused its configuration (its message is above); a restart cannot help"
    if closing:
        return False, "rank 0 is leaving"
    if not recovery:
        return False, ("recovery is off (TG_ENABLE_RECOVERY=0), so a new scheduler would have no cluster.db to "
                       "reload the membership from; the workers go on, but the job fails at its next membership "
                       "change or at its end, after TG_CONNECT_TIMEOUT. Set TG_ENABLE_RECOVERY=1 and "
                       "TG_RECOVERY_PATH to have it restarted")
    if recent_restarts >= limit:
        n = recent_restarts
        return False, f"crash loop: it failed again after {n} restart{'s' * (n != 1)} within {RESTART_WINDOW_S:g} s"
    return True, f"restart {recent_restarts + 1}/{limit} within {RESTART_WINDOW_S:g} s"


def describe(pid: int, returncode: int) -> str:
    if returncode < 0:
        return f"the scheduler (pid {pid}) was killed by signal {signal_name(-returncode)}"
    return f"the scheduler (pid {pid}) exited with code {returncode}"


# --- rank 0's side ---------------------------------------------------------------------


class SchedulerProcess:
    """The scheduler child of one worker process and the thread that supervises it."""

    def __init__(self, cfg: ClusterConfig, *, restart_limit: int = RESTART_LIMIT,
                 cmd: Sequence[str] | None = None):
        self.cfg = cfg
        self.port = cfg.sched_port  # 0 until the first child reports the port it bound
        self.restart_limit = restart_limit
        self.restarts: list[float] = []  # when it was restarted (monotonic)
        self._cmd = list(cmd) if cmd is not None else [sys.executable, *SCHEDULER_CMD]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._closing = False
        self._ready = threading.Event()  # the first child listens, or could not start
        self._start_error = ""
        self._thread = threading.Thread(target=self._supervise, name="trainguard-scheduler-supervisor", daemon=True)

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    def start(self) -> int:
        """Start the child; returns the port once it listens. ConfigError if it could not start."""
        self._thread.start()
        if not self._ready.wait(self.cfg.connect_timeout + 2 * STOP_GRACE_S):  # the supervisor gives up before
            self.close()
            raise ConfigError(f"the scheduler did not start within {self.cfg.connect_timeout:g} s (TG_CONNECT_TIMEOUT)")
        if self._start_error:
            self._thread.join(STOP_GRACE_S)
            raise ConfigError(self._start_error)
        return self.port

    def wait(self, timeout: float) -> bool:
        """After this rank's goodbye: wait (restarting it if it dies) for the scheduler to end with the job,
        at most `timeout` seconds; then stop it. True when it ended by itself."""
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if not ended:
            log.warning("the scheduler did not end within %g s of this rank's goodbye; stopping it", timeout)
        self.close()
        return ended

    def close(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL) and its supervision; idempotent."""
        with self._lock:
            self._closing = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(STOP_GRACE_S)

    # --- the supervisor thread: it starts every child, so the child's parent-death signal
    # --- (which Linux ties to the starting thread) fires only when rank 0 dies

    def _supervise(self) -> None:
        while True:
            started = self._spawn()
            if started is None:
                return
            proc, reader = started
            try:
                port = self._await_port(proc, reader)
            finally:
                os.close(reader)
            if port is not None:
                first = not self._ready.is_set()
                self.port = port
                self._ready.set()
                if not first:
                    log.warning("the scheduler is back on %s:%d (pid %d)", self.cfg.sched_host, port, proc.pid)
            code = proc.wait()
            if not self._ready.is_set():  # the first start failed: rank 0 raises it
                self._start_error = (f"{describe(proc.pid, code)} before it listened on "
                                     f"{self.cfg.sched_host}:{self.port} (its message is above)")
                self._ready.set()
                return
            with self._lock:
                closing = self._closing
            now = time.monotonic()
            recent = sum(now - t < RESTART_WINDOW_S for t in self.restarts)
            again, why = decide_restart(code, recent_restarts=recent, limit=self.restart_limit,
                                        recovery=self.cfg.enable_recovery, closing=closing)
            if not again:
                if code not in (0, EXIT_PREEMPTED, EXIT_JOB_FAILED) and not closing:  # those ended the job
                    log.error("%s; it is not restarted: %s", describe(proc.pid, code), why)
                return
            self.restarts.append(now)
            log.warning("%s; restarting it on %s:%d (%s)", describe(proc.pid, code), self.cfg.sched_host,
                        self.port, why)

    def _spawn(self) -> tuple[subprocess.Popen, int] | None:
        """A fresh child, and the read end of the pipe it writes its port to."""
        reader, writer = os.pipe()
        cmd = [*self._cmd, "--host", self.cfg.sched_host, "--port", str(self.port),
               "--workers", str(self.cfg.worker_num), "--port-fd", str(writer), "--parent-pid", str(os.getpid())]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # TG_ENABLE_RECOVERY, TG_RECOVERY_PATH, ... as this rank
        with self._lock:
            try:
                if not self._closing:
                    self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, pass_fds=(writer,),
                                                  start_new_session=True)
                    return self._proc, reader
            except OSError as exc:
                if self._ready.is_set():
                    log.error("cannot restart the scheduler (%s): %s", " ".join(cmd), exc)
                else:
                    self._start_error = f"cannot start the scheduler ({' '.join(cmd)}): {exc}"
                    self._ready.set()
            finally:
                os.close(writer)  # the child holds its copy: the child's exit ends the pipe
        os.close(reader)
        return None

    def _await_port(self, proc: subprocess.Popen, reader: int) -> int | None:
        """The port the child listens on, once it has written it; None if it exited first."""
        deadline = time.monotonic() + self.cfg.connect_timeout
        got = b""
        while b"\n" not in got:
            if time.monotonic() > deadline:
                log.error("the scheduler (pid %d) did not listen within %g s (TG_CONNECT_TIMEOUT); stopping it",
                          proc.pid, self.cfg.connect_timeout)
                proc.kill()
                return None
            if not select.select([reader], [], [], POLL_S)[0]:
                # gone without a word (a process forked from this one meanwhile may hold the pipe open)
                if proc.poll() is not None and not select.select([reader], [], [], 0)[0]:
                    return None
                continue
            chunk = os.read(reader, 64)
            if not chunk:  # it exited without a port
                return None
            got += chunk
        line = got.split(b"\n", 1)[0].strip()
        return int(line) if line.isdigit() else None


# --- the child's side ------------------------------------------------------------------


def publish_port(fd: int, port: int) -> None:
    """Tell the process that started this scheduler the port it listens on: one line on the inherited pipe."""
    try:
        os.write(fd, f"{port}\n".encode())
    finally:
        os.close(fd)


def die_with_parent(parent_pid: int) -> None:
    """End this process (SIGTERM) when `parent_pid`, which started it, dies."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
            if not armed:
                log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); polling the parent instead", ctypes.get_errno())
        except (OSError, AttributeError) as exc:
            log.warning("prctl is not available (%s); polling the parent instead", exc)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        log.error("the process that started this scheduler (pid %d) is gone; exiting", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="trainguard-parent-watch",
                         daemon=True).start()


def drain_on_signals(done: asyncio.Event, job_over: Callable[[], bool], grace: float) -> None:
    """SIGTERM or SIGINT does not end the scheduler at once: it serves on until `job_over()` (the workers'
    goodbyes after their dying gasp, or no worker left alive) or the grace period and DRAIN_EXTRA_S have
    passed, then sets `done`;
    at once if the process that started it has died.
    Slurm signals every process of a step at once, this one with the workers; dying first, it would leave
    them no one to agree on their stop step with. Main thread only (a scheduler in a test's thread has none)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []
    parent = os.getppid()  # if it is gone (die_with_parent's SIGTERM), no one is left to wait for

    async def drain() -> None:
        deadline = time.monotonic() + grace + DRAIN_EXTRA_S
        while not job_over() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        done.set()

    def on_signal(signum: int) -> None:
        if os.getppid() != parent:
            done.set()
        elif not draining:
            log.warning("received %s: serving the workers until they leave (at most %g s)", signal_name(signum),
                        grace + DRAIN_EXTRA_S)
            draining.append(loop.create_task(drain()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    log.error("the process that started this scheduler (pid %d) is gone; exiting", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def holds_connection_to(pid: int, port: int) -> bool:
    """Does process `pid` hold a TCP connection to local port `port`? Its descriptors' socket inodes
    (/proc/PID/fd) against the connection table (/proc/net/tcp, tcp6). False when either cannot be read."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    inodes = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()  # sl, local address:port, remote address:port, ..., inode (10th)
            if len(cols) > 9 and cols[9] in inodes and int(cols[2].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def kill_if_local(node_id: str, host: str, pid: int, port: int) -> None:
    """A hung (e.g. SIGSTOPped) worker on this host is killed so its peers' collectives fail fast; but only
    a process that holds a connection to this scheduler (`port`): a pid from a message is not enough, and a
    reused pid or a stranger's choice of victim holds none."""
    if host != this_host() or pid <= 0:
        return
    if not holds_connection_to(pid, port):
        log.warning("not killing pid %d (worker %s): it holds no connection to this scheduler, so it is not that "
                    "worker", pid, node_id)
        return
    try:
        os.kill(pid, signal.SIGKILL)
        log.warning("killed hung worker %s (pid %d)", node_id, pid)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.error("cannot kill hung worker %s (pid %d): %s", node_id, pid, exc)
