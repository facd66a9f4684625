"""Where the accelerator's time goes: cumulative device seconds by kind of work, busy time, and the
pre-inference time of psi that no ranking call used.

`DeviceTime` is the ledger the engine writes into (from its threads) and the metrics endpoint reads
(from its HTTP thread); every method takes one lock for microseconds. `DeviceTimeCollector` exposes
it as Prometheus counters, read at scrape time:

    relaygr_ranker_device_seconds_total{work="rank"|"preinfer"|"copy"|"reload"|"demote"}
    relaygr_ranker_device_busy_seconds_total
    relaygr_ranker_device_gap_seconds_total
    relaygr_ranker_device_starved_seconds_total
    relaygr_ranker_device_starved_gaps_over_1ms_total
    relaygr_ranker_device_fill_wait_seconds_total
    relaygr_ranker_unused_psi_device_seconds_total
    relaygr_ranker_unused_psi_total
    relaygr_ranker_preinfer_steps_total{kind="graph"|"eager"}
    relaygr_ranker_preinfer_step_seconds_total{kind=...}
    relaygr_ranker_preinfer_step_prefixes_total{kind=...}
    relaygr_ranker_preinfer_steps_over_10ms_total{kind=...}
    relaygr_ranker_preinfers_started_total
    relaygr_ranker_preinfer_start_wait_seconds_total
    relaygr_ranker_preinfers_started_over_50ms_total
    relaygr_ranker_preinfers_started_joined_total
    relaygr_ranker_preinfers_done_total
    relaygr_ranker_preinfer_build_seconds_total
    relaygr_ranker_preinfer_done_seconds_total
    relaygr_ranker_preinfers_done_after_call_total
    relaygr_ranker_preinfer_builds_over_50ms_total

What the numbers mean (the engine measures them; services/ranker/engine.py):
  rank      each ranking batch's compute_ms: on CUDA the time between events recorded before its
            first and after its last device work (behind a batch still in flight, from that
            one's end; on an idle device, the host's launch included), on the CPU its wall time;
  preinfer  on CUDA, CUDA-event time of each pre-inference step on the stream it ran on; on the
            CPU, wall time of each step;
  copy      host <-> device psi copies on the copy stream (event time on CUDA, wall time on the
            CPU); a caller may name them "reload" or "demote" instead;
  busy      wall time during which at least one ranking batch or pre-inference was outstanding
            on the device (copies excluded: they run on the copy engine, beside compute);
  gap       device time between one ranking batch's end and the next one's start (CUDA events;
            wall time between the steps on the CPU), summed over consecutive ranking batches (a
            pre-inference step between two batches starts the count again);
  starved   of each gap, the part during which a call of the next batch was already waiting:
            the device idle while work was queued, i.e. the host was the slower side (issue 13:
            at L4096 on an H200 the relay's queue P99 was 72.8 ms where a FIFO replay of its
            calls' own device time gave 43). `starved_gaps_over_1ms` counts such gaps;
  fill wait the time the device loop waited, nothing in flight, for a ranking batch to fill
            (`max_wait`): the starved time spent so by design; the rest is the host's own;
  preinfer steps  each pre-inference step by how it ran (a CUDA graph replay, or eagerly: no
            graph holds its shape, or it reads psi), its device time and the prefixes it built
            from: eager steps pay the host's per-step cost (~4 ms on an H200) and, batched, hold
            ranking calls behind them (L8192 on an H200, k8b: 63 -> 394 eager steps a point as
            the relay's P99 went 20 -> 944 ms);
  preinfer start  each pre-inference's wait from its submission to its first step, and whether
            a ranking call had joined it by then (its signal's lead over the call spent queued:
            at L8192 on an H200, k8b, joins' pre-inferences completed 135-340 ms after their
            signals with the device half idle);
  preinfer done  each completed pre-inference's time from its first step, and from its
            submission, to complete, and whether it completed after its ranking call was planned to
            come (the call's deadline less the ranker's SLO): the lead the signal gave, spent
            (at L16384 on an H200, k10d, 8.9% of the calls were partial take-overs of
            pre-inferences still building when the call came, some 160 ms after its signal);
  unused psi  the pre-inference time of each psi whose lease expired before any ranking call
            consumed it. The cost of a psi is kept, by key, from its production until it is
            consumed (then it was useful) or reported expired (then it was wasted).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from services.ranker.events import EventPool, wait_until_done

WORKS = ("rank", "preinfer", "copy", "reload", "demote")
STEP_KINDS = ("graph", "eager")
_LONG_STEP_S = 0.010


@dataclass(frozen=True)
class DeviceTimeSnapshot:
    """The ledger at one instant (seconds are cumulative since the engine was made)."""

    work_s: dict[str, float]
    busy_s: float
    unused_psi_s: float
    unused_psi: int
    gap_s: float = 0.0
    starved_s: float = 0.0
    starved_gaps_over_1ms: int = 0
    fill_wait_s: float = 0.0
    # Pre-inference steps by kind (STEP_KINDS): (steps, seconds, prefixes, steps over 10 ms,
    # ranking calls that waited while one ran, and the seconds of their waits within it).
    preinfer_steps: dict[str, tuple[int, float, int, int, int, float]] | None = None
    # Pre-inferences started: (count, seconds waited in all, waits over 50 ms, joined by then).
    preinfer_starts: tuple[int, float, int, int] = (0, 0.0, 0, 0)
    # Pre-inferences completed: (count, seconds from first step to complete, seconds from
    # submission to complete, completed after their ranking call's planned time, builds over
    # 50 ms).
    preinfer_dones: tuple[int, float, float, int, int] = (0, 0.0, 0.0, 0, 0)


def starved_seconds(gap_s: float, launched_at: float, oldest_submitted: float) -> float:
    """The part of a `gap_s` of device idleness that ended at `launched_at` during which a call
    submitted at `oldest_submitted` (same clock) was already waiting for the next batch."""
    return min(max(gap_s, 0.0), max(0.0, launched_at - oldest_submitted))


class DeviceTime:
    """Thread-safe ledger of device time. `max_tracked` bounds the psi costs held by key (the
    oldest are dropped: a psi neither consumed nor expired that long is not reported)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, max_tracked: int = 65_536) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._work_s = dict.fromkeys(WORKS, 0.0)
        self._busy_s = 0.0
        self._active = 0
        self._busy_since = 0.0
        self._psi_cost: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._max_tracked = max_tracked
        self._unused_s = 0.0
        self._unused = 0
        self._gap_s = 0.0
        self._starved_s = 0.0
        self._starved_gaps = 0
        self._fill_wait_s = 0.0
        self._steps = {kind: [0, 0.0, 0, 0, 0, 0.0] for kind in STEP_KINDS}
        self._starts = [0, 0.0, 0, 0]
        self._dones = [0, 0.0, 0.0, 0, 0]
        self._readings: collections.deque[tuple[float, float]] = collections.deque()  # (clock, busy_s)

    def add(self, work: str, seconds: float) -> None:
        """Adds `seconds` of device time to `work` (one of WORKS; ValueError otherwise)."""
        if work not in self._work_s:
            raise ValueError(f"unknown kind of device work {work!r} (one of {', '.join(WORKS)})")
        with self._lock:
            self._work_s[work] += max(0.0, seconds)

    def preinfer_step(
        self, graphed: bool, prefixes: int, seconds: float, held_calls: int = 0, held_s: float = 0.0
    ) -> None:
        """One pre-inference step of `prefixes` prefixes' chunks, by a graph replay or eagerly,
        that took `seconds` of device time (also add it to "preinfer" with `add`); `held_calls`
        ranking calls waited while it ran, `held_s` seconds in all within it: what the step cost
        the calls (a step runs when none waits, so these came during it)."""
        with self._lock:
            step = self._steps["graph" if graphed else "eager"]
            step[0] += 1
            step[1] += max(0.0, seconds)
            step[2] += prefixes
            step[3] += seconds > _LONG_STEP_S
            step[4] += max(0, held_calls)
            step[5] += max(0.0, held_s)

    def preinfer_started(self, wait_s: float, joined: bool) -> None:
        """A pre-inference's first step was launched `wait_s` after it was submitted; `joined`:
        a ranking call was already waiting for it."""
        with self._lock:
            self._starts[0] += 1
            self._starts[1] += max(0.0, wait_s)
            self._starts[2] += wait_s > 0.050
            self._starts[3] += joined

    def preinfer_done(self, build_s: float, total_s: float, after_call: bool) -> None:
        """A pre-inference completed `build_s` after its first step was launched and `total_s`
        after its submission; `after_call`: later than its ranking call was planned to come."""
        with self._lock:
            self._dones[0] += 1
            self._dones[1] += max(0.0, build_s)
            self._dones[2] += max(0.0, total_s)
            self._dones[3] += after_call
            self._dones[4] += build_s > 0.050

    def idle_between(self, gap_s: float, starved_s: float) -> None:
        """One gap between two consecutive ranking batches on the device, `starved_s` of it with
        a call of the second already waiting (`starved_seconds`)."""
        with self._lock:
            self._gap_s += max(0.0, gap_s)
            self._starved_s += max(0.0, starved_s)
            self._starved_gaps += starved_s > 0.001

    def fill_wait(self, seconds: float) -> None:
        """The device loop waited this long, nothing in flight, for a ranking batch to fill."""
        with self._lock:
            self._fill_wait_s += max(0.0, seconds)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Marks the device busy for the block (nested and concurrent blocks count once)."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = self._clock()
            self._active += 1

    def end(self) -> None:
        with self._lock:
            if self._active <= 0:
                raise RuntimeError("DeviceTime.end() without begin()")
            self._active -= 1
            if self._active == 0:
                self._busy_s += self._clock() - self._busy_since

    def produced(self, key: Hashable, seconds: float) -> None:
        """The psi under `key` cost `seconds` of pre-inference (replaces an earlier cost)."""
        with self._lock:
            self._psi_cost.pop(key, None)
            self._psi_cost[key] = seconds
            while len(self._psi_cost) > self._max_tracked:
                self._psi_cost.popitem(last=False)

    def consumed(self, key: Hashable) -> None:
        """A ranking call used the psi under `key`: its cost was not wasted."""
        with self._lock:
            self._psi_cost.pop(key, None)

    def expired_unused(self, key: Hashable, count: bool = True) -> float:
        """The psi under `key` expired before any ranking call used it: its pre-inference time is
        counted as unused (once). Returns that time (0 if unknown or already settled). `count`
        False: more time of a psi already counted (a step that was on the device when it was
        abandoned), not another psi."""
        with self._lock:
            seconds = self._psi_cost.pop(key, None)
            if seconds is None:
                return 0.0
            self._unused_s += seconds
            self._unused += 1 if count else 0
            return seconds

    def recent_busy_fraction(self, window_s: float = 2.0) -> float:
        """The busy share of about the last `window_s` seconds (at least that much when there is
        history), from this ledger's own readings: each call adds one, so callers that ask
        often (Stats polled every ~0.1-1 s) get a fraction over a sliding window. 0 on the
        first call."""
        with self._lock:
            now = self._clock()
            busy = self._busy_s + (now - self._busy_since if self._active else 0.0)
            readings = self._readings
            readings.append((now, busy))
            # Keep the newest reading at least window_s old as the base.
            while len(readings) > 2 and now - readings[1][0] >= window_s:
                readings.popleft()
            since, busy_then = readings[0]
        if now <= since:
            return 0.0
        return min(1.0, max(0.0, (busy - busy_then) / (now - since)))

    def snapshot(self) -> DeviceTimeSnapshot:
        with self._lock:
            busy = self._busy_s + (self._clock() - self._busy_since if self._active else 0.0)
            return DeviceTimeSnapshot(
                dict(self._work_s), busy, self._unused_s, self._unused,
                self._gap_s, self._starved_s, self._starved_gaps, self._fill_wait_s,
                {kind: (int(n), float(sec), int(pre), int(long), int(calls), float(held))
                 for kind, (n, sec, pre, long, calls, held) in self._steps.items()},
                (int(self._starts[0]), float(self._starts[1]), int(self._starts[2]), int(self._starts[3])),
                (int(self._dones[0]), float(self._dones[1]), float(self._dones[2]), int(self._dones[3]),
                 int(self._dones[4])),
            )  # fmt: skip


class SectionTimer:
    """The device time of one piece of work issued in host sections (e.g. one pre-inference's
    layer steps). On CUDA each section is bracketed by timing events on the current stream and
    `total_s()` must be called once the work has completed (after a synchronise); elsewhere the
    work is synchronous and sections are timed by the wall clock. With a `pool`
    (services/ranker/events.py) the events come from it, and `release()` gives them back once
    read."""

    def __init__(self, cuda: bool, pool: EventPool[torch.cuda.Event] | None = None) -> None:
        self._cuda = cuda
        self._pool = pool
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wall_s = 0.0

    def _event(self) -> torch.cuda.Event:
        return self._pool.take() if self._pool is not None else torch.cuda.Event(enable_timing=True)

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        if self._cuda:
            start, end = self._event(), self._event()
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            started = time.perf_counter()
            try:
                yield
            finally:
                self._wall_s += time.perf_counter() - started

    @property
    def first_event(self) -> torch.cuda.Event | None:
        """The event before the first section's work (None off CUDA, or before any section)."""
        return self._events[0][0] if self._events else None

    @property
    def last_event(self) -> torch.cuda.Event | None:
        """The event after the last section's work (None off CUDA, or before any section): its
        completion is the work's."""
        return self._events[-1][1] if self._events else None

    def done(self) -> bool:
        """Whether the sections' device work has completed (always, off CUDA)."""
        return not self._events or bool(self._events[-1][1].query())

    def synchronize(self) -> None:
        """Waits for the last section's device work (on CUDA; nothing elsewhere). Not the
        stream: work queued after the sections may still run."""
        if self._events:
            wait_until_done(self._events[-1][1])

    def release(self) -> None:
        """Gives the events back to the pool (after total_s(): nothing reads them again)."""
        events, self._events = self._events, []
        if self._pool is not None:
            for start, end in events:
                self._pool.give(start)
                self._pool.give(end)

    def total_s(self) -> float:
        """Seconds over all sections. Blocks on CUDA until the last section has completed."""
        return self._wall_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


class DeviceTimeCollector(Collector):
    """Prometheus view of a DeviceTime, read at scrape time."""

    def __init__(self, ledger: DeviceTime) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[CounterMetricFamily]:
        snap = self._ledger.snapshot()
        work = CounterMetricFamily(
            "relaygr_ranker_device_seconds", "device time spent, by kind of work", labels=["work"]
        )
        for name, seconds in snap.work_s.items():
            work.add_metric([name], seconds)
        yield work
        yield CounterMetricFamily(
            "relaygr_ranker_device_busy_seconds",
            "wall time with a ranking batch or a pre-inference outstanding on the device",
            value=snap.busy_s,
        )
        yield CounterMetricFamily(
            "relaygr_ranker_device_gap_seconds",
            "device time between consecutive ranking batches",
            value=snap.gap_s,
        )
        yield CounterMetricFamily(
            "relaygr_ranker_device_starved_seconds",
            "device time between consecutive ranking batches while a call of the next one waited",
            value=snap.starved_s,
        )
        yield CounterMetricFamily(
            "relaygr_ranker_device_starved_gaps_over_1ms",
            "gaps between ranking batches with over 1 ms of it spent while a call waited",
            value=snap.starved_gaps_over_1ms,
        )
        yield CounterMetricFamily(
            "relaygr_ranker_device_fill_wait_seconds",
            "time the device loop waited, nothing in flight, for a ranking batch to fill",
            value=snap.fill_wait_s,
        )
        yield CounterMetricFamily(
            "relaygr_ranker_unused_psi_device_seconds",
            "pre-inference time of psi that expired before any ranking call used it",
            value=snap.unused_psi_s,
        )
        yield CounterMetricFamily(
            "relaygr_ranker_unused_psi",
            "psi that expired before any ranking call used it",
            value=snap.unused_psi,
        )
        families = [
            CounterMetricFamily(name, doc, labels=["kind"])
            for name, doc in (
                ("relaygr_ranker_preinfer_steps", "pre-inference steps, by graph replay or eager"),
                ("relaygr_ranker_preinfer_step_seconds", "device time of pre-inference steps, by kind"),
                (
                    "relaygr_ranker_preinfer_step_prefixes",
                    "prefixes built from in pre-inference steps, by kind",
                ),
                ("relaygr_ranker_preinfer_steps_over_10ms", "pre-inference steps of over 10 ms, by kind"),
                (
                    "relaygr_ranker_preinfer_held_calls",
                    "ranking calls that waited while a pre-inference step ran, by the step's kind",
                ),
                (
                    "relaygr_ranker_preinfer_held_call_seconds",
                    "those calls' waits within the steps, by kind",
                ),
            )
        ]
        for kind, values in (snap.preinfer_steps or {}).items():
            for family, value in zip(families, values, strict=True):
                family.add_metric([kind], value)
        yield from families
        started, waited_s, over_50ms, joined = snap.preinfer_starts
        for name, doc, value in (
            ("relaygr_ranker_preinfers_started", "pre-inferences whose first step was launched", started),
            ("relaygr_ranker_preinfer_start_wait_seconds", "their waits from submission to the first step", waited_s),
            ("relaygr_ranker_preinfers_started_over_50ms", "pre-inferences that waited over 50 ms to start", over_50ms),
            ("relaygr_ranker_preinfers_started_joined", "pre-inferences a ranking call had joined before they started", joined),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)
        done, build_s, total_s, after_call, build_over_50ms = snap.preinfer_dones
        for name, doc, value in (
            ("relaygr_ranker_preinfers_done", "pre-inferences completed", done),
            ("relaygr_ranker_preinfer_build_seconds", "their times from the first step to complete", build_s),
            ("relaygr_ranker_preinfer_done_seconds", "their times from submission to complete", total_s),
            ("relaygr_ranker_preinfers_done_after_call", "pre-inferences completed after their ranking call was planned to come", after_call),
            ("relaygr_ranker_preinfer_builds_over_50ms", "pre-inferences whose build took over 50 ms", build_over_50ms),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)
