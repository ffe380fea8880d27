"""One error family. Every message says what happened and what to do about it."""

from __future__ import annotations

from .exitcodes import EXIT_DESYNC, EXIT_NOT_EXACT


class TrainguardError(Exception):
    """Base of every error trainguard raises on purpose."""


# --- configuration -----------------------------------------------------------


class ConfigError(TrainguardError, ValueError):
    """A bad environment variable, flag or config value. Raised at start, never mid-run."""


# --- the cluster's wire and membership ---------------------------------------


class ProtocolError(TrainguardError):
    """A frame or message that does not follow the protocol (bad magic, version, size or shape)."""


class AuthenticationFailed(ProtocolError):
    """A connection to or from the scheduler did not prove it holds the job's secret (control/auth.py).
    Deterministic: retrying with the same secret cannot help."""


class RegistrationRejected(TrainguardError):
    """The scheduler refused this worker: duplicate live node id, cluster full, mismatched job facts."""

    def __init__(self, message: str, *, code: str = "rejected", retry: bool = False):
        super().__init__(message)
        self.code = code
        self.retry = retry


class FencedError(TrainguardError):
    """A message carried a stale generation or incarnation and was refused."""


class SchedulerUnavailable(TrainguardError, ConnectionError):
    """The scheduler could not be reached within the configured time."""


class RendezvousTimeout(TrainguardError, TimeoutError):
    """The cluster did not form (or agree) in time; the message names who is missing."""


class ClusterFailed(TrainguardError):
    """The job failed for good; the message carries the root cause. `verdict`: the exit code of a verdict on the
    script that ended it (a desync, a replay that differed), None for a fault."""

    verdict: int | None = None


class DesyncDetected(ClusterFailed):
    """The job ended because its ranks called collectives that do not match (control/waits.py): a script bug."""

    verdict = EXIT_DESYNC


class NotExact(ClusterFailed):
    """Under `--exact strict`, the job ended because a replayed step differed from its first run (audit.py)."""

    verdict = EXIT_NOT_EXACT


class GenerationChanged(TrainguardError):
    """Membership changed while waiting; rejoin the new generation."""


# --- state, checkpoints and recovery -----------------------------------------


class CheckpointError(TrainguardError):
    """A checkpoint could not be written or read; the message names the file."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is truncated, altered, hostile or does not match its manifest."""


class CollectiveFailed(TrainguardError):
    """A collective that trainguard issued (the gradient exchange, a state transfer, a vote) failed,
    usually because a peer died or left to regroup. The original error is its `__cause__`. The step
    it belongs to is skipped (nothing was applied) and the job recovers; this is the only failure the
    training loop treats as a network fault."""


class RecoveryError(TrainguardError):
    """No consistent step could be restored on every rank."""


class ClusterStateError(TrainguardError):
    """The scheduler's persisted state (cluster.db) is unreadable or belongs to another job."""


# --- raised into the training loop on purpose --------------------------------


class Retriable(TrainguardError):
    """Raise it (or `raise Retriable(...) from exc`) inside `with step:` before the optimizer step to have
    every rank skip the step and redo it in the same processes. Needs the retry recover strategy
    (`--recover-strategy retry,...`); without it, it ends the process like any other exception."""


class Rewind(BaseException):
    """The cluster moved on while this rank was between commit points (a collective failed, or a peer
    died): the script goes back to its committed step. Raised at the next point trainguard controls
    (a batch, a forward, `optimizer.step()`); `trainguard run`'s worker entry catches it and runs the
    script again in the same process, from the top, with the committed state restored (see
    train/engine/rewind.py). A BaseException, so `except Exception` in user code does not swallow it."""


class JobStopped(SystemExit):
    """The job stopped at a commit point: a graceful exit on a signal (code EXIT_PREEMPTED) or a stop
    after a fault (code EXIT_FAULT_STOP). It is a SystemExit, so uncaught it ends the process with
    that code; it is not a TrainguardError, so `except Exception` in user code does not swallow it."""

    def __init__(self, code: int, reason: str, step: int):
        super().__init__(code)
        self.reason = reason
        self.step = step

    def __str__(self) -> str:
        return f"stopped at step {self.step} (exit code {self.code}): {self.reason}"
