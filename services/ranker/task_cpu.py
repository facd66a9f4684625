"""The CPU time of one coroutine's own steps on the event loop, however often it awaits.

A coroutine on an event loop runs in steps: from one resumption to its next suspension. The CPU
time between two clock readings taken around an `await` is everyone's (the loop runs other tasks
meanwhile), but the CPU time of each step is the coroutine's own: `metered` drives the coroutine
itself, as `await` would, and adds each step's thread CPU time to a `CpuMeter`. What it counts is
what the coroutine held the event loop (and the interpreter lock) for, its awaited callees
included: the Python side of its gRPC calls, its bookkeeping. Not counted: other threads' CPU
(gRPC's own, the device loop's).

Why the ranker needs it: a copy of psi to host DRAM (a demotion) costs the device loop ~0.4 ms
to issue, which the demotion gate weighed alone, and the event loop two gRPC round trips to the
expander and its bookkeeping, which it did not. On two H200s at 16384 tokens (k21b, one call,
2026-11-30) a ranker copying every psi leaving HBM (~270-330 more copies a point than the gate's)
used 0.03-0.055 more cores, 2.2-3.4 ms of CPU a copy, and its P99 rose 4-9 ms, while 2% of its
calls were served by a reload.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Generator, Iterator
from typing import Any, TypeVar, cast

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

T = TypeVar("T")


class CpuMeter:
    """CPU seconds counted, and how many coroutines (`runs`) they were counted over."""

    __slots__ = ("runs", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.runs = 0

    def ms_per_run(self, min_runs: int = 1) -> float | None:
        """CPU ms per coroutine run; None before `min_runs` finished."""
        if self.runs < max(1, min_runs):
            return None
        return self.seconds / self.runs * 1e3


class _Metered:
    __slots__ = ("_coro", "_meter")

    def __init__(self, coro: Coroutine[Any, Any, Any], meter: CpuMeter) -> None:
        self._coro = coro
        self._meter = meter

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, meter = self._coro, self._meter
        value: Any = None
        thrown: BaseException | None = None
        try:
            while True:
                started = time.thread_time()
                try:
                    yielded = coro.send(value) if thrown is None else coro.throw(thrown)
                except StopIteration as done:
                    return done.value
                finally:
                    meter.seconds += time.thread_time() - started
                try:
                    value, thrown = (yield yielded), None
                except GeneratorExit:
                    coro.close()
                    raise
                except BaseException as exc:  # the task's cancellation, passed on to the coroutine
                    value, thrown = None, exc
        finally:
            meter.runs += 1


async def metered(coro: Coroutine[Any, Any, T], meter: CpuMeter) -> T:
    """Awaits `coro`, adding the CPU time of its steps to `meter` (and one run, however it ends)."""
    return cast(T, await _Metered(coro, meter))


class CpuMeterCollector(Collector):
    """Prometheus view of a CpuMeter, read at scrape time: `<seconds_name>_total` and
    `<runs_name>_total`."""

    def __init__(self, meter: CpuMeter, seconds_name: str, runs_name: str, what: str) -> None:
        self._meter = meter
        self._seconds_name = seconds_name
        self._runs_name = runs_name
        self._what = what

    def collect(self) -> Iterator[CounterMetricFamily]:
        runs, seconds = self._meter.runs, self._meter.seconds
        yield CounterMetricFamily(
            self._seconds_name, f"event loop CPU seconds of {self._what}", value=seconds
        )
        yield CounterMetricFamily(self._runs_name, f"{self._what} metered", value=runs)
