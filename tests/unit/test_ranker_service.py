"""The ranker's gRPC surface, in process on the CPU (no host tier): every served-by path,
equality with full inference, admission bounds, bad input and overload; its lifecycle (a failed
background task exits 1, SIGTERM drains the calls in flight)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.ranker.config import RankerConfig
from services.ranker.engine import EngineStopped
from services.ranker.service import RankerService, preinfer_plan_lengths
from services.ranker.wire import by_reference
from shared.config import load_config
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.preinfer_gate import PreinferGate
from tests.rankers import preinfer_request, rank_request, users
from tests.waiting import eventually

TOL = 1e-5


@pytest.fixture
async def ranker(request):
    extra = getattr(request, "param", [])
    service = RankerService(load_config(RankerConfig, ["--device", "cpu", *extra]))
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    yield service, pb_grpc.RankerStub(channel), channel
    await channel.close()
    await service.shutdown(grace_s=0.5)


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def wait_produced(stub, count: int = 1) -> None:
    async def produced() -> bool:
        return (await stub.Stats(pb.StatsRequest(), timeout=5)).psi_produced >= count

    await eventually(produced, f"{count} psi produced", bound_s=60)


async def waits_for_psi(service: RankerService, calls: int = 1) -> None:
    """Until `calls` ranking calls are in flight. Admission and the cache claim happen in one step
    of the handler, so an admitted call whose psi is held by a PreinferGate is waiting to join it."""
    await eventually(lambda: service.admission.inflight == calls, f"{calls} ranking calls waiting for psi")


# psi built 256 tokens a step; a started pre-inference is joined (its rest always fits the delay).
# Full rankings keep no psi here: these tests take a full ranking as the reference, then
# pre-infer the same prefix.
NO_RANKING_PSI = ["--ranking-psi-min-tokens", "0"]
JOIN = ["--preinfer-chunk-tokens", "256", "--max-rank-delay-ms", "100000", *NO_RANKING_PSI]
# ... or taken over as partial psi (its rest never fits)
TAKE_OVER = ["--preinfer-chunk-tokens", "256", "--max-rank-delay-ms", "0.000001", *NO_RANKING_PSI]


@pytest.mark.parametrize("ranker", [JOIN], indirect=True)
async def test_miss_preinfer_join_hit_all_equal_full(ranker, monkeypatch):
    service, stub, _ = ranker
    prefixes, suffixes = users(1, 1, prefix_len=600)
    req = rank_request(prefixes[0], suffixes[0], "r1")
    full = await stub.Rank(req, timeout=30)
    assert full.served_by == pb.FULL_RECOMPUTE
    assert full.timings.prefix_reused == 0.0
    assert len(full.scores) == 16
    with PreinferGate(service.model, monkeypatch, pause_before=(1,)) as gate:  # held after chunk 0
        accepted = await stub.PreInfer(preinfer_request(prefixes[0], "p1"), timeout=5)
        assert accepted.outcome == pb.PreInferReply.ACCEPTED
        await gate.wait_reached(1)  # started: the ranking call joins it
        joining = asyncio.ensure_future(stub.Rank(req, timeout=30))
        await waits_for_psi(service)
        gate.open()
        joined = await joining
        assert gate.timed_out == []
    assert joined.served_by == pb.INFLIGHT_JOIN
    assert joined.timings.prefix_reused == 1.0
    assert gate.chunks == [(0, 256), (256, 512), (512, 603)]  # all built by the pre-inference
    again = await stub.PreInfer(preinfer_request(prefixes[0], "p2"), timeout=5)
    assert again.outcome == pb.PreInferReply.ALREADY_RESIDENT  # consumed, still in HBM: re-leased
    hit = await stub.Rank(req, timeout=30)
    assert hit.served_by == pb.HBM_HIT
    assert max_diff(joined.scores, full.scores) <= TOL
    assert max_diff(hit.scores, full.scores) <= TOL
    assert hit.timings.total_ms > 0
    assert hit.timings.prefix_reused == 1.0
    assert hit.timings.batch_seq > full.timings.batch_seq >= 1  # batches numbered in order
    assert hit.model_version


@pytest.mark.parametrize("ranker", [JOIN], indirect=True)
async def test_stats_count_a_pre_inference_once_and_list_its_deadline(ranker, monkeypatch):
    """A pre-inference under way is one of the backlog (the engine's job and the cache's
    producing entry are the same psi), and its ranking deadline is listed in ms from the reply:
    the trigger counts only the backlog due before an event as ahead of it."""
    service, stub, _ = ranker
    prefixes, _ = users(3, 1, prefix_len=600)
    with PreinferGate(service.model, monkeypatch, pause_before=(1,)) as gate:  # held after chunk 0
        due_unix_ms = int(time.time() * 1e3) + 3000
        request = preinfer_request(prefixes[0], "p1", ranking_deadline_unix_ms=due_unix_ms)
        assert (await stub.PreInfer(request, timeout=5)).outcome == pb.PreInferReply.ACCEPTED
        await gate.wait_reached(1)
        stats = await stub.Stats(pb.StatsRequest(), timeout=5)
        gate.open()
    assert stats.preinfer_backlog == 1
    [due_in_ms] = stats.preinfer_due_in_ms
    assert 2000 < due_in_ms <= 3000
    await wait_produced(stub)
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert (stats.preinfer_backlog, len(stats.preinfer_due_in_ms)) == (0, 0)
    # The price it plans for psi by length (the trigger's before it measured pre-inferences):
    # the scheduler's own plan, dearer the longer the prefix.
    plan = {p.prefix_len: p.device_ms for p in stats.preinfer_plan}
    assert list(plan) == preinfer_plan_lengths(service.config.max_prefix_tokens)
    assert plan[4096] == pytest.approx(service.engine.scheduler.remaining_seconds(0, 4096) * 1e3, rel=0.05)
    prices = list(plan.values())
    assert prices[0] > 0
    assert prices == sorted(prices)
    # The host's CPU per request, between two Stats readings with enough requests between them.
    assert stats.host_ms_per_request == 0.0  # a few requests so far: no figure
    for i in range(40):
        await stub.PreInfer(preinfer_request(prefixes[0], f"again{i}"), timeout=5)  # held: answered at once
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.host_ms_per_request > 0
    # The same figure on its metrics page (what the benchmarks record per point).
    gauge = service.metrics.host_ms_per_request._value.get()
    assert gauge == pytest.approx(stats.host_ms_per_request)


@pytest.mark.parametrize("ranker", [TAKE_OVER], indirect=True)
async def test_a_call_takes_over_its_half_built_psi_and_completes_it(ranker, monkeypatch):
    service, stub, _ = ranker
    prefixes, suffixes = users(2, 1, prefix_len=900)
    req = rank_request(prefixes[0], suffixes[0], "r1")
    full = await stub.Rank(req, timeout=30)
    with PreinferGate(service.model, monkeypatch, pause_before=(2,)) as gate:
        await stub.PreInfer(preinfer_request(prefixes[0], "p1"), timeout=5)
        await gate.wait_reached(2)  # chunks 0 and 1 built, chunk 2 under way
        taking = asyncio.ensure_future(stub.Rank(req, timeout=30))
        await eventually(lambda: service.engine.rank_queue_depth == 1, "the partial call is queued")
        gate.open()
        partial = await taking
    assert partial.served_by == pb.PARTIAL_PREFIX
    assert gate.chunks == [(0, 256), (256, 512), (512, 768)]  # none after the take-over
    assert partial.timings.prefix_reused == pytest.approx(768 / 903)
    assert max_diff(partial.scores, full.scores) <= TOL
    # The call completed psi: it is in HBM for the user's next call, exact.
    hit = await stub.Rank(req, timeout=30)
    assert hit.served_by == pb.HBM_HIT
    assert max_diff(hit.scores, full.scores) <= TOL
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.psi_produced == 1
    assert stats.psi_expired == 0


# One prefix a pre-inference step: the order of the steps is the order of the users.
ONE_A_STEP = ["--preinfer-max-batch", "1", *NO_RANKING_PSI]


@pytest.mark.parametrize("ranker", [ONE_A_STEP], indirect=True)
async def test_preinferences_are_built_in_the_order_their_ranking_calls_are_due(ranker, monkeypatch):
    service, stub, _ = ranker
    prefixes, _ = users(3, 4, prefix_len=300)
    now_ms = int(time.time() * 1e3)
    due_ms = [now_ms + 500, now_ms + 9_000, now_ms + 1_000, 0]  # 0: the signal does not say
    with PreinferGate(service.model, monkeypatch, pause_before=(0,)) as gate:
        first = preinfer_request(prefixes[0], "p0", ranking_deadline_unix_ms=due_ms[0])
        await stub.PreInfer(first, timeout=5)
        await gate.wait_reached(0)  # the device is busy with the first: the others queue
        for i in (1, 2, 3):
            request = preinfer_request(prefixes[i], f"p{i}", ranking_deadline_unix_ms=due_ms[i])
            assert (await stub.PreInfer(request, timeout=5)).outcome == pb.PreInferReply.ACCEPTED
        gate.open()
        await wait_produced(stub, 4)
        assert gate.timed_out == []
    # Each built whole before the next (one or more chunks each), in the order their calls are due.
    assert list(dict.fromkeys(gate.users)) == [prefixes[i].user_id for i in (0, 2, 1, 3)]
    assert gate.users == sorted(gate.users, key=list(dict.fromkeys(gate.users)).index)


async def test_batch_of_users_each_equal_to_full(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(2, 6, prefix_len=300)
    reqs = [rank_request(p, s, f"r{i}") for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True))]
    full = await asyncio.gather(*(stub.Rank(r, timeout=30) for r in reqs))
    await asyncio.gather(
        *(stub.PreInfer(preinfer_request(p, f"p{i}"), timeout=5) for i, p in enumerate(prefixes))
    )
    await wait_produced(stub, len(prefixes))
    cached = await asyncio.gather(*(stub.Rank(r, timeout=30) for r in reqs))
    for f, c in zip(full, cached, strict=True):
        assert c.served_by == pb.HBM_HIT
        assert max_diff(f.scores, c.scores) <= TOL


async def test_a_full_ranking_keeps_psi_and_the_users_next_call_reads_it(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(21, 1, prefix_len=600)  # 600+ tokens: over the default 512
    req = rank_request(prefixes[0], suffixes[0], "a1")
    first = await stub.Rank(req, timeout=30)
    assert first.served_by == pb.FULL_RECOMPUTE
    assert first.timings.prefix_reused == 0.0
    assert first.timings.psi_kept  # the reply says so: per-call records tell keeping rankings apart
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.ranking_psi_min_tokens == 512
    assert stats.psi_from_rankings == 1
    assert stats.hbm_resident_bytes > 0
    assert stats.hbm_leased_bytes == 0  # consumed by the call that produced it
    again = await stub.Rank(rank_request(prefixes[0], suffixes[0], "a2"), timeout=30)
    assert again.served_by == pb.HBM_HIT
    assert again.timings.prefix_reused == 1.0
    assert not again.timings.psi_kept
    assert max_diff(again.scores, first.scores) <= TOL
    pre = await stub.PreInfer(preinfer_request(prefixes[0], "p1"), timeout=5)
    assert pre.outcome == pb.PreInferReply.ALREADY_RESIDENT  # nothing to pre-infer
    # A prefix under the threshold keeps nothing: its calls are full recomputes.
    short, short_suffixes = users(22, 1, prefix_len=300)
    for i in range(2):
        reply = await stub.Rank(rank_request(short[0], short_suffixes[0], f"s{i}"), timeout=30)
        assert reply.served_by == pb.FULL_RECOMPUTE
        assert not reply.timings.psi_kept
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).psi_from_rankings == 1


@pytest.mark.parametrize("ranker", [["--psi-size-classes", "1.125"]], indirect=True)
async def test_psi_in_size_classes_counts_its_class_and_the_next_call_reads_it(ranker):
    service, stub, _ = ranker
    prefixes, suffixes = users(23, 1, prefix_len=600)
    first = await stub.Rank(rank_request(prefixes[0], suffixes[0], "c1"), timeout=30)
    assert first.served_by == pb.FULL_RECOMPUTE
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.psi_from_rankings == 1
    exact = service.spec.psi_bytes(prefixes[0].length)
    assert exact < 2**21
    assert stats.hbm_resident_bytes == 2**21  # the smallest class, 2 MiB: what the budget counts
    again = await stub.Rank(rank_request(prefixes[0], suffixes[0], "c2"), timeout=30)
    assert again.served_by == pb.HBM_HIT
    assert max_diff(again.scores, first.scores) <= TOL


async def test_the_gates_figures_are_exported_and_nan_until_measured(ranker):
    service, _, _ = ranker
    metric = service.registry.get_sample_value
    for gate in ("keep", "demotion"):  # both on by default; nothing measured yet
        assert math.isnan(metric("relaygr_ranker_gate_returns_per_action", {"gate": gate}))
        assert math.isnan(metric("relaygr_ranker_gate_host_ms_per_action", {"gate": gate}))
    assert service.relay.keep_gate is not None
    for _ in range(service.relay.keep_gate.min_actions):
        service.relay.keep_gate.kept()
    service.relay.keep_gate.read()
    assert metric("relaygr_ranker_gate_returns_per_action", {"gate": "keep"}) == pytest.approx(
        service.relay.keep_gate.reuse
    )
    # The event loop's CPU copying psi to host DRAM, per copy, for the benchmarks (task_cpu.py).
    assert metric("relaygr_ranker_demotions_metered_total") == 0
    service.relay.demotion_cpu.seconds, service.relay.demotion_cpu.runs = 0.004, 2
    assert metric("relaygr_ranker_demotion_loop_cpu_seconds_total") == pytest.approx(0.004)
    assert metric("relaygr_ranker_demotions_metered_total") == 2


async def test_a_prefetch_only_signal_re_leases_held_psi_and_never_computes_it(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(25, 2, prefix_len=600)
    nothing = await stub.PreInfer(preinfer_request(prefixes[0], "p0", prefetch_only=True), timeout=5)
    assert nothing.outcome == pb.PreInferReply.REFUSED
    assert nothing.reason == "not_held"
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert (stats.psi_produced, stats.preinfer_backlog, stats.hbm_resident_bytes) == (
        0,
        0,
        0,
    )  # nothing computed
    first = await stub.Rank(rank_request(prefixes[0], suffixes[0], "r0"), timeout=30)  # keeps psi
    assert first.served_by == pb.FULL_RECOMPUTE
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).hbm_leased_bytes == 0  # a hot copy, evictable
    held = await stub.PreInfer(preinfer_request(prefixes[0], "p1", prefetch_only=True), timeout=5)
    assert held.outcome == pb.PreInferReply.ALREADY_RESIDENT
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).hbm_leased_bytes > 0  # leased to its call now
    hit = await stub.Rank(rank_request(prefixes[0], suffixes[0], "r1"), timeout=30)
    assert hit.served_by == pb.HBM_HIT
    assert max_diff(hit.scores, first.scores) <= TOL
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).hbm_leased_bytes == 0  # consumed again
    # The same by reference (what the trigger sends: the name, not the tokens).
    ref = by_reference(rank_request(prefixes[0], suffixes[0], "x")).prefix_ref
    named = pb.PreInferRequest(request_id="p2", prefetch_only=True, user_id=prefixes[0].user_id,
                               prefix_version=prefixes[0].prefix_version, prefix_ref=ref)  # fmt: skip
    assert (await stub.PreInfer(named, timeout=5)).outcome == pb.PreInferReply.ALREADY_RESIDENT
    assert (await stub.Rank(rank_request(prefixes[0], suffixes[0], "r2"), timeout=30)).served_by == pb.HBM_HIT
    other = pb.PreInferRequest()
    other.CopyFrom(named)
    other.prefix_ref.fingerprint ^= 1  # other content under the same name: nothing held
    refused = await stub.PreInfer(other, timeout=5)
    assert (refused.outcome, refused.reason) == (pb.PreInferReply.REFUSED, "not_held")
    # A name alone cannot be pre-inferred, and a name must be possible.
    for bad, why in ((dict(prefetch_only=False), "only a prefetch-only"),
                     (dict(prefix_ref=pb.PrefixRef(length=0, fingerprint=5)), "not a possible prefix length")):  # fmt: skip
        wrong = pb.PreInferRequest()
        wrong.CopyFrom(named)
        for field, value in bad.items():
            if field == "prefix_ref":
                wrong.prefix_ref.CopyFrom(value)
            else:
                setattr(wrong, field, value)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.PreInfer(wrong, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert why in caught.value.details()


@pytest.mark.parametrize("ranker", [NO_RANKING_PSI], indirect=True)
async def test_with_ranking_psi_off_a_full_ranking_keeps_nothing(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(23, 1, prefix_len=600)
    for i in range(2):
        reply = await stub.Rank(rank_request(prefixes[0], suffixes[0], f"r{i}"), timeout=30)
        assert reply.served_by == pb.FULL_RECOMPUTE
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.ranking_psi_min_tokens == 0
    assert stats.psi_from_rankings == 0
    assert stats.hbm_resident_bytes == 0


@pytest.mark.parametrize("ranker", [["--hbm-budget-mb", "0.5"]], indirect=True)
async def test_a_full_ranking_without_room_for_its_psi_still_answers(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(24, 2, prefix_len=600)  # ~0.3 MB of psi each: one fits at a time
    accepted = await stub.PreInfer(preinfer_request(prefixes[0], "a"), timeout=5)
    assert accepted.outcome == pb.PreInferReply.ACCEPTED  # leased until its call: not evictable
    await wait_produced(stub, 1)
    reply = await stub.Rank(rank_request(prefixes[1], suffixes[1], "b"), timeout=30)
    assert reply.served_by == pb.FULL_RECOMPUTE
    assert len(reply.scores) == 16
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.psi_from_rankings == 0
    hit = await stub.Rank(rank_request(prefixes[0], suffixes[0], "a-r"), timeout=30)
    assert hit.served_by == pb.HBM_HIT


@pytest.mark.parametrize("ranker", [["--hbm-budget-mb", "0.5"]], indirect=True)
async def test_preinfer_refused_when_hbm_budget_is_full(ranker):
    _, stub, _ = ranker
    prefixes, _ = users(3, 2, prefix_len=600)  # ~0.3 MB of psi each (tiny preset, float32)
    first = await stub.PreInfer(preinfer_request(prefixes[0], "a"), timeout=5)
    second = await stub.PreInfer(preinfer_request(prefixes[1], "b"), timeout=5)
    assert first.outcome == pb.PreInferReply.ACCEPTED
    assert second.outcome == pb.PreInferReply.REFUSED
    assert second.reason == "hbm_budget"
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.preinfers_refused == 1
    assert stats.hbm_leased_bytes > 0


@pytest.mark.parametrize("ranker", [["--hbm-budget-mb", "0.5"]], indirect=True)
async def test_a_consumed_psi_makes_room_and_stats_count_the_eviction(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(4, 2, prefix_len=600)  # ~0.3 MB of psi each: one fits at a time
    await stub.PreInfer(preinfer_request(prefixes[0], "a"), timeout=5)
    await wait_produced(stub, 1)
    hit = await stub.Rank(rank_request(prefixes[0], suffixes[0], "a-r"), timeout=30)
    assert hit.served_by == pb.HBM_HIT
    before = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert before.hbm_evictions == 0
    # No host tier here: the consumed psi stays as an evictable copy, then goes for the next one.
    second = await stub.PreInfer(preinfer_request(prefixes[1], "b"), timeout=5)
    assert second.outcome == pb.PreInferReply.ACCEPTED
    await wait_produced(stub, 2)
    after = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert after.hbm_evictions == 1


class PinnedClock:
    """The HBM cache's clock, held by the test: `at` when set, else the monotonic clock."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self) -> float:
        return time.monotonic() if self.at is None else self.at


async def test_unconsumed_psi_expires_at_its_lease_deadline(ranker):
    service, stub, _ = ranker
    clock = PinnedClock()
    service.cache.clock = clock
    prefix = users(4, 1, prefix_len=200)[0][0]
    sent = time.monotonic()
    reply = await stub.PreInfer(preinfer_request(prefix, "a", int(time.time() * 1e3) + 5000), timeout=5)
    answered = time.monotonic()
    await wait_produced(stub)
    view = service.cache.lookup(
        service.model.psi_key(prefix.user_id, prefix.prefix_version, reply.fingerprint)
    )
    assert view is not None
    assert view.lease is not None
    deadline = view.lease.deadline
    assert sent + 5.0 - 0.01 <= deadline <= answered + 5.0  # the unix-ms deadline, as the lease's
    clock.at = deadline - 1e-3  # just before it: kept (an expiry pass, as the service's loop runs it)
    assert service.cache.expire() == []
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).hbm_resident_bytes > 0
    clock.at = deadline + 1e-3  # just past it: the service's expiry loop frees it

    async def freed() -> bool:
        return (await stub.Stats(pb.StatsRequest(), timeout=5)).hbm_resident_bytes == 0

    await eventually(freed, "psi freed after its lease deadline")
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.psi_expired == 1


async def test_bad_requests_get_invalid_argument_and_the_server_keeps_serving(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(5, 1, prefix_len=50)
    good = rank_request(prefixes[0], suffixes[0], "ok")
    bad = []
    no_prefix = pb.RankRequest()
    no_prefix.CopyFrom(good)
    no_prefix.ClearField("prefix")
    bad.append((no_prefix, "prefix is required"))
    other_user = pb.RankRequest()
    other_user.CopyFrom(good)
    other_user.user_id += 1
    bad.append((other_user, "must equal"))
    ragged = pb.RankRequest()
    ragged.CopyFrom(good)
    ragged.candidates_le = b"\x01\x02\x03"
    bad.append((ragged, "whole number"))
    empty = pb.RankRequest()
    empty.CopyFrom(good)
    empty.candidates_le = b""
    bad.append((empty, "at least one candidate"))
    negative = pb.RankRequest()
    negative.CopyFrom(good)
    negative.candidates_le = (-5).to_bytes(8, "little", signed=True)
    bad.append((negative, "non-negative"))
    mismatched = pb.RankRequest()
    mismatched.CopyFrom(good)
    mismatched.recent.actions_le = b""
    bad.append((mismatched, "must match"))
    no_id = pb.RankRequest()
    no_id.CopyFrom(good)
    no_id.request_id = ""
    bad.append((no_id, "request_id"))
    for request, reason in bad:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Rank(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PreInfer(pb.PreInferRequest(prefix=good.prefix), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stub.Rank(good, timeout=30)).served_by == pb.FULL_RECOMPUTE


async def test_a_call_by_reference_is_served_from_psi_and_needs_the_prefix_otherwise(ranker):
    _, stub, _ = ranker
    prefixes, suffixes = users(7, 2, prefix_len=400)
    full = [rank_request(p, s, f"f{i}") for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True))]
    expected = await stub.Rank(full[0], timeout=30)
    # Nothing resident: a reference is not enough, and the answer says what to send.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Rank(by_reference(full[1]), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "prefix_required" in err.value.details()
    await stub.PreInfer(preinfer_request(prefixes[0], "p0"), timeout=5)
    await wait_produced(stub)
    # A reference whose length is not psi's names another prefix: psi is not used for it.
    wrong = by_reference(full[0])
    wrong.prefix_ref.length += 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Rank(wrong, timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    hit = await stub.Rank(by_reference(full[0]), timeout=30)
    assert hit.served_by == pb.HBM_HIT
    assert max_diff(hit.scores, expected.scores) <= TOL
    impossible = by_reference(full[0])
    impossible.prefix_ref.length = 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Rank(impossible, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefix_ref.length" in err.value.details()


async def test_a_bad_fallback_prefix_is_refused_even_when_psi_is_resident(ranker):
    """An HBM hit never reads the fallback prefix's tokens, but the same request must not be
    accepted or refused depending on what happens to be cached."""
    _, stub, _ = ranker
    prefixes, suffixes = users(6, 1, prefix_len=80)
    good = rank_request(prefixes[0], suffixes[0], "ok")
    await stub.PreInfer(preinfer_request(prefixes[0], "p"), timeout=5)
    await wait_produced(stub)
    bad = pb.RankRequest()
    bad.CopyFrom(good)
    bad.prefix.long_term.items_le = (-1).to_bytes(8, "little", signed=True) + bad.prefix.long_term.items_le[
        8:
    ]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Rank(bad, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefix.long_term.items" in err.value.details()
    assert (await stub.Rank(good, timeout=30)).served_by == pb.HBM_HIT  # psi was left for it


@pytest.mark.parametrize(
    "ranker",
    [["--max-inflight-ranks", "1", "--admission-min-limit", "1", "--admission-shed-preinfer-ms", "600000"]],
    indirect=True,
)
async def test_overload_is_refused_fast_with_resource_exhausted(ranker):
    service, stub, _ = ranker
    prefixes, suffixes = users(6, 6, prefix_len=1500)
    reqs = [rank_request(p, s, f"r{i}") for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True))]
    results = await asyncio.gather(*(stub.Rank(r, timeout=30) for r in reqs), return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if isinstance(r, pb.RankReply)]
    assert served
    assert refused
    for r in refused:
        assert r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"ranker {service.instance_id} overloaded: 1 ranking calls in flight, limit 1" in r.details()
    assert service.admission.inflight == 0  # every admitted call released its slot
    assert service.admission.refused["limit"] == len(refused)
    metrics = service.registry.get_sample_value
    assert metrics("relaygr_ranker_rank_refusals_total", {"reason": "limit"}) == len(refused)
    assert metrics("relaygr_ranker_rank_errors_total", {"code": "resource_exhausted"}) == len(refused)
    assert metrics("relaygr_ranker_rank_admission_limit") == 1
    # Ranking calls were refused: pre-inference is shed (a long shed window: no timing in the test).
    shed = await stub.PreInfer(preinfer_request(prefixes[0], "p-shed"), timeout=5)
    assert shed.outcome == pb.PreInferReply.REFUSED
    assert shed.reason == "rank_overloaded"
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).preinfers_refused == 1


async def test_an_invalid_call_releases_its_admission_slot(ranker):
    service, stub, _ = ranker
    prefixes, suffixes = users(8, 1, prefix_len=50)
    bad = rank_request(prefixes[0], suffixes[0], "bad")
    bad.candidates_le = b""
    for _ in range(service.admission.limit + 2):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Rank(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The caller may see the status before the handler's finally has run.
    await eventually(lambda: service.admission.inflight == 0, "every admission slot released")
    assert (await stub.Rank(rank_request(prefixes[0], suffixes[0], "ok"), timeout=30)).scores


async def test_health_and_stats(ranker):
    service, stub, channel = ranker
    check = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="relaygr.v1.Ranker"), timeout=5
    )
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    prefixes, suffixes = users(7, 1, prefix_len=100)
    await stub.Rank(rank_request(prefixes[0], suffixes[0], "r"), timeout=30)
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.instance_id == service.instance_id
    assert stats.model_version == service.model.model_version
    assert stats.rank_p99_ms > 0
    assert stats.psi_bytes_per_token == service.spec.psi_bytes(1)
    assert any(s.full and s.prefix_len == prefixes[0].length for s in stats.recent_batches)


# ----- lifecycle: the process's life through shared.lifecycle.Lifecycle -----


async def health(port: int) -> int | grpc.StatusCode:
    """The ranker's health status, or the status code of a health check that was not answered."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="relaygr.v1.Ranker"), timeout=2
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return reply.status


async def serving(service: RankerService) -> bool:
    return service.port != 0 and await health(service.port) == health_pb2.HealthCheckResponse.SERVING


async def test_a_failed_background_task_stops_the_ranker_with_status_1(monkeypatch):
    service = RankerService(load_config(RankerConfig, ["--device", "cpu"]))

    def broken() -> list:
        raise RuntimeError("cache bookkeeping broken")

    monkeypatch.setattr(service.cache, "expire", broken)  # the lease-expiry loop dies at its first pass
    assert await asyncio.wait_for(service.run(install_signals=False), 120) == 1
    assert service.lifecycle.failure is not None
    assert "expire" in service.lifecycle.failure
    assert "cache bookkeeping broken" in service.lifecycle.failure
    assert await health(service.port) == grpc.StatusCode.UNAVAILABLE  # intake stopped
    with pytest.raises(EngineStopped):  # closed
        await service.engine.preinfer(users(9, 1, prefix_len=20)[0][0])


async def test_sigterm_stops_intake_and_drains_the_calls_in_flight(monkeypatch):
    service = RankerService(load_config(RankerConfig, ["--device", "cpu", *JOIN]))
    runner = asyncio.ensure_future(service.run())
    try:
        await eventually(lambda: serving(service), "the ranker serves", bound_s=120)
        prefixes, suffixes = users(10, 1, prefix_len=300)
        req = rank_request(prefixes[0], suffixes[0], "r")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = pb_grpc.RankerStub(channel)
            full = await stub.Rank(req, timeout=30)
            with PreinferGate(service.model, monkeypatch, pause_before=(1,)) as gate:
                await stub.PreInfer(preinfer_request(prefixes[0], "p"), timeout=5)
                await gate.wait_reached(1)  # started: the call joins it
                in_flight = asyncio.ensure_future(stub.Rank(req, timeout=30))
                await waits_for_psi(service)
                os.kill(os.getpid(), signal.SIGTERM)

                async def refused() -> bool:
                    return await health(service.port) == grpc.StatusCode.UNAVAILABLE

                await eventually(refused, "new calls refused")
                assert not in_flight.done()
                gate.open()  # the call in flight gets its psi, and its answer
                joined = await in_flight
        assert joined.served_by == pb.INFLIGHT_JOIN
        assert max_diff(joined.scores, full.scores) <= TOL
        assert await asyncio.wait_for(runner, 30) == 0
    finally:
        if not runner.done():
            await service.shutdown(grace_s=0.5)
            await runner


async def test_the_signal_trip_is_measured_from_the_signal_time_and_bad_clocks_are_ignored(ranker):
    _, stub, _ = ranker
    prefixes, _ = users(5, 4, prefix_len=40)
    now_ms = int(time.time() * 1e3)
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).signal_trip_p90_ms == 0.0  # none yet
    # Made up or skewed: an hour ago, the epoch's first millisecond, a time in the future, unset.
    for i, when in enumerate((now_ms - 3_600_000, 1, now_ms + 60_000, 0)):
        request = preinfer_request(prefixes[i], f"odd-{i}")
        request.signal_time_unix_ms = when
        await stub.PreInfer(request, timeout=5)
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.signal_trip_p90_ms == 0.0  # the future one counts as 0 ms: nothing above it
    request = preinfer_request(prefixes[0], "real")
    request.signal_time_unix_ms = int(time.time() * 1e3) - 40
    await stub.PreInfer(request, timeout=5)
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).signal_trip_p90_ms >= 40.0


async def test_a_device_out_of_memory_is_resource_exhausted_and_a_fault_internal(ranker, monkeypatch):
    """What the relay cache cannot absorb reaches the caller as a status that says what it was
    (k18e: four processes on one H200 answered 482 calls UNKNOWN with a traceback in the log),
    counted, and the ranker goes on serving."""
    service, stub, _ = ranker
    prefixes, suffixes = users(31, 1, prefix_len=100)
    rank = service.relay.rank
    failures = [torch.OutOfMemoryError("CUDA out of memory (a test)"), KeyError("a bug")]

    async def failing(*args, **kwargs):
        if failures:
            raise failures.pop(0)
        return await rank(*args, **kwargs)

    monkeypatch.setattr(service.relay, "rank", failing)
    for code, said in (
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "device_memory"),
        (grpc.StatusCode.INTERNAL, "KeyError"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Rank(rank_request(prefixes[0], suffixes[0], f"r-{code.name}"), timeout=30)
        assert err.value.code() == code
        assert said in err.value.details()
    errors = service.metrics.rank_errors
    assert errors.labels("device_memory")._value.get() == 1
    assert errors.labels("internal")._value.get() == 1
    # Released in the handler's finally, after abort has sent the status: the client may see the
    # status first.
    await eventually(lambda: service.admission.inflight == 0, "both released their admission")
    reply = await stub.Rank(rank_request(prefixes[0], suffixes[0], "after"), timeout=30)
    assert len(reply.scores) == len(suffixes[0].candidates)


async def test_a_device_that_refuses_psi_lowers_the_budget_and_the_calls_are_answered(ranker, monkeypatch):
    """Over gRPC, as a client sees it: full rankings that would keep psi the device has no room
    for are answered all the same (the same scores as with room), the psi budget in Stats
    drops, the refusals are counted by path, and once the device has room again psi is kept."""
    service, stub, _ = ranker
    prefixes, suffixes = users(33, 4, prefix_len=600)  # over the 512 tokens from which psi is kept
    for i in (0, 3):  # two users' psi held (consumed: evictable)
        held = await stub.Rank(rank_request(prefixes[i], suffixes[i], f"held{i}"), timeout=30)
        assert held.served_by == pb.FULL_RECOMPUTE
    before = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert before.psi_from_rankings == 2
    new_psi = service.model.new_psi
    refusals = [1]

    def refusing(*args, **kwargs):
        if refusals[0] > 0:
            refusals[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (a test)")
        return new_psi(*args, **kwargs)

    monkeypatch.setattr(service.model, "new_psi", refusing)
    refused = await stub.Rank(rank_request(prefixes[1], suffixes[1], "refused"), timeout=30)
    assert refused.served_by == pb.FULL_RECOMPUTE
    assert len(refused.scores) == len(suffixes[1].candidates)
    want = service.model.full([prefixes[1]], [suffixes[1]])[0].tolist()
    assert max_diff(refused.scores, want) <= TOL
    after = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert after.psi_from_rankings == 2  # nothing kept
    # What was held less the refused psi: one of the two held psis went to make it so.
    assert after.hbm_budget_bytes == before.hbm_resident_bytes // 2
    assert after.hbm_resident_bytes == before.hbm_resident_bytes // 2
    short = service.metrics.device_memory_short
    assert short.labels("ranking_psi")._value.get() == 1
    # The device has room again: the next new user's psi is kept, within the lowered budget.
    kept = await stub.Rank(rank_request(prefixes[2], suffixes[2], "kept"), timeout=30)
    assert kept.served_by == pb.FULL_RECOMPUTE
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.psi_from_rankings == 3
    assert stats.hbm_resident_bytes <= stats.hbm_budget_bytes == after.hbm_budget_bytes


async def test_scores_that_are_not_finite_are_never_answered(ranker, monkeypatch):
    """A full ranking whose scores come back NaN is INTERNAL with why, counted; the ranker goes
    on serving, and the next call is answered."""
    service, stub, _ = ranker
    prefixes, suffixes = users(34, 1, prefix_len=100)
    full = service.model.full
    left = [1]

    def poisoned(*args, **kwargs):
        scores = full(*args, **kwargs)
        if left[0] > 0:
            left[0] -= 1
            scores[0] = torch.full_like(scores[0], float("nan"))
        return scores

    monkeypatch.setattr(service.model, "full", poisoned)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Rank(rank_request(prefixes[0], suffixes[0], "nan"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "not finite" in err.value.details()
    assert service.metrics.rank_errors.labels("nonfinite_scores")._value.get() == 1
    # Released in the handler's finally, after abort has sent the status (a full run saw 1 here).
    await eventually(lambda: service.admission.inflight == 0, "the admission released")
    reply = await stub.Rank(rank_request(prefixes[0], suffixes[0], "after"), timeout=30)
    want = service.model.full([prefixes[0]], [suffixes[0]])[0].tolist()
    assert max_diff(reply.scores, want) <= TOL
