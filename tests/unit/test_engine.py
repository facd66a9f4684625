"""The engine's device loop: dynamic batching, ranking before pre-inference chunks, psi built in
chunks, a ranking call joining or taking over its pre-inference (partial psi), cancellation,
errors, device-time accounting."""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time

import pytest
import torch

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig, EngineStopped
from services.ranker.graphs import PendingScores
from services.ranker.model import HSTURanker
from shared.modelspec import preset
from tests.preinfer_gate import PreinferGate
from tests.waiting import eventually


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


@pytest.fixture
def engine(model):
    e = Engine(
        model,
        accelerator("cpu"),
        EngineConfig(max_batch=8, max_wait_s=0.02, chunks_ahead=_CHUNKS_AHEAD["value"]),
    )
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
    # Each batch has its number: its calls share it, as many calls as the batch had.
    by_seq = collections.Counter(r.batch_seq for r in results)
    assert min(by_seq) >= 1
    assert all(by_seq[r.batch_seq] == r.batch_size for r in results)
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


# The chunk tests run with pre-inference steps settled at once and launched ahead (settled after
# the next step is launched): joins, take-overs and exactness must not depend on which.
_CHUNKS_AHEAD = {"value": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["chunks-settled", "chunks-ahead"])
def chunks_ahead(request):
    _CHUNKS_AHEAD["value"] = request.param
    yield request.param
    _CHUNKS_AHEAD["value"] = False


def chunked(model: HSTURanker, delay_s: float = 100.0, **overrides) -> Engine:
    """An engine that builds psi 256 tokens a step; with a long max ranking delay a started
    pre-inference is joined, with a tiny one it is taken over."""
    overrides.setdefault("chunks_ahead", _CHUNKS_AHEAD["value"])
    config = EngineConfig(max_wait_s=0.0, preinfer_chunk_tokens=256, max_rank_delay_s=delay_s, **overrides)
    return Engine(model, accelerator("cpu"), config)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-5


async def test_ranking_overtakes_a_long_preinference(monkeypatch):
    """A ranking call submitted while a pre-inference is under way runs after that
    pre-inference's current chunk, not after all of it."""
    deep = HSTURanker.from_seed(preset("tiny").with_overrides(name="deep", num_layers=8), seed=0)
    prefixes, suffixes = batch(4, [Shape(2, 50, 4, 4)])
    psi = deep.preinfer(prefixes)[0]
    long_prefixes, _ = batch(3, [Shape(2, 1000, 0, 1)])
    e = chunked(deep)
    with PreinferGate(deep, monkeypatch, pause_before=(1, 2), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(long_prefixes[0]))
            await gate.wait_reached(1)  # chunk 0 done: the pre-inference is under way
            submitted = time.monotonic()
            rank = asyncio.ensure_future(e.rank_cached(suffixes[0], psi, psi.key))
            await eventually(lambda: e.rank_queue_depth == 1, "the ranking call is queued")
            gate.open(1)  # chunk 1 runs; the ranking call must come next, before chunk 2
            result = await asyncio.wait_for(rank, 30)
            assert not pre.done()  # held before chunk 2: the rank did not wait for the rest
            assert gate.timed_out == []  # nor did the engine go on to chunk 2 first
            gate.open(2)
            built = await asyncio.wait_for(pre, 30)
            assert close(built.kv, deep.preinfer(long_prefixes)[0].kv)
            assert result.scores.numel() == 4
        finally:
            e.stop()
    # The one call that came during chunk 1's step is counted as held behind it, for the part
    # of the step it waited through (at most the time since it was queued).
    eager = e.device_time.snapshot().preinfer_steps["eager"]  # type: ignore[index]
    assert eager[4] == 1
    assert 0 < eager[5] < time.monotonic() - submitted


async def test_psi_is_built_in_aligned_chunks_equal_to_one_preinference(model, monkeypatch):
    prefixes, _ = batch(7, [Shape(3, 900, 0, 1)])
    e = chunked(model)
    with PreinferGate(model, monkeypatch, pause_before=()) as gate:
        e.start()
        try:
            psi = await asyncio.wait_for(e.preinfer(prefixes[0]), 30)
        finally:
            e.stop()
    assert gate.chunks == [(0, 256), (256, 512), (512, 768), (768, 903)]
    assert close(psi.kv, model.preinfer(prefixes)[0].kv)
    snap = e.device_time.snapshot()
    assert snap.work_s["preinfer"] > 0
    assert e.preinfer_backlog == 0
    # Stats report the whole pre-inference's device time (the trigger's price of one).
    [sample] = e.recent_preinfers()
    assert sample.prefix_len == 903
    assert sample.device_ms == pytest.approx(snap.work_s["preinfer"] * 1e3, rel=1e-6)


async def test_a_call_takes_over_a_started_preinference_as_partial_psi(model, monkeypatch):
    prefixes, suffixes = batch(8, [Shape(2, 1000, 6, 8)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model, delay_s=1e-9)  # the rest never fits: take over
    with PreinferGate(model, monkeypatch, pause_before=(2,), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(prefix))
            await gate.wait_reached(2)  # chunks 0 and 1 built, chunk 2 under way
            call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12))
            await eventually(lambda: e.rank_queue_depth == 1, "the partial ranking call is queued")
            gate.open(2)
            served = await asyncio.wait_for(call, 30)
            psi = await asyncio.wait_for(pre, 30)
        finally:
            e.stop()
    assert served is not None
    assert not served.joined
    # What was built when the call ran (chunk 2 was under way: it finished first), and no more.
    assert gate.chunks == [(0, 256), (256, 512), (512, 768)]
    assert served.reused_tokens == 768
    assert served.reused_fraction == pytest.approx(768 / 1002)
    assert close(served.result.scores, model.full([prefix], [suffix])[0])
    # The call completed psi: the pre-inference's waiter gets the whole of it, exact.
    assert close(psi.kv, model.preinfer([prefix])[0].kv)
    assert e.device_time.snapshot().unused_psi == 0  # the chunks were used
    samples = e.recent_batches()
    assert samples[-1].full
    assert samples[-1].tokens == 1002 - 768 + 14


async def test_a_call_takes_over_a_preinference_not_started_and_no_chunk_runs(model, monkeypatch):
    prefixes, suffixes = batch(9, [Shape(2, 600, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model, delay_s=1e-9)  # the prefix never fits one step: the call takes over
    with PreinferGate(model, monkeypatch, pause_before=()) as gate:
        pre = asyncio.ensure_future(e.preinfer(prefix))
        await eventually(lambda: e.producing(key), "the pre-inference is queued")
        call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12))
        await eventually(lambda: e.rank_queue_depth == 1, "the ranking call is queued")
        e.start()  # only now: nothing of the pre-inference ran
        try:
            served = await asyncio.wait_for(call, 30)
            psi = await asyncio.wait_for(pre, 30)
        finally:
            e.stop()
    assert served is not None
    assert served.reused_tokens == 0
    assert gate.chunks == []  # cancelled: the call computed the whole prefix, once
    assert close(served.result.scores, model.full([prefix], [suffix])[0])
    assert close(psi.kv, model.preinfer([prefix])[0].kv)
    assert not e.producing(key)


class FullGraphsStandIn:
    """The surface of RankGraphs the engine uses, where only full rankings "replay" (computed by
    the model's full pass, psi kept, answered at once): which batches the engine hands to the
    full family's graphs on a GPU, checked on the CPU."""

    full_keeps_kv = True

    def __init__(self, model: HSTURanker) -> None:
        self.model = model
        self.full_launches: list[list[int]] = []

    def launch_full(self, prefixes, suffixes, psis=None):
        kept = psis() if callable(psis) else psis
        self.full_launches.append([p.length for p in prefixes])
        return PendingScores.done(self.model.full(prefixes, suffixes, kept))

    def launch_rank(self, suffixes, psis, keys):
        return None  # eager

    def preinfer(self, chunks) -> bool:
        return False  # eager

    def has_pending(self) -> bool:
        return False

    def capture_pending(self, limit: int = 0) -> int:
        return 0


@pytest.mark.parametrize(
    ("started", "partial_dearer"),
    [(False, False), (True, False), (True, True)],
    ids=["not-started", "started", "started-partial-dearer"],
)
async def test_a_take_over_of_nothing_built_goes_to_the_full_graphs(
    model, monkeypatch, started, partial_dearer
):
    """A take-over of a pre-inference not started is a full ranking keeping psi in the
    pre-inference's block, given to the full family's graph (on a GPU: a replay instead of the
    eager partial pass); one of a started pre-inference reads its chunks eagerly, and its time is
    weighed against a full ranking's; while partial passes measure dearer than full rankings
    (takeover.py), the full graph completes it too, rewriting the chunks. All exact."""
    prefixes, suffixes = batch(19, [Shape(2, 600, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model, delay_s=1e-9)  # the rest never fits one step: the call takes over
    graphs = FullGraphsStandIn(model)
    e.graphs = graphs  # type: ignore[assignment]
    for _ in range(32):  # a ranking fit measured enough to price a full ranking (1 ms each)
        e.rank_costs.observe(prefix.length + suffix.length, prefix.length**2, 1e-3)
    if partial_dearer:
        e.takeover.observe(partial_s=3e-3, full_s=1e-3)
    with PreinferGate(model, monkeypatch, pause_before=(1,) if started else (), timeout_s=10.0) as gate:
        pre = asyncio.ensure_future(e.preinfer(prefix))
        if started:
            e.start()
            await gate.wait_reached(1)  # chunk 0 built, chunk 1 under way
        else:
            await eventually(lambda: e.producing(key), "the pre-inference is queued")
        call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12))
        await eventually(lambda: e.rank_queue_depth == 1, "the ranking call is queued")
        if started:
            gate.open(1)
        else:
            e.start()  # only now: nothing of the pre-inference ran
        try:
            served = await asyncio.wait_for(call, 30)
            psi = await asyncio.wait_for(pre, 30)
        finally:
            e.stop()
    assert served is not None
    assert close(served.result.scores, model.full([prefix], [suffix])[0])
    assert close(psi.kv, model.preinfer([prefix])[0].kv)
    assert torch.equal(psi.timestamps, model.preinfer([prefix])[0].timestamps)
    assert not e.producing(key)
    if started and not partial_dearer:
        assert served.reused_tokens == 512
        assert graphs.full_launches == []  # it read the chunks built: the eager partial pass
        assert e.takeover.passes == {"partial": 1, "full": 0}
        assert math.isfinite(e.takeover.ratio)  # the partial pass measured against a full ranking
    else:
        assert served.reused_tokens == 0
        assert graphs.full_launches == [[prefix.length]]
        assert e.recent_batches()[-1].tokens == prefix.length + suffix.length
        assert e.takeover.passes == ({"partial": 0, "full": 1} if started else {"partial": 0, "full": 0})
        # The chunk the graph computed again counts as unused device time (not as another psi).
        snap = e.device_time.snapshot()
        assert (snap.unused_psi_s > 0) == started
        assert snap.unused_psi == 0
        if not started:
            assert gate.chunks == []


async def test_a_call_joins_a_preinference_not_started_that_fits_one_step(model, monkeypatch):
    """Nothing built yet, and the whole pre-inference is predicted within one step's budget: the
    call waits for it (run with its deadline) and ranks against complete psi; nothing is
    computed twice."""
    prefixes, suffixes = batch(12, [Shape(2, 600, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model, delay_s=100.0)
    with PreinferGate(model, monkeypatch, pause_before=()) as gate:
        pre = asyncio.ensure_future(e.preinfer(prefix))
        await eventually(lambda: e.producing(key), "the pre-inference is queued")
        call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12))
        e.start()  # only now: nothing of the pre-inference had run when the call came
        try:
            served = await asyncio.wait_for(call, 30)
            psi = await asyncio.wait_for(pre, 30)
        finally:
            e.stop()
    assert served is not None
    assert served.joined
    assert served.reused_fraction == 1.0
    assert gate.chunks[0][0] == 0  # built by the pre-inference's own chunks
    assert close(served.result.scores, model.full([prefix], [suffix])[0])
    assert close(psi.kv, model.preinfer([prefix])[0].kv)
    assert e.device_time.snapshot().unused_psi == 0


async def test_a_call_joins_a_preinference_whose_rest_fits_its_budget(model, monkeypatch):
    prefixes, suffixes = batch(10, [Shape(2, 600, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model, delay_s=100.0)
    with PreinferGate(model, monkeypatch, pause_before=(1,), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(prefix))
            await gate.wait_reached(1)
            call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12))
            gate.open(1)
            served = await asyncio.wait_for(call, 30)
            await asyncio.wait_for(pre, 30)
        finally:
            e.stop()
    assert served is not None
    assert served.joined
    assert served.reused_fraction == 1.0
    assert gate.chunks == [(0, 256), (256, 512), (512, 602)]  # every chunk by the pre-inference
    assert close(served.result.scores, model.full([prefix], [suffix])[0])
    assert e.device_time.snapshot().unused_psi == 0


async def test_a_take_over_whose_caller_left_hands_the_rest_back_to_the_chunks(model, monkeypatch):
    prefixes, suffixes = batch(15, [Shape(2, 700, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model, delay_s=1e-9)
    with PreinferGate(model, monkeypatch, pause_before=(1,), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(prefix))
            await gate.wait_reached(1)
            call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12))
            await eventually(lambda: e.rank_queue_depth == 1, "the call took the pre-inference over")
            call.cancel()  # its caller has gone before its step
            gate.open()
            psi = await asyncio.wait_for(pre, 30)  # the chunks finish it instead
        finally:
            e.stop()
    assert gate.chunks == [(0, 256), (256, 512), (512, 702)]
    assert close(psi.kv, model.preinfer([prefix])[0].kv)


async def test_relay_without_a_preinference_in_hand_returns_none(engine, model):
    prefixes, suffixes = batch(11, [Shape(1, 20, 1, 1)])
    key = model.psi_key(prefixes[0].user_id, 1, prefixes[0].fingerprint.digest)
    assert await engine.relay(prefixes[0], suffixes[0], key, deadline=1e12) is None


async def test_an_abandoned_half_built_psi_counts_as_unused_device_time(model, monkeypatch):
    prefixes, _ = batch(12, [Shape(2, 700, 0, 1)])
    e = chunked(model)
    with PreinferGate(model, monkeypatch, pause_before=(1,), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(prefixes[0]))
            await gate.wait_reached(1)
            pre.cancel()  # its waiter has gone: the rest is never built
            gate.open(1)
            await eventually(lambda: e.preinfer_backlog == 0, "the pre-inference is dropped")
        finally:
            e.stop()
    assert gate.chunks == [(0, 256), (256, 512)]
    snap = e.device_time.snapshot()
    assert snap.unused_psi == 1
    assert snap.unused_psi_s == pytest.approx(snap.work_s["preinfer"])


async def order_served(model, monkeypatch, e: Engine, deadlines_in_s: tuple[float, ...]) -> list[int]:
    """The order in which calls against psi, queued one after another behind a pre-inference
    step that holds the device, with these deadlines (seconds from now), are served."""
    prefixes, suffixes = batch(13, [Shape(2, 40, 2, 2)] * len(deadlines_in_s))
    psis = model.preinfer(prefixes)
    long_prefixes, _ = batch(14, [Shape(2, 600, 0, 1)])
    order: list[int] = []
    with PreinferGate(model, monkeypatch, pause_before=(0,), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(long_prefixes[0]))
            await gate.wait_reached(0)  # the device is busy: the calls queue up behind chunk 0
            now = time.monotonic()
            calls = []
            for i, deadline_in_s in enumerate(deadlines_in_s):
                fut = asyncio.ensure_future(
                    e.rank_cached(suffixes[i], psis[i], psis[i].key, deadline=now + deadline_in_s)
                )
                fut.add_done_callback(functools.partial(lambda i, _f: order.append(i), i))
                calls.append(fut)
                await eventually(lambda n=i + 1: e.rank_queue_depth == n, "queued")  # submitted in turn
            gate.open(0)
            await asyncio.wait_for(asyncio.gather(*calls, pre), 30)
        finally:
            e.stop()
    return order


async def test_ranking_calls_run_earliest_deadline_first(model, monkeypatch):
    assert await order_served(model, monkeypatch, chunked(model, max_batch=1), (30, 10, 20)) == [1, 2, 0]


async def test_calls_are_scheduled_by_the_latency_target_not_a_far_grpc_deadline(model, monkeypatch):
    """With a latency target, deadlines far beyond it (a client's 10 s gRPC timeout) no longer
    order the calls: each is due at its arrival plus the target, so they run as they came."""
    e = chunked(model, max_batch=1, latency_target_s=0.5)
    assert await order_served(model, monkeypatch, e, (30, 10, 20)) == [0, 1, 2]


async def test_a_call_that_cannot_finish_in_time_waits_behind_those_that_can(model, monkeypatch):
    """A call whose own deadline has passed is doomed (scheduler.doomed): the calls that can
    still meet theirs go first, then it runs (earliest deadline first would run it first)."""
    e = chunked(model, max_batch=1, slo_s=10.0)
    assert await order_served(model, monkeypatch, e, (30, -1, 20)) == [2, 0, 1]


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


async def test_a_failed_device_loop_fails_every_job_and_reports_it(model, monkeypatch):
    # A bug that escapes one step's error handling ends the device loop: without a report the
    # process would serve nothing and hang every call until its deadline.
    told: list[BaseException] = []
    e = Engine(model, accelerator("cpu"), EngineConfig(max_wait_s=0.0), on_fatal=told.append)

    def broken_plan():
        raise RuntimeError("planner bug")

    monkeypatch.setattr(e, "_plan", broken_plan)
    prefixes, suffixes = batch(3, [Shape(2, 50, 4, 8)])
    e.start()
    try:
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(e.rank_full(prefixes[0], suffixes[0]), 10)
        await eventually(lambda: bool(told), "the failure reported")
        assert "planner bug" in repr(told[0])
        with pytest.raises(EngineStopped):
            await e.rank_full(prefixes[0], suffixes[0])  # later jobs refused at once
    finally:
        e.stop()


async def test_the_saving_of_a_call_against_psi_is_read_from_measured_rankings(engine, model):
    # What a reload saves a call on a miss (relay_cache._reload_on_miss): full minus cached
    # ranking time, from the ranking batches measured; None until enough were.
    engine.forget_batches()
    assert engine.reload_saving_s(1000, 16) is None
    prefixes, suffixes = batch(7, [Shape(2, 1000, 4, 12)] * 10)
    psis = model.preinfer(prefixes)
    for p, s, psi in zip(prefixes, suffixes, psis, strict=True):
        await engine.rank_full(p, s)
        await engine.rank_cached(s, psi, psi.key)
    saving = engine.reload_saving_s(1000, 16)
    assert saving is not None
    assert saving > 0
    full_s = max(b.compute_ms for b in engine.recent_batches() if b.full) / 1e3
    assert saving < full_s  # a gap between the two kinds, never more than a full ranking


async def test_a_copy_reports_its_own_duration_not_the_wait_for_the_device_loop(engine):
    # A reload's rate is learnt from this (relay_cache._observe_reload): a copy that waited for
    # the loop (here behind a 0.2 s call) reports the copy's time, not the wait.
    timed: list[float] = []
    src, dst = torch.ones(1 << 16), torch.empty(1 << 16)
    busy = asyncio.ensure_future(engine.call(lambda: time.sleep(0.2)))
    await asyncio.sleep(0.02)  # the call holds the device loop
    t0 = time.perf_counter()
    await engine.copy(lambda: dst.copy_(src), work="reload", on_timed=timed.append)
    waited = time.perf_counter() - t0
    await busy
    assert len(timed) == 1
    assert waited >= 0.1
    assert 0 <= timed[0] < 0.05
    assert torch.equal(dst, src)


async def copies_and_launches(model, copies: list[tuple[str, str]], calls: int) -> list[str]:
    """Queues `copies` ((name, work) in order) and `calls` full rankings while the device loop is
    held, then lets it go: the order in which it issued the copies and launched the batches (one
    call a batch)."""
    e = Engine(model, accelerator("cpu"), EngineConfig(max_batch=1, max_wait_s=0.0))
    order: list[str] = []
    launch = e._launch_rank_batch

    def logged_launch(batch):
        order.append("launch")
        return launch(batch)

    e._launch_rank_batch = logged_launch  # type: ignore[method-assign]
    prefixes, suffixes = batch(11, [Shape(2, 40, 4, 4)] * calls)
    e.start()
    try:
        busy = asyncio.ensure_future(e.call(lambda: time.sleep(0.3)))  # holds the device loop
        await asyncio.sleep(0.02)
        issued = [asyncio.ensure_future(e.copy(functools.partial(order.append, name), work=work))
                  for name, work in copies]  # fmt: skip
        ranks = [asyncio.ensure_future(e.rank_full(p, s)) for p, s in zip(prefixes, suffixes, strict=True)]
        await asyncio.sleep(0.02)
        await busy
        await asyncio.gather(*issued, *ranks)
    finally:
        e.stop()
    return order


async def test_demotions_wait_for_a_launch_while_calls_queue_and_reloads_do_not(model):
    # Issuing a psi's demotion costs the device loop ~1 ms (H200): issued ahead of the next launch
    # it left the device idle with calls waiting. Reloads go first (a call waits for each); with
    # calls queued, demotions go after a launch, a few at a time; with none queued, all at once.
    from services.ranker import engine as engine_module

    copies = [("d0", "demote"), ("d1", "demote"), ("r0", "reload"), ("d2", "demote"), ("d3", "demote"),
              ("d4", "demote")]  # fmt: skip
    order = await copies_and_launches(model, copies, calls=4)
    per_launch = engine_module._DEMOTIONS_PER_LAUNCH
    assert per_launch == 2
    # r0 before any launch; two demotions after each launch while calls wait; the last launch
    # leaves none waiting, so what is left goes with it.
    assert order == ["r0", "launch", "d0", "d1", "launch", "d2", "d3", "launch", "d4", "launch"]


async def test_a_backlog_of_demotions_is_issued_at_once_whatever_waits(model):
    from services.ranker import engine as engine_module

    n = engine_module._DEMOTION_BACKLOG + 1
    order = await copies_and_launches(model, [(f"d{i}", "demote") for i in range(n)], calls=3)
    assert order[0] == "launch"
    assert order[1 : n + 1] == [f"d{i}" for i in range(n)]  # all after the first launch
    assert order[n + 1 :] == ["launch", "launch"]


async def test_a_preinference_not_started_within_its_lease_is_dropped_unrun(engine):
    # Built after its lease, psi comes after its call and delays every pre-inference behind it.
    from services.ranker.engine import PreinferExpired

    prefixes, _ = batch(8, [Shape(2, 600, 4, 8)] * 2)
    busy = asyncio.ensure_future(engine.call(lambda: time.sleep(0.2)))  # the device loop is taken
    await asyncio.sleep(0.02)
    late = asyncio.ensure_future(engine.preinfer(prefixes[0], expires_at=time.monotonic() + 0.05))
    on_time = asyncio.ensure_future(engine.preinfer(prefixes[1], expires_at=time.monotonic() + 60))
    await busy
    with pytest.raises(PreinferExpired):
        await late
    psi = await on_time
    assert psi.prefix_len == prefixes[1].length
    assert engine.preinfers_expired == 1
    assert not engine.producing(psi.key)


async def test_a_completed_pre_inference_is_timed_and_counted_late_past_its_calls_planned_time(model):
    # SLO 50 ms: a psi needed by now + 60 ms (its call planned 10 ms from now) is on time if
    # built within 10 ms; one needed by now + 10 ms (its call planned 40 ms ago) is late.
    e = Engine(model, accelerator("cpu"), EngineConfig(max_wait_s=0.0, slo_s=0.050))
    e.start()
    try:
        prefixes, _ = batch(7, [Shape(1, 16, 0, 1)] * 2)
        await e.preinfer(prefixes[0], need_by=time.monotonic() + 3600.0)
        await e.preinfer(prefixes[1], need_by=time.monotonic() + 0.010)
        done, build_s, total_s, after_call, _ = e.device_time.snapshot().preinfer_dones
        assert done == 2
        assert 0.0 < build_s <= total_s
        assert after_call == 1
    finally:
        e.stop()
