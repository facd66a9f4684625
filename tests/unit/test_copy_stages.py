"""Where a psi copy's time goes (services/ranker/copy_stages.py): the ledger, its Prometheus view
as the benchmarks read it, and the engine's bookkeeping into it on the CPU."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kernels.device import accelerator
from relaygr.harness import copy_stage_counters, copy_stage_means, parse_metrics
from services.ranker.copy_stages import RELOAD_PATH_STAGES, CopyStages, CopyStagesCollector
from services.ranker.engine import Engine, EngineConfig
from services.ranker.model import HSTURanker
from shared.modelspec import preset


def test_stages_add_up_by_work_and_a_negative_reading_counts_as_zero():
    stages = CopyStages()
    stages.add("reload", 0.002, 0.004, 0.003, 0.001)
    stages.add("reload", 0.004, 0.0, 0.003, -0.0005)
    stages.add("demote", 0.0, 0.0, 0.002, 0.0)
    assert stages.mean_ms("reload") == pytest.approx(
        {"issue": 3.0, "device_wait": 2.0, "copy": 3.0, "settle": 0.5}
    )
    assert stages.mean_ms("demote")["copy"] == pytest.approx(2.0)
    assert stages.mean_ms("copy") == {}


def test_the_benchmarks_read_the_collector_s_samples_and_take_means_over_an_interval():
    stages = CopyStages()
    registry = CollectorRegistry()
    registry.register(CopyStagesCollector(stages))

    def reading() -> dict[str, float]:  # as relaygr.harness.device_counters reads a ranker's scrape
        return copy_stage_counters(parse_metrics(generate_latest(registry).decode()))

    stages.add("reload", 1.0, 1.0, 1.0, 1.0)  # before the interval: not in its means
    before = reading()
    stages.add("reload", 0.010, 0.020, 0.002, 0.001)
    stages.add("reload", 0.030, 0.000, 0.004, 0.003)
    means = copy_stage_means(reading(), before)
    assert means["reload_issue_ms_mean"] == pytest.approx(20.0)
    assert means["reload_device_wait_ms_mean"] == pytest.approx(10.0)
    assert means["reload_copy_ms_mean"] == pytest.approx(3.0)
    assert means["reload_settle_ms_mean"] == pytest.approx(2.0)
    assert means["demote_copy_ms_mean"] == 0.0  # none timed in the interval


async def test_the_engine_times_each_copy_by_stage():
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig(max_wait_s=0.0))
    engine.start()
    try:
        assert await engine.copy(lambda: time.sleep(0.02) or "x", work="reload") == "x"
        await engine.copy(lambda: None, work="demote")
    finally:
        engine.stop()
    reload = engine.copy_stages.mean_ms("reload")
    assert reload["copy"] >= 15.0  # the issue's own time, on the CPU
    assert reload["device_wait"] == 0.0  # no streams off CUDA
    assert reload["issue"] >= 0.0
    assert reload["settle"] >= 0.0
    assert engine.copy_stages.snapshot()[1] == {"reload": 1, "demote": 1}


def test_a_call_s_reload_path_is_read_as_its_own_ledger():
    path = CopyStages(RELOAD_PATH_STAGES)
    registry = CollectorRegistry()
    registry.register(
        CopyStagesCollector(
            path,
            seconds_name="relaygr_ranker_reload_path_seconds",
            timed_name="relaygr_ranker_reload_paths_timed",
        )
    )

    def reading() -> dict[str, float]:
        return copy_stage_counters(parse_metrics(generate_latest(registry).decode()))

    before = reading()
    path.add("call", 0.001, 0.002, 0.003, 0.004, 0.005)
    path.add("call", 0.003, 0.002, 0.001, 0.000, 0.001)
    means = copy_stage_means(reading(), before)
    assert [means[f"reload_path_{stage}_ms_mean"] for stage in RELOAD_PATH_STAGES] == pytest.approx(
        [2.0, 2.0, 2.0, 2.0, 3.0]
    )
    assert means["reload_copy_ms_mean"] == 0.0  # the copy stages' own ledger is apart
    with pytest.raises(ValueError, match="5 stages, 1 readings"):
        path.add("call", 0.001)  # one reading per stage, or none taken
    assert path.snapshot()[1] == {"call": 2}
