"""The engine on CUDA with graphs and launch-ahead: calls queued together run as batches launched
behind each other (two in flight), and every call's scores equal the eager path's (run on the
device machine)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig
from services.ranker.graphs import FULL_KEEP, GraphLimits
from services.ranker.model import HSTURanker
from shared.modelspec import preset
from tests.waiting import eventually

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

SPEC = preset("tiny").with_overrides(name="graphs", num_layers=3, num_heads=2, head_dim=32, dtype="bfloat16")


@pytest.mark.parametrize(
    ("launch_ahead", "copies"),
    [(True, "engine"), (False, "engine"), (True, "scores_aside"), (True, "kernel")],
    ids=["launch_ahead", "serial", "launch_ahead-scores_aside", "launch_ahead-kernel_copies"],
)
async def test_queued_calls_match_eager_with_graphs(launch_ahead, copies):
    model = HSTURanker.from_seed(SPEC, seed=5, device="cuda")
    config = EngineConfig(
        max_batch=2,
        max_wait_s=0.0,
        launch_ahead=launch_ahead,
        batch_copies=copies,
        full_keeps_psi=True,
        graph_limits=GraphLimits(max_tokens=1024, max_prefix_tokens=4096, max_full_tokens=4096),
    )
    engine = Engine(model, accelerator("cuda"), config)
    engine.start()
    try:
        shapes = [Shape(3, 400 + 150 * i, 16, 48) for i in range(12)]
        prefixes, suffixes = batch(11, shapes)
        psis = model.preinfer(prefixes)
        await engine.capture_graphs([64])

        async def one_round():
            return await asyncio.gather(
                *(engine.rank_cached(s, p, p.key) for s, p in zip(suffixes[:8], psis[:8], strict=True)),
                *(
                    engine.rank_full(p, s, keep_psi=True)
                    for p, s in zip(prefixes[8:], suffixes[8:], strict=True)
                ),
            )

        want = model.full(prefixes, suffixes)
        scale = max(float(torch.cat(want).abs().max()), 1e-3)
        for _ in range(2):  # the second round replays graphs the first captured
            results = await one_round()
            for r, w in zip(results, want, strict=True):
                assert float((r.scores - w.cpu()).abs().max()) / scale < 3e-2
            # A kept psi is complete when its call is answered: ranking against it gives the same.
            for r, s in zip(results[8:], suffixes[8:], strict=True):
                assert r.psi is not None
                again = await engine.rank_cached(s, r.psi, r.psi.key)
                assert float((again.scores - r.scores).abs().max()) / scale < 3e-2
        stats = engine.graph_stats()
        assert stats is not None
        assert stats.replays > 0
        # Every batch timed by events from the pool: a few made, then reused.
        pool = engine.event_pool
        assert pool is not None
        assert pool.created <= 8
        assert pool.reused > pool.created
        assert engine.device_time.snapshot().work_s["rank"] > 0
    finally:
        engine.stop()


@pytest.mark.parametrize(
    ("graph_psi_chunks", "copies"), [(False, "engine"), (True, "engine"), (True, "kernel")]
)
async def test_chunks_launched_ahead_with_rankings_between_them(graph_psi_chunks, copies):
    """Pre-inference steps launched ahead (graphs for first chunks; later ones eager, or graphs
    of the chunk family, the default since k20) with ranking calls arriving among them: every
    psi equals one pre-inference, every call its full ranking. With kernel copies a new psi's
    timestamps are staged by kernel too (model.new_psi)."""
    model = HSTURanker.from_seed(SPEC, seed=6, device="cuda")
    config = EngineConfig(
        max_batch=2,
        max_wait_s=0.0,
        chunks_ahead=True,
        graph_psi_chunks=graph_psi_chunks,
        batch_copies=copies,
        preinfer_chunk_tokens=512,
        graph_limits=GraphLimits(max_tokens=1024, max_prefix_tokens=4096, max_full_tokens=4096),
    )
    engine = Engine(model, accelerator("cuda"), config)
    assert (model.host_staging is not None) == (copies == "kernel")
    engine.start()
    try:
        await engine.capture_graphs([64])
        prefixes, suffixes = batch(12, [Shape(3, 1500 + 100 * i, 16, 48) for i in range(6)])
        ready = model.preinfer(prefixes[3:])
        building = [asyncio.ensure_future(engine.preinfer(p)) for p in prefixes[:3]]
        ranked = await asyncio.gather(
            *(engine.rank_cached(s, p, p.key) for s, p in zip(suffixes[3:], ready, strict=True))
        )
        built = await asyncio.gather(*building)
        want = model.full(prefixes, suffixes)
        scale = max(float(torch.cat(want).abs().max()), 1e-3)
        for r, w in zip(ranked, want[3:], strict=True):
            assert float((r.scores - w.cpu()).abs().max()) / scale < 3e-2
        for psi, ref in zip(built, model.preinfer(prefixes[:3]), strict=True):
            assert torch.equal(psi.timestamps, ref.timestamps)
            assert float((psi.kv.float() - ref.kv.float()).abs().max()) <= 3e-2 * max(
                float(ref.kv.float().abs().max()), 1e-3
            )
    finally:
        engine.stop()


async def test_copies_to_and_from_the_host_reuse_their_timing_events():
    """psi demoted to page-locked host memory and reloaded through the engine's copy streams,
    over and over: the bytes come back equal, each copy is timed, and the copies' events come
    from the pool (a handful made, the rest reused)."""
    from services.ranker.transfer import host_meta, host_nbytes, issue_from_host, issue_to_host

    model = HSTURanker.from_seed(SPEC, seed=7, device="cuda")
    engine = Engine(model, accelerator("cuda"), EngineConfig(max_batch=2, max_wait_s=0.0))
    engine.start()
    try:
        prefixes, _ = batch(12, [Shape(3, 500, 16, 48)])
        psi = model.preinfer(prefixes)[0]
        meta = host_meta(psi)
        host = torch.empty(host_nbytes(meta), dtype=torch.uint8).pin_memory()
        timed: list[float] = []
        for _ in range(6):
            host.zero_()
            await engine.copy(lambda: issue_to_host(psi, host), work="demote", on_timed=timed.append)
            back = await engine.copy(
                lambda: issue_from_host(host, meta, psi.key, psi.kv.device, engine.compute_stream),
                work="reload",
                on_timed=timed.append,
            )
            assert torch.equal(back.kv, psi.kv)
            assert torch.equal(back.timestamps, psi.timestamps)
        # A copy's caller may be told (by the copy watcher) before the loop settles its timing.
        await eventually(lambda: len(timed) == 12, "the loop timed all 12 copies")
        # Every reload's caller was also told by the copy watcher (copy_watch.py).
        assert engine._copy_watcher is not None
        await eventually(lambda: engine._copy_watcher.told == 6, "the watcher told the 6 reloads")  # type: ignore[union-attr]
        assert all(t > 0 for t in timed)
        pool = engine.event_pool
        assert pool is not None
        assert pool.created <= 4  # 30 without reuse: two a copy, three a reload
        reload = engine.copy_stages.mean_ms("reload")
        assert reload["copy"] > 0
        assert reload["device_wait"] >= 0
    finally:
        engine.stop()


async def test_a_take_over_of_a_preinference_not_started_replays_the_full_graph():
    """A ranking call that takes over a pre-inference of which nothing was built runs the full
    ranking's CUDA graph, keeping psi in the pre-inference's own block, not the eager partial
    pass (8.3 ms of host launch at L8192 on an H200): its scores are the full ranking's, and the
    pre-inference's waiter gets psi equal to one pre-inference."""
    model = HSTURanker.from_seed(SPEC, seed=8, device="cuda")
    config = EngineConfig(
        max_batch=2,
        max_wait_s=0.0,
        preinfer_chunk_tokens=256,
        max_rank_delay_s=1e-9,  # no rest fits one step: a call takes over
        full_keeps_psi=True,
        graph_limits=GraphLimits(max_tokens=1024, max_prefix_tokens=4096, max_full_tokens=4096),
    )
    engine = Engine(model, accelerator("cuda"), config)
    prefixes, suffixes = batch(13, [Shape(3, 900 + 50 * i, 16, 48) for i in range(3)])
    want = model.full(prefixes, suffixes)
    whole = model.preinfer(prefixes)
    scale = max(float(torch.cat(want).abs().max()), 1e-3)
    engine.start()
    try:
        await engine.capture_graphs([64])
        stats = engine.graph_stats()
        assert stats is not None
        for prefix, suffix, w, ref in zip(prefixes, suffixes, want, whole, strict=True):
            key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
            # Hold the device thread so that the pre-inference cannot start before its call.
            release, held = await hold_device(engine)
            pre = asyncio.ensure_future(engine.preinfer(prefix))
            await eventually(lambda: engine.producing(key), "the pre-inference is queued")  # noqa: B023
            call = asyncio.ensure_future(engine.relay(prefix, suffix, key, deadline=1e12))
            await eventually(lambda: engine.rank_queue_depth == 1, "the call is queued")
            full_before = stats.replays_by_family.get(FULL_KEEP, 0)
            eager_before = stats.eager_by_family.get(FULL_KEEP, 0)
            release.set()
            await held
            served = await asyncio.wait_for(call, 60)
            psi = await asyncio.wait_for(pre, 60)
            assert served is not None
            assert served.reused_tokens == 0
            assert float((served.result.scores - w.cpu()).abs().max()) / scale < 3e-2
            kv_scale = max(float(ref.kv.float().abs().max()), 1e-3)
            assert float((psi.kv.float() - ref.kv.float()).abs().max()) <= 3e-2 * kv_scale
            # A replay of the keeping family (the take-over leaves psi), not eager.
            assert stats.replays_by_family.get(FULL_KEEP, 0) == full_before + 1
            assert stats.eager_by_family.get(FULL_KEEP, 0) == eager_before
            again = await engine.rank_cached(suffix, psi, psi.key)
            assert float((again.scores - w.cpu()).abs().max()) / scale < 3e-2
    finally:
        engine.stop()


async def hold_device(engine: Engine) -> tuple[threading.Event, asyncio.Future]:
    """Occupies the engine's device thread until the returned event is set."""
    entered, release = threading.Event(), threading.Event()
    held = asyncio.ensure_future(engine.call(lambda: (entered.set(), release.wait(30))))
    assert await asyncio.to_thread(entered.wait, 30)
    return release, held


async def test_with_psi_chunk_graphs_every_preinference_step_replays_a_graph():
    """RELAYGR_RANKER_GRAPH_PSI_CHUNKS: a prefix built in 256-token steps replays the preinfer
    family's graph for its first step and the chunk family's for every later one (none eager),
    and its psi is one pre-inference's; a call against it scores as a full ranking."""
    model = HSTURanker.from_seed(SPEC, seed=9, device="cuda")
    config = EngineConfig(
        max_batch=2,
        max_wait_s=0.0,
        preinfer_chunk_tokens=256,
        graph_psi_chunks=True,
        graph_limits=GraphLimits(max_tokens=1024, max_prefix_tokens=4096, max_full_tokens=4096),
    )
    engine = Engine(model, accelerator("cuda"), config)
    prefixes, suffixes = batch(17, [Shape(3, 1100, 16, 48)])
    ref = model.preinfer(prefixes)[0]
    want = model.full(prefixes, suffixes)[0]
    engine.start()
    try:
        await engine.capture_graphs([64])
        stats = engine.graph_stats()
        assert stats is not None
        psi = await asyncio.wait_for(engine.preinfer(prefixes[0]), 60)
        kv_scale = max(float(ref.kv.float().abs().max()), 1e-3)
        assert float((psi.kv.float() - ref.kv.float()).abs().max()) <= 3e-2 * kv_scale
        assert stats.replays_by_family.get("preinfer", 0) == 1
        assert stats.replays_by_family.get("chunk", 0) >= 3  # 1103 tokens in steps of 256
        assert stats.eager_by_family.get("preinfer", 0) == 0
        result = await engine.rank_cached(suffixes[0], psi, psi.key)
        scale = max(float(want.abs().max()), 1e-3)
        assert float((result.scores - want.cpu()).abs().max()) / scale < 3e-2
    finally:
        engine.stop()
