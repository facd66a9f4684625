"""Where the engine's device loop spends its own time: wall and thread-CPU seconds by section.

The device sat idle between ranking batches with calls waiting 11.6% of the time at the relay's
limit on an H200 (device_time.py: starved), while the ranker's GIL was held only 38% of the time.
These counters say which part of the loop the gaps are made of, and whether the loop computed
(thread CPU) or waited (wall minus CPU: the interpreter lock, a blocking call, the scheduler):

    relaygr_ranker_engine_loop_seconds_total{section="...", clock="wall"|"cpu"}

Sections (services/ranker/engine.py, Engine._loop):
  copies      polling and issuing host <-> device copies (reload pieces included);
  plan        dropping overdue jobs and asking the scheduler, under the engine's lock;
  launch      packing, staging and issuing a ranking batch or a pre-inference step;
  settle_wait a launched ranking batch's wait for its scores (the device's time, not the host's);
  settle      answering a batch's calls and learning its cost (a pre-inference step: all of it);
  fill_wait   waiting, nothing in flight, for a ranking batch to fill (max_wait);
  idle        waiting for work, or for copies in flight to finish;
  other       calls run on the device thread, graph captures, pre-inference steps run in place.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

SECTIONS = ("copies", "plan", "launch", "settle_wait", "settle", "fill_wait", "idle", "other")


class LoopTime:
    """Cumulative wall and thread-CPU seconds of the device loop by section. Written by the loop's
    thread only (`section`), read by the metrics thread (`snapshot`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wall = dict.fromkeys(SECTIONS, 0.0)
        self._cpu = dict.fromkeys(SECTIONS, 0.0)
        # The section running now: (name, its start on perf_counter, the loop thread's ident),
        # None between sections. One tuple assigned whole, so another thread reads it whole.
        self._open: tuple[str, float, int] | None = None

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Times the block as `name` (one of SECTIONS; ValueError otherwise). Sections do not nest."""
        if name not in self._wall:
            raise ValueError(f"unknown loop section {name!r} (one of {', '.join(SECTIONS)})")
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        self._open = (name, wall0, threading.get_ident())
        try:
            yield
        finally:
            self._open = None
            wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
            with self._lock:
                self._wall[name] += wall
                self._cpu[name] += cpu

    def running(self) -> tuple[str, float, int] | None:
        """The section the loop is in now (name, start on time.perf_counter(), the loop thread's
        ident), or None between sections: for a watchdog on another thread (loop_watch.py)."""
        return self._open

    def snapshot(self) -> dict[str, tuple[float, float]]:
        """Per section: (wall seconds, thread-CPU seconds) so far."""
        with self._lock:
            return {name: (self._wall[name], self._cpu[name]) for name in SECTIONS}


class LoopTimeCollector(Collector):
    """Prometheus view of a LoopTime, read at scrape time."""

    def __init__(self, loop_time: LoopTime) -> None:
        self._loop_time = loop_time

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "relaygr_ranker_engine_loop_seconds",
            "the engine's device loop: wall and thread-CPU seconds by section",
            labels=["section", "clock"],
        )
        for name, (wall, cpu) in self._loop_time.snapshot().items():
            family.add_metric([name, "wall"], wall)
            family.add_metric([name, "cpu"], cpu)
        yield family
