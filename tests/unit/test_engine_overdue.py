"""A ranking call the engine has not started by its `start_by` fails with Overdue, unrun; the
others go on (admission's late refusal, services/ranker/admission.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig, Overdue, RankResult
from services.ranker.model import HSTURanker
from shared.modelspec import preset


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


@pytest.fixture
def engine(model):
    e = Engine(model, accelerator("cpu"), EngineConfig(max_batch=8, max_wait_s=0.0))
    e.start()
    yield e
    e.stop()


async def test_a_call_past_its_start_by_fails_overdue_and_the_others_run(engine, model):
    prefixes, suffixes = batch(3, [Shape(2, 60, 4, 4)] * 3)
    now = time.perf_counter()
    results: list[RankResult | BaseException] = await asyncio.gather(
        engine.rank_full(prefixes[0], suffixes[0], start_by=now - 1e-3),
        engine.rank_full(prefixes[1], suffixes[1], start_by=now + 60.0),
        engine.rank_full(prefixes[2], suffixes[2]),
        return_exceptions=True,
    )
    late, in_time, unbounded = results
    assert isinstance(late, Overdue)
    assert late.waited_s >= 0.0
    assert "not started within" in str(late)
    expected = model.full(prefixes[1:], suffixes[1:])
    for result, want in zip((in_time, unbounded), expected, strict=True):
        assert isinstance(result, RankResult), result
        assert torch.allclose(result.scores, want, atol=1e-5, rtol=0)
    # The engine is healthy after dropping a call: against psi too.
    psi = model.preinfer(prefixes[:1])[0]
    with pytest.raises(Overdue):
        await engine.rank_cached(suffixes[0], psi, psi.key, start_by=time.perf_counter() - 1e-3)
    ok = await engine.rank_cached(suffixes[0], psi, psi.key, start_by=time.perf_counter() + 60.0)
    assert ok.scores.numel() == 4


async def test_a_call_whose_caller_left_leaves_the_queue_before_any_step(model):
    # Not started: no step runs, so only the call's own cancellation can take it out (a queue
    # of calls nobody waits for would be planned over at every step).
    idle = Engine(model, accelerator("cpu"), EngineConfig(max_batch=8, max_wait_s=0.0))
    prefixes, suffixes = batch(2, [Shape(2, 60, 4, 4)] * 2)
    left = asyncio.ensure_future(idle.rank_full(prefixes[0], suffixes[0]))
    stays = asyncio.ensure_future(idle.rank_full(prefixes[1], suffixes[1]))
    await asyncio.sleep(0)
    assert idle.rank_queue_depth == 2
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await left
    await asyncio.sleep(0)  # the future's callbacks run
    assert idle.rank_queue_depth == 1
    idle.start()
    try:
        result = await stays
        assert torch.allclose(result.scores, model.full(prefixes[1:], suffixes[1:])[0], atol=1e-5, rtol=0)
    finally:
        idle.stop()
