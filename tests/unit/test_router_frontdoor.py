"""The router's HTTP/2 frame relay: the frame layer on its own (parsing at any read boundary,
protocol errors, flow control both ways) and the front door on loopback (pass-through of health
checks and streams, large messages both ways, garbage on the port, a client that gives up, a
graceful shutdown). The routing behaviour itself runs against both front doors in
test_router_service.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.config import RouterConfig
from services.router.frontdoor import h2wire
from services.router.frontdoor.h2wire import (
    CONNECTION_PREFACE,
    Endpoint,
    frame,
    literal_block,
    settings_frame,
)
from services.router.frontdoor.relay import (
    FrontDoor,
    FrontDoorConnection,
    RelayReply,
    ResetBudget,
    grpc_frame,
    grpc_timeout,
    percent_decode,
    percent_encode,
    status_block,
    timeout_header,
)
from shared.config import ConfigError, load_config
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.unit.test_router_service import raw_rankers_routed, serve_healthy, start_router, target

# ---------------------------------------------------------------------- the frame layer


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


class Recorder(Endpoint):
    """Records what reaches the hooks."""

    def __init__(self, client_side: bool = False) -> None:
        self.client_side = client_side
        super().__init__()
        self.events: list[tuple] = []
        self.errors: list[int] = []

    def on_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        self.events.append(("headers", stream_id, block, end_stream))

    def on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        self.events.append(("data", stream_id, data, end_stream))

    def on_reset(self, stream_id: int, code: int) -> None:
        self.events.append(("reset", stream_id, code))

    def on_error(self, error: h2wire.H2Error) -> None:
        self.errors.append(error.code)


def connected(client_side: bool = False) -> tuple[Recorder, FakeTransport]:
    endpoint = Recorder(client_side)
    transport = FakeTransport()
    endpoint.connection_made(transport)  # type: ignore[arg-type]
    transport.written.clear()
    return endpoint, transport


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of every frame in `data`."""
    out, pos = [], 0
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        out.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5 : pos + 9], "big"),
                    bytes(data[pos + 9 : pos + 9 + length])))  # fmt: skip
        pos += 9 + length
    return out


def goaway_code(written: bytes) -> int | None:
    for frame_type, _, _, payload in frames(written):
        if frame_type == h2wire.GOAWAY:
            return struct.unpack_from(">II", payload)[1]
    return None


def test_literal_blocks_decode_to_the_same_headers():
    headers = [(b":path", b"/relaygr.v1.Ranker/Rank"), (b"grpc-timeout", b"100m"), (b"x-empty", b""),
               (b"x-long", bytes(range(32, 127)) * 3)]  # fmt: skip
    assert hpack.Decoder().decode(literal_block(headers), raw=True) == headers


def client_stream() -> bytes:
    """A client's preface, SETTINGS, a HEADERS block in two frames, padded DATA, then DATA ending
    the stream."""
    block = literal_block([(b":method", b"POST"), (b":path", b"/x")])
    padded = bytes((3,)) + b"hello" + b"\0\0\0"
    return (CONNECTION_PREFACE + settings_frame([(h2wire.INITIAL_WINDOW_SIZE, 1000)])
            + frame(h2wire.HEADERS, 0, 1, block[:5]) + frame(h2wire.CONTINUATION, h2wire.END_HEADERS, 1, block[5:])
            + frame(h2wire.DATA, h2wire.PADDED, 1, padded) + frame(h2wire.DATA, h2wire.END_STREAM, 1, b"!"))  # fmt: skip


def test_a_stream_parses_the_same_whatever_the_read_boundaries():
    whole, _ = connected()
    whole.data_received(client_stream())
    assert [e[0] for e in whole.events] == ["headers", "data", "data"]
    assert whole.events[1][2] == b"hello"
    assert whole.events[2][2:] == (b"!", True)
    assert whole.peer_window_init == 1000
    byte_by_byte, transport = connected()
    for i in range(len(client_stream())):
        byte_by_byte.data_received(client_stream()[i : i + 1])
    assert byte_by_byte.events == whole.events
    assert not transport.closed
    assert not byte_by_byte.errors


def test_settings_are_acknowledged_and_pings_answered():
    endpoint, transport = connected()
    endpoint.data_received(CONNECTION_PREFACE + settings_frame([]) + frame(h2wire.PING, 0, 0, b"12345678"))
    sent = frames(bytes(transport.written))
    assert (h2wire.SETTINGS, h2wire.ACK, 0, b"") in sent
    assert (h2wire.PING, h2wire.ACK, 0, b"12345678") in sent


@pytest.mark.parametrize(
    ("stream", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", h2wire.PROTOCOL_ERROR),
        (CONNECTION_PREFACE + frame(h2wire.DATA, 0, 1, bytes(h2wire.OUR_MAX_FRAME_SIZE + 1)), h2wire.FRAME_SIZE_ERROR),
        (CONNECTION_PREFACE + frame(h2wire.HEADERS, 0, 1, b"\x00") + frame(h2wire.PING, 0, 0, bytes(8)),
         h2wire.PROTOCOL_ERROR),  # a header block interrupted
        (CONNECTION_PREFACE + frame(h2wire.CONTINUATION, h2wire.END_HEADERS, 1, b""), h2wire.PROTOCOL_ERROR),
        (CONNECTION_PREFACE + frame(h2wire.HEADERS, h2wire.END_HEADERS, 2, b""), h2wire.PROTOCOL_ERROR),
        (CONNECTION_PREFACE + frame(h2wire.DATA, h2wire.PADDED, 1, b"\x09abc"), h2wire.PROTOCOL_ERROR),
        (CONNECTION_PREFACE + frame(h2wire.SETTINGS, 0, 0, b"\x00\x04"), h2wire.FRAME_SIZE_ERROR),
        (CONNECTION_PREFACE + settings_frame([(h2wire.INITIAL_WINDOW_SIZE, 1 << 31)]), h2wire.FLOW_CONTROL_ERROR),
        (CONNECTION_PREFACE + frame(h2wire.WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), h2wire.PROTOCOL_ERROR),
        (CONNECTION_PREFACE + frame(h2wire.PUSH_PROMISE, h2wire.END_HEADERS, 1, bytes(4)), h2wire.PROTOCOL_ERROR),
    ],
    ids=["http1", "frame-size", "interrupted-block", "lone-continuation", "even-stream", "bad-padding",
         "settings-size", "window-too-large", "zero-window-update", "push"],
)  # fmt: skip
def test_protocol_violations_close_the_connection_with_goaway(stream, code):
    endpoint, transport = connected()
    endpoint.data_received(stream)
    assert goaway_code(bytes(transport.written)) == code
    assert transport.closed
    assert endpoint.errors == [code]
    endpoint.data_received(frame(h2wire.PING, 0, 0, bytes(8)))  # nothing is read after the error
    assert endpoint.events == []


def test_a_failing_hook_costs_the_connection_not_the_process():
    class Broken(Recorder):
        def on_headers(self, stream_id, block, end_stream):
            raise RuntimeError("bug")

    endpoint, transport = Broken(), FakeTransport()
    endpoint.connection_made(transport)  # type: ignore[arg-type]
    endpoint.data_received(CONNECTION_PREFACE + frame(h2wire.HEADERS, h2wire.END_HEADERS, 1, b""))
    assert goaway_code(bytes(transport.written)) == h2wire.INTERNAL_ERROR
    assert transport.closed


def test_sending_waits_for_the_stream_and_connection_windows():
    endpoint, transport = connected(client_side=True)
    endpoint.data_received(
        settings_frame([(h2wire.INITIAL_WINDOW_SIZE, 10), (h2wire.MAX_FRAME_SIZE, 16_384)])
    )
    transport.written.clear()
    endpoint.open_send(1)
    trailers = literal_block([(b"grpc-status", b"0")])
    endpoint.send_message(1, bytes(range(25)), end_stream=True, trailers=trailers)
    endpoint.flush()
    assert frames(bytes(transport.written)) == [(h2wire.DATA, 0, 1, bytes(range(10)))]
    transport.written.clear()
    # The peer shrinks the initial window: the open stream's window follows (10 - 10 - 5 = -5).
    endpoint.data_received(settings_frame([(h2wire.INITIAL_WINDOW_SIZE, 5)]))
    endpoint.data_received(frame(h2wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 12)))  # window 7
    sent = [f for f in frames(bytes(transport.written)) if f[0] == h2wire.DATA]
    assert sent == [(h2wire.DATA, 0, 1, bytes(range(10, 17)))]
    transport.written.clear()
    endpoint.send_window = 3  # now the connection's window is the smaller one
    endpoint.data_received(frame(h2wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)))
    assert [f for f in frames(bytes(transport.written)) if f[0] == h2wire.DATA] == [
        (h2wire.DATA, 0, 1, bytes(range(17, 20)))
    ]
    transport.written.clear()
    endpoint.data_received(frame(h2wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 100)))
    assert frames(bytes(transport.written)) == [
        (h2wire.DATA, 0, 1, bytes(range(20, 25))),
        (h2wire.HEADERS, h2wire.END_STREAM | h2wire.END_HEADERS, 1, trailers),
    ]


def test_large_header_blocks_go_out_as_continuations():
    endpoint, transport = connected(client_side=True)
    block = literal_block([(b"x-big", bytes(40_000))])
    endpoint.send_headers(1, block, end_stream=True)
    endpoint.flush()
    sent = frames(bytes(transport.written))
    assert [f[0] for f in sent] == [h2wire.HEADERS, h2wire.CONTINUATION, h2wire.CONTINUATION]
    assert sent[0][1] == h2wire.END_STREAM
    assert sent[-1][1] == h2wire.END_HEADERS
    assert b"".join(f[3] for f in sent) == block


# ---------------------------------------------------------------------- gRPC details


def test_grpc_timeouts_parse_and_format():
    assert grpc_timeout(None) is None
    assert grpc_timeout(b"100m") == pytest.approx(0.1)
    assert grpc_timeout(b"2H") == 7200
    assert grpc_timeout(b"5S") == 5
    assert grpc_timeout(b"7n") == pytest.approx(7e-9)
    for bad in (b"", b"m", b"123456789m", b"10x", b"-1m", b"1.5S"):
        with pytest.raises(ValueError, match="malformed grpc-timeout"):
            grpc_timeout(bad)
    assert timeout_header(0.0001) == b"1m"
    assert timeout_header(2.5) == b"2500m"
    assert grpc_timeout(timeout_header(0.25)) == pytest.approx(0.25)


def test_status_messages_survive_percent_encoding():
    message = "prefix_required: 100% ünïcödé\nline two"
    encoded = percent_encode(message)
    assert all(0x20 <= b <= 0x7E for b in encoded)
    assert percent_decode(encoded) == message
    assert percent_decode(b"bad %zz and %4") == "bad %zz and %4"
    headers = dict(hpack.Decoder().decode(status_block(grpc.StatusCode.UNAVAILABLE, message), raw=True))
    assert headers[b"grpc-status"] == b"14"
    assert percent_decode(headers[b"grpc-message"]) == message


def test_the_relay_is_the_default_front_door():
    assert load_config(RouterConfig, ["--rankers", "h:1"]).relay_front_door
    assert not load_config(RouterConfig, ["--rankers", "h:1", "--front-door", "grpc"]).relay_front_door
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(RouterConfig, ["--rankers", "h:1", "--front-door", "auto"])


# ---------------------------------------------------------------------- the front door on loopback


@pytest.fixture
async def relayed():
    """Two raw rankers behind a router whose public port is the relay."""
    async with raw_rankers_routed("--front-door", "relay") as routed:
        yield routed


async def test_the_relay_owns_the_port_and_passes_health_checks_and_streams_through(relayed):
    router, _, channel = relayed
    assert router._front_door is not None
    stub = health_pb2_grpc.HealthStub(channel)
    checked = await stub.Check(health_pb2.HealthCheckRequest(service="relaygr.v1.Router"), timeout=5)
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)  # a server stream
    first = await watch.read()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    stats = await pb_grpc.RankerStub(channel).Stats(pb.StatsRequest(), timeout=5)
    assert stats.instance_id == router.instance_id
    assert router.registry.get_sample_value("relaygr_router_relay_passed_through_total") == 3
    assert router.registry.get_sample_value("relaygr_router_relay_connections") == 1


async def test_large_messages_cross_the_relay_intact_both_ways(relayed):
    """1 MB in, 600 KB out: far beyond gRPC's initial 64 KB windows on every hop."""
    _router, fakes, channel = relayed
    for fake in fakes:
        fake.rank_reply = pb.RankReply(scores=[0.25] * 150_000, instance_id=fake.name).SerializeToString()
    rank = channel.unary_unary("/relaygr.v1.Ranker/Rank")
    sent = []
    for user in range(4):
        request = pb.RankRequest(request_id=f"r{user}", user_id=user,
                                 candidates_le=bytes(range(256)) * 4096).SerializeToString()  # fmt: skip
        sent.append(request)
        reply = await rank(request, timeout=10)
        assert reply in {f.rank_reply for f in fakes}
    assert sorted(r for f in fakes for _, r in f.received) == sorted(sent)


async def test_garbage_on_the_port_costs_that_connection_only(relayed):
    router, _, channel = relayed
    loop = asyncio.get_running_loop()
    junk = {b"GET / HTTP/1.1\r\nHost: x\r\n\r\n": h2wire.PROTOCOL_ERROR,
            CONNECTION_PREFACE + b"\xff" * 64: h2wire.FRAME_SIZE_ERROR}  # fmt: skip
    for data, code in junk.items():
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            sock.setblocking(False)
            await loop.sock_sendall(sock, data)
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), 5):
                received += chunk  # the relay's SETTINGS, WINDOW_UPDATE, then GOAWAY and close
        assert goaway_code(received) == code
    for name in ("protocol_error", "frame_size_error"):
        errors = router.registry.get_sample_value(
            "relaygr_router_relay_protocol_errors_total", {"peer": "client", "code": name}
        )
        assert errors == 1
    reply = await channel.unary_unary("/relaygr.v1.Ranker/Rank")(
        pb.RankRequest(request_id="ok", user_id=3).SerializeToString(), timeout=5
    )
    assert pb.RankReply.FromString(reply).scores == [0.5]


class SlowRanker(pb_grpc.RankerServicer):
    """Answers Rank after `delay_s`, noting a call that its client cancelled."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.cancelled = asyncio.Event()
        self.server: grpc.aio.Server | None = None

    async def Rank(self, request, context):
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return pb.RankReply(scores=[2.0], instance_id="slow")

    async def start(self) -> int:
        self.server = grpc.aio.server()
        pb_grpc.add_RankerServicer_to_server(self, self.server)
        return await serve_healthy(self.server)


async def test_a_client_that_gives_up_cancels_the_forwarded_call():
    slow = SlowRanker(30.0)
    port = await slow.start()
    router = await start_router([target(port)], "--front-door", "relay")
    channel = grpc.aio.insecure_channel(target(router.port))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.RankerStub(channel).Rank(pb.RankRequest(request_id="x", user_id=1), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(slow.cancelled.wait(), 5)  # the relay reset the ranker's stream
    finally:
        await channel.close()
        await router.shutdown(grace_s=0.2)
        assert slow.server is not None
        await slow.server.stop(0)


async def test_shutdown_lets_calls_in_flight_finish():
    slow = SlowRanker(0.5)
    port = await slow.start()
    router = await start_router([target(port)], "--front-door", "relay")
    channel = grpc.aio.insecure_channel(target(router.port))
    try:
        call = asyncio.ensure_future(
            pb_grpc.RankerStub(channel).Rank(pb.RankRequest(request_id="x", user_id=1), timeout=10)
        )
        await asyncio.sleep(0.2)
        await router.shutdown(grace_s=5)
        assert (await call).instance_id == "slow"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", router.port), timeout=1).close()
    finally:
        await channel.close()
        assert slow.server is not None
        await slow.server.stop(0)


# A ranker's reply as the relay passes it on: status 200, one empty message, status OK.
EMPTY_REPLY = RelayReply(literal_block([(b":status", b"200")]), b"\x00\x00\x00\x00\x00",
                         literal_block([(b"grpc-status", b"0")]))  # fmt: skip


async def test_a_stream_cannot_be_reopened_or_continued_after_it_ended():
    release = asyncio.Event()

    async def handle_rank(message: bytes, timeout_s: float | None) -> RelayReply:
        await release.wait()
        return EMPTY_REPLY

    door = FrontDoor(handle_rank, "127.0.0.1:1", max_message_bytes=1 << 20)
    calls = valid_client_bytes()
    block = literal_block([(b":method", b"POST"), (b":path", b"/relaygr.v1.Ranker/Rank"),
                           (b"content-type", b"application/grpc")])  # fmt: skip
    for ended_by_reply in (False, True):
        conn, transport = FrontDoorConnection(door), FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.data_received(calls)  # three calls: the Rank calls wait in handle_rank
        await asyncio.sleep(0)
        if ended_by_reply:
            release.set()
            await asyncio.sleep(0.01)
        assert not transport.closed
        conn.data_received(frame(h2wire.HEADERS, h2wire.END_HEADERS | h2wire.END_STREAM, 1, block))
        assert goaway_code(bytes(transport.written)) == h2wire.PROTOCOL_ERROR
        conn.connection_lost(None)


# ---------------------------------------------------------------------- fuzz


def valid_client_bytes() -> bytes:
    """What a gRPC client sends for two Rank calls, a health check and a ping on one connection."""
    encoder = hpack.Encoder()
    message = pb.RankRequest(request_id="r", user_id=7).SerializeToString()
    framed = b"\x00" + struct.pack(">I", len(message)) + message
    out = CONNECTION_PREFACE + settings_frame([(h2wire.INITIAL_WINDOW_SIZE, 1 << 20)])
    for stream_id, path in ((1, b"/relaygr.v1.Ranker/Rank"), (3, b"/grpc.health.v1.Health/Check"),
                            (5, b"/relaygr.v1.Ranker/Rank")):  # fmt: skip
        block = encoder.encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                                (b":authority", b"x"), (b"content-type", b"application/grpc"),
                                (b"te", b"trailers"), (b"grpc-timeout", b"5S")])  # fmt: skip
        out += frame(h2wire.HEADERS, h2wire.END_HEADERS, stream_id, block)
        out += frame(h2wire.DATA, h2wire.END_STREAM, stream_id, framed)
    return (
        out + frame(h2wire.PING, 0, 0, bytes(8)) + frame(h2wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1000))
    )


async def test_malformed_client_bytes_never_hit_an_internal_error():
    """3,000 mutations of a valid client stream: each either works or closes the connection with a
    protocol-level code; none reaches the catch-all that answers INTERNAL_ERROR (a bug)."""
    import random

    async def handle_rank(message: bytes, timeout_s: float | None) -> RelayReply:
        pb.RankRequest.FromString(message)
        return EMPTY_REPLY

    door = FrontDoor(handle_rank, "127.0.0.1:1", max_message_bytes=1 << 20)
    valid = valid_client_bytes()
    rng = random.Random(5)
    codes: dict[int, int] = {}
    for _ in range(3000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            at = rng.randrange(24, len(data))
            if kind < 0.5:
                data[at] = rng.randrange(256)
            elif kind < 0.75:
                del data[at : at + rng.randint(1, 8)]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        conn = FrontDoorConnection(door)
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        cut = rng.randrange(1, len(data))
        conn.data_received(bytes(data[:cut]))
        conn.data_received(bytes(data[cut:]))
        await asyncio.sleep(0)  # let Rank tasks run and answer
        code = goaway_code(bytes(transport.written)) if transport.closed else None
        assert code != h2wire.INTERNAL_ERROR, f"internal error on input {bytes(data)!r}"
        outcome = -1 if code is None else code
        codes[outcome] = codes.get(outcome, 0) + 1
        conn.connection_lost(None)
    assert codes.get(-1, 0) > 0  # some inputs still work
    assert len(codes) > 2  # and several kinds of error were met


# ---------------------------------------------------------------------- per-stream errors and abuse

RANK_HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/relaygr.v1.Ranker/Rank"),
                (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]  # fmt: skip
RANK_DATA = grpc_frame(pb.RankRequest(request_id="r", user_id=7).SerializeToString())


def header_frames(stream_id: int, block: bytes, end_stream: bool = False, size: int = 16_384) -> bytes:
    """A header block as a client sends it: HEADERS, then CONTINUATIONs of `size` bytes."""
    parts = [block[i : i + size] for i in range(0, len(block), size)] or [b""]
    out = b""
    for i, part in enumerate(parts):
        flags = (h2wire.END_HEADERS if i == len(parts) - 1 else 0) | (
            h2wire.END_STREAM if end_stream and not i else 0
        )
        out += frame(h2wire.HEADERS if not i else h2wire.CONTINUATION, flags, stream_id, part)
    return out


def statuses(written: bytes) -> dict[int, tuple[int, str]]:
    """(grpc-status, grpc-message) of every stream the front door ended with a status."""
    out = {}
    for frame_type, flags, stream_id, payload in frames(written):
        if frame_type == h2wire.HEADERS and flags & h2wire.END_STREAM:
            fields = dict(hpack.Decoder().decode(payload, raw=True))  # the door's blocks are literals
            out[stream_id] = (int(fields[b"grpc-status"]), percent_decode(fields.get(b"grpc-message", b"")))
    return out


def open_connection(door: FrontDoor) -> tuple[FrontDoorConnection, FakeTransport]:
    conn, transport = FrontDoorConnection(door), FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(CONNECTION_PREFACE + settings_frame([]))
    return conn, transport


async def test_an_oversized_header_list_fails_its_own_stream_and_the_connection_goes_on():
    """Finding 4 on the frame level: stream 1 is in flight, stream 3 carries 100 KB of metadata
    (HEADERS + CONTINUATIONs, then its message), stream 5 names a table entry that stream 3's
    block added after its oversized field: 1 and 5 are served, 3 alone fails."""
    release = asyncio.Event()
    served = []

    async def handle_rank(message: bytes, timeout_s: float | None) -> RelayReply:
        served.append(message)
        await release.wait()
        return EMPTY_REPLY

    door = FrontDoor(handle_rank, "127.0.0.1:1", max_message_bytes=1 << 20)
    conn, transport = open_connection(door)
    encoder = hpack.Encoder()
    conn.data_received(
        header_frames(1, encoder.encode(RANK_HEADERS)) + frame(h2wire.DATA, h2wire.END_STREAM, 1, RANK_DATA)
    )
    big = encoder.encode([*RANK_HEADERS, (b"x-big", b"v" * 100_000), (b"x-after", b"kept")])
    conn.data_received(header_frames(3, big) + frame(h2wire.DATA, h2wire.END_STREAM, 3, RANK_DATA))
    following = encoder.encode([*RANK_HEADERS, (b"x-after", b"kept")])
    conn.data_received(header_frames(5, following) + frame(h2wire.DATA, h2wire.END_STREAM, 5, RANK_DATA))
    await asyncio.sleep(0)
    release.set()
    await asyncio.sleep(0.01)
    written = bytes(transport.written)
    assert not transport.closed
    assert goaway_code(written) is None
    ended = statuses(written)
    assert ended[1][0] == ended[5][0] == 0
    code, message = ended[3]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "exceeds the router's limit of 65536 bytes" in message
    assert (h2wire.RST_STREAM, 0, 3, struct.pack(">I", h2wire.NO_ERROR)) in frames(written)  # stop sending
    assert len(served) == 2
    conn.connection_lost(None)


def test_the_door_announces_its_header_list_limit():
    door = FrontDoor(lambda m, t: None, "127.0.0.1:1", max_message_bytes=1 << 20,  # type: ignore[arg-type,return-value]
                     max_header_list_bytes=4096)  # fmt: skip
    conn, transport = FrontDoorConnection(door), FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    settings = next(f for f in frames(bytes(transport.written)) if f[0] == h2wire.SETTINGS)[3]
    pairs = dict(struct.unpack_from(">HI", settings, i) for i in range(0, len(settings), 6))
    assert pairs[h2wire.MAX_HEADER_LIST_SIZE] == 4096


def test_a_continuation_flood_is_cut_off_at_the_block_cap_with_bounded_memory():
    """CVE-2024-27316: HEADERS then CONTINUATIONs that never end the block."""
    import tracemalloc

    cap = 65_536
    door = FrontDoor(lambda m, t: None, "127.0.0.1:1", max_message_bytes=1 << 20,  # type: ignore[arg-type,return-value]
                     max_header_list_bytes=16_384, max_header_block_bytes=cap)  # fmt: skip
    conn, transport = open_connection(door)
    chunk = bytes(16_384)
    fed = 0
    tracemalloc.start()
    try:
        conn.data_received(frame(h2wire.HEADERS, 0, 1, b"\x00\x7f\xff\xff\x03" + chunk[5:]))
        while not transport.closed and fed < 100 * cap:
            conn.data_received(frame(h2wire.CONTINUATION, 0, 1, chunk))
            fed += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert goaway_code(bytes(transport.written)) == h2wire.ENHANCE_YOUR_CALM
    assert fed <= cap  # the frame that crossed the cap was the last one read
    assert peak < 4 * cap


def test_a_flood_of_empty_continuations_is_cut_off():
    door = FrontDoor(lambda m, t: None, "127.0.0.1:1", max_message_bytes=1 << 20)  # type: ignore[arg-type,return-value]
    conn, transport = open_connection(door)
    conn.data_received(frame(h2wire.HEADERS, 0, 1, b"\x82") + frame(h2wire.CONTINUATION, 0, 1) * 10_000)
    assert goaway_code(bytes(transport.written)) == h2wire.ENHANCE_YOUR_CALM
    assert conn._block_frames <= 17


async def test_rapid_reset_is_cut_off_after_the_burst():
    """CVE-2023-44487: a call opened and reset at once, over and over, on one connection."""
    started = []

    async def handle_rank(message: bytes, timeout_s: float | None) -> RelayReply:
        started.append(message)
        await asyncio.sleep(60)
        return EMPTY_REPLY

    burst = 50
    door = FrontDoor(handle_rank, "127.0.0.1:1", max_message_bytes=1 << 20, reset_burst=burst,
                     reset_rate_per_s=0.001)  # fmt: skip
    conn, transport = open_connection(door)
    encoder = hpack.Encoder()
    attack = b"".join(
        header_frames(stream_id, encoder.encode(RANK_HEADERS)) + frame(h2wire.DATA, h2wire.END_STREAM, stream_id, RANK_DATA)
        + frame(h2wire.RST_STREAM, 0, stream_id, struct.pack(">I", h2wire.CANCEL))
        for stream_id in range(1, 2000, 2)
    )  # fmt: skip
    conn.data_received(attack)
    await asyncio.sleep(0)
    written = bytes(transport.written)
    assert goaway_code(written) == h2wire.ENHANCE_YOUR_CALM
    last_stream = next(struct.unpack_from(">I", p)[0] for t, _, _, p in frames(written) if t == h2wire.GOAWAY)
    assert last_stream == 2 * (burst + 1) - 1  # the 51st reset overdrew the budget
    assert not conn._ranks
    assert len(started) <= burst + 1


def test_the_reset_budget_refills_at_its_rate():
    now = [0.0]
    budget = ResetBudget(3, 2.0, clock=lambda: now[0])
    assert all(budget.spend() for _ in range(3))
    assert not budget.spend()  # overdrawn
    now[0] = 1.0  # +2 tokens (from -1)
    assert budget.spend()
    now[0] = 100.0  # refills to the burst, not beyond
    assert budget.spend(3)
    assert not budget.spend()


# ---------------------------------------------------------------------- the same on loopback


async def rank_calls(channel: grpc.aio.Channel, n: int, **kwargs) -> list[object]:
    rank = channel.unary_unary("/relaygr.v1.Ranker/Rank")
    request = pb.RankRequest(request_id="ok", user_id=3).SerializeToString()
    return await asyncio.gather(
        *(rank(request, timeout=10, **kwargs) for _ in range(n)), return_exceptions=True
    )


@pytest.mark.parametrize("door", ["relay", "grpc"])
async def test_a_100kb_metadata_header_fails_its_call_alone_on_either_front_door(door):
    """Finding 4 as found: one channel, calls in flight, one of them with a 100 KB header."""
    async with raw_rankers_routed("--front-door", door) as (router, _fakes, channel):
        others = asyncio.ensure_future(rank_calls(channel, 20))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary("/relaygr.v1.Ranker/Rank")(
                RANK_DATA[5:], timeout=10, metadata=(("x-big", "v" * 100_000),)
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        results = await others
        assert all(isinstance(r, bytes) for r in results), results
        assert all(isinstance(r, bytes) for r in await rank_calls(channel, 5))  # the channel still works
        if door == "relay":
            assert (
                router.registry.get_sample_value(
                    "relaygr_router_relay_refused_streams_total", {"reason": "header_list_too_large"}
                )
                == 1
            )
            assert router.registry.get_sample_value("relaygr_router_relay_connections") == 1


async def attack(port: int, payloads, limit_bytes: int) -> tuple[int, bool]:
    """Writes `payloads` (an iterator of bytes) on a raw connection until the router closes it or
    `limit_bytes` have gone; returns (bytes sent, whether the router cut the connection off)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    closed = asyncio.Event()

    async def drain_replies() -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65_536):
                pass
        closed.set()

    draining = loop.create_task(drain_replies())
    try:
        writer.write(CONNECTION_PREFACE + settings_frame([]))
        for payload in payloads:
            if closed.is_set() or sent >= limit_bytes:
                break
            writer.write(payload)
            sent += len(payload)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closed.wait(), 10)
        return sent, closed.is_set()
    finally:
        writer.close()
        draining.cancel()


async def test_a_rapid_reset_attacker_is_cut_off_and_other_clients_are_served():
    async with raw_rankers_routed("--reset-burst", "200") as (router, fakes, channel):
        encoder = hpack.Encoder()
        block = encoder.encode(RANK_HEADERS)

        def streams():
            for stream_id in range(1, 1 << 30, 2):
                yield (header_frames(stream_id, encoder.encode(RANK_HEADERS) if stream_id > 1 else block)
                       + frame(h2wire.DATA, h2wire.END_STREAM, stream_id, RANK_DATA)
                       + frame(h2wire.RST_STREAM, 0, stream_id, struct.pack(">I", h2wire.CANCEL)))  # fmt: skip

        served = asyncio.ensure_future(rank_calls(channel, 40))
        sent, cut_off = await attack(router.port, streams(), limit_bytes=50 << 20)
        assert cut_off
        assert all(isinstance(r, bytes) for r in await served)
        assert (
            router.registry.get_sample_value(
                "relaygr_router_relay_protocol_errors_total", {"peer": "client", "code": "enhance_your_calm"}
            )
            == 1
        )
        assert sum(len(f.received) for f in fakes) <= 40 + 201 + 5  # the attack reached rankers boundedly
        assert sent < 50 << 20


async def test_a_continuation_flood_is_cut_off_and_other_clients_are_served():
    async with raw_rankers_routed() as (router, _fakes, channel):
        first = frame(h2wire.HEADERS, 0, 1, literal_block(RANK_HEADERS) + b"\x00\x01a\x7f\xff\xff\xff\x01")

        def flood():
            yield first
            while True:
                yield frame(h2wire.CONTINUATION, 0, 1, bytes(16_384))

        served = asyncio.ensure_future(rank_calls(channel, 40))
        sent, cut_off = await attack(router.port, flood(), limit_bytes=64 << 20)
        assert cut_off
        assert sent < 64 << 20
        assert all(isinstance(r, bytes) for r in await served)
        assert (
            router.registry.get_sample_value(
                "relaygr_router_relay_protocol_errors_total", {"peer": "client", "code": "enhance_your_calm"}
            )
            == 1
        )
