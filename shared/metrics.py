"""Prometheus metrics: one registry per service instance, served over HTTP on its own port."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import FrameType

from prometheus_client import CollectorRegistry, Histogram, start_http_server

from shared.lifecycle import name_os_thread
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
# Frames of the event loop's stack logged with a loop stall (innermost last).
STALL_STACK_FRAMES = 12


def stack_lines(frame: FrameType | None, limit: int) -> list[str]:
    """`file:line function` of `frame` and its callers, innermost last, at most `limit`."""
    if frame is None:  # the thread has no Python frame (ended, or not started yet)
        return []
    return [
        f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
        for f in traceback.extract_stack(frame)[-limit:]
    ]


class HostStalls:
    """A daemon thread that sleeps `period_s` at a time and records how late it wakes into
    `relaygr_host_stall_seconds`. Late by tens of milliseconds means the whole process stood
    still (the host's scheduler, page faults, memory compaction) or one thread held the GIL
    through a long C call: every service runs one, so a stall that shows in all of them at
    once is the host's. Costs one wake-up per period (100 a second by default).

    Built inside a running asyncio loop, it also watches that loop: a task that sleeps
    `period_s` at a time records how late the loop ran it (`relaygr_event_loop_lag_seconds`),
    and when the loop is more than `log_over_s` behind, the thread logs what the loop thread
    is executing at that moment (`event_loop_stall`: `loop_frames`, its stack, and the other threads' top
    frames). A late loop with no late thread is the service's own Python work: one long
    callback, or many queued at once; the stack names it. At most one such line a second."""

    def __init__(
        self,
        registry: CollectorRegistry,
        period_s: float = 0.01,
        log_over_s: float = 0.02,
        watchers: Sequence[Callable[[float], None]] = (),
    ) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be > 0")
        # Called on each wake-up with time.perf_counter() (a service's own watchdogs: the
        # ranker's device loop, services/ranker/loop_watch.py); one that raises is dropped.
        self._watchers = list(watchers)
        self.stalls = Histogram("relaygr_host_stall_seconds", "how late a sleeping thread woke",
                                buckets=STALL_BUCKETS, registry=registry)  # fmt: skip
        self.loop_lag = Histogram("relaygr_event_loop_lag_seconds", "how late the event loop ran a timer",
                                  buckets=STALL_BUCKETS, registry=registry)  # fmt: skip
        self._period_s, self._log_over_s = period_s, log_over_s
        self._logged_at, self._over = float("-inf"), 0
        self._loop_logged_at, self._loop_over = float("-inf"), 0
        self._stop = threading.Event()
        self._ticker: asyncio.Task[None] | None = None
        self._loop_thread: int | None = None
        self._tick_at = time.perf_counter()  # when the loop last ran the ticker (perf_counter)
        self._sampled_tick = -1.0  # the tick whose stall was already looked at
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._loop_thread = threading.get_ident()
            self._ticker = loop.create_task(self._tick(), name="relaygr-loop-watch")
        self._thread = threading.Thread(target=self._run, name="relaygr-stall-watch", daemon=True)
        self._thread.start()

    async def _tick(self) -> None:
        while True:
            self._tick_at = started = time.perf_counter()
            await asyncio.sleep(self._period_s)
            self.loop_lag.observe(max(0.0, time.perf_counter() - started - self._period_s))

    def _run(self) -> None:
        name_os_thread("relaygr-stalls")
        while not self._stop.is_set():
            started = time.perf_counter()
            time.sleep(self._period_s)
            now = time.perf_counter()
            late = max(0.0, now - started - self._period_s)
            self.stalls.observe(late)
            if late > self._log_over_s:
                self._over += 1
                if now - self._logged_at >= 1.0:  # at most one line a second: a loaded host stalls often
                    log.warning("host_stall", ms=round(late * 1e3, 1), stalls_since_last_line=self._over)
                    self._logged_at, self._over = now, 0
            if self._loop_thread is not None:
                self._watch_loop(now)
            for watcher in list(self._watchers):
                try:
                    watcher(now)
                except Exception as exc:  # a watchdog's fault must not end the stall watch
                    log.warning("watcher_failed", watcher=repr(watcher), error=repr(exc))
                    self._watchers.remove(watcher)

    def _watch_loop(self, now: float) -> None:
        tick = self._tick_at
        behind = now - tick - self._period_s
        if behind <= self._log_over_s or tick == self._sampled_tick:
            return
        self._sampled_tick = tick  # one look per stall
        self._loop_over += 1
        if now - self._loop_logged_at < 1.0:
            return
        frames = sys._current_frames()
        others = {t.name: stack_lines(frames.get(t.ident or -1), 1)
                  for t in threading.enumerate() if t.ident not in (self._loop_thread, threading.get_ident())}  # fmt: skip
        log.warning("event_loop_stall", behind_ms=round(behind * 1e3, 1), stalls_since_last_line=self._loop_over,
                    loop_frames=stack_lines(frames.get(self._loop_thread or -1), STALL_STACK_FRAMES),
                    threads={name: top[0] for name, top in others.items() if top})  # fmt: skip
        self._loop_logged_at, self._loop_over = now, 0

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed first: the task is gone with it
                self._ticker.cancel()
        self._thread.join(timeout=1.0)
