"""Liveness of the engine's device loop when a ranking call takes over a pre-inference whose last
chunk is already under way (issue 13: on an H100 with long chunk steps, calls joined psi that
was never handed over and waited until their deadline)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig, Overdue
from services.ranker.model import HSTURanker
from shared.modelspec import preset
from tests.preinfer_gate import PreinferGate
from tests.waiting import eventually


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


def chunked(model: HSTURanker) -> Engine:
    """Builds psi 256 tokens a step; a tiny step budget: a call takes a started pre-inference over."""
    config = EngineConfig(max_wait_s=0.0, preinfer_chunk_tokens=256, max_rank_delay_s=1e-9)
    return Engine(model, accelerator("cpu"), config)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-5


@pytest.mark.parametrize("leaves", ["cancelled", "overdue"])
async def test_a_take_over_during_the_last_chunk_whose_caller_left_still_hands_psi_over(
    model, monkeypatch, leaves
):
    """The call takes over while the last chunk runs (the take-over sees psi half built), then
    leaves before its step (its caller gone, or not started by its `start_by`): the chunk built
    all of psi, so its waiter must get it and the pre-inference must leave the queue."""
    prefixes, suffixes = batch(31, [Shape(2, 700, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model)
    with PreinferGate(model, monkeypatch, pause_before=(2,), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(prefix))
            await gate.wait_reached(2)  # chunks 0 and 1 built, the last one under way
            start_by = time.perf_counter() if leaves == "overdue" else float("inf")
            call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12, start_by=start_by))
            await eventually(lambda: e.rank_queue_depth == 1, "the call took the pre-inference over")
            if leaves == "cancelled":
                call.cancel()  # its caller has gone before its step
            gate.open()
            psi = await asyncio.wait_for(pre, 10)
            if leaves == "overdue":
                with pytest.raises(Overdue):
                    await asyncio.wait_for(call, 10)
        finally:
            e.stop()
    assert gate.chunks == [(0, 256), (256, 512), (512, prefix.length)]
    assert close(psi.kv, model.preinfer([prefix])[0].kv)
    assert not e.producing(key)
    assert e.preinfer_backlog == 0


async def test_a_take_over_during_the_last_chunk_ranks_against_the_psi_it_built(model, monkeypatch):
    """The call takes over while the last chunk runs and stays: its step finds psi complete."""
    prefixes, suffixes = batch(32, [Shape(2, 700, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    key = model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
    e = chunked(model)
    with PreinferGate(model, monkeypatch, pause_before=(2,), timeout_s=10.0) as gate:
        e.start()
        try:
            pre = asyncio.ensure_future(e.preinfer(prefix))
            await gate.wait_reached(2)
            call = asyncio.ensure_future(e.relay(prefix, suffix, key, deadline=1e12))
            await eventually(lambda: e.rank_queue_depth == 1, "the call took the pre-inference over")
            gate.open()
            served = await asyncio.wait_for(call, 10)
            psi = await asyncio.wait_for(pre, 10)
        finally:
            e.stop()
    assert served is not None
    assert served.reused_tokens == prefix.length
    assert close(served.result.scores, model.full([prefix], [suffix])[0])
    assert close(psi.kv, model.preinfer([prefix])[0].kv)
    assert not e.producing(key)


async def test_a_stall_report_names_what_waits_and_where_the_device_thread_is(model, monkeypatch):
    """A chunk held on the device thread: the queued call behind it shows in the report, with the
    thread's stack; nothing waiting past the threshold, no report."""
    prefixes, suffixes = batch(33, [Shape(2, 700, 4, 4)])
    prefix, suffix = prefixes[0], suffixes[0]
    e = chunked(model)
    with PreinferGate(model, monkeypatch, pause_before=(1,), timeout_s=10.0) as gate:
        e.start()
        try:
            assert e.stall_report(0.0) is None  # nothing queued
            pre = asyncio.ensure_future(e.preinfer(prefix))
            await gate.wait_reached(1)  # the device thread waits inside the second chunk
            call = asyncio.ensure_future(e.rank_full(prefix, suffix))
            await eventually(lambda: e.rank_queue_depth == 1, "the call is queued")
            assert e.stall_report(60.0) is None  # not waiting that long
            report = e.stall_report(0.0)
            assert report is not None
            assert [r["kind"] for r in report["ranks"]] == ["full"]
            assert report["preinfers"][0]["done"] == 256
            assert "preinfer_chunks" in report["threads"][0]  # where the device thread is
            gate.open()
            await asyncio.wait_for(asyncio.gather(pre, call), 30)
        finally:
            e.stop()
