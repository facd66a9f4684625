"""Launch-ahead in the device loop: the next ranking batch is launched before the one on the
device is collected (at most two in flight), scores are those of the serial loop, and each
batch's compute_ms is its own time (on the CPU, its launch's: it computes there)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig
from services.ranker.graphs import PendingScores
from services.ranker.model import HSTURanker
from shared.modelspec import preset


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


class Gate:
    """Holds the device loop in the launch of the first batch until released, so that every
    later call is queued when the loop comes back; records launches and collections."""

    def __init__(self, engine: Engine) -> None:
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


async def rank_four(model: HSTURanker, launch_ahead: bool):
    engine = Engine(
        model, accelerator("cpu"), EngineConfig(max_batch=1, max_wait_s=0.0, launch_ahead=launch_ahead)
    )
    gate = Gate(engine)
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
    # collection almost nothing, and the cost fit then batched full rankings by eight.
    first = results[0].compute_ms
    assert all(r.compute_ms > 0.25 * first for r in results[1:])


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
