"""The device loop's watchdog (services/ranker/loop_watch.py) and HostStalls' watchers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from services.ranker.config import RankerConfig
from services.ranker.loop_time import LoopTime
from services.ranker.loop_watch import LoopWatch
from shared.config import ConfigError, load_config
from shared.metrics import HostStalls


@contextmanager
def held_section(loop_time: LoopTime, name: str) -> Iterator[tuple[str, float, int]]:
    """A device-loop thread inside section `name` until the block ends; yields the section as
    LoopTime.running() reports it."""
    inside, release = threading.Event(), threading.Event()

    def launching_a_slow_batch() -> None:  # the name the logged stack must show
        with loop_time.section(name):
            inside.set()
            release.wait(5.0)

    thread = threading.Thread(target=launching_a_slow_batch, name="relaygr-engine")
    thread.start()
    try:
        assert inside.wait(5.0)
        running = loop_time.running()
        assert running is not None
        yield running
    finally:
        release.set()
        thread.join(5.0)
    assert loop_time.running() is None  # between sections


def lines(logs: list[dict], event: str) -> list[dict]:
    return [r for r in logs if r.get("event") == event]


def slow_count(registry: CollectorRegistry, section: str) -> float:
    return registry.get_sample_value("relaygr_ranker_device_loop_slow_total", {"section": section}) or 0.0


def test_a_slow_launch_is_counted_once_and_logged_with_every_threads_frames():
    registry, loop_time = CollectorRegistry(), LoopTime()
    watch = LoopWatch(loop_time, registry, slow_ms=5.0, log_every_s=1.0)
    with capture_logs() as logs, held_section(loop_time, "launch") as (name, started, thread):
        assert name == "launch"
        assert thread != threading.get_ident()
        watch.check(started + 0.004)  # within the threshold: nothing
        assert slow_count(registry, "launch") == 0
        watch.check(started + 0.006)
        watch.check(started + 0.050)  # the same section, seen again: counted once
    assert slow_count(registry, "launch") == 1
    [line] = lines(logs, "device_loop_slow")
    assert line["section"] == "launch"
    assert line["ms"] == pytest.approx(6.0)
    assert any("launching_a_slow_batch" in frame for frame in line["loop_frames"])
    # This thread built the watch, as the ranker's event loop does: its stack is the event loop's.
    assert any("test_a_slow_launch_is_counted_once" in frame for frame in line["event_loop_frames"])


def test_sections_that_wait_by_design_are_not_watched_and_lines_come_at_most_once_a_second():
    registry, loop_time = CollectorRegistry(), LoopTime()
    watch = LoopWatch(loop_time, registry, slow_ms=5.0, log_every_s=1.0)
    with capture_logs() as logs:
        for waiting in ("settle_wait", "fill_wait", "idle", "other"):
            with held_section(loop_time, waiting) as (_, started, _):
                watch.check(started + 1.0)
            assert slow_count(registry, waiting) == 0
        # Three slow sections within a second: three counted, one line; then a line again that
        # counts the two it left out.
        base = time.perf_counter() + 10.0
        for i, section in enumerate(("plan", "settle", "copies")):
            with held_section(loop_time, section):
                watch.check(base + 0.1 * i)
        with held_section(loop_time, "launch"):
            watch.check(base + 2.0)
    for section in ("plan", "settle", "copies", "launch"):
        assert slow_count(registry, section) == 1
    logged = lines(logs, "device_loop_slow")
    assert [line["section"] for line in logged] == ["plan", "launch"]
    assert logged[1]["slow_sections_since_last_line"] == 3


def test_the_watch_refuses_a_threshold_that_is_not_positive():
    with pytest.raises(ValueError, match="slow_ms"):
        LoopWatch(LoopTime(), CollectorRegistry(), slow_ms=0.0)


def test_host_stalls_calls_its_watchers_and_drops_one_that_raises():
    calls: list[float] = []
    seen = threading.Event()

    def good(now: float) -> None:
        calls.append(now)
        if len(calls) >= 3:
            seen.set()

    def broken(now: float) -> None:
        raise RuntimeError("boom")

    with capture_logs() as logs:
        stalls = HostStalls(CollectorRegistry(), period_s=0.001, watchers=[broken, good])
        try:
            assert seen.wait(5.0)
        finally:
            stalls.close()
    assert calls == sorted(calls)
    failed = lines(logs, "watcher_failed")
    assert len(failed) == 1  # dropped after its first fault
    assert "boom" in failed[0]["error"]


def test_the_rankers_setting_is_checked_at_start_up():
    assert load_config(RankerConfig, ["--device", "cpu"]).loop_slow_ms == 5.0
    assert load_config(RankerConfig, ["--device", "cpu", "--loop-slow-ms", "0"]).loop_slow_ms == 0.0
    with pytest.raises(ConfigError, match="loop"):
        load_config(RankerConfig, ["--device", "cpu", "--loop-slow-ms", "-1"])
