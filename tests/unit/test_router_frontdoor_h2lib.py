"""The router's front door on the h2 library (--front-door h2, frontdoor/h2lib.py): on the frame
level (an oversized header list fails its own stream, rapid reset is cut off, a client reset
cancels the forwarded call, grpc-timeout reaches the router) and on loopback (health checks,
a server stream and Stats pass through; a 100 KB metadata header fails its call alone; large
messages cross both ways; a cancelled call reaches the ranker; shutdown lets calls finish). The
routing behaviour itself runs against every front door in test_router_service.py."""

from __future__ import annotations

import asyncio
import socket
import struct

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.config import RouterConfig
from services.router.frontdoor import h2wire
from services.router.frontdoor.h2lib import H2FrontDoor, H2FrontDoorConnection, ReplyHeaders
from services.router.frontdoor.h2wire import CONNECTION_PREFACE, frame, literal_block, settings_frame
from services.router.frontdoor.relay import RelayReply, percent_decode
from shared.config import load_config
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.unit.test_router_frontdoor import (
    EMPTY_REPLY,
    RANK_DATA,
    RANK_HEADERS,
    FakeTransport,
    SlowRanker,
    frames,
    goaway_code,
    header_frames,
    rank_calls,
)
from tests.unit.test_router_service import raw_rankers_routed, start_router, target

BOUND_S = 5.0  # upper bound for "eventually": never a speed claim


async def eventually(condition, what: str) -> None:
    """Polls `condition` until it holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND_S
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def open_connection(door: H2FrontDoor) -> tuple[H2FrontDoorConnection, FakeTransport]:
    conn, transport = H2FrontDoorConnection(door), FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(CONNECTION_PREFACE + settings_frame([]))
    return conn, transport


def statuses(written: bytes) -> dict[int, tuple[int, str]]:
    """(grpc-status, grpc-message) of every stream the door ended with a status. h2 encodes with
    its dynamic table: every header block is decoded, in order, by one decoder."""
    decoder, out = hpack.Decoder(), {}
    for frame_type, flags, stream_id, payload in frames(written):
        if frame_type != h2wire.HEADERS:
            continue
        assert flags & h2wire.END_HEADERS  # the door's blocks are small: no CONTINUATION
        fields = dict(decoder.decode(payload, raw=True))
        if flags & h2wire.END_STREAM:
            out[stream_id] = (int(fields[b"grpc-status"]), percent_decode(fields.get(b"grpc-message", b"")))
    return out


def rank_stream(encoder: hpack.Encoder, stream_id: int, *extra: tuple[bytes, bytes]) -> bytes:
    return header_frames(stream_id, encoder.encode([*RANK_HEADERS, *extra])) + frame(
        h2wire.DATA, h2wire.END_STREAM, stream_id, RANK_DATA
    )


# ---------------------------------------------------------------------- the frame level


async def test_an_oversized_header_list_fails_its_own_stream_and_the_connection_goes_on():
    """Stream 1 in flight, stream 3 with 100 KB of metadata, stream 5 naming a table entry that
    stream 3's block added after its oversized field: 1 and 5 are served, 3 alone fails."""
    release = asyncio.Event()
    served = []

    async def handle_rank(message: bytes, timeout_s: float | None) -> RelayReply:
        served.append(message)
        await release.wait()
        return EMPTY_REPLY

    refused: list[str] = []
    door = H2FrontDoor(handle_rank, "127.0.0.1:1", max_message_bytes=1 << 20, on_refused=refused.append)
    conn, transport = open_connection(door)
    encoder = hpack.Encoder()
    conn.data_received(rank_stream(encoder, 1))
    conn.data_received(rank_stream(encoder, 3, (b"x-big", b"v" * 100_000), (b"x-after", b"kept")))
    conn.data_received(rank_stream(encoder, 5, (b"x-after", b"kept")))
    await eventually(lambda: len(served) == 2, "streams 1 and 5 to reach the router")
    release.set()
    await eventually(lambda: len(statuses(bytes(transport.written))) == 3, "three statuses")
    written = bytes(transport.written)
    assert not transport.closed
    assert goaway_code(written) is None
    ended = statuses(written)
    assert ended[1][0] == ended[5][0] == 0
    code, message = ended[3]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "exceeds the router's limit of 65536 bytes" in message
    assert refused == ["header_list_too_large"]
    assert served == [RANK_DATA[5:]] * 2
    conn.connection_lost(None)


def test_the_door_announces_its_header_list_limit_and_cuts_a_connection_off_at_the_block_cap():
    door = H2FrontDoor(lambda m, t: None, "127.0.0.1:1", max_message_bytes=1 << 20,  # type: ignore[arg-type,return-value]
                       max_header_list_bytes=4096, max_header_block_bytes=8192)  # fmt: skip
    conn, transport = open_connection(door)
    settings = next(p for t, _, _, p in frames(bytes(transport.written)) if t == h2wire.SETTINGS and p)
    announced = dict(struct.unpack_from(">HI", settings, i) for i in range(0, len(settings), 6))
    assert announced[6] == 4096  # MAX_HEADER_LIST_SIZE
    conn.data_received(rank_stream(hpack.Encoder(), 1, (b"x-big", b"v" * 10_000)))
    assert goaway_code(bytes(transport.written)) == h2wire.ENHANCE_YOUR_CALM
    assert transport.closed


async def test_rapid_reset_is_cut_off_after_the_burst():
    """CVE-2023-44487: a call opened and reset at once, over and over, on one connection."""
    started = []

    async def handle_rank(message: bytes, timeout_s: float | None) -> RelayReply:
        started.append(message)
        await asyncio.sleep(60)
        return EMPTY_REPLY

    burst = 50
    errors: list[tuple[str, int]] = []
    door = H2FrontDoor(handle_rank, "127.0.0.1:1", max_message_bytes=1 << 20, reset_burst=burst,
                       reset_rate_per_s=0.001, on_protocol_error=lambda *e: errors.append(e))  # fmt: skip
    conn, transport = open_connection(door)
    encoder = hpack.Encoder()
    attack = b"".join(
        rank_stream(encoder, stream_id)
        + frame(h2wire.RST_STREAM, 0, stream_id, struct.pack(">I", h2wire.CANCEL))
        for stream_id in range(1, 2000, 2)
    )
    conn.data_received(attack)
    written = bytes(transport.written)
    assert goaway_code(written) == h2wire.ENHANCE_YOUR_CALM
    last_stream = next(struct.unpack_from(">I", p)[0] for t, _, _, p in frames(written) if t == h2wire.GOAWAY)
    assert last_stream == 2 * (burst + 1) - 1  # the 51st reset overdrew the budget
    assert errors == [("client", h2wire.ENHANCE_YOUR_CALM)]
    assert transport.closed
    conn.connection_lost(None)
    await asyncio.sleep(0)  # the started calls see their cancellation
    assert len(started) <= burst + 1


async def test_a_client_reset_cancels_the_call_and_grpc_timeout_reaches_the_router():
    timeouts: list[float | None] = []
    cancelled = asyncio.Event()

    async def handle_rank(message: bytes, timeout_s: float | None) -> RelayReply:
        timeouts.append(timeout_s)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return EMPTY_REPLY

    door = H2FrontDoor(handle_rank, "127.0.0.1:1", max_message_bytes=1 << 20)
    conn, transport = open_connection(door)
    encoder = hpack.Encoder()
    conn.data_received(rank_stream(encoder, 1, (b"grpc-timeout", b"250m")))
    conn.data_received(rank_stream(encoder, 3, (b"grpc-timeout", b"soon")))
    await eventually(lambda: timeouts == [0.25], "the call to reach the router")
    conn.data_received(frame(h2wire.RST_STREAM, 0, 1, struct.pack(">I", h2wire.CANCEL)))
    await asyncio.wait_for(cancelled.wait(), BOUND_S)
    code, message = statuses(bytes(transport.written))[3]
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "malformed grpc-timeout" in message
    assert not conn.busy
    assert not transport.closed
    conn.connection_lost(None)


def test_reply_blocks_decode_once_and_a_dynamic_table_reference_fails():
    headers = ReplyHeaders(max_list_bytes=65_536)
    block = literal_block([(b":status", b"200"), (b"content-type", b"application/grpc")])
    first = headers.decode(block)
    assert first == [(b":status", b"200"), (b"content-type", b"application/grpc")]
    assert headers.decode(block) is first  # cached: the same block is not decoded again
    assert headers.decode(b"\xbe") is None  # index 62: the first dynamic entry, which no block may name


def test_h2_is_a_front_door_choice():
    config = load_config(RouterConfig, ["--rankers", "h:1", "--front-door", "h2"])
    assert config.front_door == "h2"
    assert config.relay_front_door


# ---------------------------------------------------------------------- on loopback


@pytest.fixture
async def routed():
    """Two raw rankers behind a router whose public port is the h2-library relay."""
    async with raw_rankers_routed("--front-door", "h2") as pair:
        yield pair


async def test_health_checks_a_server_stream_and_stats_pass_through(routed):
    router, _, channel = routed
    assert isinstance(router._front_door, H2FrontDoor)
    stub = health_pb2_grpc.HealthStub(channel)
    checked = await stub.Check(health_pb2.HealthCheckRequest(service="relaygr.v1.Router"), timeout=5)
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    stats = await pb_grpc.RankerStub(channel).Stats(pb.StatsRequest(), timeout=5)
    assert stats.instance_id == router.instance_id
    assert router.registry.get_sample_value("relaygr_router_relay_passed_through_total") == 3
    assert router.registry.get_sample_value("relaygr_router_relay_connections") == 1


async def test_a_100kb_metadata_header_fails_its_call_alone(routed):
    router, _, channel = routed
    others = asyncio.ensure_future(rank_calls(channel, 20))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary("/relaygr.v1.Ranker/Rank")(
            RANK_DATA[5:], timeout=10, metadata=(("x-big", "v" * 100_000),)
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(isinstance(r, bytes) for r in await others)
    assert all(isinstance(r, bytes) for r in await rank_calls(channel, 5))  # the channel still works
    refused = router.registry.get_sample_value(
        "relaygr_router_relay_refused_streams_total", {"reason": "header_list_too_large"}
    )
    assert refused == 1
    assert router.registry.get_sample_value("relaygr_router_relay_connections") == 1


async def test_large_messages_cross_intact_both_ways(routed):
    """1 MB in, 600 KB out: beyond the first windows on every hop (the reply waits for them)."""
    _router, fakes, channel = routed
    for fake in fakes:
        fake.rank_reply = pb.RankReply(scores=[0.25] * 150_000, instance_id=fake.name).SerializeToString()
    rank = channel.unary_unary("/relaygr.v1.Ranker/Rank")
    sent = []
    for user in range(4):
        request = pb.RankRequest(request_id=f"r{user}", user_id=user,
                                 candidates_le=bytes(range(256)) * 4096).SerializeToString()  # fmt: skip
        sent.append(request)
        assert await rank(request, timeout=10) in {f.rank_reply for f in fakes}
    assert sorted(r for f in fakes for _, r in f.received) == sorted(sent)


async def test_a_client_that_gives_up_cancels_the_forwarded_call():
    slow = SlowRanker(30.0)
    port = await slow.start()
    router = await start_router([target(port)], "--front-door", "h2")
    channel = grpc.aio.insecure_channel(target(router.port))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RankerStub(channel).Rank(pb.RankRequest(request_id="x", user_id=1), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(slow.cancelled.wait(), BOUND_S)  # the upstream stream was reset
    finally:
        await channel.close()
        await router.shutdown(grace_s=0.2)
        assert slow.server is not None
        await slow.server.stop(0)


async def test_shutdown_lets_calls_in_flight_finish():
    slow = SlowRanker(0.5)
    port = await slow.start()
    router = await start_router([target(port)], "--front-door", "h2")
    channel = grpc.aio.insecure_channel(target(router.port))
    try:
        call = asyncio.ensure_future(
            pb_grpc.RankerStub(channel).Rank(pb.RankRequest(request_id="x", user_id=1), timeout=10)
        )
        door = router._front_door
        assert isinstance(door, H2FrontDoor)
        await eventually(lambda: any(c.busy for c in door.connections), "the call to reach the door")
        await router.shutdown(grace_s=5)
        assert (await call).instance_id == "slow"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", router.port), timeout=1).close()
    finally:
        await channel.close()
        assert slow.server is not None
        await slow.server.stop(0)
