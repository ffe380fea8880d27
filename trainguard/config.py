"""Environment → typed, validated configuration.

Every variable name is declared once, below. Each TG_* name has a MindSpore alias (MS_*); torchrun's RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT and OpenMPI's OMPI_COMM_WORLD_* are recognised too. A bad value raises ConfigError naming it.
"""

from __future__ import annotations

import enum
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from . import tlsconfig
from .errors import ConfigError
from .files import read_small_file
from .strategies import (
    DEFAULT_ELASTIC_DEADLINE_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_STRATEGY,
    RecoverStrategy,
    parse_strategy,
    require_implemented,
    virtual_shards,
)

# --- names (declared once) ----------------------------------------------------
ROLE_ENV = ("TG_ROLE", "MS_ROLE")
SCHED_HOST_ENV = ("TG_SCHED_HOST", "MS_SCHED_HOST")
SCHED_PORT_ENV = ("TG_SCHED_PORT", "MS_SCHED_PORT")
WORKER_NUM_ENV = ("TG_WORKER_NUM", "MS_WORKER_NUM")
NODE_ID_ENV = ("TG_NODE_ID", "MS_NODE_ID")
ENABLE_RECOVERY_ENV = ("TG_ENABLE_RECOVERY", "MS_ENABLE_RECOVERY")
RECOVERY_PATH_ENV = ("TG_RECOVERY_PATH", "MS_RECOVERY_PATH")
HEARTBEAT_INTERVAL_ENV = "TG_HEARTBEAT_INTERVAL"
HEARTBEAT_TIMEOUT_ENV = "TG_HEARTBEAT_TIMEOUT"
CONNECT_TIMEOUT_ENV = "TG_CONNECT_TIMEOUT"
JOIN_TIMEOUT_ENV = "TG_JOIN_TIMEOUT"
COLLECTIVE_TIMEOUT_ENV = "TG_COLLECTIVE_TIMEOUT"
EXACT_ENV, EXACT_MODES = "TG_EXACT", ("warn", "strict", "off")  # the replay audit (train/engine/audit.py)
CHECKPOINT_DIR_ENV = "TG_CHECKPOINT_DIR"  # the dying gasp's folder (default: the recovery path's checkpoints/)
VIRTUAL_SHARDS_ENV = "TG_VIRTUAL_SHARDS"  # the global batch over this many fixed data shards, summed exactly (0: off)
HANG_TIMEOUT_ENV = "TG_HANG_TIMEOUT"  # seconds without progress while peers wait before a worker is replaced; 0 = off
BACKEND_ENV = "TG_BACKEND"
LOCAL_RANK_ENV = "TG_LOCAL_RANK"
FLAP_LIMIT_ENV = "TG_FLAP_LIMIT"
LOG_LEVEL_ENV = "TG_LOG_LEVEL"
QUARANTINE_ENV = "TG_QUARANTINE"
GRACE_PERIOD_ENV = "TG_GRACE_PERIOD"  # seconds from SIGTERM/SIGINT/SIGUSR1 to SIGKILL; the launcher's --grace-period
RECOVER_STRATEGY_ENV = "TG_RECOVER_STRATEGY"  # e.g. "retry,recover-in-place"; the launcher's --recover-strategy
MAX_RETRIES_ENV = "TG_MAX_RETRIES"  # in-process retries of a failed step in a row (the retry strategy)
ELASTIC_DEADLINE_ENV = "TG_ELASTIC_DEADLINE"  # elastic: seconds a dead worker has to come back before the job shrinks
JOB_SECRET_ENV = "TG_JOB_SECRET"  # the job's shared secret (control/auth.py); `trainguard run` makes one
JOB_SECRET_FILE_ENV = "TG_JOB_SECRET_FILE"  # or a file holding it (the same on every host)
INSECURE_ENV = "TG_INSECURE"  # 1: let a scheduler without a secret listen on a routable address
METRICS_PORT_ENV = "TG_METRICS_PORT"  # the scheduler serves Prometheus metrics on this port (off if unset)
METRICS_HOST_ENV = "TG_METRICS_HOST"  # ... on this address (default: the scheduler's)
BEAT_SOCKET_ENV = "TG_BEAT_SOCKET"  # set by `trainguard run`'s agent: beat to it, not the scheduler (launch/relay.py)
TERMINAL_ENV = "TG_TERMINAL"  # set by `trainguard run` on a terminal: where rank 0's progress bar draws
# torchrun and OpenMPI
TORCHRUN_RANK, TORCHRUN_WORLD = "RANK", "WORLD_SIZE"
TORCHRUN_ADDR, TORCHRUN_PORT, TORCHRUN_LOCAL_RANK = "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"
MPI_RANK, MPI_SIZE, MPI_LOCAL_RANK = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
)

# --- defaults (in one place) --------------------------------------------------
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 300.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
DEFAULT_FLAP_LIMIT = 5  # restarts of one node id inside the window before quarantine
DEFAULT_QUARANTINE_S = 30.0
DEFAULT_GRACE_PERIOD_S = 10.0
DEFAULT_MPI_PORT = 8118
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_WORKER_NUM = 1 << 20  # workers in one job (TG_WORKER_NUM, a world size); 10,000 measured: bench/scheduler_scale.py
MAX_SLOTS = 4096  # worker processes one host may run (--workers, --slots, hot spares)
MIN_SECRET_CHARS, MAX_SECRET_BYTES = 16, 4096
MIN_GROUP_BUILD_TIMEOUT_S = 10.0

NODE_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class Role(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class LaunchMode(enum.Enum):
    DYNAMIC = "dynamic"  # TG_ROLE / MS_ROLE: one scheduler process plus N workers
    TORCHRUN = "torchrun"  # RANK/WORLD_SIZE: rank 0 starts the scheduler as its child process
    MPI = "mpi"  # OMPI_COMM_WORLD_*: rank 0 starts the scheduler as its child process


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    role: Role
    mode: LaunchMode
    sched_host: str
    sched_port: int  # 0 = let the OS pick (embedded scheduler under torchrun)
    worker_num: int
    node_id: str | None = None
    enable_recovery: bool = False
    recovery_path: Path | None = None
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    hang_timeout: float | None = None  # TG_HANG_TIMEOUT (control/waits.py); None: off
    exact: str = "warn"  # TG_EXACT: what a replayed step that differs from its first run leads to (audit.py)
    virtual_shards: int = 0  # TG_VIRTUAL_SHARDS (train/parallel/exactsum.py); 0: the float sum over the ranks
    backend: str = "auto"
    local_rank: int | None = None
    flap_limit: int = DEFAULT_FLAP_LIMIT
    quarantine_s: float = DEFAULT_QUARANTINE_S
    embedded_scheduler: bool = False  # this worker process starts (and supervises) the scheduler process
    grace_period: float = DEFAULT_GRACE_PERIOD_S
    recover_strategy: RecoverStrategy = parse_strategy(DEFAULT_STRATEGY)
    secret: bytes | None = field(default=None, repr=False)  # None: connections are not authenticated
    insecure: bool = False  # TG_INSECURE=1
    metrics_port: int | None = None  # TG_METRICS_PORT: Prometheus metrics from the scheduler (control/metrics.py)
    metrics_host: str | None = None  # TG_METRICS_HOST, else sched_host
    beat_socket: str | None = None  # TG_BEAT_SOCKET: heartbeats go to this host's agent (launch/relay.py)
    tls: tlsconfig.TLSConfig | None = None  # TG_ENABLE_SSL + TG_SSL_CONFIG (tlsconfig.py, control/tls.py)

    def __post_init__(self) -> None:
        if not 1 <= self.worker_num <= MAX_WORKER_NUM:
            raise ConfigError(f"worker count must be in 1..{MAX_WORKER_NUM}, got {self.worker_num}")
        if not 0 <= self.sched_port <= 65535:
            raise ConfigError(f"scheduler port must be in 0..65535, got {self.sched_port}")
        if self.node_id is not None and not NODE_ID_RE.match(self.node_id):
            raise ConfigError(
                f"node id {self.node_id!r} is invalid: use 1-64 characters from A-Z a-z 0-9 _ . -"
            )
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                f"{HEARTBEAT_TIMEOUT_ENV}={self.heartbeat_timeout} must exceed "
                f"{HEARTBEAT_INTERVAL_ENV}={self.heartbeat_interval}"
            )
        if self.enable_recovery and self.recovery_path is None:
            raise ConfigError(
                f"{ENABLE_RECOVERY_ENV[0]}=1 needs {RECOVERY_PATH_ENV[0]} (or {RECOVERY_PATH_ENV[1]}): "
                "a directory where the scheduler keeps cluster.db and the event log"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"{BACKEND_ENV}={self.backend!r}: expected auto, gloo or nccl")
        if self.metrics_port is not None and self.metrics_port == self.sched_port:
            raise ConfigError(f"{METRICS_PORT_ENV}={self.metrics_port} is the scheduler's own port; choose another")

    @property
    def group_build_timeout(self) -> float:
        """Seconds to build a generation's process group. Every member has joined before the build
        starts, so it is quick; but gloo retries a refused connection until its timeout, so a peer
        that dies mid-build must not cost the whole collective timeout."""
        return min(self.collective_timeout, max(MIN_GROUP_BUILD_TIMEOUT_S, 2 * self.heartbeat_timeout))

    @property
    def address(self) -> str:
        return f"{self.sched_host}:{self.sched_port}"


# --- readers --------------------------------------------------------------------


def _pick(env: Mapping[str, str], names: tuple[str, ...], same=str.strip) -> tuple[str, str] | None:
    """Value of the first set name; two aliases whose values differ (after `same`) is an error."""
    found = [(n, env[n]) for n in names if env.get(n, "") != ""]
    if len(found) > 1 and len({same(v) for _, v in found}) > 1:
        shown = ", ".join(f"{n}={v!r}" for n, v in found)
        raise ConfigError(f"conflicting aliases: {shown}; set only one of them")
    return found[0] if found else None


def parse_int(name: str, raw: str, *, lo: int, hi: int | None = None) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < lo or (hi is not None and value > hi):
        rng = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
        raise ConfigError(f"{name}={raw!r} is invalid: expected {rng}")
    return value


def env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name}={raw!r} is invalid: expected a number of seconds > 0")
    return value


def exact_mode(raw: str, source: str) -> str:
    mode = raw.strip().lower() or "warn"
    if mode not in EXACT_MODES:
        raise ConfigError(f"{source}={raw!r}: expected one of {', '.join(EXACT_MODES)} (what a step replayed after a "
                          "fault that differs from its first run leads to)")
    return mode


def hang_timeout(env: Mapping[str, str]) -> float | None:
    """TG_HANG_TIMEOUT: seconds, or unset/0/off for none."""
    raw = env.get(HANG_TIMEOUT_ENV, "").strip().lower()
    return None if raw in ("", "0", "off") else env_seconds(env, HANG_TIMEOUT_ENV, 0.0)


def _bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}={raw!r} is invalid: expected 1/0 (or true/false)")


def _required(env: Mapping[str, str], names: tuple[str, ...], what: str, same=str.strip) -> tuple[str, str]:
    got = _pick(env, names, same)
    if got is None:
        raise ConfigError(f"{names[0]} (or {names[1]}) is not set: it must give {what}")
    return got


_ROLE_VALUES = {"scheduler": Role.SCHEDULER, "sched": Role.SCHEDULER, "ms_sched": Role.SCHEDULER,
                "worker": Role.WORKER, "ms_worker": Role.WORKER}


def _same_role(raw: str) -> Role | str:
    return _ROLE_VALUES.get(raw.strip().lower(), raw)


def _role(name: str, raw: str) -> Role:
    role = _ROLE_VALUES.get(raw.strip().lower())
    if role is not None:
        return role
    raise ConfigError(
        f"{name}={raw!r} is invalid: expected scheduler or worker (MindSpore: MS_SCHED or MS_WORKER)"
    )


def _node_id(name: str, raw: str) -> str:
    value = raw.strip()
    if not NODE_ID_RE.match(value):
        raise ConfigError(f"{name}={raw!r} is invalid: expected 1-64 characters from A-Z a-z 0-9 _ . -")
    return value


def _common(env: Mapping[str, str]) -> dict:
    got = _pick(env, ENABLE_RECOVERY_ENV)
    enable = _bool(*got) if got else False
    path = _pick(env, RECOVERY_PATH_ENV)
    local = env.get(LOCAL_RANK_ENV, "")
    flap = env.get(FLAP_LIMIT_ENV, "")
    metrics = env.get(METRICS_PORT_ENV, "").strip()
    return dict(
        enable_recovery=enable,
        recovery_path=Path(path[1]).expanduser() if path else None,
        heartbeat_interval=env_seconds(env, HEARTBEAT_INTERVAL_ENV, DEFAULT_HEARTBEAT_INTERVAL_S),
        heartbeat_timeout=env_seconds(env, HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S),
        connect_timeout=env_seconds(env, CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S),
        join_timeout=env_seconds(env, JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S),
        collective_timeout=env_seconds(env, COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S),
        hang_timeout=hang_timeout(env),
        exact=exact_mode(env.get(EXACT_ENV, ""), EXACT_ENV),
        virtual_shards=virtual_shards(env.get(VIRTUAL_SHARDS_ENV, ""), VIRTUAL_SHARDS_ENV),
        backend=env.get(BACKEND_ENV, "auto").strip().lower() or "auto",
        local_rank=parse_int(LOCAL_RANK_ENV, local, lo=0) if local else None,
        flap_limit=parse_int(FLAP_LIMIT_ENV, flap, lo=1) if flap else DEFAULT_FLAP_LIMIT,
        quarantine_s=env_seconds(env, QUARANTINE_ENV, DEFAULT_QUARANTINE_S),
        grace_period=env_seconds(env, GRACE_PERIOD_ENV, DEFAULT_GRACE_PERIOD_S),
        recover_strategy=strategy_from_env(env),
        secret=read_secret(env),
        insecure=_bool(INSECURE_ENV, env.get(INSECURE_ENV, "")),
        metrics_port=parse_int(METRICS_PORT_ENV, metrics, lo=1, hi=65535) if metrics else None,
        metrics_host=env.get(METRICS_HOST_ENV, "").strip() or None,
        beat_socket=env.get(BEAT_SOCKET_ENV) or None,
        tls=tlsconfig.read(env),
    )


def read_secret(env: Mapping[str, str]) -> bytes | None:
    """The job secret from TG_JOB_SECRET or the file TG_JOB_SECRET_FILE names; None if neither is set."""
    raw, path = env.get(JOB_SECRET_ENV, "").strip(), env.get(JOB_SECRET_FILE_ENV, "").strip()
    hint = "make one with: python -c 'import secrets; print(secrets.token_hex(32))'"
    if raw and path:
        raise ConfigError(f"both {JOB_SECRET_ENV} and {JOB_SECRET_FILE_ENV} are set; set only one of them")
    source = JOB_SECRET_ENV
    if path:
        source = f"{JOB_SECRET_FILE_ENV}={path!r}"
        try:
            raw = read_small_file(path, MAX_SECRET_BYTES, source).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: the job secret is not UTF-8 text; {hint}") from None
        if not raw:
            raise ConfigError(f"{source}: the file is empty; {hint}")
    if not raw:
        return None
    if len(raw) < MIN_SECRET_CHARS:
        raise ConfigError(f"{source}: the job secret has {len(raw)} characters, fewer than {MIN_SECRET_CHARS}; {hint}")
    return raw.encode()


def strategy_from_env(env: Mapping[str, str]) -> RecoverStrategy:
    """TG_RECOVER_STRATEGY and TG_MAX_RETRIES; recover and elastic are refused at start (not built yet)."""
    retries = env.get(MAX_RETRIES_ENV, "")
    limit = parse_int(MAX_RETRIES_ENV, retries, lo=0) if retries.strip() else DEFAULT_MAX_RETRIES
    deadline = env_seconds(env, ELASTIC_DEADLINE_ENV, DEFAULT_ELASTIC_DEADLINE_S)
    strategy = parse_strategy(env.get(RECOVER_STRATEGY_ENV), source=RECOVER_STRATEGY_ENV, max_retries=limit,
                              elastic_deadline=deadline)
    return require_implemented(strategy, RECOVER_STRATEGY_ENV)


def detect_mode(env: Mapping[str, str]) -> LaunchMode | None:
    if _pick(env, ROLE_ENV, _same_role):
        return LaunchMode.DYNAMIC
    if env.get(TORCHRUN_RANK) and env.get(TORCHRUN_WORLD):
        return LaunchMode.TORCHRUN
    if env.get(MPI_RANK) and env.get(MPI_SIZE):
        return LaunchMode.MPI
    return None


def from_env(env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Read and validate the whole configuration, or raise ConfigError naming the variable."""
    env = os.environ if env is None else env
    mode = detect_mode(env)
    if mode is None:
        raise ConfigError(
            f"no cluster environment found: set {ROLE_ENV[0]} (scheduler|worker) with "
            f"{SCHED_HOST_ENV[0]}, {SCHED_PORT_ENV[0]} and {WORKER_NUM_ENV[0]} "
            "(MindSpore names MS_* work too), or start the script with `trainguard run`, "
            "torchrun or mpirun"
        )
    common = _common(env)
    if mode is LaunchMode.DYNAMIC:
        role = _role(*_required(env, ROLE_ENV, "this process's role", _same_role))
        host = _required(env, SCHED_HOST_ENV, "the scheduler's host or IP address")[1].strip()
        port = parse_int(*_required(env, SCHED_PORT_ENV, "the scheduler's TCP port"), lo=1, hi=65535)
        workers = parse_int(*_required(env, WORKER_NUM_ENV, "the number of worker processes"), lo=1,
                            hi=MAX_WORKER_NUM)
        node = _pick(env, NODE_ID_ENV)
        return ClusterConfig(
            role=role, mode=mode, sched_host=host, sched_port=port, worker_num=workers,
            node_id=_node_id(*node) if node else None, **common,
        )
    if mode is LaunchMode.TORCHRUN:
        rank = parse_int(TORCHRUN_RANK, env[TORCHRUN_RANK], lo=0)
        world = parse_int(TORCHRUN_WORLD, env[TORCHRUN_WORLD], lo=1, hi=MAX_WORKER_NUM)
        local = env.get(TORCHRUN_LOCAL_RANK, "")
        host = env.get(TORCHRUN_ADDR, "") or "127.0.0.1"
        port_env = _pick(env, SCHED_PORT_ENV)
        port = parse_int(*port_env, lo=1, hi=65535) if port_env else 0  # 0: published via torchrun's store
    else:
        rank = parse_int(MPI_RANK, env[MPI_RANK], lo=0)
        world = parse_int(MPI_SIZE, env[MPI_SIZE], lo=1, hi=MAX_WORKER_NUM)
        local = env.get(MPI_LOCAL_RANK, "")
        host_env = _pick(env, SCHED_HOST_ENV)
        host = host_env[1] if host_env else (env.get(TORCHRUN_ADDR, "") or "127.0.0.1")
        port_env = _pick(env, SCHED_PORT_ENV)
        port = parse_int(*port_env, lo=1, hi=65535) if port_env else DEFAULT_MPI_PORT
    if rank >= world:
        names = (TORCHRUN_RANK, TORCHRUN_WORLD) if mode is LaunchMode.TORCHRUN else (MPI_RANK, MPI_SIZE)
        raise ConfigError(f"{names[0]}={rank} is invalid: expected a rank below {names[1]}={world}")
    if local and common["local_rank"] is None:
        common["local_rank"] = parse_int("LOCAL_RANK", local, lo=0)
    return ClusterConfig(
        role=Role.WORKER, mode=mode, sched_host=host, sched_port=port, worker_num=world,
        node_id=str(rank), embedded_scheduler=(rank == 0), **common,
    )


def check_recovery_path(path: Path) -> Path:
    """Create the recovery directory and prove it is writable, at start."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"recovery path {str(path)!r} is not writable ({exc.strerror or exc}); "
            f"point {RECOVERY_PATH_ENV[0]} at a directory this user can write"
        ) from None
    return path


def this_host() -> str:
    return socket.gethostname()
