"""Signal names for messages (one place for the launcher and the workers)."""

from __future__ import annotations

import signal


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
