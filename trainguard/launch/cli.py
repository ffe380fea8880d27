"""`trainguard` command line: `scheduler`, `run`, `ckpt`, `chaos`, `status`, `report` and `certs`.

Flag names follow torchrun where they mean the same (`--nproc-per-node`, `--nnodes`,
`--node-rank`, `--max-restarts`, `--log-dir`; `--master-addr/--master-port` are aliases of
`--sched-host/--sched-port`). Bad input prints one message to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from ..config import (
    CHECKPOINT_DIR_ENV,
    EXACT_ENV,
    EXACT_MODES,
    INSECURE_ENV,
    RECOVERY_PATH_ENV,
    ROLE_ENV,
    SCHED_HOST_ENV,
    SCHED_PORT_ENV,
    VIRTUAL_SHARDS_ENV,
    WORKER_NUM_ENV,
    Role,
    check_recovery_path,
    exact_mode,
    from_env,
)
from ..strategies import virtual_shards
from ..errors import CheckpointError, ConfigError
from ..tlsconfig import ENABLE_SSL_ENV, SSL_CONFIG_ENV
from ..tlsconfig import read as read_tls
from . import certs, chaos, observe, slurm, verify
from .agent import Supervisor
from .budget import restart_rate
from .jobfile import merge_job_file, resolve_hang_timeout, resolve_strategy
from .policy import EXIT_CONFIG, LaunchSpec, set_env
from .relocate import placement_policy
from .secret import job_secret, write_secret

DEFAULT_SCHED_HOST = "127.0.0.1"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard", description="Fault-tolerant PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sched = sub.add_parser("scheduler", help="run the job's scheduler in this process",
                           description="Run the scheduler; flags override TG_*/MS_* environment variables.")
    sched.add_argument("--host", help="address to serve on (TG_SCHED_HOST)")
    sched.add_argument("--port", type=int, help="TCP port (TG_SCHED_PORT); 0: the OS picks one (needs --port-fd)")
    sched.add_argument("--workers", type=int, help="total number of workers in the job (TG_WORKER_NUM)")
    sched.add_argument("--port-fd", type=int, help="write the port it listens on, as a line, to this inherited fd")
    sched.add_argument("--parent-pid", type=int, help="end when this process (the one that started it) dies")
    sched.set_defaults(handler=_scheduler)

    # allow_abbrev=False (run, verify): a script's own option after the script (`--sched cosine`) is never taken for a
    # prefix of trainguard's (`--sched-host`), as torchrun passes it on
    run = sub.add_parser("run", help="start and supervise this host's workers (and the scheduler on node rank 0)",
                         allow_abbrev=False)
    add_run_arguments(run)
    run.set_defaults(handler=_run)

    ckpt = sub.add_parser("ckpt", help="list, verify, inspect and repair checkpoints")
    cmds = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    ls = cmds.add_parser("ls", help="the checkpoints in DIR, oldest step first")
    ls.add_argument("path", type=Path, metavar="DIR")
    cmds.add_parser("verify", help="hash every file against the manifest").add_argument("path", type=Path)
    inspect = cmds.add_parser("inspect", help="step, files, layout and every tensor's slices")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="print the manifest as it is")
    recover = cmds.add_parser("recover", help="rebuild a rank's missing or corrupt file from its replicas")
    recover.add_argument("path", type=Path)
    recover.add_argument("--rank", type=int, required=True)
    ckpt.set_defaults(handler=_ckpt)
    check = sub.add_parser("verify", help="run a script N steps without a fault, then once per fault (kill -9 in a "
                           "step, after a commit, outside a step, at an epoch's end; SIGTERM and a rerun), and compare "
                           "every tensor", description=verify.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    verify.add_arguments(check)
    add_run_arguments(check)
    check.set_defaults(handler=verify.main)
    chaos.add_parser(sub)
    observe.add_parsers(sub)
    certs.add_parser(sub)
    return parser


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """`trainguard run`'s flags, the script and its arguments (verify takes them too)."""
    run.add_argument("--workers", "--nproc-per-node", "--nproc_per_node", dest="workers", type=int,
                     help="worker processes on this host (default 1)")
    run.add_argument("--nnodes", type=int, help="number of hosts (default 1)")
    run.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int,
                     help="this host's rank; rank 0 starts the scheduler (default 0)")
    run.add_argument("--sched-host", "--master-addr", "--master_addr", dest="sched_host",
                     help=f"scheduler address (default TG_SCHED_HOST, else {DEFAULT_SCHED_HOST})")
    run.add_argument("--sched-port", "--master-port", "--master_port", dest="sched_port", type=int,
                     help="scheduler port (default TG_SCHED_PORT, else a free port; required with --nnodes > 1)")
    run.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                     help="restarts allowed for the whole job on this host; 0 turns recovery off (default 32767)")
    run.add_argument("--restart-limit", dest="restart_limit", type=int,
                     help="a crash loop ends the job: one worker may be restarted at most this many times within "
                          "--restart-window (default TG_RESTART_LIMIT, else 3)")
    run.add_argument("--restart-window", dest="restart_window", type=float,
                     help="seconds (default TG_RESTART_WINDOW, else 3600)")
    run.add_argument("--hot-spares", "--hot_spares", dest="hot_spares", type=int,
                     help="warm processes (torch already imported) kept to replace a dead worker in well "
                          "under a second; 0 turns them off (default 1 with restarts on, else 0)")
    run.add_argument("--no-zygote", dest="no_zygote", action="store_true", default=None,
                     help="start every worker and spare as a fresh interpreter, not forked from one warm process "
                          "that imported torch once (for a library that breaks in a forked process)")
    run.add_argument("--recovery-path", dest="recovery_path", type=Path,
                     help="directory for cluster.db and events (default TG_RECOVERY_PATH, else a new temp dir)")
    run.add_argument("--log-dir", "--log_dir", dest="log_dir", type=Path,
                     help="also write each child's output to DIR/worker_<node id>.log and DIR/scheduler.log")
    run.add_argument("--recover-strategy", dest="recover_strategy",
                     help="what a fault leads to: retry, recover-in-place, recover, elastic, dump, exit, "
                          "combined with commas (default TG_RECOVER_STRATEGY, else recover-in-place)")
    run.add_argument("--max-retries", dest="max_retries", type=int,
                     help="in-process retries of a failed step in a row (default TG_MAX_RETRIES, else 3)")
    run.add_argument("--elastic-deadline", dest="elastic_deadline", type=float,
                     help="elastic: seconds a dead worker has to come back before the others go on without it "
                          "(default TG_ELASTIC_DEADLINE, else 30)")
    run.add_argument("--grace-period", dest="grace_period", type=float,
                     help="seconds from SIGTERM/SIGINT/SIGUSR1 to SIGKILL, for the dying-gasp checkpoint "
                          "(default TG_GRACE_PERIOD, else 10)")
    run.add_argument("--exact", choices=EXACT_MODES,
                     help="a step replayed after a fault that differs from its first run: warn (say so), strict (end "
                          "the job, exit 80), off (no audit) (default TG_EXACT, else warn)")
    run.add_argument("--virtual-shards", dest="virtual_shards",
                     help="define the global batch over this many fixed data shards and sum their gradients exactly, "
                          "so the result has the same bits at every world size (elastic runs stay exact); "
                          "default TG_VIRTUAL_SHARDS, else off")
    run.add_argument("--hang-timeout", dest="hang_timeout", type=float,
                     help="seconds a worker may make no progress (no step, collective or batch) while its peers wait "
                          "for it before its stacks are printed and it is replaced (default TG_HANG_TIMEOUT, else off)")
    run.add_argument("--slots", type=int,
                     help="recover: workers this host can run, its own included; room for workers moved here from "
                          "another host (default: --workers)")
    run.add_argument("--host-fail-limit", dest="host_fail_limit", type=int,
                     help="recover: a host with this many worker failures within --host-fail-window is excluded "
                          "for --host-cooldown (default TG_HOST_FAIL_LIMIT, else 3)")
    run.add_argument("--host-fail-window", dest="host_fail_window", type=float,
                     help="recover: seconds (default TG_HOST_FAIL_WINDOW, else 300)")
    run.add_argument("--host-cooldown", dest="host_cooldown", type=float,
                     help="recover: seconds an excluded host takes no worker (default TG_HOST_COOLDOWN, else 300)")
    run.add_argument("--metrics-port", dest="metrics_port", type=int,
                     help="the scheduler serves Prometheus metrics on this port, at /metrics (default TG_METRICS_PORT, "
                          "else off); TG_METRICS_HOST sets the address (default the scheduler's)")
    run.add_argument("--ssl-config", dest="ssl_config", type=Path,
                     help="TLS between every process and the scheduler, as TG_ENABLE_SSL=1 TG_SSL_CONFIG=this file "
                          "(reference 001's JSON); key passwords from TG_SERVER_PASSWORD(_FILE), TG_CLIENT_PASSWORD(_FILE)")
    run.add_argument("--config", type=Path, help="a job file (YAML or JSON) with these flags; flags win over it")
    run.add_argument("script", nargs="?", help="the training script (or `script:` in --config)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # verify passes run's flags on as they were given
    try:
        return args.handler(args)
    except (ConfigError, CheckpointError) as exc:
        print(f"trainguard {args.command}: {exc}", file=sys.stderr)
        return EXIT_CONFIG


# --- scheduler ------------------------------------------------------------------------


def _scheduler(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    set_env(env, ROLE_ENV, Role.SCHEDULER.value)
    any_port = args.port == 0  # the environment may not say 0 (workers could not find it); --port-fd tells it
    if any_port and args.port_fd is None:
        raise ConfigError("--port 0 lets the OS pick the port; give --port-fd too, so the workers can learn it")
    port = 1 if any_port else args.port  # 1 passes validation and is replaced by 0 below
    for names, value in ((SCHED_HOST_ENV, args.host), (SCHED_PORT_ENV, port), (WORKER_NUM_ENV, args.workers)):
        if value is not None:
            set_env(env, names, str(value))
    cfg = from_env(env)
    if any_port:
        cfg = replace(cfg, sched_port=0)
    if cfg.enable_recovery and cfg.recovery_path is not None:
        check_recovery_path(cfg.recovery_path)
    from ..control.sched_main import (
        run_scheduler,  # lazy: the agent must import without it
    )

    return run_scheduler(cfg, port_fd=args.port_fd, parent_pid=args.parent_pid)


# --- ckpt -------------------------------------------------------------------------------


def _ckpt(args: argparse.Namespace) -> int:
    from ..checkpoint import cli_cmds  # lazy: imports torch

    if args.ckpt_command == "recover":
        return cli_cmds.recover(args.path, args.rank)
    if args.ckpt_command == "inspect":
        return cli_cmds.inspect(args.path, args.json)
    return getattr(cli_cmds, args.ckpt_command)(args.path)


# --- run --------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    spec = resolve_run(args, os.environ)
    os.environ.update(ssl_env(spec.ssl_config))  # --ssl-config: for this agent's connections and all it starts
    return Supervisor(spec).run()


def ssl_env(ssl_config: Path | None) -> dict[str, str]:
    """--ssl-config F (or `ssl_config:`) is TG_ENABLE_SSL=1 TG_SSL_CONFIG=F."""
    return {ENABLE_SSL_ENV: "1", SSL_CONFIG_ENV: str(ssl_config)} if ssl_config is not None else {}


def _hot_spares(args: argparse.Namespace) -> int:
    if args.hot_spares is not None:
        return args.hot_spares
    return 1 if args.max_restarts > 0 else 0


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    return next(((n, env[n]) for n in names if env.get(n, "").strip()), None)


def resolve_run(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchSpec:
    """Flags (then the --config file, then env) → a validated LaunchSpec with the port and recovery path chosen."""
    args = merge_job_file(args, fallback=slurm.defaults(env))
    ssl_config = args.ssl_config.expanduser().resolve() if getattr(args, "ssl_config", None) else None
    strategy, grace = resolve_strategy(args, env)
    spec = LaunchSpec(script=args.script, script_args=tuple(args.script_args), nproc_per_node=args.workers,
                      nnodes=args.nnodes, node_rank=args.node_rank, sched_port=args.sched_port or 0,
                      max_restarts=args.max_restarts, restart_rate=restart_rate(args, env),
                      hot_spares=_hot_spares(args), recover_strategy=strategy,
                      grace_s=grace, slots=args.slots or 0, placement=placement_policy(args, env),
                      metrics_port=args.metrics_port, hang_timeout=resolve_hang_timeout(args, env),
                      exact=exact_mode(args.exact or env.get(EXACT_ENV, ""), "--exact" if args.exact else EXACT_ENV),
                      virtual_shards=virtual_shards(args.virtual_shards or env.get(VIRTUAL_SHARDS_ENV, ""),
                                                    "--virtual-shards" if args.virtual_shards else VIRTUAL_SHARDS_ENV,
                                                    args.workers * (args.nnodes or 1)))
    if not Path(args.script).is_file():
        raise ConfigError(f"script {args.script!r} not found")
    host_env, port_env = _first(env, SCHED_HOST_ENV), _first(env, SCHED_PORT_ENV)
    host = args.sched_host or (host_env[1].strip() if host_env else None)
    port = args.sched_port
    if port is None and port_env is not None:
        try:
            port = int(port_env[1])
        except ValueError:
            raise ConfigError(f"{port_env[0]}={port_env[1]!r} is invalid: expected a port in 1..65535") from None
    if spec.nnodes > 1 and (host is None or not port):
        raise ConfigError("with --nnodes > 1 every agent needs the same --sched-host and --sched-port "
                          "(the address of node rank 0, where the scheduler runs)")
    host = host or DEFAULT_SCHED_HOST
    if not port:
        port = pick_free_port(host)
    if spec.hosts_scheduler:
        check_port_free(host, port)
    recovery, temporary = args.recovery_path, False
    if recovery is None and spec.enable_recovery:
        path_env = _first(env, RECOVERY_PATH_ENV)
        temporary = not path_env and not env.get(CHECKPOINT_DIR_ENV)  # where the dying gasp goes: a new one each run
        recovery = Path(path_env[1]) if path_env else Path(tempfile.mkdtemp(prefix="trainguard-"))
    if recovery is not None:
        recovery = check_recovery_path(recovery.expanduser().resolve())
    check_tls({**env, **ssl_env(ssl_config)}, spec.hosts_scheduler)
    secret = job_secret(env, nnodes=spec.nnodes, insecure=_bool_env(env, INSECURE_ENV))
    if secret is not None and recovery is not None and spec.hosts_scheduler:
        write_secret(recovery, secret)  # for the same user's tools (trainguard chaos)
    terminal = os.ttyname(sys.stderr.fileno()) if sys.stderr.isatty() else None  # rank 0's progress bar draws there
    return replace(spec, sched_host=host, sched_port=port, recovery_path=recovery, recovery_temporary=temporary,
                   log_dir=args.log_dir, secret=secret, terminal=terminal, ssl_config=ssl_config, zygote=not args.no_zygote)


def check_tls(env: Mapping[str, str], hosts_scheduler: bool) -> None:
    """With TLS on, open every certificate this host will use now: a wrong password, an expired or revoked
    certificate ends the job before anything starts (and an expiry within the warning time is said once here)."""
    cfg = read_tls(env)
    if cfg is None:
        return
    from ..control import tls  # lazily: it loads cryptography, for TLS jobs only

    tls.client_context(cfg)
    if hosts_scheduler:
        tls.scheduler_context(cfg)


def _bool_env(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# --- ports --------------------------------------------------------------------------------


def _address(host: str, port: int) -> tuple[int, tuple]:
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--sched-host {host!r} does not resolve ({exc.strerror})") from None
    return family, addr


def pick_free_port(host: str) -> int:
    """A port free on `host` now, below the kernel's ephemeral range where one is: a port the OS hands out (bind
    port 0) comes from that range, and until the scheduler binds it every process's outgoing connections and gloo's
    listeners draw from the same range (a parallel job took one once, and the scheduler could not listen)."""
    low = _ephemeral_low()
    for port in random.sample(range(max(1024, low - 8192), low), 16) + [0]:
        family, addr = _address(host, port)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(addr)
            except OSError as exc:
                if port and exc.errno == errno.EADDRINUSE:
                    continue
                raise ConfigError(f"cannot open a port on --sched-host {host} ({exc.strerror}); "
                                  "give an address of this machine") from None
            return sock.getsockname()[1]
    raise AssertionError("unreachable: port 0 binds or raises")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it cannot be read)."""
    try:
        return max(2048, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def check_port_free(host: str, port: int) -> None:
    """Raise ConfigError naming the port and the flag if the scheduler could not listen there."""
    family, addr = _address(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the scheduler's server will
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"scheduler port {port} on {host} is already in use; choose another with "
                                  "--sched-port (or leave it out to get a free one)") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"--sched-host {host} is not an address of this machine, but node rank 0 "
                                  "runs the scheduler here; give one of its own addresses") from None
            raise ConfigError(f"cannot use scheduler port {port} on {host}: {exc.strerror}; "
                              "choose another with --sched-port") from None
