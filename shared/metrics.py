"""Prometheus metrics: one registry per service instance, served over HTTP on its own port."""

from __future__ import annotations

import contextlib
import gc
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
