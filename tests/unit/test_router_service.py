"""The router in process on the CPU: affinity (PreInfer and Rank on one instance, cached scores
equal to full inference), residency precedence, pass-through of client errors, retries on the next
instance (dead, overloaded, hung), membership loss, and no instance at all; requests and replies
forwarded byte for byte, malformed bytes refused, reflection and message-size limits kept. Every
test runs once per front door (gRPC server, HTTP/2 frame relay).

Real rankers (tiny preset) where scores matter; small fake rankers where only status codes do."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.ranker.config import RankerConfig
from services.ranker.service import RankerService
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.router.stats import RankLatencies, fleet_stats
from shared.broker import free_port
from shared.config import ConfigError, load_config
from shared.membership import Membership
from shared.placement import Instance, preference
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.rankers import preinfer_request, rank_request, users

TOL = 1e-5
BOUND_S = 20.0  # generous upper bound for "eventually" (membership changes): never a speed claim


@pytest.fixture(autouse=True, params=["grpc", "relay"])
def front_door(request, monkeypatch) -> str:
    """Every test here runs against every front door: the gRPC server, and the HTTP/2 frame relay
    that serves Rank itself and passes everything else to it."""
    monkeypatch.setenv("RELAYGR_ROUTER_FRONT_DOOR", request.param)
    return request.param


def target(port: int) -> str:
    return f"127.0.0.1:{port}"


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def start_router(targets: list[str], *extra: str) -> RouterService:
    config = load_config(
        RouterConfig,
        ["--rankers", ",".join(targets), "--consume-signals", "false", "--check-interval-s", "0.1", *extra],
    )
    router = RouterService(config)
    await router.start()
    return router


def idle(router: RouterService) -> list[Instance]:
    """The healthy instances with their loads zeroed: the pure rendezvous order."""
    return [Instance(i.id, 0.0) for i in router.membership.healthy()]


async def eventually(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"not within {BOUND_S}s: {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def rankers():
    services = [RankerService(load_config(RankerConfig, ["--device", "cpu"])) for _ in range(2)]
    for service in services:
        await service.start()
    yield services
    for service in services:
        await service.shutdown(grace_s=0.5)


@pytest.fixture
async def routed(rankers):
    # A large slack makes placement pure rendezvous hashing here, so tests can predict it (the
    # load bound itself is tested in test_placement.py).
    router = await start_router([target(r.port) for r in rankers], "--load-slack", "1000")
    channel = grpc.aio.insecure_channel(target(router.port))
    yield router, pb_grpc.RankerStub(channel), channel
    await channel.close()
    await router.shutdown(grace_s=0.5)


async def test_preinfer_then_rank_land_on_one_instance_and_equal_full(routed, rankers):
    router, stub, _ = routed
    for r in rankers:  # the reference full rankings must not leave psi: these prefixes are pre-inferred
        r.relay.ranking_psi_min_tokens = 0
    by_id = {r.instance_id: target(r.port) for r in rankers}
    prefixes, suffixes = users(11, 6, prefix_len=800)
    for p, s in zip(prefixes, suffixes, strict=True):
        full = await stub.Rank(rank_request(p, s, f"f{p.user_id}"), timeout=30)
        assert full.served_by == pb.FULL_RECOMPUTE
        pre = await stub.PreInfer(preinfer_request(p, f"p{p.user_id}"), timeout=5)
        assert pre.outcome == pb.PreInferReply.ACCEPTED
        assert by_id[pre.instance_id] == preference(p.user_id, idle(router))[0]
        resident = router.residency.lookup(p.user_id, p.prefix_version, time.monotonic())
        assert resident is not None
        assert resident.instance == by_id[pre.instance_id]
        holder = next(r for r in rankers if r.instance_id == pre.instance_id)
        # Resident first: a call that came earlier would join or take over the pre-inference.
        await eventually(lambda h=holder: h.cache.producing == 0, "psi produced")
        cached = await stub.Rank(rank_request(p, s, f"r{p.user_id}"), timeout=30)
        assert cached.instance_id == pre.instance_id
        assert cached.served_by == pb.HBM_HIT
        assert max_diff(cached.scores, full.scores) <= TOL
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    assert stats.instance_id == router.instance_id
    assert stats.model_version == rankers[0].model.model_version
    assert stats.rank_p99_ms > 0


async def test_residency_takes_precedence_over_the_hash(routed, rankers):
    router, stub, _ = routed
    by_target = {target(r.port): r.instance_id for r in rankers}
    prefixes, suffixes = users(12, 1, prefix_len=100)
    p, s = prefixes[0], suffixes[0]
    hashed = preference(p.user_id, idle(router))
    router.residency.record(
        p.user_id,
        p.prefix_version,
        hashed[1],
        time.monotonic() + 60,
        time.monotonic(),
        fingerprint=p.fingerprint.digest,
    )
    reply = await stub.Rank(rank_request(p, s, "a"), timeout=30)
    assert reply.instance_id == by_target[hashed[1]]
    # Another prefix version is another psi: the residency entry does not apply to it.
    other = rank_request(p, s, "b")
    other.prefix_version = other.prefix.prefix_version = p.prefix_version + 1
    reply = await stub.Rank(other, timeout=30)
    assert reply.instance_id == by_target[hashed[0]]


def by_reference_count(router: RouterService, result: str) -> float:
    return (
        router.registry.get_sample_value("relaygr_router_rank_by_reference_total", {"result": result}) or 0.0
    )


async def test_a_call_to_the_instance_holding_psi_goes_by_reference(routed, rankers):
    router, stub, _ = routed
    prefixes, suffixes = users(14, 1, prefix_len=600)
    p, s = prefixes[0], suffixes[0]
    full = await stub.Rank(rank_request(p, s, "f"), timeout=30)
    assert by_reference_count(router, "hit") == 0  # no residency: the call went as it came
    pre = await stub.PreInfer(preinfer_request(p, "p"), timeout=5)
    holder = next(r for r in rankers if r.instance_id == pre.instance_id)
    await eventually(lambda: holder.cache.used_bytes > 0 and holder.cache.producing == 0, "psi produced")
    cached = await stub.Rank(rank_request(p, s, "r"), timeout=30)
    assert cached.served_by == pb.HBM_HIT
    assert cached.instance_id == pre.instance_id
    assert max_diff(cached.scores, full.scores) <= TOL
    assert by_reference_count(router, "hit") == 1
    assert by_reference_count(router, "resent") == 0


async def test_a_reference_to_psi_that_is_gone_is_followed_by_the_whole_call(routed, rankers):
    router, stub, _ = routed
    by_target = {target(r.port): r.instance_id for r in rankers}
    prefixes, suffixes = users(15, 1, prefix_len=300)
    p, s = prefixes[0], suffixes[0]
    full = await stub.Rank(rank_request(p, s, "f"), timeout=30)
    # The map says psi is on an instance that does not have it (expired, evicted, restarted).
    holder = preference(p.user_id, idle(router))[1]
    router.residency.record(
        p.user_id,
        p.prefix_version,
        holder,
        time.monotonic() + 60,
        time.monotonic(),
        fingerprint=p.fingerprint.digest,
    )
    reply = await stub.Rank(rank_request(p, s, "r"), timeout=30)
    assert reply.instance_id == by_target[holder]
    assert reply.served_by == pb.FULL_RECOMPUTE
    assert max_diff(reply.scores, full.scores) <= TOL
    assert by_reference_count(router, "resent") == 1
    assert by_reference_count(router, "hit") == 0


async def test_ranking_by_reference_can_be_turned_off(rankers):
    router = await start_router([target(r.port) for r in rankers], "--rank-by-reference", "false")
    channel = grpc.aio.insecure_channel(target(router.port))
    try:
        stub = pb_grpc.RankerStub(channel)
        prefixes, suffixes = users(16, 1, prefix_len=200)
        p, s = prefixes[0], suffixes[0]
        holder = preference(p.user_id, idle(router))[1]
        router.residency.record(
            p.user_id,
            p.prefix_version,
            holder,
            time.monotonic() + 60,
            time.monotonic(),
            fingerprint=p.fingerprint.digest,
        )
        reply = await stub.Rank(rank_request(p, s, "r"), timeout=30)
        assert reply.served_by == pb.FULL_RECOMPUTE
        assert by_reference_count(router, "resent") == by_reference_count(router, "hit") == 0
    finally:
        await channel.close()
        await router.shutdown(grace_s=0.5)


async def test_bad_requests_pass_through_as_invalid_argument(routed):
    _, stub, channel = routed
    prefixes, suffixes = users(13, 1, prefix_len=50)
    good = rank_request(prefixes[0], suffixes[0], "ok")
    ragged = pb.RankRequest()
    ragged.CopyFrom(good)
    ragged.candidates_le = b"\x01\x02\x03"
    no_prefix = pb.RankRequest()
    no_prefix.CopyFrom(good)
    no_prefix.ClearField("prefix")
    for request, reason in ((ragged, "whole number"), (no_prefix, "prefix is required")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Rank(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PreInfer(pb.PreInferRequest(prefix=good.prefix), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in err.value.details()
    assert (await stub.Rank(good, timeout=30)).served_by == pb.FULL_RECOMPUTE
    check = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="relaygr.v1.Router"), timeout=5
    )
    assert check.status == health_pb2.HealthCheckResponse.SERVING


async def test_losing_an_instance_mid_traffic_every_call_still_succeeds(routed, rankers):
    router, stub, _ = routed
    victim, survivor = rankers
    prefixes, suffixes = users(14, 16, prefix_len=200)
    reqs = [rank_request(p, s, f"r{p.user_id}") for p, s in zip(prefixes, suffixes, strict=True)]
    before = await asyncio.gather(*(stub.Rank(r, timeout=30) for r in reqs))
    assert {r.instance_id for r in before} == {victim.instance_id, survivor.instance_id}

    during = asyncio.gather(*(stub.Rank(r, timeout=30) for r in reqs))
    await victim.shutdown(grace_s=0.2)
    assert all(r.scores for r in await during)
    after = await asyncio.gather(*(stub.Rank(r, timeout=30) for r in reqs))
    assert {r.instance_id for r in after} == {survivor.instance_id}
    for b, a in zip(before, after, strict=True):
        assert max_diff(a.scores, b.scores) <= TOL
    await eventually(
        lambda: [i.id for i in router.membership.healthy()] == [target(survivor.port)],
        "the stopped ranker leaves membership",
    )


async def test_a_failed_call_drops_the_instance_at_once_and_is_retried(rankers):
    """Health checks far apart: only the failed real call can tell the router the instance died."""
    victim, survivor = rankers
    router = await start_router([target(r.port) for r in rankers], "--check-interval-s", "600")
    try:
        channel = grpc.aio.insecure_channel(target(router.port))
        stub = pb_grpc.RankerStub(channel)
        prefixes, suffixes = users(16, 24, prefix_len=100)
        reqs = [rank_request(p, s, f"r{p.user_id}") for p, s in zip(prefixes, suffixes, strict=True)]
        order = idle(router)
        reqs.sort(key=lambda r: preference(r.user_id, order)[0] != target(victim.port))  # victim's first
        await victim.shutdown(grace_s=0.2)
        assert router.membership.is_healthy(target(victim.port))  # nobody has noticed yet
        replies = [await stub.Rank(r, timeout=30) for r in reqs]  # one by one: one failure is enough
        assert {r.instance_id for r in replies} == {survivor.instance_id}
        assert not router.membership.is_healthy(target(victim.port))
        assert router.metrics.retries.labels("rank")._value.get() == 1
        await channel.close()
    finally:
        await router.shutdown(grace_s=0.2)


async def test_no_healthy_instance_is_unavailable_with_a_clear_message():
    router = await start_router([target(free_port())])
    try:
        assert router.membership.healthy() == []
        channel = grpc.aio.insecure_channel(target(router.port))
        stub = pb_grpc.RankerStub(channel)
        prefixes, suffixes = users(15, 1, prefix_len=50)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Rank(rank_request(prefixes[0], suffixes[0], "x"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy ranker instance" in err.value.details()
        await channel.close()
    finally:
        await router.shutdown(grace_s=0.2)


# ---------------------------------------------------------------------- fake rankers


async def serve_healthy(server: grpc.aio.Server, port: int = 0) -> int:
    """Adds health checking (SERVING as a Ranker, so the router admits it), binds, starts."""
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await checker.set("relaygr.v1.Ranker", health_pb2.HealthCheckResponse.SERVING)
    return bound


class FakeRanker(pb_grpc.RankerServicer):
    """Answers Rank per `behavior`: "ok", "exhausted" (RESOURCE_EXHAUSTED) or "hang"."""

    def __init__(self, name: str, behavior: str) -> None:
        self.name = name
        self.behavior = behavior
        self.calls = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> int:
        self.server = grpc.aio.server()
        pb_grpc.add_RankerServicer_to_server(self, self.server)
        self.port = await serve_healthy(self.server, port)
        return self.port

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(0)

    async def Rank(self, request, context):
        self.calls += 1
        if self.behavior == "exhausted":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name} overloaded")
        if self.behavior == "hang":
            await asyncio.sleep(60)
        return pb.RankReply(scores=[1.0], instance_id=self.name)

    async def Stats(self, request, context):
        return pb.StatsReply(instance_id=self.name, rank_queue_depth=0)


@pytest.fixture
async def fakes(request):
    started = [FakeRanker(behavior, behavior) for behavior in request.param]
    for fake in started:
        await fake.start()
    yield started
    for fake in started:
        await fake.stop()


def requests_for(n: int) -> list[pb.RankRequest]:
    return [pb.RankRequest(request_id=f"r{u}", user_id=u) for u in range(n)]


@pytest.mark.parametrize("fakes", [["exhausted", "ok"]], indirect=True)
async def test_overloaded_instance_is_retried_on_the_next_and_stays_a_member(fakes):
    exhausted, ok = fakes
    router = await start_router([target(exhausted.port), target(ok.port)])
    try:
        channel = grpc.aio.insecure_channel(target(router.port))
        stub = pb_grpc.RankerStub(channel)
        replies = await asyncio.gather(*(stub.Rank(r, timeout=5) for r in requests_for(24)))
        assert {r.instance_id for r in replies} == {"ok"}
        assert exhausted.calls > 0
        assert router.membership.is_healthy(target(exhausted.port))
        assert router.metrics.retries.labels("rank")._value.get() == exhausted.calls
        await channel.close()
    finally:
        await router.shutdown(grace_s=0.2)


@pytest.mark.parametrize("fakes", [["exhausted", "exhausted", "exhausted"]], indirect=True)
@pytest.mark.parametrize("retries", [0, 1])
async def test_a_shedding_fleet_is_not_asked_more_than_overload_retries_times(fakes, retries):
    """Every instance refuses: each call costs 1 + overload_retries attempts, not one per
    instance, and the caller gets RESOURCE_EXHAUSTED with the instances' reasons."""
    router = await start_router([target(f.port) for f in fakes], "--overload-retries", str(retries))
    try:
        channel = grpc.aio.insecure_channel(target(router.port))
        stub = pb_grpc.RankerStub(channel)
        for request in requests_for(10):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Rank(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "overloaded" in err.value.details()
        assert sum(f.calls for f in fakes) == 10 * (1 + retries)
        await channel.close()
    finally:
        await router.shutdown(grace_s=0.2)


@pytest.mark.parametrize("fakes", [["hang", "ok"]], indirect=True)
async def test_hung_attempt_times_out_and_is_retried_within_the_callers_deadline(fakes):
    hang, ok = fakes
    router = await start_router([target(hang.port), target(ok.port)], "--rank-attempt-timeout-ms", "200")
    try:
        channel = grpc.aio.insecure_channel(target(router.port))
        stub = pb_grpc.RankerStub(channel)
        # Users whose first choice is the hung instance, chosen from the placement itself: the ports
        # are random, so a fixed list of users could (rarely) all hash to the other instance.
        first_hang = [u for u in range(1000) if preference(u, idle(router))[0] == target(hang.port)]
        requests = [pb.RankRequest(request_id=f"r{u}", user_id=u) for u in first_hang[:6]]
        replies = await asyncio.gather(*(stub.Rank(r, timeout=10) for r in requests + requests_for(6)))
        assert {r.instance_id for r in replies} == {"ok"}
        assert hang.calls > 0
        await channel.close()
    finally:
        await router.shutdown(grace_s=0.2)


@pytest.mark.parametrize("fakes", [["ok", "ok"]], indirect=True)
async def test_membership_drops_a_silent_instance_and_readmits_it_after_one_success(fakes):
    """No traffic at all: health checks alone drop a stopped instance and re-admit it when it is
    back on the same address."""
    gone, stays = fakes
    membership = Membership(
        [target(gone.port), target(stays.port)], check_interval_s=0.05, check_timeout_s=0.5, fail_after=2
    )
    await membership.start()
    try:
        assert {i.id for i in membership.healthy()} == {target(gone.port), target(stays.port)}
        assert membership.members() == (target(gone.port), target(stays.port))  # target-list order
        await gone.stop()
        await eventually(lambda: not membership.is_healthy(target(gone.port)), "stopped instance dropped")
        assert membership.is_healthy(target(stays.port))
        assert membership.members() == (target(stays.port),)
        gone.port = await gone.start(gone.port)
        await eventually(lambda: membership.is_healthy(target(gone.port)), "restarted instance re-admitted")
        assert membership.members() == tuple(i.id for i in membership.healthy())
        with pytest.raises(KeyError):
            membership.stub("127.0.0.1:1")
    finally:
        await membership.close()


@pytest.mark.parametrize("fakes", [["ok"]], indirect=True)
async def test_a_router_listed_as_a_ranker_never_joins(fakes):
    front = await start_router([target(fakes[0].port)])
    loop_router = await start_router([target(front.port)])
    try:
        assert front.membership.healthy() != []
        assert loop_router.membership.healthy() == []  # a router is not "relaygr.v1.Ranker"
    finally:
        await loop_router.shutdown(grace_s=0.2)
        await front.shutdown(grace_s=0.2)


def test_round_robin_placement_ignores_affinity_for_ranking_calls():
    config = load_config(RouterConfig, ["--rankers", "127.0.0.1:1,127.0.0.1:2", "--placement", "round_robin",
                                        "--consume-signals", "false"])  # fmt: skip
    router = RouterService(config)
    router.membership.healthy = lambda: [Instance("127.0.0.1:1", 0.0), Instance("127.0.0.1:2", 0.0)]  # type: ignore[method-assign]
    router.membership.members = lambda: ("127.0.0.1:1", "127.0.0.1:2")  # type: ignore[method-assign]
    firsts = {router.forwarder.place(42, 1, "rank").order[0] for _ in range(4)}
    assert firsts == {"127.0.0.1:1", "127.0.0.1:2"}  # one user, both instances
    signals = {router.forwarder.place(42, 1, "preinfer").order[0] for _ in range(4)}
    assert len(signals) == 1  # signals still hash


# ---------------------------------------------------------------------- pass-through (bytes)

UNKNOWN_FIELD = b"\xfa\x3e\x03abc"  # field 999, length-delimited: no message here declares it


class RawRanker:
    """A ranker that sees and answers bytes: records every Rank / PreInfer request as received and
    answers with fixed reply bytes (which carry a field the generated classes do not know)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[tuple[str, bytes]] = []
        self.rank_reply = pb.RankReply(scores=[0.5], instance_id=name).SerializeToString() + UNKNOWN_FIELD
        self.preinfer_reply = pb.PreInferReply(
            outcome=pb.PreInferReply.ACCEPTED, instance_id=name
        ).SerializeToString()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        async def rank(request: bytes, context) -> bytes:
            self.received.append(("Rank", request))
            return self.rank_reply

        async def preinfer(request: bytes, context) -> bytes:
            self.received.append(("PreInfer", request))
            return self.preinfer_reply

        async def stats(request, context):
            return pb.StatsReply(instance_id=self.name)

        self.server = grpc.aio.server()
        handlers = {
            "Rank": grpc.unary_unary_rpc_method_handler(rank),
            "PreInfer": grpc.unary_unary_rpc_method_handler(preinfer),
            "Stats": grpc.unary_unary_rpc_method_handler(
                stats, pb.StatsRequest.FromString, pb.StatsReply.SerializeToString
            ),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("relaygr.v1.Ranker", handlers),)
        )
        self.port = await serve_healthy(self.server)
        return self.port

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(0)


@contextlib.asynccontextmanager
async def raw_rankers_routed(
    *router_flags: str,
) -> AsyncIterator[tuple[RouterService, list[RawRanker], grpc.aio.Channel]]:
    """Two raw rankers ("a", "b") behind a router started with `router_flags`, and a client
    channel to the router; all stopped on exit."""
    fakes = [RawRanker("a"), RawRanker("b")]
    for fake in fakes:
        await fake.start()
    router = await start_router([target(f.port) for f in fakes], *router_flags)
    channel = grpc.aio.insecure_channel(target(router.port))
    try:
        yield router, fakes, channel
    finally:
        await channel.close()
        await router.shutdown(grace_s=0.2)
        for fake in fakes:
            await fake.stop()


@pytest.fixture
async def raw_pair():
    """Two raw rankers behind a router (pure rendezvous placement), and a client channel."""
    async with raw_rankers_routed("--load-slack", "1000") as pair:
        yield pair


def raw_method(channel: grpc.aio.Channel, name: str):
    return channel.unary_unary(f"/relaygr.v1.Ranker/{name}")


async def test_rank_is_forwarded_byte_for_byte_to_the_users_instance(raw_pair):
    router, fakes, channel = raw_pair
    by_target = {target(f.port): f for f in fakes}
    rank = raw_method(channel, "Rank")
    # Extreme ids, an unknown field, and fields out of order: all reach the ranker as sent.
    for user_id in (0, 1, 2**63, 2**64 - 1, 987_654_321):
        fields = pb.RankRequest(
            request_id=f"r{user_id}", user_id=user_id, prefix_version=3
        ).SerializeToString()
        request = pb.RankRequest(query_time=5).SerializeToString() + UNKNOWN_FIELD + fields
        reply = await rank(request, timeout=5)
        chosen = by_target[preference(user_id, idle(router))[0]]
        assert chosen.received[-1] == ("Rank", request)
        assert reply == chosen.rank_reply  # the unknown field too: nothing was re-serialised
    assert sum(len(f.received) for f in fakes) == 5  # one attempt each, nothing retried


async def test_preinfer_is_forwarded_byte_for_byte_and_recorded_from_the_bytes(raw_pair):
    router, fakes, channel = raw_pair
    preinfer = raw_method(channel, "PreInfer")
    user_id, version = 2**64 - 2, 9
    request = pb.PreInferRequest(
        request_id="p", prefix=pb.UserPrefix(user_id=user_id, prefix_version=version),
        lease_deadline_unix_ms=int(time.time() * 1e3) + 60_000,
    ).SerializeToString() + UNKNOWN_FIELD  # fmt: skip
    hashed = preference(user_id, idle(router))
    reply = await preinfer(request, timeout=5)
    by_target = {target(f.port): f for f in fakes}
    assert by_target[hashed[0]].received == [("PreInfer", request)]
    assert reply == by_target[hashed[0]].preinfer_reply
    resident = router.residency.lookup(user_id, version, time.monotonic())
    assert resident is not None
    assert resident.instance == hashed[0]
    assert resident.deadline > time.monotonic() + 50  # the lease read from the bytes, not the default
    # The user's ranking call follows the residency entry, even where the hash would differ.
    router.residency.record(
        user_id, version, hashed[1], time.monotonic() + 60, time.monotonic(), fingerprint=0
    )
    await raw_method(channel, "Rank")(
        pb.RankRequest(request_id="r", user_id=user_id, prefix_version=version).SerializeToString(), timeout=5
    )
    assert by_target[hashed[1]].received[-1][0] == "Rank"
    # A refused PreInfer is passed back as it came and records nothing.
    for fake in fakes:
        fake.preinfer_reply = pb.PreInferReply(
            outcome=pb.PreInferReply.REFUSED, reason="hbm_budget"
        ).SerializeToString()
    refused_request = pb.PreInferRequest(request_id="q", prefix=pb.UserPrefix(user_id=77, prefix_version=1))
    reply = await preinfer(refused_request.SerializeToString(), timeout=5)
    assert pb.PreInferReply.FromString(reply).reason == "hbm_budget"
    assert router.residency.lookup(77, 1, time.monotonic()) is None


@pytest.mark.parametrize(
    ("method", "request_bytes", "reason"),
    [
        ("Rank", b"\x16\x01", "malformed RankRequest: field 2: invalid wire type 6"),
        ("Rank", b"\x10\x80", "malformed RankRequest: truncated varint"),
        ("Rank", b"\x22\x10abc", "malformed RankRequest: field 4: length 16 runs past the end"),
        ("PreInfer", b"\x12\x04\x08\x01", "malformed PreInferRequest: field 2: length 4 runs past the end"),
        ("PreInfer", b"\x00", "malformed PreInferRequest: field number 0"),
    ],
)
async def test_malformed_bytes_are_invalid_argument_and_go_nowhere(raw_pair, method, request_bytes, reason):
    router, fakes, channel = raw_pair
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw_method(channel, method)(request_bytes, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in err.value.details()
    assert all(not f.received for f in fakes)
    assert router.metrics.latency_ms.labels(method.lower(), "invalid_argument")._sum.get() > 0
    # The router is unharmed: the next well-formed call is answered.
    await raw_method(channel, "Rank")(
        pb.RankRequest(request_id="ok", user_id=1).SerializeToString(), timeout=5
    )


@pytest.mark.parametrize("fakes", [["ok"]], indirect=True)
async def test_message_size_limit_still_applies(fakes):
    router = await start_router([target(fakes[0].port)], "--max-message-mb", "0.01")  # ~10 KB
    try:
        channel = grpc.aio.insecure_channel(target(router.port))
        rank = raw_method(channel, "Rank")
        small = pb.RankRequest(request_id="s", user_id=1, candidates_le=bytes(8 * 100)).SerializeToString()
        assert pb.RankReply.FromString(await rank(small, timeout=5)).instance_id == "ok"
        big = pb.RankRequest(request_id="b", user_id=1, candidates_le=bytes(8 * 4000)).SerializeToString()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rank(big, timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert fakes[0].calls == 1
        await channel.close()
    finally:
        await router.shutdown(grace_s=0.2)


async def test_reflection_still_describes_the_ranker_service(raw_pair):
    _, _, channel = raw_pair
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def ask(**request):
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(**request))
        await call.done_writing()
        return await call.read()

    listed = await ask(list_services="")
    assert "relaygr.v1.Ranker" in {s.name for s in listed.list_services_response.service}
    found = await ask(file_containing_symbol="relaygr.v1.Ranker")
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in found.file_descriptor_response.file_descriptor_proto]  # fmt: skip
    services = {svc.name: svc for f in files for svc in f.service}
    assert {m.name for m in services["Ranker"].method} == {"Rank", "PreInfer", "Stats"}
    assert {m.input_type for m in services["Ranker"].method} >= {".relaygr.v1.RankRequest"}


# ---------------------------------------------------------------------- health and Stats of the router


class CountingRanker(FakeRanker):
    """A fake ranker whose Stats report fixed counters."""

    async def Stats(self, request, context):
        return pb.StatsReply(instance_id=self.name, hbm_hits=15, hbm_misses=2, demotions=1, reloads=3,
                             psi_produced=20, psi_expired=4, preinfers_refused=5, hbm_evictable_bytes=7, hbm_evictions=3, hbm_released=1,
                             hbm_evicted_undemoted=1, prefetches_issued=6, prefetches_used=4, prefetches_wasted=1,
                             prefetches_failed=1, demotion_lag_p99_ms=2.0 if self.name == "a" else 5.0,
                             lead_time_p50_ms=10.0 if self.name == "a" else 30.0, psi_from_rankings=9,
                             ranking_psi_min_tokens=1024 if self.name == "a" else 512,
                             device_busy=0.3 if self.name == "a" else 0.6,
                             signal_trip_p90_ms=12.0 if self.name == "a" else 4.0,
                             preinfer_due_in_ms=[5.0, 40.0] if self.name == "a" else [20.0] * 300)  # fmt: skip


async def test_router_health_for_the_ranker_api_follows_membership():
    fakes = [FakeRanker("a", "ok"), FakeRanker("b", "ok")]
    for fake in fakes:
        await fake.start()
    router = await start_router([target(f.port) for f in fakes])
    channel = grpc.aio.insecure_channel(target(router.port))
    health_stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="relaygr.v1.Ranker")
    watch = health_stub.Watch(request, timeout=BOUND_S * 2)
    try:
        assert (await health_stub.Check(request, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await fakes[0].stop()  # one left: still serving
        await eventually(lambda: len(router.membership.healthy()) == 1, "one ranker left")
        assert (await health_stub.Check(request, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
        await fakes[1].stop()
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (
            await health_stub.Check(request, timeout=5)
        ).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await fakes[1].start(fakes[1].port)  # back: serving again
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        watch.cancel()
        await channel.close()
        await router.shutdown(grace_s=0.2)
        await fakes[1].stop()


async def test_router_stats_sum_the_rankers_counters():
    fakes = [CountingRanker("a", "ok"), CountingRanker("b", "ok")]
    for fake in fakes:
        await fake.start()
    router = await start_router([target(f.port) for f in fakes])
    channel = grpc.aio.insecure_channel(target(router.port))
    try:
        await eventually(lambda: len(router.membership.stats()) == 2, "both rankers polled")
        stats = await pb_grpc.RankerStub(channel).Stats(pb.StatsRequest(), timeout=5)
        assert stats.instance_id == router.instance_id
        assert (stats.hbm_hits, stats.hbm_misses, stats.demotions, stats.reloads) == (30, 4, 2, 6)
        assert (stats.psi_produced, stats.psi_expired, stats.preinfers_refused) == (40, 8, 10)
        assert stats.hbm_evictable_bytes == 14
        assert (stats.hbm_evictions, stats.hbm_released, stats.hbm_evicted_undemoted) == (6, 2, 2)
        assert (stats.prefetches_issued, stats.prefetches_used, stats.prefetches_wasted) == (12, 8, 2)
        assert stats.prefetches_failed == 2
        assert stats.demotion_lag_p99_ms == 5.0  # the slowest ranker's
        assert stats.psi_from_rankings == 18
        assert stats.ranking_psi_min_tokens == 512  # the smallest positive: some ranker keeps psi there
        assert stats.lead_time_p50_ms == 30.0
        assert stats.device_busy == pytest.approx(0.6)  # the busiest device's
        assert stats.signal_trip_p90_ms == pytest.approx(12.0)  # the slowest signal path's
        # Both rankers' pre-inference deadlines, merged earliest first, the first 256.
        assert list(stats.preinfer_due_in_ms) == [5.0] + [20.0] * 255
    finally:
        await channel.close()
        await router.shutdown(grace_s=0.2)
        for fake in fakes:
            await fake.stop()


def test_header_limits_are_validated():
    base = ["--rankers", "h:1"]
    config = load_config(RouterConfig, base)
    assert (config.max_header_list_bytes, config.max_header_block_bytes) == (65_536, 262_144)
    with pytest.raises(ConfigError, match="MAX_HEADER_BLOCK_BYTES must be >="):
        load_config(
            RouterConfig, [*base, "--max-header-list-bytes", "100000", "--max-header-block-bytes", "70000"]
        )
    with pytest.raises(ConfigError, match="1024-"):
        load_config(RouterConfig, [*base, "--max-header-list-bytes", "10"])
    with pytest.raises(ConfigError, match=">= 1"):
        load_config(RouterConfig, [*base, "--reset-burst", "0"])
    with pytest.raises(ConfigError, match="> 0"):
        load_config(RouterConfig, [*base, "--reset-rate-per-s", "0"])


def test_the_fleets_planned_psi_price_is_the_dearest_rankers_per_length():
    def plan(*prices: tuple[int, float]) -> pb.StatsReply:
        return pb.StatsReply(
            preinfer_plan=[pb.PreinferSample(prefix_len=n, device_ms=ms) for n, ms in prices]
        )

    merged = fleet_stats("router@x", [plan((256, 0.6), (4096, 2.1)), plan((4096, 4.0), (8192, 7.5)), plan()],
                         RankLatencies())  # fmt: skip
    assert [(p.prefix_len, p.device_ms) for p in merged.preinfer_plan] == [
        (256, 0.6),
        (4096, 4.0),
        (8192, 7.5),
    ]
    assert not fleet_stats("router@x", [], RankLatencies()).preinfer_plan
    hosts = [pb.StatsReply(host_ms_per_request=ms) for ms in (0.8, 1.4, 0.0)]
    assert fleet_stats("router@x", hosts, RankLatencies()).host_ms_per_request == 1.4  # the dearest host
