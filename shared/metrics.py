"""Prometheus metrics: one registry per service instance, served over HTTP on its own port."""

from __future__ import annotations

import contextlib
import gc
import threading
import time

from prometheus_client import CollectorRegistry, Histogram, start_http_server

from shared.logging import get_logger

log = get_logger(__name__)

# Latency buckets (ms) from sub-millisecond to a few seconds: ranking P99 budgets are tens of ms.
LATENCY_MS_BUCKETS = (
    0.25,
    0.5,
    1,
    2,
    3,
    5,
    7.5,
    10,
    15,
    20,
    30,
    50,
    75,
    100,
    150,
    250,
    500,
    1000,
    2500,
    5000,
)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Starts the /metrics endpoint in a daemon thread; returns the bound port (0 picks one)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])


# Collector pauses (seconds): a full collection of a large heap stops every thread of the process.
GC_PAUSE_BUCKETS = (0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 1.0)


class GcPauses:
    """Times every pause of Python's cyclic garbage collector (gc.callbacks) into
    `relaygr_gc_pause_seconds{generation}`, and logs each one longer than `log_over_s`. A
    collection holds the GIL throughout: a ranker's device thread launches nothing meanwhile,
    and calls queue behind it. One per process (install once; `close` removes the callback)."""

    def __init__(self, registry: CollectorRegistry, log_over_s: float = 0.02) -> None:
        self.pauses = Histogram("relaygr_gc_pause_seconds", "cyclic garbage collector pauses",
                                ["generation"], buckets=GC_PAUSE_BUCKETS, registry=registry)  # fmt: skip
        self._log_over_s = log_over_s
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info.get("generation", -1)
        self.pauses.labels(str(generation)).observe(pause)
        if pause > self._log_over_s:
            log.warning("gc_pause", generation=generation, ms=round(pause * 1e3, 1),
                        collected=info.get("collected", 0), frozen=gc.get_freeze_count())  # fmt: skip

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)


# How late a sleeping thread wakes (seconds): the process could not run, or could not get the GIL.
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class HostStalls:
    """A daemon thread that sleeps `period_s` at a time and records how late it wakes into
    `relaygr_host_stall_seconds`. Late by tens of milliseconds means the whole process stood
    still (the host's scheduler, page faults, memory compaction) or one thread held the GIL
    through a long C call: every service runs one, so a stall that shows in all of them at
    once is the host's. Costs one wake-up per period (100 a second by default)."""

    def __init__(self, registry: CollectorRegistry, period_s: float = 0.01, log_over_s: float = 0.02) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be > 0")
        self.stalls = Histogram("relaygr_host_stall_seconds", "how late a sleeping thread woke",
                                buckets=STALL_BUCKETS, registry=registry)  # fmt: skip
        self._period_s, self._log_over_s = period_s, log_over_s
        self._logged_at, self._over = float("-inf"), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relaygr-stall-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            time.sleep(self._period_s)
            late = max(0.0, time.perf_counter() - started - self._period_s)
            self.stalls.observe(late)
            if late > self._log_over_s:
                self._over += 1
                now = time.perf_counter()
                if now - self._logged_at >= 1.0:  # at most one line a second: a loaded host stalls often
                    log.warning("host_stall", ms=round(late * 1e3, 1), stalls_since_last_line=self._over)
                    self._logged_at, self._over = now, 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
