"""The job secret of `trainguard run` (control/auth.py says what it protects).

A secret given as TG_JOB_SECRET or TG_JOB_SECRET_FILE is used as is: a job over several hosts
needs one, the same on every agent (a fresh one per agent could not match), unless TG_INSECURE=1
lets it run unauthenticated. A one-host job without one gets a fresh secret. The agent hands it
to its children in their environment (never on a command line, so never in `ps`; /proc/PID/environ
is readable only by the same user) and writes it to <recovery path>/job.secret (mode 0600), so
the same user's tools reach the job: `TG_JOB_SECRET_FILE=<recovery path>/job.secret trainguard chaos ...`.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Mapping

from .. import durable
from ..config import INSECURE_ENV, JOB_SECRET_ENV, JOB_SECRET_FILE_ENV, read_secret
from ..errors import ConfigError

SECRET_FILE = "job.secret"


def job_secret(env: Mapping[str, str], *, nnodes: int, insecure: bool) -> bytes | None:
    """The secret of this job (given, or fresh for one host); None only for several hosts under TG_INSECURE=1."""
    given = read_secret(env)
    if given is not None:
        return given
    if nnodes > 1:
        if insecure:
            return None
        raise ConfigError(f"a job over several hosts needs the same secret on every agent: write one to a file "
                          f"every host can read (python -c 'import secrets; print(secrets.token_hex(32))' > "
                          f"job.secret; chmod 600 job.secret) and set {JOB_SECRET_FILE_ENV}=job.secret (or "
                          f"{JOB_SECRET_ENV}) for every agent; or {INSECURE_ENV}=1 on a network you trust")
    return secrets.token_hex(32).encode()


def write_secret(folder: Path, secret: bytes) -> Path:
    """Write the secret to folder/job.secret, readable by this user only (a temp file renamed into place)."""
    path = folder / SECRET_FILE
    durable.write_bytes(path, secret + b"\n", mode=0o600)
    return path
