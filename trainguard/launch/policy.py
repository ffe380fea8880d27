"""What the agent decides and what it starts its children with: pure functions and data.

`decide_exit` maps one child's exit to an `Action`: a deterministic error (exit 78, worker_main.py)
and a crash loop (budget.py) end the job; `failure_summary` words the job's root cause;
`LaunchSpec` is one agent's validated job description; `worker_cmd` and the `*_env` builders give
each child (scheduler, worker, hot spare) its command and environment. `Supervisor` (agent.py)
carries these out.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..config import (
    DEFAULT_GRACE_PERIOD_S, ELASTIC_DEADLINE_ENV, ENABLE_RECOVERY_ENV, EXACT_ENV, GRACE_PERIOD_ENV,
    HANG_TIMEOUT_ENV, JOB_SECRET_ENV, JOB_SECRET_FILE_ENV, LOCAL_RANK_ENV, MAX_RETRIES_ENV, MAX_SLOTS,
    MAX_WORKER_NUM, METRICS_PORT_ENV, NODE_ID_ENV, RECOVER_STRATEGY_ENV, RECOVERY_PATH_ENV, ROLE_ENV,
    SCHED_HOST_ENV, SCHED_PORT_ENV, TERMINAL_ENV, VIRTUAL_SHARDS_ENV, WORKER_NUM_ENV, Role,
)
from ..control.auth import worker_secret
from ..control.placement import PlacementPolicy
from ..errors import ConfigError
from ..exitcodes import EXIT_CONFIG, EXIT_CONFIG_ERROR, EXIT_FAULT_STOP, EXIT_JOB_FAILED, EXIT_PREEMPTED, VERDICTS
from ..signals import signal_name
from ..strategies import DEFAULT_STRATEGY, RecoverStrategy, parse_strategy
from .budget import CRASH_LOOP_ADVICE, DEFAULT_MAX_RESTARTS, RestartRate
from .worker_main import deterministic_error

DEFAULT_GRACE_S = DEFAULT_GRACE_PERIOD_S  # one setting: --grace-period, TG_GRACE_PERIOD
DEFAULT_SCHED_EXIT_WAIT_S = 15.0
RERUN = "run the same command again"
# EXIT_CONFIG: a scheduler exiting 2 rejected its config; EXIT_JOB_FAILED: it ended the job as failed (root
# cause on its stderr). Neither is restarted. EXIT_CONFIG_ERROR: a worker's script raised a deterministic error
# (worker_main.py); it is not restarted either. EXIT_PREEMPTED, EXIT_FAULT_STOP: see exitcodes.py.


# --- decisions (pure) ------------------------------------------------------------


class Action(enum.Enum):
    FINISHED = "finished"  # exited 0
    RESTART = "restart"
    GIVE_UP = "give_up"
    PREEMPTED = "preempted"  # a graceful exit (75): no restart; the agent exits 75 once every worker has left
    STOPPED = "stopped"  # left because the job stops after a fault elsewhere (76): a consequence, not a cause
    LEFT_OUT = "left_out"  # elastic, restarts used up: not replaced; the other workers go on without it


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    crash_loop: bool = False  # GIVE_UP or LEFT_OUT because the child's restart rate is used up


_DEFAULT_STRATEGY = parse_strategy(DEFAULT_STRATEGY)
_DEFAULT_RATE = RestartRate()


def decide_exit(role: Role, returncode: int, restarts_used: int, max_restarts: int,
                strategy: RecoverStrategy = _DEFAULT_STRATEGY, *, stopping: bool = False,
                rate: RestartRate = _DEFAULT_RATE, restarts: Sequence[float] = (), now: float = 0.0) -> Decision:
    """What to do when a child exits; `returncode` < 0 means killed by signal -returncode.
    `restarts_used` of `max_restarts` counts the whole job on this host; `restarts` are the times (monotonic,
    as `now`) this child was restarted, for `rate`. `stopping`: the job is already ending (a graceful exit
    began), so nothing is restarted."""
    if returncode == 0:
        return Decision(Action.FINISHED, "exited with code 0")
    if role is Role.SCHEDULER and returncode == EXIT_CONFIG:
        return Decision(Action.GIVE_UP, "the scheduler rejected its configuration; a restart cannot help")
    if role is Role.SCHEDULER and returncode == EXIT_JOB_FAILED:
        return Decision(Action.GIVE_UP, "the scheduler ended the job as failed")
    if returncode in VERDICTS:  # a verdict on the script (a desync, a replay that differed): no restart changes it
        return Decision(Action.GIVE_UP, VERDICTS[returncode])
    if role is Role.SCHEDULER and returncode == EXIT_PREEMPTED:
        return Decision(Action.FINISHED, "the scheduler ended the job as stopped")
    if role is Role.WORKER and returncode == EXIT_PREEMPTED:
        return Decision(Action.PREEMPTED, "stopped gracefully")
    if role is Role.WORKER and returncode == EXIT_FAULT_STOP:
        return Decision(Action.STOPPED, "stopped because the job stops after a fault")
    if stopping:
        return Decision(Action.STOPPED, "the job is stopping; no restart")
    if role is Role.WORKER and returncode == EXIT_CONFIG_ERROR:  # under any strategy: it would fail again
        return Decision(Action.GIVE_UP, "a deterministic error (exit code 78): a restart would fail the same way")
    if role is Role.WORKER and not strategy.restarts:
        return Decision(Action.GIVE_UP, f"the recover strategy is {strategy}: a dead worker is not replaced")
    if max_restarts == 0:
        return Decision(Action.GIVE_UP, "restarts are off (--max-restarts 0)")
    loop = rate.crash_loop(restarts, now)
    if restarts_used < max_restarts and not loop:
        return Decision(Action.RESTART, f"restart {restarts_used + 1}/{max_restarts}")
    why = loop or f"all {max_restarts} restarts are used"
    if role is Role.WORKER and strategy.elastic:
        return Decision(Action.LEFT_OUT, f"{why}; elastic: the job goes on without it", bool(loop))
    return Decision(Action.GIVE_UP, why, bool(loop))


def describe_exit(name: str, pid: int, returncode: int) -> str:
    if returncode < 0:
        return f"{name} (pid {pid}) was killed by signal {signal_name(-returncode)}"
    return f"{name} (pid {pid}) exited with code {returncode}"


def exit_code_for(returncode: int) -> int:
    """The agent's exit code for a failed job: the child's own code if > 0, else 1."""
    return returncode if returncode > 0 else 1


def job_exit_code(root: Failure, last: Failure) -> int:
    """The agent's exit code when `last` ended the job: 78 if it was a deterministic error, else the root cause's."""
    if last.role is Role.WORKER and last.returncode == EXIT_CONFIG_ERROR:
        return EXIT_CONFIG_ERROR
    verdict = next((c for c in (last.returncode, root.returncode) if c in VERDICTS), None)
    return verdict or exit_code_for(root.returncode)


def signal_exit_code(signum: int) -> int:
    return 128 + signum


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed child: the first one is the job's root cause."""

    name: str
    pid: int
    returncode: int
    tail: tuple[str, ...] = ()
    role: Role = Role.WORKER

    def describe(self) -> str:
        return describe_exit(self.name, self.pid, self.returncode)


def failure_summary(root: Failure, restarts_used: int, last: Failure | None = None,
                    max_restarts: int | None = None, *, crash_loop: str = "") -> str:
    """The one message printed when the job fails for good: the restarts used (of the job-wide
    budget), the root cause (the first failure) and, if another one ended the job, that one.
    A deterministic error that ended the job comes first, named; `crash_loop`: why `last` (or the
    root) was not restarted again."""
    end = last or root
    deterministic = end.role is Role.WORKER and end.returncode == EXIT_CONFIG_ERROR
    if deterministic:
        error = deterministic_error(end.tail)
        head = (f"trainguard: {end.name} (pid {end.pid}) failed with a deterministic error"
                + (f": {error}" if error else f" (exit code {EXIT_CONFIG_ERROR})")
                + "; a restart would fail the same way, so the job ends without one")
        if end is not root:
            head += f"\n  first failure: {root.describe()}"
        root = end
    elif root.role is Role.SCHEDULER and root.returncode == EXIT_JOB_FAILED:
        head = f"trainguard: the scheduler (pid {root.pid}) ended the job as failed; its last lines give the root cause"
    elif root.returncode in VERDICTS or end.returncode in VERDICTS:
        code = end.returncode if end.returncode in VERDICTS else root.returncode
        head = f"trainguard: {VERDICTS[code]} (exit code {code}); the scheduler's last lines say where"
    elif restarts_used:
        plural = "restart" if restarts_used == 1 else "restarts"
        head = f"trainguard: giving up after {restarts_used} {plural}; root cause: {root.describe()}"
    else:
        head = f"trainguard: {root.describe()}"
    if crash_loop:
        head += f"\n  {end.name}: {crash_loop}. {CRASH_LOOP_ADVICE}"
    elif max_restarts is not None and restarts_used >= max_restarts and not deterministic and not (
            root.role is Role.SCHEDULER and root.returncode == EXIT_JOB_FAILED):
        head += f"\n  max restarts: {restarts_used} of {max_restarts} used (--max-restarts counts the whole job)"
    if last is not None and last is not root:
        head += f"\n  last failure: {last.describe()}"
        root = last if last.tail else root
    if not root.tail:
        return head
    return "\n".join([head, f"last stderr lines of {root.name}:", *("    " + ln for ln in root.tail)])


def resume_advice(saved: bool | None, rerun: str = RERUN) -> str:
    """What a rerun does after a graceful stop: `saved` says whether the workers wrote a dying-gasp
    checkpoint (their `graceful_exit` events), None when that is unknown; `rerun`: how (`LaunchSpec.rerun`)."""
    if saved is None:
        return f"{rerun} to resume from its dying-gasp checkpoint, if one is configured"
    if saved:
        return f"{rerun} to resume from its dying-gasp checkpoint"
    return "no dying-gasp checkpoint was saved (none is configured), so running the same command again starts over"


def ended_exit(preempted: bool, fault_stops: list[Failure], root: Failure | None,
               restarts_used: int, saved: bool | None = None, rerun: str = RERUN, *,
               done: bool = False) -> tuple[int, str]:
    """Every worker has left: (exit code, last message). 75 after a graceful exit; after a stop on a fault, the root
    cause's code (or the first stop's), unless the job ended `done` (every rank ran its script to the end): else 0."""
    if fault_stops and not preempted:
        cause = root or fault_stops[0]
        if done:
            return 0, (f"trainguard: the job finished: every rank ran its script to the end; {cause.describe()} "
                       "after that, with nothing left to redo")
        return exit_code_for(cause.returncode), failure_summary(cause, restarts_used)
    if preempted:
        return EXIT_PREEMPTED, ("trainguard: the job stopped gracefully (exit code 75) at a commit point; "
                                + resume_advice(saved, rerun))
    return 0, ""


def signalled_exit(codes: list[int | None], signum: int, saved: bool | None = None,
                   rerun: str = RERUN) -> tuple[int, str]:
    """After the agent forwarded signal `signum`: 75 if the workers left gracefully (75, or 0 when they had
    finished anyway), else 128 + signum."""
    if EXIT_PREEMPTED in codes and all(c in (0, EXIT_PREEMPTED) for c in codes):
        return EXIT_PREEMPTED, (f"trainguard: stopped on {signal_name(signum)}: every worker left at a commit "
                                f"point; {resume_advice(saved, rerun)}")
    return signal_exit_code(signum), ""


# --- what the children are started with -------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """One agent's job description, validated; errors name the flag."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    sched_host: str = "127.0.0.1"
    sched_port: int = 0  # 0 = not chosen yet (the CLI picks a free one)
    max_restarts: int = DEFAULT_MAX_RESTARTS  # restarts of this host's children together (budget.py)
    restart_rate: RestartRate = _DEFAULT_RATE  # and of each one within a window: a crash loop ends the job
    hot_spares: int = 0  # warm processes kept to replace dead workers (the CLI defaults to 1 with restarts on)
    recovery_path: Path | None = None
    recovery_temporary: bool = False  # a new temporary folder (no --recovery-path), where the dying gasp goes
    log_dir: Path | None = None
    grace_s: float = DEFAULT_GRACE_S  # --grace-period / TG_GRACE_PERIOD: signal -> dying-gasp save -> SIGKILL
    hang_timeout: float | None = None  # --hang-timeout / TG_HANG_TIMEOUT (control/waits.py); None: off
    exact: str = "warn"  # --exact / TG_EXACT: the replay audit (train/engine/audit.py)
    virtual_shards: int = 0  # --virtual-shards / TG_VIRTUAL_SHARDS (train/parallel/exactsum.py)
    sched_exit_wait_s: float = DEFAULT_SCHED_EXIT_WAIT_S
    recover_strategy: RecoverStrategy = _DEFAULT_STRATEGY
    slots: int = 0  # recover: workers this host can run (--slots); 0 = its own worker count
    placement: PlacementPolicy = PlacementPolicy()  # recover: host exclusion (--host-fail-limit, ...)
    secret: bytes | None = field(default=None, repr=False)  # the job secret (launch/secret.py); in the children's env
    metrics_port: int | None = None  # --metrics-port: the scheduler serves Prometheus metrics (control/metrics.py)
    terminal: str | None = None  # the agent's terminal, if its stderr is one: workers' progress bars draw there
    ssl_config: Path | None = None  # --ssl-config: TLS (tlsconfig.py); set in this agent's env and its children's
    zygote: bool = True  # workers and spares fork from one warm process (zygote.py); --no-zygote: fresh ones

    def __post_init__(self) -> None:
        if self.slots and self.slots < self.nproc_per_node:
            raise ConfigError(f"--slots must be >= the workers on this host ({self.nproc_per_node}), got {self.slots}")
        if not 1 <= self.nproc_per_node <= MAX_SLOTS:
            raise ConfigError(f"--workers/--nproc-per-node must be in 1..{MAX_SLOTS}, got {self.nproc_per_node}")
        if self.slots > MAX_SLOTS or self.hot_spares > MAX_SLOTS:
            raise ConfigError(f"--slots and --hot-spares must be at most {MAX_SLOTS} (processes on one host), got "
                              f"{self.slots} and {self.hot_spares}")
        if not 1 <= self.nnodes <= MAX_WORKER_NUM // self.nproc_per_node:
            raise ConfigError(f"--nnodes must be in 1..{MAX_WORKER_NUM // self.nproc_per_node} (at most "
                              f"{MAX_WORKER_NUM} workers in a job), got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.hot_spares < 0:
            raise ConfigError(f"--hot-spares must be >= 0 (0 turns them off), got {self.hot_spares}")
        if not 0 <= self.sched_port <= 65535:
            raise ConfigError(f"--sched-port must be in 1..65535, got {self.sched_port}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 1..65535, got {self.metrics_port}")
        if self.grace_s <= 0 or self.sched_exit_wait_s < 0:
            raise ConfigError(f"--grace-period must be > 0 seconds (got {self.grace_s:g}) and the scheduler exit "
                              "wait >= 0")

    @property
    def capacity(self) -> int:
        return self.slots or self.nproc_per_node

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def enable_recovery(self) -> bool:
        return self.max_restarts > 0

    @property
    def rerun(self) -> str:
        """How the job is run again to resume from its dying gasp: a temporary recovery folder is a new one in every
        run, so the command must name the one this run saved into."""
        if self.recovery_temporary and self.recovery_path is not None:
            return f"run the same command with --recovery-path {self.recovery_path}"
        return RERUN

    @property
    def events_path(self) -> Path | None:
        """The job's events.jsonl, shared by the scheduler, the workers and the agents of this host."""
        return self.recovery_path / "events.jsonl" if self.recovery_path is not None else None

    @property
    def uses_hot_spares(self) -> bool:
        """Spares only replace workers, so without restarts they would never be used."""
        return self.hot_spares > 0 and self.max_restarts > 0 and self.recover_strategy.restarts

    @property
    def hosts_scheduler(self) -> bool:
        return self.node_rank == 0


def worker_cmd(spec: LaunchSpec) -> list[str]:
    """A cold-started worker: the script under worker_main, which exits 78 on a deterministic error."""
    return [sys.executable, "-u", "-m", "trainguard.launch.worker_main", spec.script, *spec.script_args]


def spare_cmd(script: str, ready_fd: int) -> list[str]:
    """A hot spare (spare_main.py) that writes a byte to `ready_fd` once warm."""
    return [sys.executable, "-u", "-m", "trainguard.launch.spare_main", "--ready-fd", str(ready_fd), script]


def set_env(env: dict[str, str], names: str | tuple[str, ...], value: str | None) -> None:
    """Set the first name (or remove it if value is None) and drop its aliases, so they cannot conflict."""
    names = (names,) if isinstance(names, str) else names
    for alias in names[1:]:
        env.pop(alias, None)
    if value is None:
        env.pop(names[0], None)
    else:
        env[names[0]] = value


def _cluster_env(base: Mapping[str, str], spec: LaunchSpec, role: Role) -> dict[str, str]:
    env = dict(base)
    set_env(env, ROLE_ENV, role.value)
    set_env(env, SCHED_HOST_ENV, spec.sched_host)
    set_env(env, SCHED_PORT_ENV, str(spec.sched_port))
    set_env(env, WORKER_NUM_ENV, str(spec.world_size))
    set_env(env, ENABLE_RECOVERY_ENV, "1" if spec.enable_recovery else "0")
    set_env(env, RECOVERY_PATH_ENV, str(spec.recovery_path) if spec.recovery_path else None)
    env[GRACE_PERIOD_ENV] = f"{spec.grace_s:g}"
    env[RECOVER_STRATEGY_ENV] = str(spec.recover_strategy)
    env[MAX_RETRIES_ENV] = str(spec.recover_strategy.max_retries)
    env[ELASTIC_DEADLINE_ENV] = f"{spec.recover_strategy.elastic_deadline:g}"
    env[HANG_TIMEOUT_ENV] = f"{spec.hang_timeout:g}" if spec.hang_timeout else "0"
    env[EXACT_ENV] = spec.exact
    env[VIRTUAL_SHARDS_ENV] = str(spec.virtual_shards)
    env.pop(JOB_SECRET_FILE_ENV, None)
    secret = spec.secret if spec.secret is None or role is Role.SCHEDULER else worker_secret(spec.secret)
    set_env(env, JOB_SECRET_ENV, secret.decode() if secret is not None else None)  # a worker's: control/auth.py
    env["PYTHONUNBUFFERED"] = "1"
    return env


def scheduler_env(base: Mapping[str, str], spec: LaunchSpec) -> dict[str, str]:
    env = _cluster_env(base, spec, Role.SCHEDULER)
    env.update(spec.placement.env())  # recover: the scheduler decides placements and host exclusion
    if spec.metrics_port is not None:
        env[METRICS_PORT_ENV] = str(spec.metrics_port)
    set_env(env, NODE_ID_ENV, None)
    set_env(env, LOCAL_RANK_ENV, None)
    return env


def worker_env(base: Mapping[str, str], spec: LaunchSpec, index: int, *, node_id: str | None = None) -> dict[str, str]:
    """Local worker `index`; its node id is this host's share of the ranks, or `node_id` (recover: a worker
    placed here from another host keeps its node id, hence its rank)."""
    env = _cluster_env(base, spec, Role.WORKER)
    node = node_id if node_id is not None else str(spec.node_rank * spec.nproc_per_node + index)
    set_env(env, NODE_ID_ENV, node)
    set_env(env, LOCAL_RANK_ENV, str(index))
    env.update(torchrun_env(spec, int(node), index))
    env.setdefault("OMP_NUM_THREADS", "1")
    set_env(env, TERMINAL_ENV, spec.terminal)  # their stderr is a pipe to the agent (train/engine/progress.py)
    return env


def torchrun_env(spec: LaunchSpec, rank: int, index: int) -> dict[str, str]:
    """What torchrun sets before a worker's script starts, for scripts (and frameworks) that read it first. A
    node id of `trainguard run` is its fixed rank; `init()` sets RANK and WORLD_SIZE to each generation's values
    (the same, unless `elastic` shrank the job). MASTER_ADDR/MASTER_PORT name the scheduler: a script's own
    `init_process_group()` joins trainguard's group and opens no store there (worker/pginit.py). A restart sets its
    own TORCHELASTIC_RESTART_COUNT (agent.py)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": str(index),
            "LOCAL_WORLD_SIZE": str(spec.nproc_per_node), "GROUP_RANK": str(spec.node_rank),
            "GROUP_WORLD_SIZE": str(spec.nnodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(spec.world_size),
            "ROLE_NAME": "default", "MASTER_ADDR": spec.sched_host, "MASTER_PORT": str(spec.sched_port),
            TORCHELASTIC_RESTART_COUNT: "0"}


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def spare_env(base: Mapping[str, str], spec: LaunchSpec) -> dict[str, str]:
    """A hot spare's env: this host's worker env without a node id or local rank (it gets them on activation)."""
    env = worker_env(base, spec, 0)
    set_env(env, NODE_ID_ENV, None)
    set_env(env, LOCAL_RANK_ENV, None)
    for name in (*TORCHRUN_ENV, TORCHELASTIC_RESTART_COUNT):  # it learns them when it takes a worker's place
        env.pop(name, None)
    return env
