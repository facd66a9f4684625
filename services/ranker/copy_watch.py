"""Telling a reload's caller as soon as its copy is done on the device.

The device loop learns that a copy is done by polling between its steps: while it launches an
eager step or waits for a batch's scores, a finished reload waits with it (the copy stage
`settle`, copy_stages.py: 2.9-7.9 ms mean at L8192 on an H200, h6c, of a reload path of 12-23 ms
for a 6 ms copy), and the ranking call waiting for that psi waits too. A CopyWatcher thread waits
on each watched copy's completion event with the interpreter released (Event.synchronize) and
tells the caller at once. The loop still settles the copy's bookkeeping (its timing, the events
back to the pool) when it polls; telling a caller twice is a no-op (the engine's jobs resolve
once).

One thread for all watched copies, in issue order: reloads run in order on their one stream, so
the first one watched is the first one done.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

from shared.lifecycle import name_os_thread
from shared.logging import get_logger

log = get_logger("ranker.copy_watch")


class Completion(Protocol):
    """A device event: synchronize() returns once the work recorded before it is done."""

    def synchronize(self) -> None: ...


class CopyWatcher:
    """watch(event, tell): calls tell() from the watcher thread once event is done."""

    def __init__(self, name: str = "relaygr-copies") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Completion, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.told = 0  # callers told by the watcher (read by tests and the engine's report)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the thread once the copies watched before are told (or their waits fail)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def watch(self, event: Completion, tell: Callable[[], None]) -> None:
        self._queue.put((event, tell))

    def _run(self) -> None:
        name_os_thread(self._name)
        while (item := self._queue.get()) is not None:
            event, tell = item
            try:
                event.synchronize()  # the interpreter is released while it waits
                tell()
                self.told += 1
            except Exception as exc:  # the loop's poll still settles the copy and its caller
                log.warning("copy_watch_failed", error=repr(exc))
