"""Spending a thread's CPU time on purpose (what metering by thread CPU should then count)."""

from __future__ import annotations

import time


def burn_cpu(seconds: float) -> None:
    """Busy-loops until this thread used `seconds` of CPU (not wall) time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass
