"""Launch-ahead in the device loop: the next ranking batch is launched before the one on the
device is collected (at most two in flight), scores are those of the serial loop, and each
batch's compute_ms is its own time (on the CPU, its launch's: it computes there)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig
from services.ranker.graphs import PendingScores
from services.ranker.model import HSTURanker
from shared.modelspec import preset
from tests.waiting import eventually


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


class Gate:
    """Holds the device loop in the launch of the first batch until released, so that every
    later call is queued when the loop comes back; records launches and collections. With
    `device_busy`, every launched batch reads as still computing on the device (on the CPU a
    launch computes its batch, so the loop would settle each at once)."""

    def __init__(self, engine: Engine, device_busy: bool = True) -> None:
        self.order: list[tuple[str, tuple[int, ...]]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        launch, complete = engine._launch_rank_batch, engine._complete_rank_batch

        def gated_launch(jobs):
            ids = tuple(j.id for j in jobs)
            if not self.order:
                self.entered.set()
                self.release.wait(5)
            self.order.append(("launch", ids))
            return launch(jobs)

        def recorded_complete(flight):
            self.order.append(("collect", tuple(j.id for j in flight.batch)))
            complete(flight)

        engine._launch_rank_batch = gated_launch  # type: ignore[method-assign]
        engine._complete_rank_batch = recorded_complete  # type: ignore[method-assign]
        if device_busy:
            engine._ready = lambda flight: False  # type: ignore[method-assign]


async def rank_four(
    model: HSTURanker,
    launch_ahead: bool,
    device_busy: bool = True,
    max_batch: int = 1,
    max_wait_s: float = 0.0,
):
    engine = Engine(
        model,
        accelerator("cpu"),
        EngineConfig(max_batch=max_batch, max_wait_s=max_wait_s, launch_ahead=launch_ahead),
    )
    gate = Gate(engine, device_busy)
    engine.start()
    try:
        prefixes, suffixes = batch(3, [Shape(2, 120, 4, 8)] * 4)
        psis = model.preinfer(prefixes)
        first = asyncio.ensure_future(engine.rank_cached(suffixes[0], psis[0], psis[0].key))
        await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, 5)
        rest = [asyncio.ensure_future(engine.rank_cached(s, p, p.key))
                for s, p in zip(suffixes[1:], psis[1:], strict=True)]  # fmt: skip
        await asyncio.sleep(0.05)  # all three queued behind the first
        gate.release.set()
        results = await asyncio.gather(first, *rest)
        return engine, gate.order, results, model.full(prefixes, suffixes)
    finally:
        engine.stop()


async def test_next_batch_is_launched_before_the_one_in_flight_is_collected(model):
    _, order, results, want = await rank_four(model, launch_ahead=True)
    kinds = [k for k, _ in order]
    assert kinds == ["launch", "launch", "collect", "launch", "collect", "launch", "collect", "collect"]
    # Each batch is collected once, in launch order, and never more than two are outstanding.
    launched = [ids for k, ids in order if k == "launch"]
    assert [ids for k, ids in order if k == "collect"] == launched
    for r, w in zip(results, want, strict=True):
        assert torch.allclose(r.scores, w, atol=1e-5, rtol=0)
    assert [r.batch_seq for r in results] == [1, 2, 3, 4]


async def test_a_batch_done_on_the_device_is_answered_before_the_next_launch(model):
    # On the CPU a launch computes its batch: holding it in flight would only make its calls
    # wait for the next batch's launch (its whole compute here).
    _, order, results, want = await rank_four(model, launch_ahead=True, device_busy=False)
    assert [k for k, _ in order] == ["launch", "collect"] * 4
    for r, w in zip(results, want, strict=True):
        assert torch.allclose(r.scores, w, atol=1e-5, rtol=0)


async def test_serial_loop_collects_each_batch_before_the_next(model):
    _, order, results, want = await rank_four(model, launch_ahead=False)
    assert [k for k, _ in order] == ["launch", "collect"] * 4
    for r, w in zip(results, want, strict=True):
        assert torch.allclose(r.scores, w, atol=1e-5, rtol=0)


async def test_each_batch_counts_its_own_time(model):
    _, _, results, _ = await rank_four(model, launch_ahead=True)
    # Calls queued behind the first: their queue_ms includes the batches ahead of them, their
    # compute_ms only their own, so queue + compute grows with the place in the queue.
    ends = [r.queue_ms + r.compute_ms for r in results[1:]]
    assert ends == sorted(ends)
    # Each batch's own time, not what is left of it after the batch ahead was collected: a
    # clock read at collection gave a batch launched (and, eagerly, computed) ahead of that
    # collection almost nothing, and the cost fit then batched full rankings by eight. The
    # yardstick is one such call computed alone, warm, at its fastest (the first batch's time
    # was one, until its cold start made it 4x the others in a CI run).
    prefixes, suffixes = batch(3, [Shape(2, 120, 4, 8)])
    psi = model.preinfer(prefixes)[0]
    alone_ms = []
    for _ in range(5):
        started = time.perf_counter()
        model.rank_cached(suffixes, [psi], [psi.key])
        alone_ms.append((time.perf_counter() - started) * 1e3)
    assert all(r.compute_ms > 0.25 * min(alone_ms) for r in results), (
        [r.compute_ms for r in results],
        alone_ms,
    )


async def test_a_batch_fills_while_the_one_in_flight_computes(model):
    # The calls queued behind the first make a batch that is not full: it waits to fill (up to
    # max_wait) while the first is still on the device, and is launched behind it before that
    # one is collected. Settling the first before filling left the device idle meanwhile.
    # The fill wait (0.2 s from the first queued call) outlasts rank_four's 0.05 s of queueing.
    _, order, results, want = await rank_four(model, launch_ahead=True, max_batch=4, max_wait_s=0.2)
    assert [k for k, _ in order] == ["launch", "launch", "collect", "collect"]
    assert [len(ids) for _, ids in order] == [1, 3, 1, 3]
    assert [r.batch_size for r in results] == [1, 3, 3, 3]
    for r, w in zip(results, want, strict=True):
        assert torch.allclose(r.scores, w, atol=1e-5, rtol=0)


def test_pending_scores_done_and_copied():
    scores = [torch.arange(3, dtype=torch.float32), torch.arange(2, dtype=torch.float32)]
    pending = PendingScores.done(scores)
    assert pending.ready()
    assert [t.tolist() for t in pending.wait()] == [[0.0, 1.0, 2.0], [0.0, 1.0]]
    # From a reused host buffer: wait() copies, so a later write to the buffer changes nothing.
    buffer = torch.tensor([1.0, 2.0, 3.0, 4.0])
    pending = PendingScores(buffer, (1, 2))
    got = pending.wait()
    buffer.fill_(0)
    assert [t.tolist() for t in got] == [[1.0], [2.0, 3.0]]
    assert pending.wait() is got
    assert pending.all_finite is True  # checked once over the batch's scores as they are copied
    # Only the batch's own scores count (the buffer's rest is another launch's).
    nan_after = PendingScores(torch.tensor([1.0, float("nan"), 5.0, float("inf")]), (1,))
    nan_after.wait()
    assert nan_after.all_finite is True
    with_nan = PendingScores(torch.tensor([1.0, float("nan"), 5.0]), (1, 2))
    with_nan.wait()
    assert with_nan.all_finite is False
    assert PendingScores.done(scores).all_finite is None  # not checked: the engine checks each call


def chunks_engine(model: HSTURanker, delay_s: float = 100.0) -> tuple[Engine, list[tuple[str, int]]]:
    """An engine with pre-inference steps launched ahead, 256 tokens a step, whose every step
    reads as still on the device until settled; records step launches and settlements by the
    chunk's end."""
    config = EngineConfig(
        max_wait_s=0.0, preinfer_chunk_tokens=256, max_rank_delay_s=delay_s, chunks_ahead=True
    )
    engine = Engine(model, accelerator("cpu"), config)
    order: list[tuple[str, int]] = []
    launch, complete = engine._launch_chunks, engine._complete_chunks

    def recorded_launch(plan):
        flight = launch(plan)
        if flight is not None:
            order.append(("launch", flight.work[0][0].end))
        return flight

    def recorded_complete(flight):
        order.append(("settle", flight.work[0][0].end))
        complete(flight)

    engine._launch_chunks = recorded_launch  # type: ignore[method-assign]
    engine._complete_chunks = recorded_complete  # type: ignore[method-assign]
    engine._ready = lambda flight: False  # type: ignore[method-assign]
    return engine, order


async def test_chunks_launched_ahead_build_the_same_psi_and_price(model):
    prefixes, _ = batch(7, [Shape(3, 900, 0, 1)])
    engine, order = chunks_engine(model)
    engine.start()
    try:
        psi = await asyncio.wait_for(engine.preinfer(prefixes[0]), 30)
    finally:
        engine.stop()
    # Each step is launched before the one ahead of it is settled.
    assert order == [("launch", 256), ("launch", 512), ("settle", 256), ("launch", 768), ("settle", 512),
                     ("launch", 903), ("settle", 768), ("settle", 903)]  # fmt: skip
    assert float((psi.kv - model.preinfer(prefixes)[0].kv).abs().max()) <= 1e-5
    # Finished by the step that ends the prefix, priced at all four steps.
    [sample] = engine.recent_preinfers()
    assert sample.device_ms == pytest.approx(engine.device_time.snapshot().work_s["preinfer"] * 1e3, rel=1e-6)
    assert engine.device_time.snapshot().unused_psi == 0


@pytest.mark.parametrize("delay_s", [100.0, 1e-9], ids=["join", "take-over"])
async def test_a_call_during_chunks_launched_ahead_scores_as_in_full(model, delay_s):
    prefixes, suffixes = batch(8, [Shape(2, 1000, 6, 8)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    engine, order = chunks_engine(model, delay_s)
    engine.start()
    try:
        pre = asyncio.ensure_future(engine.preinfer(prefix))
        await eventually(lambda: bool(order), "a pre-inference step is launched")
        relayed = await asyncio.wait_for(
            engine.relay(prefix, suffix, key, deadline=time.monotonic() + 5.0), 30
        )
        psi = await asyncio.wait_for(pre, 30)
    finally:
        engine.stop()
    assert relayed is not None
    want = model.full(prefixes, suffixes)[0]
    assert float((relayed.result.scores - want).abs().max()) <= 1e-5
    assert float((psi.kv - model.preinfer(prefixes)[0].kv).abs().max()) <= 1e-5
    assert relayed.joined is (delay_s > 1)
