"""The device-time ledger (services/ranker/device_time.py) and the engine's bookkeeping into it."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kernels.device import accelerator
from relaygr.harness import parse_metrics
from relaygr.synthetic import Shape, batch
from services.ranker.device_time import DeviceTime, DeviceTimeCollector, starved_seconds
from services.ranker.engine import Engine, EngineConfig
from services.ranker.model import HSTURanker
from shared.modelspec import preset


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_busy_intervals_count_once():
    clock = FakeClock()
    ledger = DeviceTime(clock)
    ledger.begin()  # a ranking batch
    clock.now += 1.0
    ledger.begin()  # a pre-inference on its own thread, overlapping
    clock.now += 2.0
    ledger.end()
    clock.now += 0.5
    assert ledger.snapshot().busy_s == pytest.approx(3.5)  # still open: counted up to now
    ledger.end()
    clock.now += 10.0  # idle
    assert ledger.snapshot().busy_s == pytest.approx(3.5)
    with pytest.raises(RuntimeError):
        ledger.end()


def test_psi_cost_is_unused_only_if_it_expires_before_any_consumption():
    ledger = DeviceTime()
    ledger.produced("a", 0.25)
    ledger.produced("b", 0.5)
    ledger.consumed("a")
    assert ledger.expired_unused("a") == 0.0  # consumed first: it was useful
    assert ledger.expired_unused("b") == 0.5
    assert ledger.expired_unused("b") == 0.0  # settled once
    snap = ledger.snapshot()
    assert (snap.unused_psi_s, snap.unused_psi) == (0.5, 1)


def test_tracked_costs_are_bounded():
    ledger = DeviceTime(max_tracked=2)
    for key in "abc":
        ledger.produced(key, 1.0)
    assert ledger.expired_unused("a") == 0.0  # the oldest was dropped
    assert ledger.expired_unused("c") == 1.0


def test_unknown_work_is_refused():
    with pytest.raises(ValueError, match="unknown kind"):
        DeviceTime().add("nap", 1.0)


async def test_engine_books_rank_and_preinfer_time_and_unused_psi():
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig(max_wait_s=0.0))
    engine.start()
    try:
        prefixes, suffixes = batch(3, [Shape(2, 300, 4, 8)] * 2)
        psis = await asyncio.gather(*(engine.preinfer(p) for p in prefixes))
        after_preinfer = engine.device_time.snapshot()
        assert after_preinfer.work_s["preinfer"] > 0
        assert after_preinfer.work_s["rank"] == 0
        await engine.rank_cached(suffixes[0], psis[0], psis[0].key)  # consumes psi 0
        await engine.rank_full(prefixes[1], suffixes[1])
        with pytest.raises(ValueError, match="a copy is"):
            await engine.copy(lambda: None, work="rank")
        await engine.copy(lambda: None, work="reload")
        snap = engine.device_time.snapshot()
        assert snap.work_s["rank"] > 0
        assert snap.busy_s >= snap.work_s["rank"]  # busy covers the batches (and pre-inference)
        # psi 0 was used; psi 1 expires unused: its share of the pre-inference is wasted.
        assert engine.device_time.expired_unused(psis[0].key) == 0.0
        wasted = engine.device_time.expired_unused(psis[1].key)
        assert 0 < wasted <= snap.work_s["preinfer"]
    finally:
        engine.stop()

    registry = CollectorRegistry()
    registry.register(DeviceTimeCollector(engine.device_time))
    samples = parse_metrics(generate_latest(registry).decode())
    assert samples['relaygr_ranker_device_seconds_total{work="rank"}'] == pytest.approx(snap.work_s["rank"])
    assert samples["relaygr_ranker_unused_psi_device_seconds_total"] == pytest.approx(wasted)
    assert samples["relaygr_ranker_unused_psi_total"] == 1
    assert samples["relaygr_ranker_device_busy_seconds_total"] > 0
    # Both pre-inferences ran as eager steps on the CPU (no graphs), their time all of "preinfer".
    steps = snap.preinfer_steps
    assert steps is not None
    assert steps["graph"] == (0, 0.0, 0, 0, 0, 0.0)
    n, seconds, prefixes, *_ = steps["eager"]
    assert n >= 1
    assert prefixes >= 2  # each step builds one or more of the two prefixes
    assert seconds == pytest.approx(snap.work_s["preinfer"])
    assert samples['relaygr_ranker_preinfer_steps_total{kind="eager"}'] == n
    assert samples['relaygr_ranker_preinfer_step_prefixes_total{kind="eager"}'] == prefixes
    # Each pre-inference's start was counted once, nobody waiting for it yet.
    started, waited_s, _, joined = snap.preinfer_starts
    assert started == 2
    assert waited_s >= 0.0
    assert joined == 0
    assert samples["relaygr_ranker_preinfers_started_total"] == 2
    # ... and each completion once: built after it started, no SLO known so never "after its call".
    done, build_s, total_s, after_call, _ = snap.preinfer_dones
    assert done == 2
    assert 0.0 < build_s <= total_s
    assert after_call == 0
    assert samples["relaygr_ranker_preinfers_done_total"] == 2


def test_preinfer_starts_count_their_waits_and_those_a_call_waited_for():
    ledger = DeviceTime()
    ledger.preinfer_started(0.010, joined=False)
    ledger.preinfer_started(0.120, joined=True)
    assert ledger.snapshot().preinfer_starts == (2, pytest.approx(0.130), 1, 1)
    registry = CollectorRegistry()
    registry.register(DeviceTimeCollector(ledger))
    samples = parse_metrics(generate_latest(registry).decode())
    assert samples["relaygr_ranker_preinfer_start_wait_seconds_total"] == pytest.approx(0.130)
    assert samples["relaygr_ranker_preinfers_started_over_50ms_total"] == 1
    assert samples["relaygr_ranker_preinfers_started_joined_total"] == 1


def test_preinfer_completions_count_their_build_times_and_those_after_their_call():
    ledger = DeviceTime()
    ledger.preinfer_done(build_s=0.020, total_s=0.030, after_call=False)
    ledger.preinfer_done(build_s=0.070, total_s=0.160, after_call=True)
    assert ledger.snapshot().preinfer_dones == (2, pytest.approx(0.090), pytest.approx(0.190), 1, 1)
    registry = CollectorRegistry()
    registry.register(DeviceTimeCollector(ledger))
    samples = parse_metrics(generate_latest(registry).decode())
    assert samples["relaygr_ranker_preinfer_build_seconds_total"] == pytest.approx(0.090)
    assert samples["relaygr_ranker_preinfer_done_seconds_total"] == pytest.approx(0.190)
    assert samples["relaygr_ranker_preinfers_done_after_call_total"] == 1
    assert samples["relaygr_ranker_preinfer_builds_over_50ms_total"] == 1


def test_preinfer_steps_are_counted_by_kind():
    ledger = DeviceTime()
    ledger.preinfer_step(True, 1, 0.005)
    ledger.preinfer_step(False, 4, 0.020, held_calls=3, held_s=0.021)
    ledger.preinfer_step(False, 1, 0.004, held_calls=1, held_s=0.002)
    steps = ledger.snapshot().preinfer_steps
    assert steps == {
        "graph": (1, 0.005, 1, 0, 0, 0.0),
        "eager": (2, pytest.approx(0.024), 5, 1, 4, pytest.approx(0.023)),
    }
    registry = CollectorRegistry()
    registry.register(DeviceTimeCollector(ledger))
    samples = parse_metrics(generate_latest(registry).decode())
    assert samples['relaygr_ranker_preinfer_steps_over_10ms_total{kind="eager"}'] == 1
    assert samples['relaygr_ranker_preinfer_step_seconds_total{kind="graph"}'] == pytest.approx(0.005)
    assert samples['relaygr_ranker_preinfer_held_calls_total{kind="eager"}'] == 4
    assert samples['relaygr_ranker_preinfer_held_call_seconds_total{kind="eager"}'] == pytest.approx(0.023)


def test_starved_time_is_the_part_of_a_gap_a_waiting_call_saw():
    # A 5 ms gap that ended at t=10.000: a call waiting since 9.990 saw all of it, one since
    # 9.998 the last 2 ms, one submitted at the launch none.
    assert starved_seconds(0.005, 10.0, 9.990) == pytest.approx(0.005)
    assert starved_seconds(0.005, 10.0, 9.998) == pytest.approx(0.002)
    assert starved_seconds(0.005, 10.0, 10.0) == 0.0
    assert starved_seconds(-0.001, 10.0, 9.0) == 0.0  # overlapping events: no gap
    ledger = DeviceTime()
    ledger.idle_between(0.005, 0.002)
    ledger.idle_between(0.003, 0.0005)
    snap = ledger.snapshot()
    assert snap.gap_s == pytest.approx(0.008)
    assert snap.starved_s == pytest.approx(0.0025)
    assert snap.starved_gaps_over_1ms == 1
    registry = CollectorRegistry()
    registry.register(DeviceTimeCollector(ledger))
    samples = parse_metrics(generate_latest(registry).decode())
    assert samples["relaygr_ranker_device_gap_seconds_total"] == pytest.approx(0.008)
    assert samples["relaygr_ranker_device_starved_seconds_total"] == pytest.approx(0.0025)
    assert samples["relaygr_ranker_device_starved_gaps_over_1ms_total"] == 1
    ledger.fill_wait(0.001)
    assert ledger.snapshot().fill_wait_s == pytest.approx(0.001)


async def test_the_engine_books_the_gap_between_batches_and_a_waiting_calls_share_of_it():
    """On the CPU the engine waits up to max_wait for a batch to fill: the device is idle then
    while the call waits (starved); the idle time before the call came is a gap, not starved."""
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig(max_wait_s=0.05))
    engine.start()
    try:
        prefixes, suffixes = batch(3, [Shape(2, 64, 4, 8)] * 2)
        psis = model.preinfer(prefixes)
        await engine.rank_cached(suffixes[0], psis[0], psis[0].key)
        assert engine.device_time.snapshot().gap_s == 0.0  # one batch: no gap yet
        await asyncio.sleep(0.1)  # idle, nobody waiting
        await engine.rank_cached(suffixes[1], psis[1], psis[1].key)
    finally:
        engine.stop()  # joins the device loop: its bookkeeping after the answer is done
    snap = engine.device_time.snapshot()
    assert snap.gap_s >= 0.1 + 0.04
    assert 0.04 <= snap.starved_s < 0.1  # the batch's fill wait, not the idle time before the call
    assert snap.starved_gaps_over_1ms == 1
    # Both batches waited to fill (max_wait) with nothing in flight; the fill waits are counted.
    assert 0.08 <= snap.fill_wait_s <= snap.gap_s + 0.06


def test_recent_busy_fraction_is_the_busy_share_of_a_sliding_window():
    clock = FakeClock()
    ledger = DeviceTime(clock)
    assert ledger.recent_busy_fraction(window_s=2.0) == 0.0  # the first reading: no window yet
    for _ in range(4):  # busy 0.25 of every second
        ledger.begin()
        clock.now += 0.25
        ledger.end()
        clock.now += 0.75
    assert ledger.recent_busy_fraction(window_s=2.0) == pytest.approx(0.25)
    ledger.begin()  # then fully busy, still outstanding when asked: counted up to now
    for _ in range(4):
        clock.now += 0.5
        ledger.recent_busy_fraction(window_s=2.0)
    # The window slid past the quiet seconds: only the last ~2 s count.
    assert ledger.recent_busy_fraction(window_s=2.0) == pytest.approx(1.0)
    ledger.end()
    clock.now += 3.0
    ledger.recent_busy_fraction(window_s=2.0)
    clock.now += 0.1
    assert ledger.recent_busy_fraction(window_s=2.0) < 0.5  # idle again
