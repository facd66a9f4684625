"""The engine thread: dynamic batching, ranking before pre-inference, cancellation, errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench.synthetic import Shape, batch
from kernels.device import accelerator
from services.ranker.engine import Engine, EngineConfig, EngineStopped
from services.ranker.model import HSTURanker
from shared.modelspec import preset
from tests.preinfer_gate import PreinferGate
from tests.waiting import eventually


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


@pytest.fixture
def engine(model):
    e = Engine(model, accelerator("cpu"), EngineConfig(max_batch=8, max_wait_s=0.02))
    e.start()
    yield e
    e.stop()


async def test_concurrent_ranks_are_batched_and_scores_match(engine, model):
    prefixes, suffixes = batch(1, [Shape(2, 200, 4, 8)] * 6)
    psis = model.preinfer(prefixes)
    results = await asyncio.gather(
        *(engine.rank_cached(s, p, p.key) for s, p in zip(suffixes, psis, strict=True))
    )
    assert max(r.batch_size for r in results) > 1
    want = model.full(prefixes, suffixes)
    for r, w in zip(results, want, strict=True):
        assert torch.allclose(r.scores, w, atol=1e-5, rtol=0)
    assert any(s.batch > 1 and not s.full for s in engine.recent_batches())


async def test_full_and_cached_jobs_are_not_mixed_in_one_batch(engine, model):
    prefixes, suffixes = batch(2, [Shape(2, 100, 4, 8)] * 4)
    psis = model.preinfer(prefixes[:2])
    await asyncio.gather(
        engine.rank_cached(suffixes[0], psis[0], psis[0].key),
        engine.rank_full(prefixes[2], suffixes[2]),
        engine.rank_cached(suffixes[1], psis[1], psis[1].key),
        engine.rank_full(prefixes[3], suffixes[3]),
    )
    kinds = {(s.full, s.batch) for s in engine.recent_batches()}
    assert (True, 2) in kinds or (True, 1) in kinds
    assert all(s.prefix_len == 0 for s in engine.recent_batches() if not s.full)


async def test_ranking_overtakes_a_long_preinference(monkeypatch):
    """Inline pre-inference (the engine's default config): a ranking call submitted while a
    pre-inference is under way runs after that pre-inference's current layer, not after all of it."""
    deep = HSTURanker.from_seed(preset("tiny").with_overrides(name="deep", num_layers=8), seed=0)
    prefixes, suffixes = batch(4, [Shape(2, 50, 4, 4)])
    psi = deep.preinfer(prefixes)[0]
    long_prefixes, _ = batch(3, [Shape(2, 1000, 0, 1)])
    e = Engine(deep, accelerator("cpu"), EngineConfig(max_wait_s=0.0))
    with PreinferGate(deep, monkeypatch, pause_before=(1, 2), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(long_prefixes[0]))
            await gate.wait_reached(1)  # layer 0 done: the pre-inference is under way
            rank = asyncio.ensure_future(e.rank_cached(suffixes[0], psi, psi.key))
            await eventually(lambda: e.rank_queue_depth == 1, "the ranking call is queued")
            gate.open(1)  # layer 1 runs; the ranking call must come next, before layer 2
            result = await asyncio.wait_for(rank, 30)
            assert not pre.done()  # held before layer 2: the rank did not wait for the rest
            assert gate.timed_out == []  # nor did the engine go on to layer 2 first
            gate.open(2)
            assert (await asyncio.wait_for(pre, 30)).key.user_id == long_prefixes[0].user_id
            assert result.scores.numel() == 4
        finally:
            e.stop()


async def test_cancelled_jobs_are_dropped_and_errors_stay_per_job(engine, model):
    prefixes, suffixes = batch(5, [Shape(2, 50, 4, 4)] * 2)
    psi = model.preinfer(prefixes[:1])[0]
    wrong_key = model.psi_key(999, 1, 0)
    with pytest.raises(ValueError, match="psi refused"):
        await engine.rank_cached(suffixes[0], psi, wrong_key)
    job = asyncio.ensure_future(engine.rank_full(prefixes[1], suffixes[1]))
    job.cancel()
    ok = await engine.rank_cached(suffixes[0], psi, psi.key)  # the engine is still healthy
    assert ok.scores.numel() == 4


async def test_copy_jobs_run_and_resolve(engine):
    dest = torch.zeros(8)

    def issue() -> str:
        dest.copy_(torch.arange(8.0))
        return "done"

    assert await engine.copy(issue) == "done"
    assert dest[-1] == 7


async def test_stop_fails_queued_work(model):
    e = Engine(model, accelerator("cpu"), EngineConfig())
    e.start()
    e.stop()
    prefixes, _ = batch(6, [Shape(1, 10, 0, 1)])
    with pytest.raises(EngineStopped):
        await e.preinfer(prefixes[0])
