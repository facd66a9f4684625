"""A coroutine's own CPU on the event loop: its steps, not what other tasks do while it awaits."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from relaygr.harness import demote_loop_cpu_ms_mean, parse_metrics
from services.ranker.task_cpu import CpuMeter, CpuMeterCollector, metered
from tests.cpu import burn_cpu


async def test_counts_its_own_steps_and_not_the_other_tasks_that_run_while_it_waits():
    meter = CpuMeter()
    release = asyncio.Event()

    async def copy() -> str:
        burn_cpu(0.02)  # e.g. a gRPC call's Python side
        await release.wait()  # the expander answers meanwhile; other tasks run
        burn_cpu(0.02)  # the bookkeeping after it
        return "stored"

    async def others() -> None:
        burn_cpu(0.2)  # far more than the metered coroutine's own
        release.set()

    task = asyncio.create_task(metered(copy(), meter))
    await asyncio.sleep(0)  # the metered task takes its first step
    await others()
    assert await task == "stored"
    assert meter.runs == 1
    assert 0.04 <= meter.seconds < 0.1
    assert meter.ms_per_run() == pytest.approx(meter.seconds * 1e3)


async def test_exceptions_and_cancellation_pass_through_and_still_count_a_run():
    meter = CpuMeter()

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("expander refused")

    with pytest.raises(ValueError, match="expander refused"):
        await metered(fails(), meter)
    assert meter.runs == 1

    cleaned = asyncio.Event()

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()  # the coroutine saw its cancellation (e.g. to abort a reservation)

    task = asyncio.create_task(metered(waits_forever(), meter))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()
    assert meter.runs == 2


def test_no_figure_before_enough_runs():
    meter = CpuMeter()
    assert meter.ms_per_run() is None
    meter.seconds, meter.runs = 0.003, 2
    assert meter.ms_per_run(min_runs=3) is None
    assert meter.ms_per_run() == pytest.approx(1.5)


def test_the_harness_reads_the_event_loops_cpu_per_copy_over_a_point():
    registry = CollectorRegistry()
    meter = CpuMeter()
    registry.register(CpuMeterCollector(meter, "relaygr_ranker_demotion_loop_cpu_seconds",
                                        "relaygr_ranker_demotions_metered", "copies"))  # fmt: skip

    def reading() -> dict[str, float]:
        samples = parse_metrics(generate_latest(registry).decode())
        return {
            "demote_loop_cpu_s": samples["relaygr_ranker_demotion_loop_cpu_seconds_total"],
            "demotions_metered": samples["relaygr_ranker_demotions_metered_total"],
        }

    meter.seconds, meter.runs = 0.010, 4  # before the point
    before = reading()
    assert demote_loop_cpu_ms_mean(reading(), before) == 0.0  # nothing copied over the point
    meter.seconds, meter.runs = 0.016, 7  # three copies of 2 ms each over the point
    assert demote_loop_cpu_ms_mean(reading(), before) == pytest.approx(2.0)
