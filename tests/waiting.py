"""Waiting on conditions in tests: a bounded poll, never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

POLL_S = 0.005


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]], what: str, bound_s: float = 10.0
) -> None:
    """Returns as soon as `condition()` (a plain or an async callable) is true; raises
    AssertionError naming `what` when it is still false after `bound_s`."""
    deadline = time.monotonic() + bound_s
    while True:
        result: Any = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still not so after {bound_s} s")
        await asyncio.sleep(POLL_S)
