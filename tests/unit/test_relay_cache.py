"""The relay cache's policy on the CPU, without gRPC: a real engine, HBM cache and model (no host
tier). Produce, claim (hit, join, partial take-over, take-over before any chunk, miss, content
mismatch), lease conversion and expiry, with the device-time ledger."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import cast

import pytest
import torch

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.cost_model import CostModel
from services.ranker.demotion_gate import DemotionGate
from services.ranker.engine import Engine, EngineConfig, NonFiniteScores, nonfinite_calls
from services.ranker.hbm_cache import EntryState, HbmCache, Lease
from services.ranker.host_tier import HostTier
from services.ranker.keep_gate import PROBE_EVERY, KeepGate
from services.ranker.model import HSTURanker
from services.ranker.psi import Psi, PsiKey
from services.ranker.relay_cache import Produce, RecentIds, RelayCache, Served
from services.ranker.wire import PrefixReference, rank_inputs
from shared.modelspec import preset
from shared.wire import RequestLimits
from tests.cpu import burn_cpu
from tests.preinfer_gate import PreinferGate
from tests.rankers import rank_request, users
from tests.waiting import eventually

TOL = 1e-5
FAR = 1e12  # a deadline that never comes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Relay:
    """A relay cache over a real engine, with what the tests look at."""

    def __init__(self, model: HSTURanker, delay_s: float, ranking_psi_min_tokens: int = 0) -> None:
        self.model = model
        self.clock = Clock()
        # Keys grouped by (user, prefix version, model), as the service does: content mismatches show.
        self.cache = HbmCache(64 * 2**20, self.clock, group_of=lambda key: cast(PsiKey, key).name)
        config = EngineConfig(max_wait_s=0.0, preinfer_chunk_tokens=256, max_rank_delay_s=delay_s)
        self.engine = Engine(model, accelerator("cpu"), config)
        self.events: list[tuple[str, str]] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.after: list[object] = []
        costs = CostModel(model.spec, assumed_tflops=0.05, h2d_gbps=5.0)
        self.relay = RelayCache(
            self.cache, self.engine, costs, model.spec.psi_bytes, self.spawn,
            join_margin_ms=5.0, keep_demoted=True, on_event=lambda k, v: self.events.append((k, v)),
            ranking_psi_min_tokens=ranking_psi_min_tokens,
        )  # fmt: skip

    def rebuild(self, **kwargs: object) -> RelayCache:
        """A relay cache over the same cache and engine, full rankings keeping psi from 512
        tokens, with these settings (e.g. a gate)."""
        self.relay = RelayCache(
            self.cache, self.engine, CostModel(self.model.spec, assumed_tflops=0.05, h2d_gbps=5.0),
            self.model.spec.psi_bytes, self.spawn, join_margin_ms=5.0, keep_demoted=True,
            on_event=lambda k, v: self.events.append((k, v)), ranking_psi_min_tokens=512,
            **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        return self.relay

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task

    def inputs(self, seed: int, prefix_len: int):
        prefixes, suffixes = users(seed, 1, prefix_len=prefix_len)
        prefix, suffix = rank_inputs(rank_request(prefixes[0], suffixes[0], f"r{seed}"), RequestLimits())
        key = self.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        want = self.model.full([prefixes[0]], [suffixes[0]])[0]
        return key, prefix, suffix, want

    async def rank(self, key, prefix, suffix):
        return await self.relay.rank(key, "r", prefix, suffix, FAR, self.after.append)

    def state(self, key) -> EntryState | None:
        view = self.cache.lookup(key)
        return view.state if view is not None else None


@pytest.fixture(scope="module")
def model() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


@pytest.fixture
async def join(model) -> AsyncIterator[Relay]:
    r = Relay(model, delay_s=100.0)  # a started pre-inference's rest always fits: join
    r.engine.start()
    yield r
    r.engine.stop()


@pytest.fixture
async def take_over(model) -> AsyncIterator[Relay]:
    r = Relay(model, delay_s=1e-9)  # the rest never fits: take over
    yield r  # started by the test
    r.engine.stop()


def close(scores: torch.Tensor, want: torch.Tensor) -> bool:
    return float((scores - want).abs().max()) <= TOL


async def test_produce_then_hit_converts_the_lease(join):
    key, prefix, suffix, want = join.inputs(1, 500)
    assert await join.relay.produce(key, prefix, Lease("p", FAR)) == (Produce.ACCEPTED, "")
    await eventually(lambda: join.state(key) is EntryState.RESIDENT, "psi resident")
    assert await join.relay.produce(key, prefix, Lease("p2", FAR)) == (Produce.ALREADY_RESIDENT, "")
    ranked = await join.rank(key, prefix, suffix)
    assert ranked.served is Served.HBM_HIT
    assert ranked.prefix_reused == 1.0
    assert close(ranked.result.scores, want)
    assert join.state(key) is EntryState.CONSUMED  # the lease ended with the call
    assert join.engine.device_time.snapshot().unused_psi == 0


async def test_a_call_joins_a_started_preinference(join, monkeypatch):
    key, prefix, suffix, want = join.inputs(2, 700)
    with PreinferGate(join.model, monkeypatch, pause_before=(1,), timeout_s=10.0) as gate:
        await join.relay.produce(key, prefix, Lease("p", FAR))
        await gate.wait_reached(1)
        assert await join.relay.produce(key, prefix, Lease("p2", FAR)) == (Produce.ALREADY_PRODUCING, "")
        call = asyncio.ensure_future(join.rank(key, prefix, suffix))
        gate.open()
        ranked = await asyncio.wait_for(call, 30)
    assert ranked.served is Served.INFLIGHT_JOIN
    assert ranked.prefix_reused == 1.0
    assert close(ranked.result.scores, want)
    assert join.state(key) is EntryState.CONSUMED
    assert len(join.after) == 1  # demotion (or keeping it hot) once the reply is sent


async def test_a_call_takes_over_a_half_built_psi_as_partial_prefix(take_over, monkeypatch):
    r = take_over
    key, prefix, suffix, want = r.inputs(3, 1000)
    with PreinferGate(r.model, monkeypatch, pause_before=(1,), timeout_s=10.0) as gate:
        r.engine.start()
        await r.relay.produce(key, prefix, Lease("p", FAR))
        await gate.wait_reached(1)  # chunk 0 built, chunk 1 under way
        call = asyncio.ensure_future(r.rank(key, prefix, suffix))
        await eventually(lambda: r.engine.rank_queue_depth == 1, "the partial call is queued")
        gate.open()
        ranked = await asyncio.wait_for(call, 30)
    assert ranked.served is Served.PARTIAL_PREFIX
    assert gate.chunks == [(0, 256), (256, 512)]
    assert ranked.prefix_reused == pytest.approx(512 / 1003)
    assert close(ranked.result.scores, want)
    assert r.state(key) is EntryState.CONSUMED  # produced by the call, consumed by it
    again = await r.rank(key, prefix, suffix)
    assert again.served is Served.HBM_HIT
    assert close(again.result.scores, want)
    assert r.engine.device_time.snapshot().unused_psi == 0


async def test_a_call_by_reference_takes_over_with_the_preinferences_tokens(take_over, monkeypatch):
    # The router sends a call whose psi it expects here by reference (no prefix tokens): it must
    # still take a slow pre-inference over rather than wait for its background chunks.
    r = take_over
    key, prefix, suffix, want = r.inputs(8, 1000)
    ref = PrefixReference(prefix.user_id, prefix.prefix_version, prefix.length, prefix.digest)
    with PreinferGate(r.model, monkeypatch, pause_before=(1,), timeout_s=10.0) as gate:
        r.engine.start()
        await r.relay.produce(key, prefix, Lease("p", FAR))
        await gate.wait_reached(1)
        call = asyncio.ensure_future(r.rank(key, ref, suffix))
        await eventually(lambda: r.engine.rank_queue_depth == 1, "the partial call is queued")
        gate.open()
        ranked = await asyncio.wait_for(call, 30)
    assert ranked.served is Served.PARTIAL_PREFIX
    assert ranked.prefix_reused == pytest.approx(512 / 1003)
    assert close(ranked.result.scores, want)
    assert r.state(key) is EntryState.CONSUMED


async def test_a_preinference_not_started_is_taken_over_whole(take_over, monkeypatch):
    r = take_over
    key, prefix, suffix, want = r.inputs(4, 600)
    with PreinferGate(r.model, monkeypatch, pause_before=()) as gate:
        await r.relay.produce(key, prefix, Lease("p", FAR))  # queued: the engine is not running
        await eventually(lambda: r.engine.producing(key), "the pre-inference is queued")
        call = asyncio.ensure_future(r.rank(key, prefix, suffix))
        await eventually(lambda: r.engine.rank_queue_depth == 1, "the call took it over")
        r.engine.start()
        ranked = await asyncio.wait_for(call, 30)
    assert ranked.served is Served.FULL_RECOMPUTE  # nothing was built: the call computed it all ...
    assert ranked.prefix_reused == 0.0
    assert gate.chunks == []  # ... once: no chunk ran
    assert close(ranked.result.scores, want)
    assert r.state(key) is EntryState.CONSUMED  # ... and psi was produced by it all the same
    assert r.cache.counters.produced == 1


async def test_a_miss_ranks_in_full_and_another_content_is_a_mismatch(join):
    key, prefix, suffix, want = join.inputs(5, 300)
    ranked = await join.rank(key, prefix, suffix)
    assert ranked.served is Served.FULL_RECOMPUTE
    assert close(ranked.result.scores, want)
    await join.relay.produce(key, prefix, Lease("p", FAR))
    await eventually(lambda: join.state(key) is EntryState.RESIDENT, "psi resident")
    other = join.model.psi_key(key.user_id, key.prefix_version, key.fingerprint ^ 1)
    assert (await join.rank(other, prefix, suffix)).served is Served.FULL_RECOMPUTE
    assert ("content_mismatch", "") in join.events
    assert join.relay.content_mismatches == 1


async def test_psi_nobody_consumed_expires_with_its_device_time_unused(join):
    key, prefix, _, _ = join.inputs(6, 400)
    await join.relay.produce(key, prefix, Lease("p", join.clock.now + 1.0))
    await eventually(lambda: join.state(key) is EntryState.RESIDENT, "psi resident")
    assert join.relay.expire() == []
    join.clock.now += 2.0
    assert join.relay.expire() == [key]
    snap = join.engine.device_time.snapshot()
    assert snap.unused_psi == 1
    assert snap.unused_psi_s == pytest.approx(snap.work_s["preinfer"])


async def test_a_call_in_the_same_turn_as_its_signal_still_takes_the_preinference_over(take_over):
    r = take_over
    key, prefix, suffix, want = r.inputs(7, 800)
    r.engine.start()
    await r.relay.produce(key, prefix, Lease("p", FAR))  # its task has not run yet ...
    ranked = await r.rank(key, prefix, suffix)  # ... when the call claims psi
    assert ranked.served in (Served.PARTIAL_PREFIX, Served.FULL_RECOMPUTE)  # taken over, not waited for
    assert close(ranked.result.scores, want)
    assert r.state(key) is EntryState.CONSUMED
    assert r.cache.counters.produced == 1


@pytest.fixture
async def keeping(model) -> AsyncIterator[Relay]:
    r = Relay(model, delay_s=100.0, ranking_psi_min_tokens=512)  # full rankings keep psi from 512 tokens
    r.engine.start()
    yield r
    r.engine.stop()


async def test_two_calls_of_a_new_user_compute_its_prefix_once(keeping):
    """The first call's full ranking keeps psi; a second call that comes meanwhile waits for
    it (as for a pre-inference) and ranks against it, instead of computing the prefix again."""
    key, prefix, suffix, want = keeping.inputs(41, 700)
    first, second = await asyncio.gather(keeping.rank(key, prefix, suffix), keeping.rank(key, prefix, suffix))
    assert sorted(r.served for r in (first, second)) == sorted([Served.FULL_RECOMPUTE, Served.INFLIGHT_JOIN])
    for r in (first, second):
        assert close(r.result.scores, want)
    assert keeping.relay.psi_from_rankings == 1
    assert keeping.state(key) is EntryState.CONSUMED
    assert ("ranking_psi", "kept") in keeping.events
    again = await keeping.rank(key, prefix, suffix)
    assert again.served is Served.HBM_HIT
    assert close(again.result.scores, want)


class CopyingHost:
    """A host tier that holds nothing and takes every demotion (the copy itself is not the
    subject here): records which keys it was given."""

    connected = True
    indexed = False

    def __init__(self) -> None:
        self.demoted: list[PsiKey] = []

    def may_hold(self, key: PsiKey) -> bool:
        return False

    async def demote(self, key: PsiKey, psi: Psi, engine: Engine) -> bool:
        self.demoted.append(key)
        return True

    async def lookup(self, key: PsiKey) -> int | None:
        return None  # holds nothing: a pre-inference computes its psi

    def stored_nbytes(self, prefix_len: int) -> int | None:
        return None  # as HBM holds it


class SlowCopyingHost(CopyingHost):
    """Takes every demotion, spending `step_s` of the event loop's CPU on each side of an await
    (as the expander's reserve and commit calls do)."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    async def demote(self, key: PsiKey, psi: Psi, engine: Engine) -> bool:
        burn_cpu(self.step_s)
        await asyncio.sleep(0)
        burn_cpu(self.step_s)
        return await super().demote(key, psi, engine)


async def test_the_demotion_gate_prices_a_copy_with_the_event_loops_own_steps(keeping, monkeypatch):
    """A copy to host DRAM costs the device loop its issue and the event loop its own steps (the
    expander's round trips, the bookkeeping): the gate weighs both. At 16384 tokens on an H200
    (k21b) the ranker spent 2.2-3.4 ms of CPU a copy, the device loop's issue ~0.4 of it."""
    r = keeping
    host = SlowCopyingHost(step_s=0.002)
    gate = DemotionGate(sample_every=1, min_demotions=1)
    r.rebuild(demotion_reserve_bytes=r.cache.budget_bytes, demotion_gate=gate)
    r.relay.host = cast(HostTier, host)
    monkeypatch.setattr(r.engine, "host_ms_per_copy", lambda: 0.3)
    priced: list[float | None] = []
    admits = gate.admits
    monkeypatch.setattr(
        gate, "admits", lambda user, saving, cost: priced.append(cost) or admits(user, saving, cost)
    )
    prefixes, suffixes = users(51, 4, prefix_len=600)
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        prefix, suffix = rank_inputs(rank_request(p, s, f"c{i}"), RequestLimits())
        key = r.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        await r.rank(key, prefix, suffix)
        for after in r.after:
            after(None)  # the reply is sent: the consumed psi is a candidate for host DRAM
        r.after.clear()
        await asyncio.gather(*r.tasks)
    assert len(host.demoted) >= 2
    assert r.relay.demotion_cpu.runs == len(host.demoted)
    per_copy = r.relay.host_ms_per_demotion()
    assert per_copy is not None
    assert per_copy >= 0.3 + 4.0  # the device loop's 0.3 and the host's two steps of 2 ms
    assert priced[0] == pytest.approx(0.3)  # nothing copied yet: the device loop's alone
    assert priced[-1] is not None
    assert priced[-1] >= 4.3  # what the gate weighed the later copies at


async def test_the_demotion_gate_copies_only_a_sample_while_copies_do_not_pay(keeping, monkeypatch):
    """Every consumed psi is a candidate (a reserve as large as the budget). Once a copy is
    measured to cost more host time than reloads save (no reload at all here), only the
    sampled users' psi is copied; the others stay evictable hot copies, counted as skipped."""
    r = keeping
    host = CopyingHost()
    gate = DemotionGate(sample_every=2, min_demotions=1)
    r.rebuild(demotion_reserve_bytes=r.cache.budget_bytes, demotion_gate=gate)
    r.relay.host = cast(HostTier, host)
    monkeypatch.setattr(r.engine, "host_ms_per_copy", lambda: 0.3)
    monkeypatch.setattr(r.engine, "reload_saving_s", lambda prefix_len, suffix_len: 0.0016)
    keys = []
    prefixes, suffixes = users(50, 6, prefix_len=600)  # users 0-5
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        prefix, suffix = rank_inputs(rank_request(p, s, f"g{i}"), RequestLimits())
        key = r.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        want = r.model.full([p], [s])[0]
        ranked = await r.rank(key, prefix, suffix)
        assert ranked.served is Served.FULL_RECOMPUTE
        assert close(ranked.result.scores, want)
        for after in r.after:
            after(None)  # the reply is sent: the consumed psi is a candidate for host DRAM
        r.after.clear()
        await asyncio.gather(*r.tasks)
        keys.append(key)
    first, rest = keys[0], keys[1:]
    assert host.demoted[0] == first  # before any copy was measured the gate is open
    assert gate.reload_yield == 0.0
    assert [k for k in host.demoted[1:] if k in rest] == [k for k in rest if k.user_id % 2 == 0]
    skipped = {k for k in rest if k.user_id % 2}
    assert skipped  # the seeds give both kinds
    assert r.relay.demotions_skipped == len(skipped)  # each once, however often it was a candidate
    assert ("demotion", "skipped") in r.events
    assert all(r.state(k) is EntryState.CONSUMED for k in skipped)  # still hot in HBM
    # Declined once, a candidate is not asked about again on later admissions and consumptions
    # (on the length mix ~130 of them were, each time: ~0.6 ms of the event loop a call) ...
    asked: list[int] = []
    admits = gate.admits
    monkeypatch.setattr(gate, "admits", lambda user, *a: asked.append(user) or admits(user, *a))
    r.relay.demote_ahead()
    assert not set(asked) & {k.user_id for k in skipped}
    # ... until a call reads it again: then it is a candidate to decide anew.
    again = next(k for k in skipped)
    i = keys.index(again)
    prefix, suffix = rank_inputs(rank_request(prefixes[i], suffixes[i], "again"), RequestLimits())
    assert (await r.rank(again, prefix, suffix)).served is Served.HBM_HIT
    for after in r.after:
        after(None)
    await asyncio.gather(*r.tasks)
    assert again.user_id in asked


async def test_psi_no_reload_would_take_back_is_never_copied_to_host_dram(keeping, monkeypatch):
    """A candidate whose reload would take longer than the reload decision ever accepts for
    what it saves (CostModel.may_reload: 1.5 x the saving, under load) is not copied, whatever
    the gate would say, and the gate is not asked: it stays an evictable hot copy, counted as
    never reloaded. Longer psi, whose reload pays, is copied as before."""
    r = keeping
    host = CopyingHost()
    gate = DemotionGate(sample_every=1, min_demotions=1)  # would copy every candidate it is asked about
    r.rebuild(demotion_reserve_bytes=r.cache.budget_bytes, demotion_gate=gate)
    r.relay.host = cast(HostTier, host)
    monkeypatch.setattr(r.engine, "host_ms_per_copy", lambda: 0.3)
    # A reload costs at least the copy's fixed 0.2 ms: psi under 800 tokens saves 0.1 ms here,
    # so no reload would ever take it back; longer psi saves 2 ms.
    monkeypatch.setattr(
        r.engine, "reload_saving_s", lambda prefix_len, suffix_len: 1e-4 if prefix_len < 800 else 2e-3
    )
    asked: list[int] = []
    admits = gate.admits
    monkeypatch.setattr(gate, "admits", lambda user, *a: asked.append(user) or admits(user, *a))
    keys = {}
    prefixes, suffixes = batch(7, [Shape(3, 600, 8, 16), Shape(3, 900, 8, 16)])  # users 0 and 1
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        prefix, suffix = rank_inputs(rank_request(p, s, f"n{i}"), RequestLimits())
        key = r.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        assert (await r.rank(key, prefix, suffix)).served is Served.FULL_RECOMPUTE
        for after in r.after:
            after(None)
        r.after.clear()
        await asyncio.gather(*r.tasks)
        keys[(600, 900)[i]] = key
    short, long = keys[600], keys[900]
    assert host.demoted == [long]
    assert r.relay.demotions_never_reloaded == 1
    assert r.relay.demotions_skipped == 0
    assert ("demotion", "never_reloaded") in r.events
    assert short.user_id not in asked
    assert long.user_id in asked
    assert r.state(short) is EntryState.CONSUMED  # still hot in HBM, evictable


async def test_a_preinference_not_started_within_its_lease_is_dropped_and_frees_its_room(take_over):
    r = take_over
    key, prefix, suffix, want = r.inputs(9, 500)
    await r.relay.produce(key, prefix, Lease("p", r.clock.now + 0.05))  # queued: the engine is not running
    assert r.state(key) is EntryState.PRODUCING
    await asyncio.sleep(0.1)  # its lease ends before the engine could start it
    r.engine.start()
    await eventually(lambda: ("preinfer_expired", "") in r.events, "the pre-inference expired")
    await eventually(lambda: r.state(key) is None, "its entry is gone")
    assert r.engine.preinfers_expired == 1
    assert r.engine.device_time.snapshot().unused_psi == 0  # nothing of it was built
    ranked = await r.rank(key, prefix, suffix)
    assert ranked.served is Served.FULL_RECOMPUTE
    assert close(ranked.result.scores, want)


async def test_a_signal_that_comes_after_its_ranking_call_is_refused(join):
    key, prefix, suffix, want = join.inputs(10, 500)
    ranked = await join.relay.rank(key, "req-1", prefix, suffix, FAR, join.after.append)
    assert ranked.served is Served.FULL_RECOMPUTE  # no psi: the signal was still on its way
    assert close(ranked.result.scores, want)
    assert await join.relay.produce(key, prefix, Lease("req-1", FAR)) == (Produce.REFUSED, "call_arrived")
    assert join.state(key) is None  # nothing admitted, nothing computed
    assert join.relay.late_signals == 1
    assert ("late_signal", "") in join.events
    # The next request of the same user is signalled ahead of its call, as usual.
    assert await join.relay.produce(key, prefix, Lease("req-2", FAR)) == (Produce.ACCEPTED, "")


def test_recent_ids_forget_after_their_ttl_and_beyond_their_bound():
    clock = Clock()
    ids = RecentIds(ttl_s=10.0, max_ids=3, clock=clock)
    ids.add("a")
    clock.now += 5
    ids.add("b")
    assert ids.seen("a")
    assert ids.seen("b")
    assert not ids.seen("c")
    assert not ids.seen("")
    clock.now += 6  # "a" is 11 s old
    assert not ids.seen("a")
    assert ids.seen("b")
    for name in ("c", "d", "e"):
        ids.add(name)
    assert len(ids) == 3  # the oldest went first
    assert not ids.seen("b")
    assert ids.seen("e")


async def test_the_keep_gate_keeps_psi_only_for_a_sample_while_reads_do_not_pay(keeping, monkeypatch):
    """Once psi kept by full rankings is measured never to be read (each user calls once here)
    while keeping one costs more host time than a read would save, only the sampled users'
    rankings keep psi; the others rank in full without it, counted as declined, with the same
    scores. A user whose psi was kept is then served from it (a read the gate counts)."""
    r = keeping
    gate = KeepGate(sample_every=2, min_kept=1)
    r.rebuild(keep_gate=gate)
    monkeypatch.setattr(r.engine, "host_ms_per_keep", lambda: 1.0)
    monkeypatch.setattr(r.engine, "reload_saving_s", lambda prefix_len, suffix_len: 0.0003)
    prefixes, suffixes = users(60, 6, prefix_len=600)  # users 0-5
    calls = []
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        prefix, suffix = rank_inputs(rank_request(p, s, f"k{i}"), RequestLimits())
        key = r.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        want = r.model.full([p], [s])[0]
        ranked = await r.rank(key, prefix, suffix)
        assert ranked.served is Served.FULL_RECOMPUTE
        assert close(ranked.result.scores, want)
        calls.append((key, prefix, suffix, want))
    first, rest = calls[0][0], [c[0] for c in calls[1:]]
    assert r.state(first) is EntryState.CONSUMED  # before any psi was measured the gate is open
    keep_ms = r.relay.host_ms_per_keep()  # the device loop's (1.0 here) and the event loop's
    assert keep_ms is not None
    assert keep_ms >= 1.0
    kept = {k for k in rest if r.state(k) is not None}
    assert kept == {k for k in rest if k.user_id % 2 == 0}
    declined = [k for k in rest if k.user_id % 2]
    assert declined  # the seeds give both kinds
    assert r.relay.ranking_psi_declined == len(declined)
    assert ("ranking_psi", "declined") in r.events
    assert gate.reuse == 0.0
    key, prefix, suffix, want = next(c for c in calls[1:] if c[0] in kept)
    again = await r.rank(key, prefix, suffix)  # the sampled user comes back: read from kept psi
    assert again.served is Served.HBM_HIT
    assert close(again.result.scores, want)
    assert gate.reuse is not None
    assert gate.reuse > 0.0


async def test_the_keep_gate_weighs_a_keeps_device_time_and_probes_for_it(keeping, monkeypatch):
    """The keep's cost is the host's time plus the device's, once the ranking batches tell the
    device's (KeepDeviceCost); while too few full rankings keep nothing for that, the probe's
    users (one in PROBE_EVERY, never a sampled one) rank without keeping psi, counted as probed,
    with the same scores."""
    r = keeping
    gate = KeepGate(sample_every=2, min_kept=1)
    r.rebuild(keep_gate=gate)
    monkeypatch.setattr(r.engine, "host_ms_per_keep", lambda: 0.5)
    assert r.engine.device_ms_per_keep(4096) is None  # nothing measured: the host's alone
    assert r.relay.cost_ms_per_keep(4096) == pytest.approx(r.relay.host_ms_per_keep())
    assert r.engine.keep_needs_plain
    prefixes, suffixes = users(61, PROBE_EVERY, prefix_len=600)
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        prefix, suffix = rank_inputs(rank_request(p, s, f"q{i}"), RequestLimits())
        key = r.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        ranked = await r.rank(key, prefix, suffix)
        assert close(ranked.result.scores, r.model.full([p], [s])[0])
        assert (r.state(key) is None) == (prefix.user_id == PROBE_EVERY - 1)
    assert r.relay.ranking_psi_probed == 1
    assert ("ranking_psi", "probed") in r.events
    # The batches measured a keep (fed here: the CPU's own are too noisy to assert on).
    for i in range(64):
        kept = 4096 * (i % 2)
        r.engine.keep_device.observe(3e-3, 3e-3 + 66e-9 * kept, kept)
    assert not r.engine.keep_needs_plain
    assert r.engine.device_ms_per_keep(4096) == pytest.approx(0.27, rel=0.01)
    host = r.relay.host_ms_per_keep()
    assert host is not None
    assert r.relay.cost_ms_per_keep(4096) == pytest.approx(host + 0.27, rel=0.01)


async def test_while_the_host_is_pressed_the_relay_keeps_no_psi_and_copies_none(keeping):
    """With the event loop behind (loop_lag.py), full rankings keep no psi and consumed psi is
    not copied to host DRAM, each counted as shed; the scores are the same, psi already held is
    still read, and once the loop catches up both resume."""
    r = keeping
    pressed = [False]
    host = CopyingHost()
    r.rebuild(demotion_reserve_bytes=r.cache.budget_bytes, host_pressed=lambda: pressed[0])
    r.relay.host = cast(HostTier, host)
    prefixes, suffixes = users(90, 4, prefix_len=600)
    calls = []
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        prefix, suffix = rank_inputs(rank_request(p, s, f"h{i}"), RequestLimits())
        calls.append((r.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest), prefix, suffix,
                      r.model.full([p], [s])[0]))  # fmt: skip

    async def rank_and_reply(key, prefix, suffix):
        ranked = await r.rank(key, prefix, suffix)
        for after in r.after:
            after(None)  # the reply is sent: consumed psi becomes a candidate for host DRAM
        r.after.clear()
        await asyncio.gather(*r.tasks)
        return ranked

    held, *_ = calls[0]
    await rank_and_reply(*calls[0][:3])  # not pressed: kept, and copied to DRAM
    assert r.state(held) is not None
    assert host.demoted == [held]
    pressed[0] = True
    for key, prefix, suffix, want in calls[1:3]:
        ranked = await rank_and_reply(key, prefix, suffix)
        assert ranked.served is Served.FULL_RECOMPUTE
        assert close(ranked.result.scores, want)
        assert r.state(key) is None  # no psi kept
    assert r.relay.ranking_psi_shed == 2
    assert ("ranking_psi", "shed") in r.events
    again = await rank_and_reply(*calls[0][:3])  # psi held before is still read
    assert again.served is Served.HBM_HIT
    assert close(again.result.scores, calls[0][3])
    # A pre-inference the trigger admitted still runs; its psi, once consumed, is not copied.
    key, prefix, suffix, want = calls[3]
    assert (await r.relay.produce(key, prefix, Lease("p", FAR)))[0] is Produce.ACCEPTED
    ranked = await rank_and_reply(key, prefix, suffix)
    assert ranked.served in (Served.HBM_HIT, Served.INFLIGHT_JOIN)
    assert close(ranked.result.scores, want)
    assert key not in host.demoted
    assert r.relay.demotions_shed >= 1
    assert ("demotion", "shed") in r.events
    pressed[0] = False  # the loop caught up: keeping resumes
    key, prefix, suffix, want = calls[2]
    await rank_and_reply(key, prefix, suffix)
    assert r.state(key) is not None


async def test_what_keeping_psi_costs_the_host_is_measured_once_enough_psi_was_kept(keeping):
    """The device loop times allocating each kept psi (and, with graphs, issuing its copy); the
    event loop its admission and lease: reported per psi once 32 were kept, not before."""
    r = keeping
    prefixes, suffixes = users(70, 32, prefix_len=520)
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        assert r.relay.host_ms_per_keep() is None
        prefix, suffix = rank_inputs(rank_request(p, s, f"m{i}"), RequestLimits())
        key = r.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        await r.rank(key, prefix, suffix)
    assert r.relay.psi_from_rankings == 32
    keep_ms = r.relay.host_ms_per_keep()
    assert keep_ms is not None
    assert 0.0 < keep_ms < 1000.0


def _refuse_allocations(model: HSTURanker, monkeypatch, refusals: list[int]) -> None:
    """The model's psi blocks are refused by the device while refusals[0] > 0 (one each)."""
    new_psi = model.new_psi

    def refusing(*args, **kwargs):
        if refusals[0] > 0:
            refusals[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 248.00 MiB (a test)")
        return new_psi(*args, **kwargs)

    monkeypatch.setattr(model, "new_psi", refusing)


async def test_a_device_out_of_memory_keeping_psi_ranks_anyway_and_lowers_the_budget(keeping, monkeypatch):
    """Four ranker processes on one H200 (k18e) were refused psi blocks their budgets allowed,
    and 482 calls failed as UNKNOWN: keeping psi is optional, so the call is ranked (the same
    scores) without it, and the budget drops to what is held less that psi, evicting unleased
    psi, once a second at most."""
    r = keeping
    held = []
    for seed in (60, 63):  # kept, then consumed: unleased, evictable
        key, prefix, suffix, _ = r.inputs(seed, 600)
        await r.rank(key, prefix, suffix)
        held.append(key)
    for after in r.after:
        after(None)
    assert [r.state(k) for k in held] == [EntryState.CONSUMED] * 2
    held_bytes = r.cache.used_bytes
    refusals = [2]
    _refuse_allocations(r.model, monkeypatch, refusals)
    key, prefix, suffix, want = r.inputs(61, 520)
    ranked = await r.rank(key, prefix, suffix)
    assert ranked.served is Served.FULL_RECOMPUTE
    assert close(ranked.result.scores, want)
    assert ranked.result.psi is None
    assert ranked.result.psi_out_of_memory
    assert r.state(key) is None  # nothing kept
    assert r.relay.device_memory_short == 1
    assert ("device_memory_short", "ranking_psi") in r.events
    lowered = held_bytes - r.model.spec.psi_bytes(prefix.length)  # held less the refused psi
    assert r.cache.budget_bytes == lowered
    assert [r.state(k) for k in held] == [None, EntryState.CONSUMED]  # the least recently used went
    assert r.cache.counters.budget_lowered == 1
    # Refused again within the second: counted, the budget as it was (one shortage's refusals
    # come together). The call is ranked all the same.
    key, prefix, suffix, want = r.inputs(62, 520)
    ranked = await r.rank(key, prefix, suffix)
    assert close(ranked.result.scores, want)
    assert refusals == [0]
    assert r.relay.device_memory_short == 2
    assert r.cache.counters.budget_lowered == 1
    assert r.cache.budget_bytes == lowered


async def test_a_full_pass_the_device_refuses_is_retried_once_with_psi_freed(join, monkeypatch):
    """The full pass itself refused (activations beside the psi held): psi gives way and the
    pass runs again; refused again, the error reaches the caller (RESOURCE_EXHAUSTED there)."""
    r = join
    held, held_prefix, _, _ = r.inputs(70, 500)  # user 0, as the call's: a content mismatch there
    assert (await r.relay.produce(held, held_prefix, Lease("p", FAR)))[0] is Produce.ACCEPTED
    await eventually(lambda: r.state(held) is EntryState.RESIDENT, "psi resident")
    rank_full = r.engine.rank_full
    refusals = [1]

    async def refusing(*args, **kwargs):
        if refusals[0] > 0:
            refusals[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return await rank_full(*args, **kwargs)

    monkeypatch.setattr(r.engine, "rank_full", refusing)
    key, prefix, suffix, want = r.inputs(71, 600)
    ranked = await r.rank(key, prefix, suffix)
    assert ranked.served is Served.FULL_RECOMPUTE
    assert close(ranked.result.scores, want)
    assert ("device_memory_short", "ranking") in r.events
    assert r.state(held) is EntryState.RESIDENT  # leased psi stays for its call
    # Held (the leased psi, which stays) less what the pass would take: below what is held, so
    # nothing more is admitted until that psi's call has come.
    assert r.cache.budget_bytes == max(0, r.cache.used_bytes - r.model.spec.psi_bytes(600))
    r.clock.now += 2.0
    refusals[0] = 2
    with pytest.raises(torch.OutOfMemoryError):
        await r.rank(key, prefix, suffix)


async def test_a_preinference_the_device_refuses_fails_its_production_and_lowers_the_budget(
    join, monkeypatch
):
    r = join
    budget = r.cache.budget_bytes
    refusals = [1]
    _refuse_allocations(r.model, monkeypatch, refusals)
    key, prefix, suffix, want = r.inputs(80, 500)
    assert (await r.relay.produce(key, prefix, Lease("p", FAR)))[0] is Produce.ACCEPTED
    await eventually(lambda: r.relay.device_memory_short == 1, "the refusal counted")
    assert ("device_memory_short", "preinfer") in r.events
    assert r.state(key) is None
    assert r.cache.budget_bytes < budget
    ranked = await r.rank(key, prefix, suffix)  # its call ranks in full
    assert ranked.served is Served.FULL_RECOMPUTE
    assert close(ranked.result.scores, want)


def _poison_once(monkeypatch, target: object, name: str) -> list[int]:
    """target.name returns its scores with the first one NaN, for the next call only."""
    real = getattr(target, name)
    left = [1]

    def poisoned(*args, **kwargs):
        scores = real(*args, **kwargs)
        if left[0] > 0:
            left[0] -= 1
            scores[0] = scores[0].clone()
            scores[0][0] = float("nan")
        return scores

    monkeypatch.setattr(target, name, poisoned)
    return left


def test_nonfinite_calls_names_every_call_with_a_nan_or_an_infinity():
    ok = torch.zeros(4)
    assert nonfinite_calls([ok, ok]) == []
    nan, inf = torch.tensor([0.0, float("nan")]), torch.tensor([float("-inf")])
    assert nonfinite_calls([ok, nan, inf, ok]) == [1, 2]


async def test_psi_that_scores_nan_is_dropped_and_its_call_ranks_in_full(join, monkeypatch):
    """A call against psi whose scores come back NaN (a kernel reading memory it should not,
    an H200 run of this session) is never answered with them: it ranks in full (the same
    scores as without psi), and that psi is dropped so that no later call reads it."""
    key, prefix, suffix, want = join.inputs(90, 500)
    await join.relay.produce(key, prefix, Lease("p", FAR))
    await eventually(lambda: join.state(key) is EntryState.RESIDENT, "psi resident")
    left = _poison_once(monkeypatch, join.model, "rank_cached")
    ranked = await join.rank(key, prefix, suffix)
    assert left == [0]  # the cached pass ran, and scored NaN
    assert ranked.served is Served.FULL_RECOMPUTE
    assert close(ranked.result.scores, want)
    assert ("fallback", "nonfinite_scores") in join.events
    assert join.engine.nonfinite_scores == 1
    assert join.state(key) is None  # dropped, not kept as a hot copy nor demoted
    assert not join.after  # nothing scheduled after the reply for it


async def test_a_full_ranking_that_scores_nan_fails_and_keeps_no_psi(keeping, monkeypatch):
    """Without psi to fall back from, a NaN full ranking is an error (NonFiniteScores: the
    ranker's servicer answers INTERNAL), and the psi the pass would have kept is not kept."""
    r = keeping
    key, prefix, suffix, want = r.inputs(91, 600)  # over the 512 tokens from which psi is kept
    _poison_once(monkeypatch, r.model, "full")
    with pytest.raises(NonFiniteScores, match="not finite"):
        await r.rank(key, prefix, suffix)
    assert r.state(key) is None
    ranked = await r.rank(key, prefix, suffix)  # the next pass is finite: answered, psi kept
    assert close(ranked.result.scores, want)
    assert r.state(key) is EntryState.CONSUMED
