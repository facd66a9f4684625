"""Collector pauses and host stalls are timed into the service's registry (shared.metrics)."""

from __future__ import annotations

import asyncio
import gc
import sys
import time

import structlog.testing
from prometheus_client import CollectorRegistry

from shared.metrics import GcPauses, HostStalls


def test_every_collection_is_timed_by_generation_and_close_stops_it():
    registry = CollectorRegistry()
    pauses = GcPauses(registry, log_over_s=0.0)  # logs every pause: the logging path runs too
    try:
        gc.collect(2)
        gc.collect(0)
        for generation in ("0", "2"):
            count = registry.get_sample_value("relaygr_gc_pause_seconds_count", {"generation": generation})
            assert count is not None
            assert count >= 1
    finally:
        pauses.close()
    before = registry.get_sample_value("relaygr_gc_pause_seconds_count", {"generation": "2"})
    gc.collect(2)
    assert registry.get_sample_value("relaygr_gc_pause_seconds_count", {"generation": "2"}) == before
    pauses.close()  # twice: harmless


def test_a_thread_kept_from_running_is_counted_as_a_stall():
    # Holding the GIL for 0.15 s in one stretch (a long switch interval) stands for any stall.
    registry = CollectorRegistry()
    stalls = HostStalls(registry, period_s=0.005)
    interval = sys.getswitchinterval()
    try:
        time.sleep(0.05)  # the watch is running
        sys.setswitchinterval(0.15)
        deadline = time.perf_counter() + 0.15
        while time.perf_counter() < deadline:
            pass
    finally:
        sys.setswitchinterval(interval)
        time.sleep(0.05)
        stalls.close()
    count = registry.get_sample_value("relaygr_host_stall_seconds_count")
    under_20ms = registry.get_sample_value("relaygr_host_stall_seconds_bucket", {"le": "0.02"})
    assert count is not None
    assert under_20ms is not None
    assert count > under_20ms  # at least one wake-up came over 20 ms late


def _busy_wait(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


async def test_a_blocked_event_loop_is_timed_and_what_blocked_it_is_logged():
    # One callback runs 0.12 s without yielding: the loop's timer is late, and the watch thread
    # (which still gets the GIL) logs the loop thread's stack with this function in it.
    registry = CollectorRegistry()
    with structlog.testing.capture_logs() as logs:
        stalls = HostStalls(registry, period_s=0.005)
        try:
            await asyncio.sleep(0.05)
            _busy_wait(0.12)
            await asyncio.sleep(0.05)
        finally:
            stalls.close()
    count = registry.get_sample_value("relaygr_event_loop_lag_seconds_count")
    under_50ms = registry.get_sample_value("relaygr_event_loop_lag_seconds_bucket", {"le": "0.05"})
    assert count is not None
    assert under_50ms is not None
    assert count > under_50ms  # the ticker ran over 50 ms late once
    stalls_logged = [e for e in logs if e["event"] == "event_loop_stall"]
    assert len(stalls_logged) == 1  # one look per stall
    # Logged at the watch's first look past 20 ms: rounded to 0.1 ms, that can read 20.0.
    assert stalls_logged[0]["behind_ms"] >= 20
    assert any("_busy_wait" in line for line in stalls_logged[0]["loop_frames"])


def test_outside_an_event_loop_only_the_thread_is_watched():
    registry = CollectorRegistry()
    stalls = HostStalls(registry, period_s=0.005)
    time.sleep(0.03)
    stalls.close()
    assert registry.get_sample_value("relaygr_event_loop_lag_seconds_count") == 0
    assert (registry.get_sample_value("relaygr_host_stall_seconds_count") or 0) >= 1
