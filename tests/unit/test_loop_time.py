"""The device loop's own time by section (services/ranker/loop_time.py) and the engine's use of it."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kernels.device import accelerator
from relaygr.harness import parse_metrics
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig
from services.ranker.loop_time import SECTIONS, LoopTime, LoopTimeCollector
from services.ranker.model import HSTURanker
from shared.modelspec import preset


def test_a_section_books_its_wall_time_and_only_the_cpu_it_used() -> None:
    loop = LoopTime()
    with loop.section("idle"):
        time.sleep(0.05)  # waits: wall time, next to no CPU
    with loop.section("plan"):
        end = time.thread_time() + 0.03
        while time.thread_time() < end:  # computes: CPU about equal to wall
            pass
    snap = loop.snapshot()
    idle_wall, idle_cpu = snap["idle"]
    plan_wall, plan_cpu = snap["plan"]
    assert idle_wall >= 0.05
    assert idle_cpu < 0.5 * idle_wall
    assert plan_cpu >= 0.03
    assert plan_wall >= plan_cpu - 0.001  # two clocks: CPU time can read a hair over wall
    assert snap["launch"] == (0.0, 0.0)
    with pytest.raises(ValueError, match="unknown loop section"), loop.section("nap"):
        pass
    registry = CollectorRegistry()
    registry.register(LoopTimeCollector(loop))
    samples = parse_metrics(generate_latest(registry).decode())
    name = 'relaygr_ranker_engine_loop_seconds_total{clock="%s",section="%s"}'  # labels sorted
    assert samples[name % ("wall", "idle")] == pytest.approx(idle_wall)
    assert samples[name % ("cpu", "plan")] == pytest.approx(plan_cpu)
    assert all(name % (c, s) in samples for s in SECTIONS for c in ("wall", "cpu"))


async def test_the_engine_loop_books_planning_launching_settling_and_waiting() -> None:
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig(max_wait_s=0.02))
    engine.start()
    try:
        prefixes, suffixes = batch(3, [Shape(2, 64, 4, 8)] * 2)
        psis = model.preinfer(prefixes)
        await engine.rank_cached(suffixes[0], psis[0], psis[0].key)
        await engine.rank_full(prefixes[1], suffixes[1])
        await asyncio.sleep(0.05)  # the loop waits for work
    finally:
        engine.stop()
    snap = engine.loop_time.snapshot()
    for section in ("plan", "launch", "settle", "fill_wait", "idle"):
        assert snap[section][0] > 0, section
    # On the CPU a launch computes the batch: the launch section holds the compute.
    assert snap["launch"][1] > 0
    assert snap["fill_wait"][0] >= 0.015  # at least one batch waited to fill (max_wait 20 ms)
