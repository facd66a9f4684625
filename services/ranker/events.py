"""Device events reused instead of created for each use.

The device loop brackets every ranking batch and every psi copy with timing events. On an H200
host creating, recording and destroying one timing event cost ~150 us of the loop's time, an
untimed one ~45 us, re-recording an event that exists ~20 us (bench.host_costs, alone); and
every such call gives up the interpreter, so with the event loop running Python each one also
waited to take it back (1.3 ms for a new timing event at the 0.5 ms switch interval). A batch
against psi made two new timing events (~0.3 ms of the ~0.45 ms its launch cost alone), a psi
copy three more and an ordering event.

An event is given back only once nothing will read it again (its elapsed time taken, its
completion seen); an event handed out again is re-recorded by its next user, which replaces its
earlier state. A stream waiting for an event (`wait_event`) waits for the record made before the
call, so an event used only to order two streams can be recorded again at once.

`wait_until_done(event)` waits for an event's work with a query first: a query keeps the
interpreter, a synchronize gives it up and, with the event loop running Python, waits to take it
back even when the work was long done (bench.host_costs: a query 26 us under contention;
re-recording an event, which gives it up too, 727 us at the 0.5 ms switch interval).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

EventT = TypeVar("EventT")


class _Waitable(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def wait_until_done(event: _Waitable) -> None:
    """Returns once the event's work is done; synchronizes only when a query says it is not."""
    if not event.query():
        event.synchronize()


class EventPool(Generic[EventT]):
    """Events not in use, handed out before new ones are made. Thread-safe; holds at most
    `limit` idle events (one given back beyond that is dropped, destroyed by its finaliser)."""

    def __init__(self, factory: Callable[[], EventT], limit: int = 64) -> None:
        if limit < 0:
            raise ValueError("an event pool's limit is >= 0")
        self._factory = factory
        self._limit = limit
        self._idle: list[EventT] = []
        self._lock = threading.Lock()
        self.created = 0  # events made because none was idle
        self.reused = 0  # events handed out again

    def take(self) -> EventT:
        """An event nobody else holds: the caller records it before reading it."""
        with self._lock:
            if self._idle:
                self.reused += 1
                return self._idle.pop()
            self.created += 1
        return self._factory()

    def give(self, event: EventT) -> None:
        """Back to the pool: the caller (and anyone it lent the event to) never reads it again."""
        with self._lock:
            if len(self._idle) < self._limit:
                self._idle.append(event)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


def timing_event_pool(limit: int = 64) -> EventPool[torch.cuda.Event]:
    """A pool of CUDA timing events (elapsed_time between two of them)."""
    return EventPool(lambda: torch.cuda.Event(enable_timing=True), limit)
