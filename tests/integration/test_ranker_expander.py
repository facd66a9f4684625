"""One expander and two ranker processes on loopback: psi produced on one ranker comes back from
host DRAM on the other with scores equal to full inference; concurrent wants cause one reload;
the expander dying never fails a ranking call; nothing is left in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest

from relaygr.processes import ServiceProcess
from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from services.ranker.sequences import Behaviors, UserPrefix
from shared.modelspec import preset
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.rankers import preinfer_request, rank_request

pytestmark = pytest.mark.integration
TOL = 1e-5


def start_expander(sock: Path) -> ServiceProcess:
    p = ServiceProcess("services.expander", "--socket-path", str(sock), "--arena-bytes", str(256 << 20))
    p.wait_event("expander_ready")
    return p


class Ranker:
    def __init__(self, sock: Path, *extra: str) -> None:
        # Admission prices a call that carries its prefix as a full recompute until the ranker
        # knows better (services/ranker/admission.py): a herd of 50 calls on one psi in DRAM, which
        # costs one reload and 50 cheap rankings, would be refused in part (predicted 6 s of work
        # against the 5 s bound). These tests are about the tiers, so the bound is out of the way.
        self.proc = ServiceProcess(
            "services.ranker", "--device", "cpu", "--host-tier", "true", "--expander-socket-path", str(sock),
            "--admission-target-ms", "600000", *extra,
        )  # fmt: skip
        ready = self.proc.wait_event("ranker_ready", timeout_s=120)
        self.port, self.metrics_port = ready["port"], ready["metrics_port"]
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.RankerStub(self.channel)

    async def stats(self) -> pb.StatsReply:
        return await self.stub.Stats(pb.StatsRequest(), timeout=5)

    async def wait(self, predicate, timeout_s: float = 20.0) -> pb.StatsReply:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            stats = await self.stats()
            if predicate(stats):
                return stats
            assert asyncio.get_running_loop().time() < deadline, f"condition never met; last stats: {stats}"
            await asyncio.sleep(0.05)


@pytest.fixture
async def stack(tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    sock = tmp_path / "run" / "expander.sock"
    expander = start_expander(sock)
    # Every consumed psi copied to DRAM at once: these tests are about reloads across rankers.
    # In 10 KiB pieces, so that every exactness check here covers psi copied in many of them.
    rankers = [Ranker(sock, "--demotion", "consumed", "--copy-piece-mb", "0.01") for _ in range(2)]
    holder = {"expander": expander}
    try:
        for r in rankers:
            await r.wait(lambda s: s.expander_connected)
        yield holder, rankers, sock
    finally:
        for r in rankers:
            await r.channel.close()
            r.proc.stop()
        holder["expander"].stop()
    assert set(os.listdir("/dev/shm")) <= shm_before  # the arena is a memfd: nothing named is left


@pytest.fixture(scope="module")
def reference() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)  # the rankers' weights (same preset, same seed)


def full_scores(model: HSTURanker, prefix, suffix) -> list[float]:
    return model.full([prefix], [suffix])[0].tolist()


def close(a, b) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= TOL


async def produce_and_consume_on(ranker: Ranker, prefix, suffix, tag: str) -> pb.RankReply:
    produced = (await ranker.stats()).psi_produced
    await ranker.stub.PreInfer(preinfer_request(prefix, f"{tag}-p"), timeout=10)
    # Resident before the call (a call that came earlier would join or take over the pre-inference).
    await ranker.wait(lambda s: s.psi_produced > produced)
    reply = await ranker.stub.Rank(rank_request(prefix, suffix, f"{tag}-r"), timeout=30)
    assert reply.served_by == pb.HBM_HIT
    return reply


async def test_psi_from_ranker_a_is_reloaded_by_ranker_b(stack, reference):
    _, (a, b), _ = stack
    prefixes, suffixes = batch(11, [Shape(3, 1200, 8, 24), Shape(2, 900, 4, 12)])
    want = [full_scores(reference, p, s) for p, s in zip(prefixes, suffixes, strict=True)]
    for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
        assert close((await produce_and_consume_on(a, p, s, f"a{i}")).scores, want[i])
    await a.wait(lambda st: st.demotions == 2)  # both copied to host DRAM

    # User 0: a pre-infer signal on B reloads psi instead of recomputing it.
    reply = await b.stub.PreInfer(preinfer_request(prefixes[0], "b0-p"), timeout=10)
    assert reply.outcome == pb.PreInferReply.RELOAD_SCHEDULED
    ranked = await b.stub.Rank(rank_request(prefixes[0], suffixes[0], "b0-r"), timeout=30)
    assert ranked.served_by in (pb.HBM_HIT, pb.INFLIGHT_JOIN)
    assert close(ranked.scores, want[0])
    # That reload was a prefetch (ahead of the call), and the call read it.
    stats = await b.stats()
    assert (stats.prefetches_issued, stats.prefetches_used, stats.prefetches_wasted) == (1, 1, 0)
    assert b.proc.metric(b.metrics_port, 'relaygr_ranker_prefetches_total{outcome="used"}') == 1
    # User 1: no signal at all; the ranking call itself reloads from host DRAM (no prefetch).
    ranked = await b.stub.Rank(rank_request(prefixes[1], suffixes[1], "b1-r"), timeout=30)
    assert ranked.served_by == pb.DRAM_RELOAD
    assert close(ranked.scores, want[1])
    assert b.proc.metric(b.metrics_port, "relaygr_ranker_reloads_total") == 2
    # The call's reload path, timed by stage (the prefetch had no call waiting on it).
    assert b.proc.metric(b.metrics_port, 'relaygr_ranker_reload_paths_timed_total{work="call"}') == 1
    copy_s = b.proc.metric(
        b.metrics_port, 'relaygr_ranker_reload_path_seconds_total{stage="copy",work="call"}'
    )
    assert copy_s > 0
    stats = await b.stats()
    assert stats.reloads == 2
    assert (stats.prefetches_issued, stats.prefetches_used) == (1, 1)
    assert (await a.stats()).demotion_lag_p99_ms > 0  # A's consumed psi went to DRAM after its reply
    # Each copy's own event-loop CPU (the expander's round trips, the bookkeeping: task_cpu.py),
    # which the demotion gate adds to the device loop's issue when it prices a copy.
    assert a.proc.metric(a.metrics_port, "relaygr_ranker_demotions_metered_total") == 2
    cpu_s = a.proc.metric(a.metrics_port, "relaygr_ranker_demotion_loop_cpu_seconds_total")
    assert 0 < cpu_s < 2.0


async def test_a_miss_nobody_demoted_is_answered_without_asking_the_daemon(stack, reference):
    # A first call's psi is nowhere: the expander's presence index says so in the ranker's own
    # mapping, and the call goes straight to its full ranking (no lookup round trip).
    _, (a, _b), _ = stack
    prefixes, suffixes = batch(12, [Shape(2, 700, 4, 12)])
    ranked = await a.stub.Rank(rank_request(prefixes[0], suffixes[0], "first-r"), timeout=30)
    assert ranked.served_by == pb.FULL_RECOMPUTE
    assert close(ranked.scores, full_scores(reference, prefixes[0], suffixes[0]))

    def lookups(result: str) -> float:
        return a.proc.metric(a.metrics_port, f'relaygr_ranker_host_lookups_total{{result="{result}"}}')

    assert lookups("absent_local") == 1
    assert lookups("absent") == 0


def named_prefetch(prefix, request_id: str) -> pb.PreInferRequest:
    """A prefetch-only PreInfer naming its prefix instead of carrying it."""
    ref = pb.PrefixRef(length=prefix.fingerprint.length, fingerprint=prefix.fingerprint.digest)
    return pb.PreInferRequest(request_id=request_id, prefetch_only=True, user_id=prefix.user_id,
                              prefix_version=prefix.prefix_version, prefix_ref=ref)  # fmt: skip


async def test_a_prefetch_only_signal_reloads_psi_from_dram_and_computes_nothing_else(stack, reference):
    _, (a, b), _ = stack
    prefixes, suffixes = batch(31, [Shape(3, 1000, 8, 16), Shape(2, 800, 8, 16)])
    want = full_scores(reference, prefixes[0], suffixes[0])
    await produce_and_consume_on(a, prefixes[0], suffixes[0], "a0")
    await a.wait(lambda st: st.demotions == 1)
    # By reference, as the trigger sends it: the name is enough to reload.
    reply = await b.stub.PreInfer(named_prefetch(prefixes[0], "b0-p"), timeout=10)
    assert reply.outcome == pb.PreInferReply.RELOAD_SCHEDULED
    ranked = await b.stub.Rank(rank_request(prefixes[0], suffixes[0], "b0-r"), timeout=30)
    assert ranked.served_by in (pb.HBM_HIT, pb.INFLIGHT_JOIN)  # reloaded ahead of the call
    assert close(ranked.scores, want)
    # Neither tier holds user 1's psi: refused, and nothing is pre-inferred for it.
    produced = (await b.stats()).psi_produced
    for request in (
        preinfer_request(prefixes[1], "b1-p", prefetch_only=True),
        named_prefetch(prefixes[1], "b1-n"),
    ):
        refused = await b.stub.PreInfer(request, timeout=10)
        assert (refused.outcome, refused.reason) == (pb.PreInferReply.REFUSED, "not_held")
    await asyncio.sleep(0.2)
    assert (await b.stats()).psi_produced == produced


async def test_a_prefetch_nobody_reads_is_counted_wasted(stack, reference):
    _, (a, b), _ = stack
    prefixes, suffixes = batch(14, [Shape(3, 1100, 8, 16)])
    await produce_and_consume_on(a, prefixes[0], suffixes[0], "seed")
    await a.wait(lambda st: st.demotions == 1)
    # A prefetch on B under a lease that ends in 300 ms, and no ranking call.
    deadline = int(time.time() * 1e3) + 300
    reply = await b.stub.PreInfer(preinfer_request(prefixes[0], "b-p", deadline), timeout=10)
    assert reply.outcome == pb.PreInferReply.RELOAD_SCHEDULED
    stats = await b.wait(lambda st: st.prefetches_wasted == 1)
    assert (stats.prefetches_issued, stats.prefetches_used, stats.prefetches_failed) == (1, 0, 0)


async def test_fifty_concurrent_wants_cause_one_reload(stack, reference):
    _, (a, b), _ = stack
    prefixes, suffixes = batch(12, [Shape(3, 1500, 8, 16)])
    prefix, suffix = prefixes[0], suffixes[0]
    want = full_scores(reference, prefix, suffix)
    await produce_and_consume_on(a, prefix, suffix, "seed")
    await a.wait(lambda st: st.demotions == 1)
    replies = await asyncio.gather(
        *(b.stub.Rank(rank_request(prefix, suffix, f"c{i}"), timeout=60) for i in range(50))
    )
    served = [r.served_by for r in replies]
    reloads = b.proc.metric(b.metrics_port, "relaygr_ranker_reloads_total")
    notes = [r for r in b.proc.records() if r.get("level") in ("warning", "error")]
    # The reload counter is the ground truth: one copy from host DRAM for all 50 calls.
    assert reloads == 1, (served, reloads, notes)
    assert served.count(pb.DRAM_RELOAD) == 1
    assert pb.FULL_RECOMPUTE not in served
    assert all(close(r.scores, want) for r in replies)


async def test_expander_kill_never_fails_a_ranking_call(stack, reference):
    holder, rankers, sock = stack
    prefixes, suffixes = batch(13, [Shape(2, 400, 4, 8)] * 6)
    failures: list[BaseException] = []
    calls = {"before": 0, "after": 0}
    killed = asyncio.Event()
    done = asyncio.Event()

    async def traffic(ranker: Ranker, tag: str) -> None:
        r = 0
        while not done.is_set():
            for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True)):
                try:
                    await ranker.stub.PreInfer(preinfer_request(p, f"{tag}{r}-{i}-p"), timeout=10)
                    reply = await ranker.stub.Rank(rank_request(p, s, f"{tag}{r}-{i}-r"), timeout=30)
                    assert len(reply.scores) == s.candidates.numel()
                    calls["after" if killed.is_set() else "before"] += 1
                except Exception as exc:  # any failed call fails the test
                    failures.append(exc)
            r += 1

    async def kill_midway() -> None:
        await asyncio.sleep(0.5)
        holder["expander"].kill()
        killed.set()
        await asyncio.sleep(1.5)
        done.set()

    await asyncio.gather(*(traffic(r, f"t{n}-") for n, r in enumerate(rankers)), kill_midway())
    assert not failures
    assert calls["before"] > 0
    assert calls["after"] > 0
    for r in rankers:
        await r.wait(lambda s: not s.expander_connected)
    # A new daemon on the same socket: the rankers reconnect by themselves.
    holder["expander"] = start_expander(sock)
    for r in rankers:
        await r.wait(lambda s: s.expander_connected)
    reply = await rankers[0].stub.Rank(rank_request(prefixes[0], suffixes[0], "after"), timeout=30)
    assert close(reply.scores, full_scores(reference, prefixes[0], suffixes[0]))


async def test_psi_in_host_dram_is_never_reloaded_for_other_tokens(stack, reference):
    """Finding 3 through the DRAM tier: psi of prefix A is in host DRAM; a call with prefix B
    (same user, prefix version and length, one token changed) on the other ranker is ranked
    from B's tokens, with no reload; A's own call still reloads it."""
    _, (a, b), _ = stack
    prefixes, suffixes = batch(13, [Shape(3, 1000, 8, 16)])
    prefix, suffix = prefixes[0], suffixes[0]
    items = prefix.long_term.items.clone()
    items[-1] = (items[-1] + 1) % 1000
    lt = prefix.long_term
    other = UserPrefix(
        prefix.user_id, prefix.prefix_version, prefix.profile, Behaviors(items, lt.actions, lt.timestamps)
    )
    want, want_other = full_scores(reference, prefix, suffix), full_scores(reference, other, suffix)
    assert not close(want, want_other)  # serving A's psi to B would be caught
    await produce_and_consume_on(a, prefix, suffix, "seed")
    await a.wait(lambda st: st.demotions == 1)
    ranked = await b.stub.Rank(rank_request(other, suffix, "other"), timeout=30)
    assert ranked.served_by == pb.FULL_RECOMPUTE
    assert close(ranked.scores, want_other)
    assert (await b.stats()).reloads == 0
    ranked = await b.stub.Rank(rank_request(prefix, suffix, "own"), timeout=30)
    assert ranked.served_by == pb.DRAM_RELOAD
    assert close(ranked.scores, want)


@pytest.mark.parametrize("reserve_fraction", ["0.4", "0.001"])
async def test_under_pressure_dram_receives_what_hbm_drops_and_a_returning_user_reloads_it(
    tmp_path, reference, reserve_fraction
):
    """Demotion under pressure (the default): psi is copied to host DRAM only when HBM needs
    its room, least recently used first, and eviction takes it after the copy: nothing leaves
    HBM without a host copy, and DRAM holds what HBM no longer does. A reserve smaller than one
    psi (here 0.1% of the budget) still covers the largest psi admitted: else every eviction took a psi whose
    copy had not begun (CPU goodput run, tiny model: 336 of 336 evictions undemoted)."""
    sock = tmp_path / "run" / "expander.sock"
    expander = start_expander(sock)
    prefixes, suffixes = batch(21, [Shape(3, 1200, 8, 24)] * 3)
    psi_bytes = preset("tiny").psi_bytes(prefixes[0].length)
    # Room for two psis and a half; the reserve (one psi) starts a copy once two are held.
    budget_mb = 2.5 * psi_bytes / 2**20
    ranker = Ranker(
        sock, "--hbm-budget-mb", f"{budget_mb:.6f}", "--demotion-reserve-fraction", reserve_fraction
    )
    try:
        await ranker.wait(lambda s: s.expander_connected)
        want = [full_scores(reference, p, s) for p, s in zip(prefixes, suffixes, strict=True)]
        await produce_and_consume_on(ranker, prefixes[0], suffixes[0], "u0")
        await asyncio.sleep(0.2)
        assert (await ranker.stats()).demotions == 0  # room to spare: HBM only
        await produce_and_consume_on(ranker, prefixes[1], suffixes[1], "u1")
        await ranker.wait(lambda st: st.demotions == 1)  # the least recently used, user 0
        await produce_and_consume_on(ranker, prefixes[2], suffixes[2], "u2")  # evicts user 0's copy
        stats = await ranker.wait(lambda st: st.hbm_evictions == 1 and st.demotions == 2)
        assert stats.hbm_evicted_undemoted == 0
        ranked = await ranker.stub.Rank(rank_request(prefixes[0], suffixes[0], "u0-again"), timeout=30)
        assert ranked.served_by == pb.DRAM_RELOAD  # gone from HBM, back from DRAM
        assert close(ranked.scores, want[0])
        assert (await ranker.stats()).hbm_evicted_undemoted == 0
    finally:
        await ranker.channel.close()
        ranker.proc.stop()
        expander.stop()


async def test_a_ranker_warns_when_the_arena_holds_less_than_its_hbm(tmp_path):
    # With every consumed psi copied at once, HBM evicts its oldest psi, which an arena smaller
    # than HBM has already overwritten: a returning user is then recomputed, never reloaded. The
    # ranker says so when it connects (under pressure, the default, the tiers add up instead).
    sock = tmp_path / "run" / "expander.sock"
    expander = start_expander(sock)  # a 256 MiB arena
    eager = ("--demotion", "consumed")
    rankers = [Ranker(sock, "--hbm-budget-mb", "512", *eager), Ranker(sock, "--hbm-budget-mb", "128", *eager),
               Ranker(sock, "--hbm-budget-mb", "512")]  # fmt: skip
    try:
        for r in rankers:
            await r.wait(lambda s: s.expander_connected)
        warned = [
            [rec for rec in r.proc.records() if rec.get("event") == "host_tier_smaller_than_hbm"]
            for r in rankers
        ]
        assert len(warned[0]) == 1
        assert warned[0][0]["arena_bytes"] == 256 << 20
        assert warned[0][0]["hbm_budget_bytes"] == 512 << 20
        assert warned[1] == []  # 128 MiB of HBM fits the arena
        assert warned[2] == []  # under pressure DRAM holds what HBM drops
    finally:
        for r in rankers:
            await r.channel.close()
            r.proc.stop()
        expander.stop()


async def test_psi_stored_as_fp8_takes_half_the_bytes_and_ranks_within_its_rounding(tmp_path, reference):
    """--host-psi-format fp8: ranker A stores its consumed psi in the arena as float8 with
    per-group scales (a quarter of float32 psi's K/V bytes and the scales), ranker B reloads it;
    B's scores are full inference's within what e4m3's rounding of psi does to them."""
    sock = tmp_path / "run" / "expander.sock"
    expander = start_expander(sock)
    expander_metrics = expander.wait_event("expander_ready")["metrics_port"]
    a, b = (Ranker(sock, "--demotion", "consumed", "--host-psi-format", "fp8") for _ in range(2))
    try:
        for r in (a, b):
            await r.wait(lambda s: s.expander_connected)
        (prefix,), (suffix,) = batch(13, [Shape(3, 1200, 8, 24)])
        want = full_scores(reference, prefix, suffix)
        assert close((await produce_and_consume_on(a, prefix, suffix, "a0")).scores, want)
        await a.wait(lambda st: st.demotions == 1)
        spec = preset("tiny")
        plen = prefix.length
        # The daemon's gauges follow its store on each sweep: wait for the one after the commit.
        deadline = time.monotonic() + 10.0
        while not (stored := expander.metric(expander_metrics, 'relaygr_expander_bytes{kind="stored"}')):
            assert time.monotonic() < deadline, "the expander's stored bytes never showed the demotion"
            await asyncio.sleep(0.05)
        native = spec.psi_bytes(plen)
        fp8 = (
            2 * spec.num_layers * plen * spec.hidden
            + 2 * spec.num_layers * -(-plen // 16) * spec.num_heads * 4
        )
        assert stored == fp8 + 8 * plen < native / 3  # float32 K/V as 1 byte a value
        ranked = await b.stub.Rank(rank_request(prefix, suffix, "b0-r"), timeout=30)
        assert ranked.served_by == pb.DRAM_RELOAD
        got = list(ranked.scores)
        spread = (sum((x - sum(want) / len(want)) ** 2 for x in want) / len(want)) ** 0.5
        error = max(abs(x - y) for x, y in zip(got, want, strict=True))
        assert 0 < error < 0.25 * spread  # rounded, not lost: bench.psi_fp8 shows 0.03-0.1 of the spread
    finally:
        for r in (a, b):
            await r.channel.close()
            r.proc.stop()
        expander.stop()
