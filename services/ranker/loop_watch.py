"""A watchdog on the device loop's host work: what every thread runs while one section is slow.

On an H200's length mix (k25c, 398 req/s) batch launches that take ~1 ms took 6-8 ms for 400 ms,
the queue grew to 50 ms and calls past their SLO waited 400-870 ms, while neither the event loop
nor the host logged a stall (shared/metrics.py's HostStalls watch those). The loop's section
counters (loop_time.py) say the time went to `launch`, not why: the device thread waits for the
interpreter lock there, or runs slow Python itself. This says which, and who holds the lock: a
section of host work (launch, plan, settle, copies) running past `slow_ms` is counted,

    relaygr_ranker_device_loop_slow_total{section="..."}

and at most once every `log_every_s` logged (`device_loop_slow`) with the device thread's stack
and the other threads' innermost frames, the event loop's with its callers (the prime suspect:
it shares the lock). Sections that wait by design (settle_wait, fill_wait, idle) and `other`
(graph captures, work run in place) are not watched.

`check` is called from a thread that is not the device loop's: HostStalls' watchdog, every 10 ms
(shared/metrics.py, `watchers`). A section is counted once however many checks see it.
"""

from __future__ import annotations

import sys
import threading

from prometheus_client import CollectorRegistry, Counter

from services.ranker.loop_time import LoopTime
from shared.logging import get_logger
from shared.metrics import STALL_STACK_FRAMES, stack_lines

log = get_logger("ranker")

WATCHED = ("launch", "plan", "settle", "copies")


class LoopWatch:
    def __init__(
        self,
        loop_time: LoopTime,
        registry: CollectorRegistry,
        slow_ms: float = 5.0,
        log_every_s: float = 1.0,
        event_loop_thread: int | None = None,
    ) -> None:
        if slow_ms <= 0 or log_every_s < 0:
            raise ValueError("slow_ms must be > 0 and log_every_s >= 0")
        self._loop_time = loop_time
        self._slow_s = slow_ms / 1e3
        self._log_every_s = log_every_s
        self._event_loop_thread = (
            event_loop_thread if event_loop_thread is not None else threading.get_ident()
        )
        self.slow = Counter("relaygr_ranker_device_loop_slow", "sections of the device loop's host work "
                            "that ran past the watch's threshold", ["section"], registry=registry)  # fmt: skip
        self._seen: tuple[str, float, int] | None = None  # the slow section already counted
        self._logged_at = float("-inf")
        self._unlogged = 0  # slow sections since the last line

    def check(self, now: float) -> None:
        """Looks at the section the device loop is in (`now`: time.perf_counter())."""
        running = self._loop_time.running()
        if running is None or running == self._seen:
            return
        name, started, thread = running
        if name not in WATCHED or now - started <= self._slow_s:
            return
        self._seen = running
        self.slow.labels(name).inc()
        self._unlogged += 1
        if now - self._logged_at < self._log_every_s:
            return
        frames = sys._current_frames()
        me = threading.get_ident()
        others = {
            t.name: stack_lines(frames.get(t.ident or -1), 1)
            for t in threading.enumerate()
            if t.ident not in (thread, self._event_loop_thread, me)
        }
        log.warning("device_loop_slow", section=name, ms=round((now - started) * 1e3, 1),
                    slow_sections_since_last_line=self._unlogged,
                    loop_frames=stack_lines(frames.get(thread), STALL_STACK_FRAMES),
                    event_loop_frames=stack_lines(frames.get(self._event_loop_thread), STALL_STACK_FRAMES),
                    threads={name: top[0] for name, top in others.items() if top})  # fmt: skip
        self._logged_at, self._unlogged = now, 0
