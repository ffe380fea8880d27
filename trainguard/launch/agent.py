"""The per-host agent behind `trainguard run`.

It starts the workers (and, at node rank 0, the scheduler), waits on each with waitpid in a thread
(exits are seen at once, in order), reports each death to the scheduler at once, and restarts it while
the restart budget lasts (budget.py: a total cap, and a rate per child that ends a crash loop) and the
recover strategy replaces dead workers: in place, or under `recover` on another host's agent
(relocate.py). A worker that dies after its goodbye is not restarted, nor one whose script raised a
deterministic error (exit 78, worker_main.py): that ends the job at once. It forwards SIGINT/SIGTERM/
SIGUSR1 (workers first, scheduler last; the workers save a dying-gasp checkpoint within the grace period
and exit 75, and so does the agent) and prefixes every line a child prints (children.py). A restarted
worker is a warm hot spare when there is one (spare_pool.py); every worker and spare is forked from the
agent's zygote, which imported torch once (zygote.py, forked.py), unless --no-zygote or it cannot be.
What to do about an exit is decided by the pure functions in policy.py; `Supervisor` carries the
decisions out.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from typing import Mapping, Sequence, TextIO

from .. import signals
from ..config import BEAT_SOCKET_ENV, Role
from ..errors import ConfigError
from ..obs.events import EventLog, format_recovery, summarize_recovery
from . import relay
from .children import Child, signal_alive, wait_exits
from .exitreport import report_death
from .forked import Process, ZygoteLink, room_for, start_process, start_zygote
from .policy import (TORCHELASTIC_RESTART_COUNT, Action, Decision, Failure, LaunchSpec, decide_exit, ended_exit,
                     failure_summary, job_exit_code, scheduler_env, signal_name, signalled_exit, spare_cmd, spare_env,
                     worker_cmd, worker_env)
from .relocate import Relocation
from .spare_pool import SparePool, activate

POLL_INTERVAL_S = 0.02
PUMP_DRAIN_S = 0.25  # time to read the rest of a dead child's stderr


# --- the supervisor ----------------------------------------------------------------


class Supervisor:
    """Runs one host's children until the job ends; `run()` returns the agent's exit code."""

    def __init__(self, spec: LaunchSpec, *, scheduler_cmd: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None,
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
        if spec.sched_port == 0:
            raise ConfigError("the scheduler port is not chosen; give --sched-port or let the CLI pick one")
        if spec.enable_recovery and spec.recovery_path is None:
            raise ConfigError("recovery is on (--max-restarts > 0) but no recovery path is set; give --recovery-path")
        self.spec = spec
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        base = os.environ if env is None else env
        self.relay = relay.for_agent(base, spec.nnodes * spec.nproc_per_node, (spec.sched_host, spec.sched_port),
                                     spec.secret, self._node_of_pid)  # this host's heartbeats as one (relay.py), or None
        if self.relay is not None:
            base = {**base, BEAT_SOCKET_ENV: self.relay.path}
        self.base_env = dict(base)
        self.children: list[Child] = []
        if spec.hosts_scheduler:
            # --parent-pid: it ends with this agent, even one killed by SIGKILL (no orphan holds the port)
            cmd = list(scheduler_cmd or [sys.executable, "-m", "trainguard", "scheduler", "--parent-pid", str(os.getpid())])
            self.children.append(Child(Role.SCHEDULER, 0, None, cmd, scheduler_env(base, spec)))
        for i in range(spec.nproc_per_node):
            self.children.append(Child(Role.WORKER, i, str(spec.node_rank * spec.nproc_per_node + i), worker_cmd(spec),
                                       worker_env(base, spec, i)))
        self.zygote: ZygoteLink | None = None  # started in run(): workers and spares fork from it (zygote.py)
        self._zygote_env = spare_env(base, spec)
        self.spares: SparePool | None = None
        if spec.uses_hot_spares:
            self.spares = SparePool(spec.script, self._zygote_env, spec.hot_spares, say=self._say,
                                    events=spec.events_path and EventLog(spec.events_path), agent=spec.node_rank,
                                    start=self._start_process)
        self.restarts_used = 0
        self.root: Failure | None = None
        self.preempted = False  # a worker exited 75: the job is stopping gracefully, nothing is restarted
        self.fault_stops: list[Failure] = []  # workers that left (76) because the job stops after a fault
        self._signals: list[int] = []
        self._lock = threading.Lock()
        self._exits: queue.Queue[tuple[Child, Process, int]] = queue.Queue()
        self.relocation: Relocation | None = None  # recover: started in run()

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c.role is Role.WORKER]

    def _node_of_pid(self, pid: int) -> str | None:
        return next((c.node_id for c in self.workers if c.popen is not None and c.popen.pid == pid), None)

    @property
    def scheduler(self) -> Child | None:
        return next((c for c in self.children if c.role is Role.SCHEDULER), None)

    def run(self) -> int:
        previous = signals.install(lambda signum, _frame: self._signals.append(signum))
        try:
            spec = self.spec
            spares = spec.hot_spares if self.spares else 0
            self._say(f"{'starting' if spec.hosts_scheduler else 'using'} scheduler at {spec.sched_host}:{spec.sched_port}; "
                      f"{spec.nproc_per_node} worker{'s' * (spec.nproc_per_node != 1)} on node rank {spec.node_rank} of {spec.nnodes}; "
                      f"max restarts {spec.max_restarts} ({spec.restart_rate.describe()}); "
                      f"{spares} hot spare{'s' * (spares != 1)}; "
                      f"recover strategy {spec.recover_strategy}; grace period {spec.grace_s:g} s; "
                      f"recovery path {spec.recovery_path or 'none'}")
            if spec.log_dir is not None:
                spec.log_dir.mkdir(parents=True, exist_ok=True)
            if self.relay is not None:
                self.relay.start()
                self._say("relaying this host's heartbeats to the scheduler as one per interval (TG_HEARTBEAT_RELAY)")
            if spec.zygote:
                self.zygote = start_zygote(spec.script, spec.script_args, self._zygote_env, say=self._say,
                                           err=self.err, lock=self._lock,
                                           room=room_for(worker_cmd(spec), spare_cmd(spec.script, 0)))
            for child in self.children:  # the scheduler first
                self._start(child)
            if self.spares is not None:  # after the workers: they need the CPU first
                self.spares.start()
            if spec.recover_strategy.moves:
                self.relocation = Relocation(self, spec, self._say)
                self.relocation.start()
            code = self._loop()
            self._print_recoveries()
            return code
        finally:
            if self.relocation is not None:
                self.relocation.close()
            if self.relay is not None:
                self.relay.close()
            self._close_spares()
            self._kill(self.children)
            if self.zygote is not None:
                self.zygote.close()
            signals.restore(previous)
            for child in self.children:
                if child.log is not None:
                    child.log.close()

    # --- the loop --------------------------------------------------------------------

    def _loop(self) -> int:
        while True:
            if self._signals:
                signum = self._signals[0]
                self._say(f"received {signal_name(signum)}; forwarding it to the workers, then the scheduler")
                self._stop(signum)
                return self._signalled_code(signum)
            if self.relocation is not None:
                self.relocation.take_orders()
            try:
                child, popen, rc = self._exits.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                child = None
            if child is not None and popen is child.popen:  # else an incarnation already replaced
                code = self._on_exit(child, rc)
                if code is not None:
                    return code
            elif self.relocation is None:
                continue
            if all(w.done for w in self.workers) and (self.relocation is None or self.relocation.may_end()):
                self._finish()
                return self._final_code()

    def _final_code(self) -> int:
        ends = [e for e in self._events() if e.get("event") == "job_end"]  # the scheduler's, and its exit: done
        done = bool(ends) and ends[-1].get("state") == "done" and self.scheduler is not None and \
            self.scheduler.popen is not None and self.scheduler.popen.returncode == 0
        code, message = ended_exit(self.preempted, self.fault_stops, self.root, self.restarts_used,
                                   self._gasp_saved(), self.spec.rerun, done=done)
        elsewhere = self.relocation.failed_elsewhere if self.relocation is not None else None
        if code == 0 and elsewhere is not None:  # failed on another host
            code, message = 1, f"trainguard: the job failed: {elsewhere}"
        if message:
            print(message, file=self.err, flush=True)
        return code

    def _gasp_saved(self) -> bool | None:
        """Did the workers that stopped gracefully save a dying-gasp checkpoint (their events say)?"""
        stops = [e for e in self._events() if e.get("event") == "graceful_exit"]
        return any(e.get("saved") for e in stops) if stops else None

    def _events(self) -> list[dict]:
        """The job's events.jsonl so far ([] without a recovery path)."""
        path = self.spec.events_path
        return EventLog.read(path) if path is not None and path.is_file() else []

    def _signalled_code(self, signum: int) -> int:
        code, message = signalled_exit([w.popen.returncode for w in self.workers if w.popen is not None], signum,
                                       self._gasp_saved(), self.spec.rerun)
        if message:
            print(message, file=self.err, flush=True)
        return code

    def _on_exit(self, child: Child, rc: int) -> int | None:
        """Carry out the decision for one exit; return the agent's exit code if the job is over."""
        if child.done and child.role is Role.WORKER:  # ended by us: an elastic latecomer (_end_latecomers)
            return None
        decision = decide_exit(child.role, rc, self.restarts_used, self.spec.max_restarts, self.spec.recover_strategy,
                               stopping=self.preempted, rate=self.spec.restart_rate, restarts=child.restart_times,
                               now=time.monotonic())
        if decision.action is Action.FINISHED:
            child.done = True
            if child.role is Role.SCHEDULER and self.spec.recover_strategy.elastic:
                self._end_latecomers()
            return None
        assert child.popen is not None
        for pump in child.pumps:
            pump.join(PUMP_DRAIN_S)
        with self._lock:
            failure = Failure(child.name, child.popen.pid, rc, tuple(child.tail), child.role)
        if decision.action in (Action.PREEMPTED, Action.STOPPED):  # it left on purpose: no restart, no report
            child.done = True
            self.preempted = self.preempted or decision.action is Action.PREEMPTED
            if decision.action is Action.STOPPED:
                self.fault_stops.append(failure)
            self._say(f"{failure.describe()}: {decision.reason}")
            return None
        self.root = self.root or failure
        self._say(failure.describe())
        if decision.action is Action.LEFT_OUT and not any(w.alive() for w in self.workers if w is not child):
            decision = Decision(Action.GIVE_UP, f"{decision.reason}, but no other worker is left here",
                                decision.crash_loop)
        if child.role is Role.WORKER:
            over = self.report(child, failure, final=decision.action in (Action.GIVE_UP, Action.LEFT_OUT))
            if over and decision.action is Action.RESTART:  # killed after its goodbye: nothing to redo
                child.done = True
                self._say(f"{child.name} is not restarted: {over}")
                return None
        if decision.action is Action.LEFT_OUT:  # elastic: the scheduler goes on without it after the deadline
            child.done = True
            self._say(f"{child.name} is not restarted: {decision.reason}")
            return None
        if decision.action is Action.RESTART:
            self.restarts_used += 1
            child.restarts += 1
            child.restart_times.append(time.monotonic())
            self._kill([child])  # leftovers of the dead process's group
            where = (self.relocation.place(child, failure) if self.relocation is not None and child.role is Role.WORKER
                     else "here")
            if where == "here":
                self.restart(child)
                return None
            if where == "moved":
                return None
            self.restarts_used -= 1  # nothing was restarted
            child.restart_times.pop()
            decision = Decision(Action.GIVE_UP, where)
        self._say(f"stopping the job: {decision.reason}")
        self._stop(signal.SIGTERM)
        print(failure_summary(self.root, self.restarts_used, failure, self.spec.max_restarts,
                              crash_loop=decision.reason if decision.crash_loop else ""), file=self.err, flush=True)
        return job_exit_code(self.root, failure)

    def _end_latecomers(self) -> None:
        """Elastic: the job ended (the scheduler exited 0) while a dead worker's replacement was still on its
        way back; training is done without it, so it is stopped and not counted as a failure. Workers that
        finished (a `finished` event in events.jsonl) are left to exit by themselves."""
        done = {e.get("node") for e in self._events() if e.get("event") == "finished"}
        late = [w for w in self.workers if not w.done and w.node_id not in done]
        for w in late:
            self._say(f"the job is over; {w.name} came back too late and is stopped")
        self._kill(late)
        for w in late:
            w.done = True

    def _finish(self) -> None:
        """Every worker exited 0: let the scheduler exit by itself, then stop it."""
        self._close_spares()
        sched = self.scheduler
        if sched is None or not sched.alive():
            return
        deadline = time.monotonic() + self.spec.sched_exit_wait_s
        while sched.alive() and time.monotonic() < deadline and not self._signals:
            time.sleep(POLL_INTERVAL_S)
        if sched.alive():
            self._say("all workers finished; stopping the scheduler")
            signal_alive([sched], signal.SIGTERM)
            self._wait([sched], time.monotonic() + self.spec.grace_s)

    # --- processes -------------------------------------------------------------------

    def _start(self, child: Child) -> None:
        """A new process for the child: a worker forked from the zygote where it can be, else a fresh one."""
        self._attach(child, self._start_process(child.cmd, child.env))

    def _start_process(self, cmd: Sequence[str], env: dict[str, str], **kwargs) -> Process:
        return start_process(self.zygote, cmd, env, give_up=lambda: bool(self._signals), **kwargs)

    @property
    def stopping(self) -> bool:
        """A stop signal arrived: nothing new is started."""
        return bool(self._signals)

    def restart(self, child: Child, budget: str | None = None) -> None:
        """A worker from a hot spare when one is alive, else a new process (_start)."""
        budget = budget or f"restart {self.restarts_used}/{self.spec.max_restarts}"
        if child.role is Role.WORKER:  # as torchrun counts its restarts
            child.env[TORCHELASTIC_RESTART_COUNT] = str(child.restarts)
        more = self.restarts_used < self.spec.max_restarts  # else no restart will need a successor
        spare = self.spares.take(replace=more) if self.spares and child.role is Role.WORKER else None
        if not more:
            self._close_spares()
        if spare is not None:
            try:
                activate(spare, child.env, self.spec.script_args)
            except OSError as exc:
                self._say(f"the hot spare (pid {spare.pid}) could not take over ({exc}); starting a fresh process")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(spare.pid, signal.SIGKILL)
                spare.wait()
            else:
                self._say(f"restarting {child.name} from a hot spare ({budget})")
                self._attach(child, spare)
                return
        self._say(f"restarting {child.name} ({budget})")
        self._start(child)

    def _attach(self, child: Child, popen: Process) -> None:
        """Make `popen` the child's process: prefix pumps, tail, log file, exit watcher."""
        if self.spec.log_dir is not None and child.log is None:
            stem = "scheduler" if child.role is Role.SCHEDULER else f"worker_{child.node_id}"
            child.log = open(self.spec.log_dir / f"{stem}.log", "a", encoding="utf-8")
        child.popen = popen
        child.done = False
        with self._lock:
            child.tail.clear()
        child.start_pumps(self.out, self.err, self._lock)
        threading.Thread(target=lambda c=child, proc=popen: self._exits.put((c, proc, proc.wait())),
                         name=f"tg-{child.name}-wait", daemon=True).start()

    def _close_spares(self) -> None:
        if self.spares is not None:
            self.spares.close()

    def _stop(self, signum: int) -> None:
        """Signal the workers, wait for them, then the scheduler; SIGKILL what outlives the grace period."""
        self._close_spares()
        deadline = time.monotonic() + self.spec.grace_s
        signal_alive(self.workers, signum)
        self._wait(self.workers, deadline)
        sched = [c for c in self.children if c.role is Role.SCHEDULER]
        signal_alive(sched, signum)
        self._wait(sched, max(deadline, time.monotonic() + 1.0))
        self._kill(self.children)

    def _wait(self, children: Sequence[Child], deadline: float) -> None:
        """Wait until the children exit, the deadline passes, or a second signal asks to hurry."""
        hurry = len(self._signals) + 1
        wait_exits(children, deadline, lambda: len(self._signals) > hurry, POLL_INTERVAL_S)

    def _kill(self, children: Sequence[Child]) -> None:
        for child in children:
            problem = child.kill_group(PUMP_DRAIN_S)
            if problem:
                self._say(problem)

    # --- reporting -------------------------------------------------------------------

    def report(self, child: Child, failure: Failure, *, final: bool = False, why: str = "") -> str:
        """Tell the scheduler about a dead worker at once (exitreport.py); why it needs no replacement, or ""."""
        return report_death(self.spec, self.scheduler, child, failure, self._say, final=final, why=why)

    def _print_recoveries(self) -> None:
        """One line per recovery of this job that resumed training, with its MTTR and lost steps (from
        events.jsonl). A failure nothing resumed from is the final message's business, not a recovery."""
        if not self.spec.hosts_scheduler:
            return
        resumed = [rec for rec in summarize_recovery(self._events()) if rec["to_step"] is not None]
        for i, rec in enumerate(resumed, 1):
            print(format_recovery(i, rec), file=self.out, flush=True)

    def _say(self, message: str) -> None:
        with self._lock:
            print(f"[agent] {message}", file=self.err, flush=True)


def launch(spec: LaunchSpec, **kwargs: object) -> int:
    """Run one host's share of the job; returns the agent's exit code."""
    return Supervisor(spec, **kwargs).run()  # type: ignore[arg-type]
