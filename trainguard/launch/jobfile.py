"""`trainguard run --config job.yaml`: the launcher's flags in a file, validated by pydantic.

    script: train.py
    script_args: [--epochs, "10"]
    workers: 4
    max_restarts: 100                                  # the whole job on this host (default 32767)
    restart_limit: 3                                   # one worker: at most 3 restarts ...
    restart_window: 3600                               # ... within an hour, else a crash loop ends the job
    recover_strategy: retry,recover-in-place,dump     # or a list: [retry, recover-in-place, dump]
    max_retries: 3
    grace_period: 30                                   # seconds from SIGTERM to SIGKILL
    hang_timeout: 600                                  # no progress this long while peers wait: replaced
    exact: strict                                      # a replayed step that differs ends the job (warn, off)
    recovery_path: /shared/job42/recovery
    ssl_config: /shared/tls/ssl.json                   # TLS; passwords from TG_SERVER/CLIENT_PASSWORD(_FILE)

Keys are the long flag names with underscores (`nproc_per_node` = `workers`, `master_addr` =
`sched_host`, `master_port` = `sched_port`). A flag given on the command line wins over the
file; the file wins over TG_* variables; those win over the defaults. An unknown key, a wrong
type or a bad strategy is a ConfigError naming the file and the key, before anything starts.
JSON files (`.json`) are read too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal, Mapping

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from ..config import (
    DEFAULT_GRACE_PERIOD_S,
    ELASTIC_DEADLINE_ENV,
    GRACE_PERIOD_ENV,
    MAX_RETRIES_ENV,
    RECOVER_STRATEGY_ENV,
    env_seconds,
    hang_timeout,
    parse_int,
)
from ..errors import ConfigError
from ..strategies import (
    DEFAULT_ELASTIC_DEADLINE_S,
    DEFAULT_MAX_RETRIES,
    RecoverStrategy,
    parse_strategy,
    require_implemented,
)
from .budget import DEFAULT_MAX_RESTARTS

# the defaults of `trainguard run` flags that a job file may set (argparse leaves them None)
RUN_DEFAULTS = {"workers": 1, "nnodes": 1, "node_rank": 0, "max_restarts": DEFAULT_MAX_RESTARTS, "no_zygote": False}


class JobFile(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    script: str | None = None
    script_args: list[str] = Field(default_factory=list)
    workers: int | None = Field(None, ge=1, validation_alias=AliasChoices("workers", "nproc_per_node"))
    nnodes: int | None = Field(None, ge=1)
    node_rank: int | None = Field(None, ge=0)
    sched_host: str | None = Field(None, validation_alias=AliasChoices("sched_host", "master_addr"))
    sched_port: int | None = Field(None, ge=1, le=65535, validation_alias=AliasChoices("sched_port", "master_port"))
    max_restarts: int | None = Field(None, ge=0)
    restart_limit: int | None = Field(None, ge=1)  # a crash loop: restarts of one worker within restart_window
    restart_window: float | None = Field(None, gt=0)
    hot_spares: int | None = Field(None, ge=0)
    no_zygote: bool | None = None
    recovery_path: Path | None = None
    log_dir: Path | None = None
    recover_strategy: str | None = None
    max_retries: int | None = Field(None, ge=0)
    grace_period: float | None = Field(None, gt=0)
    hang_timeout: float | None = Field(None, ge=0)  # 0: off
    exact: Literal["warn", "strict", "off"] | None = None  # the replay audit (train/engine/audit.py)
    slots: int | None = Field(None, ge=1)  # recover: this host's capacity
    host_fail_limit: int | None = Field(None, ge=1)
    host_fail_window: float | None = Field(None, gt=0)
    host_cooldown: float | None = Field(None, ge=0)
    elastic_deadline: float | None = Field(None, gt=0)
    ssl_config: Path | None = None  # TLS (tlsconfig.py); the key passwords never go in this file

    @field_validator("recover_strategy", mode="before")
    @classmethod
    def _join(cls, value):
        if isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value)
        return value

    @field_validator("script_args", mode="before")
    @classmethod
    def _strings(cls, value):
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else value


def load_job_file(path: Path) -> JobFile:
    """Read and validate a job file; every problem is a ConfigError that names the file (and the key)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        if str(path).endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml and json raise several unrelated types on bad input
        raise ConfigError(f"--config {path}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                          f"{str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values at the top level")
    try:
        job = JobFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ConfigError(f"--config {path}: {where}: {first.get('msg')}") from None
    if job.recover_strategy is not None:  # a bad name fails here, at start, naming the file
        parse_strategy(job.recover_strategy, source=f"recover_strategy in {path}")
    return job


def merge_job_file(args: argparse.Namespace, fallback: Mapping[str, object] | None = None) -> argparse.Namespace:
    """Fill every flag not given on the command line from --config (if any), then from `fallback` (what the
    environment says, e.g. Slurm's: launch/slurm.py), then from the defaults."""
    path = getattr(args, "config", None)
    job = load_job_file(path) if path is not None else JobFile()
    for key, value in job.model_dump().items():
        if key == "script_args":
            if not getattr(args, "script_args", None) and value:
                args.script_args = value
        elif getattr(args, key, None) is None and value is not None:
            setattr(args, key, value)
    for key, value in [*(fallback or {}).items(), *RUN_DEFAULTS.items()]:
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if getattr(args, "script", None) is None:
        raise ConfigError("no training script: give it after the flags, or as `script:` in the --config file")
    return args


def resolve_hang_timeout(args: argparse.Namespace, env: Mapping[str, str]) -> float | None:
    """--hang-timeout or the job file's hang_timeout, else TG_HANG_TIMEOUT; None (also for 0): off."""
    value = getattr(args, "hang_timeout", None)
    if value is None:
        return hang_timeout(env)
    if value < 0:
        raise ConfigError(f"--hang-timeout must be >= 0 seconds (0: off), got {value:g}")
    return float(value) or None


def resolve_strategy(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[RecoverStrategy, float]:
    """(recover strategy, grace period) from flags/job file, else TG_RECOVER_STRATEGY/TG_MAX_RETRIES/
    TG_GRACE_PERIOD, else the defaults; recover and elastic are refused here, before anything starts."""
    text, source = getattr(args, "recover_strategy", None), "--recover-strategy"
    if text is None:
        text, source = env.get(RECOVER_STRATEGY_ENV), RECOVER_STRATEGY_ENV
    retries = getattr(args, "max_retries", None)
    if retries is None:
        raw = env.get(MAX_RETRIES_ENV, "")
        retries = parse_int(MAX_RETRIES_ENV, raw, lo=0) if raw.strip() else DEFAULT_MAX_RETRIES
    if retries < 0:
        raise ConfigError(f"--max-retries must be >= 0, got {retries}")
    deadline = getattr(args, "elastic_deadline", None)
    if deadline is None:
        deadline = env_seconds(env, ELASTIC_DEADLINE_ENV, DEFAULT_ELASTIC_DEADLINE_S)
    if not deadline > 0:
        raise ConfigError(f"--elastic-deadline must be > 0 seconds, got {deadline}")
    strategy = require_implemented(parse_strategy(text, source=source, max_retries=retries,
                                                  elastic_deadline=float(deadline)), source)
    grace = getattr(args, "grace_period", None)
    if grace is None:
        grace = env_seconds(env, GRACE_PERIOD_ENV, DEFAULT_GRACE_PERIOD_S)
    return strategy, float(grace)
