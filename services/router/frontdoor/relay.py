"""The router's front door as an HTTP/2 frame relay (RELAYGR_ROUTER_FRONT_DOOR=relay).

The router's gRPC server (grpc.aio) then listens on a loopback port only, and this relay owns the
public port:

* Rank (unary, identity encoding) is served here: the request's message is handed to the router's
  placement and retry logic (RouterService.relay_rank), which sends it to a ranker over an
  `Upstream` connection of this module and returns the ranker's reply. The reply's header blocks
  and message go to the client as they came (see h2wire: upstream blocks are self-contained);
  errors become a trailers-only response with the router's status.
* Every other stream (health checks, reflection, Stats, PreInfer, a compressed Rank) is passed
  through, frame by frame, to the router's own gRPC server, which serves it as it always has.

Why: a grpc.aio hop costs ~0.6 ms of CPU per call on the build machine; this relay reads one
header block and one message per call and writes the reply through (bench/router.py compares the
two in one run).

With mutual TLS configured, the relay's listener and its connections to the rankers use it (ALPN
h2); the router's own gRPC server then listens in cleartext on loopback only, for the relay.

Errors cost as little as they can, as in grpcio: a header list over `max_header_list_bytes` fails
its own stream (trailers-only RESOURCE_EXHAUSTED saying why; the block is still decoded whole, so
the connection's HPACK state stays in step and its other streams go on). The connection is closed
only for what leaves it unusable or is abuse: a malformed header block (COMPRESSION_ERROR), a
header block over `max_header_block_bytes` (ENHANCE_YOUR_CALM, from h2wire), and a client that
makes the router start and abandon streams faster than its `ResetBudget` allows (its RST_STREAMs
and the streams refused for their headers or for concurrency: the rapid-reset attack,
CVE-2023-44487; ENHANCE_YOUR_CALM).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.router.frontdoor import h2wire
from services.router.frontdoor.h2headers import DecodedBlock, HeaderBlockError, HeaderDecoder
from services.router.frontdoor.h2wire import Endpoint, H2Error, literal_block
from shared.logging import get_logger

log = get_logger("router.frontdoor")

RANK_PATH = b"/relaygr.v1.Ranker/Rank"
ErrorHook = Callable[[str, int], None]
"""Told of every connection closed for a protocol violation: (peer, HTTP/2 error code), the
peer "client" (a front door connection) or "upstream" (a ranker, or the router's own server)."""
RefusalHook = Callable[[str], None]
"""Told of every client stream refused while its connection goes on, with the reason:
"header_list_too_large" or "too_many_streams"."""
_GRPC_CONTENT_TYPE = b"application/grpc"
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
# Request headers a pass-through stream drops (connection-specific: RFC 9113 8.2.2); the rest pass.
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}


def grpc_timeout(value: bytes | None) -> float | None:
    """Seconds from a grpc-timeout header ("100m", "5S": at most 8 digits and a unit); None when
    absent; raises ValueError when malformed."""
    if value is None:
        return None
    digits, unit = value[:-1], value[-1:]
    if not (1 <= len(digits) <= 8 and digits.isdigit() and unit in _TIMEOUT_UNITS):
        raise ValueError(f"malformed grpc-timeout {value!r}")
    return int(digits) * _TIMEOUT_UNITS[unit]


def timeout_header(seconds: float) -> bytes:
    """A grpc-timeout value for `seconds` (milliseconds, rounded up; at least 1)."""
    return b"%dm" % max(1, min(99_999_999, int(seconds * 1e3 + 0.999)))


def percent_encode(message: str) -> bytes:
    """grpc-message encoding: printable ASCII except '%' as is, everything else %XX of UTF-8."""
    out = bytearray()
    for byte in message.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def percent_decode(value: bytes) -> str:
    out = bytearray()
    i = 0
    while i < len(value):
        if value[i] == 0x25 and i + 2 < len(value) and _is_hex(value[i + 1 : i + 3]):
            out.append(int(value[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(value[i])
            i += 1
    return out.decode("utf-8", "replace")


def _is_hex(pair: bytes) -> bool:
    return len(pair) == 2 and all(c in b"0123456789abcdefABCDEF" for c in pair)


def status_block(code: grpc.StatusCode, message: str) -> bytes:
    """A trailers-only response: HTTP 200, gRPC status `code` with `message`."""
    headers = [(b":status", b"200"), (b"content-type", _GRPC_CONTENT_TYPE),
               (b"grpc-status", b"%d" % code.value[0])]  # fmt: skip
    if message:
        headers.append((b"grpc-message", percent_encode(message)))
    return literal_block(headers)


def grpc_frame(message: bytes) -> bytes:
    """One uncompressed gRPC length-prefixed message."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The exception a grpc.aio call raises, so the router's retry logic reads both transports alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass
class RelayReply:
    """A ranker's reply, as it goes back to the client: its header block, its DATA (the gRPC
    message with its 5-byte prefix) and its trailer block."""

    header_block: bytes
    data: bytes
    trailer_block: bytes


class StreamSink(Protocol):
    """Where a passed-through upstream stream's frames go."""

    def upstream_headers(self, block: bytes, end_stream: bool) -> None: ...
    def upstream_data(self, data: bytes, end_stream: bool) -> None: ...
    def upstream_reset(self, code: int) -> None: ...


class _Call:
    """One unary call on an Upstream: what has arrived of its reply."""

    __slots__ = ("data", "ended", "future", "header_block", "size")

    def __init__(self, future: asyncio.Future[RelayReply]) -> None:
        self.future = future
        self.ended = False  # the server closed the stream (END_STREAM or RST_STREAM), or we reset it
        self.header_block: bytes | None = None
        self.data: list[bytes] = []
        self.size = 0


class Upstream(Endpoint):
    """The client side of one connection to a gRPC server (a ranker, or the router's own server for
    passed-through streams). Announces HEADER_TABLE_SIZE 0, so every header block it receives
    can be forwarded to any other connection unchanged."""

    client_side = True

    def __init__(
        self, address: str, max_message_bytes: int, on_protocol_error: ErrorHook | None = None
    ) -> None:
        super().__init__()
        self.address = address
        self._on_protocol_error = on_protocol_error
        self.max_message_bytes = max_message_bytes
        # Table size 0 (announced): every block is self-contained. A reply's header list is only
        # read for its status; one over the block cap fails its call, not the connection.
        self._decoder = HeaderDecoder(self.max_header_block_bytes, max_table_size=0)
        self._next_stream = 1
        self._calls: dict[int, _Call] = {}
        self._sinks: dict[int, StreamSink] = {}
        self._request_blocks: dict[bytes, bytes] = {}  # path -> its constant request headers

    @property
    def usable(self) -> bool:
        return not self.closed and self.goaway_received is None and self._next_stream < (1 << 31) - 2

    def _open(self) -> int:
        if not self.usable:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.address}: connection closed")
        stream_id = self._next_stream
        self._next_stream += 2
        self.open_send(stream_id)
        return stream_id

    async def unary(self, path: bytes, message: bytes, timeout_s: float) -> RelayReply:
        """One unary gRPC call of `path` (b"/pkg.Service/Method") with the serialized `message`;
        the request's header block is built here (its constant part once per path)."""
        start = self._request_blocks.get(path)
        if start is None:
            start = self._request_blocks[path] = literal_block(
                ((b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                 (b":authority", self.address.encode()), (b"content-type", _GRPC_CONTENT_TYPE),
                 (b"te", b"trailers"))
            )  # fmt: skip
        block = start + literal_block(((b"grpc-timeout", timeout_header(timeout_s)),))
        return await self.call(block, grpc_frame(message), timeout_s)

    async def call(self, block: bytes, data: bytes, timeout_s: float) -> RelayReply:
        """One unary call: header `block`, `data` (a framed gRPC message); the reply, or
        grpc.aio.AioRpcError (UNAVAILABLE: not processed, safe to retry elsewhere)."""
        stream_id = self._open()
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future())
        self._calls[stream_id] = call
        self.send_headers(stream_id, block)
        self.send_message(stream_id, data, end_stream=True)
        self.flush()
        # A timer rather than asyncio.wait_for, which wraps every call in one more task.
        timer = loop.call_later(
            timeout_s, self._fail, stream_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        )
        try:
            return await call.future
        finally:
            timer.cancel()
            self._calls.pop(stream_id, None)
            if not call.ended and not self.closed:
                self.reset(stream_id)  # timed out or cancelled: the ranker can stop working on it
                self.flush()

    def open_stream(self, block: bytes, end_stream: bool, sink: StreamSink) -> int:
        """A passed-through stream: its frames go to `sink`; returns the stream id to send on."""
        stream_id = self._open()
        self._sinks[stream_id] = sink
        self.send_headers(stream_id, block, end_stream)
        self.flush()
        return stream_id

    def close_stream(self, stream_id: int) -> None:
        """The other side of a passed-through stream went away: reset it here."""
        if self._sinks.pop(stream_id, None) is not None and not self.closed:
            self.reset(stream_id)
            self.flush()

    # ------------------------------------------------------------------ from the server

    def _sink(self, stream_id: int, end_stream: bool) -> StreamSink | None:
        """The passed-through stream's sink, forgotten here when this frame ends the stream."""
        return self._sinks.pop(stream_id, None) if end_stream else self._sinks.get(stream_id)

    def _fail(self, stream_id: int, code: grpc.StatusCode, details: str) -> None:
        call = self._calls.pop(stream_id, None)
        if call is not None and not call.future.done():
            call.future.set_exception(rpc_error(code, details))

    def on_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        headers = _decode(self._decoder, block).headers
        sink = self._sink(stream_id, end_stream)
        if sink is not None:
            sink.upstream_headers(block, end_stream)
            return
        call = self._calls.get(stream_id)
        if call is None:
            return  # a call we gave up on
        if headers is None:
            call.ended = True
            self.reset(stream_id)
            self._fail(
                stream_id, grpc.StatusCode.INTERNAL, f"{self.address} sent a reply header list too large"
            )
            return
        call.ended = end_stream
        if call.header_block is None and not end_stream:
            call.header_block = block
            return
        if not end_stream:
            raise H2Error(h2wire.PROTOCOL_ERROR, "a third header block on a unary call")
        status, message = _status(headers)
        if call.header_block is None or status != 0:  # trailers-only, or a status after data
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            self._fail(stream_id, code, message)
            return
        del self._calls[stream_id]
        if not call.future.done():
            call.future.set_result(RelayReply(call.header_block, b"".join(call.data), block))

    def on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        sink = self._sink(stream_id, end_stream)
        if sink is not None:
            sink.upstream_data(data, end_stream)
            return
        call = self._calls.get(stream_id)
        if call is None:
            return
        call.size += len(data)
        call.ended = end_stream
        if call.size > self.max_message_bytes + 5:
            call.ended = True
            self.reset(stream_id)
            self._fail(stream_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"reply larger than {self.max_message_bytes} bytes")  # fmt: skip
            return
        call.data.append(data)
        if end_stream:  # a reply must end with trailers
            self._fail(
                stream_id, grpc.StatusCode.INTERNAL, f"{self.address} ended the reply without a status"
            )

    def on_reset(self, stream_id: int, code: int) -> None:
        sink = self._sinks.pop(stream_id, None)
        if sink is not None:
            sink.upstream_reset(code)
            return
        call = self._calls.get(stream_id)
        if call is not None:
            call.ended = True
        # REFUSED_STREAM: the server did no work on it (RFC 9113 8.7), so another instance may.
        grpc_code = grpc.StatusCode.UNAVAILABLE if code == h2wire.REFUSED_STREAM else grpc.StatusCode.INTERNAL
        self._fail(stream_id, grpc_code, f"{self.address} reset the stream (HTTP/2 error {code})")

    def on_goaway(self, last_stream_id: int, code: int, debug: bytes) -> None:
        # Streams above last_stream_id were not processed: safe to retry elsewhere.
        for stream_id in [s for s in self._calls if s > last_stream_id]:
            self._fail(stream_id, grpc.StatusCode.UNAVAILABLE, f"{self.address} is going away")
        for stream_id in [s for s in self._sinks if s > last_stream_id]:
            self._sinks.pop(stream_id).upstream_reset(h2wire.REFUSED_STREAM)

    def on_error(self, error: H2Error) -> None:
        log.warning("upstream_protocol_error", target=self.address, error=error.message)
        if self._on_protocol_error is not None:
            self._on_protocol_error("upstream", error.code)

    def on_lost(self, exc: Exception | None) -> None:
        for stream_id in list(self._calls):
            self._fail(stream_id, grpc.StatusCode.UNAVAILABLE, f"{self.address}: connection lost")
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.upstream_reset(h2wire.INTERNAL_ERROR)


def _decode(decoder: HeaderDecoder, block: bytes) -> DecodedBlock:
    """The block decoded; a malformed one is a connection error (COMPRESSION_ERROR)."""
    try:
        return decoder.decode(block)
    except HeaderBlockError as exc:
        raise H2Error(h2wire.COMPRESSION_ERROR, f"undecodable header block: {exc}") from None


def _status(headers: list[tuple[bytes, bytes]]) -> tuple[int, str]:
    status, message = 2, "reply without grpc-status"  # UNKNOWN
    for name, value in headers:
        if name == b"grpc-status":
            status = int(value) if value.isdigit() else 2
            if message == "reply without grpc-status":
                message = ""
        elif name == b"grpc-message":
            message = percent_decode(value)
    return status, message


class UpstreamPool:
    """One Upstream connection per target, opened on first use and again after it closes."""

    def __init__(
        self,
        max_message_bytes: int,
        connect_timeout_s: float = 1.0,
        on_protocol_error: ErrorHook | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.on_protocol_error = on_protocol_error
        self.ssl_context = ssl_context  # TLS to every target when given
        self.connect_timeout_s = connect_timeout_s
        self._connections: dict[str, Upstream] = {}
        self._connecting: dict[str, asyncio.Future[Upstream]] = {}

    async def get(self, target: str) -> Upstream:
        """A usable connection to `target` (host:port); AioRpcError UNAVAILABLE if none can be made."""
        upstream = self._connections.get(target)
        if upstream is not None and upstream.usable:
            return upstream
        pending = self._connecting.get(target)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(target))
            self._connecting[target] = pending
            pending.add_done_callback(lambda _f: self._connecting.pop(target, None))
        return await asyncio.shield(pending)

    async def _connect(self, target: str) -> Upstream:
        host, _, port = target.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Upstream(target, self.max_message_bytes, self.on_protocol_error),
                    host.strip("[]"),
                    int(port),
                    ssl=self.ssl_context,
                    server_hostname=host.strip("[]") if self.ssl_context is not None else None,
                ),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{target}: cannot connect ({exc!r})") from None
        self._connections[target] = upstream
        return upstream

    def close(self) -> None:
        for upstream in self._connections.values():
            upstream.close()
        self._connections.clear()


RankHandler = Callable[[bytes, float | None], Awaitable[RelayReply]]
"""(the RankRequest's bytes, the caller's timeout in seconds or None) -> the reply; raises
FrontDoorError for a status of the router's own."""


class FrontDoorError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ResetBudget:
    """A token bucket over the streams one client connection makes the router start and then
    abandon: `burst` at once, refilled at `per_s`. `spend` is False once the client has overdrawn
    it: the connection is then closed (ENHANCE_YOUR_CALM). Legitimate clients reset streams too (a
    call past its deadline): the defaults allow a sustained 100 per second on one connection."""

    __slots__ = ("_at", "_clock", "burst", "per_s", "tokens")

    def __init__(self, burst: int, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.per_s = per_s
        self.tokens = float(burst)
        self._clock = clock
        self._at = clock()

    def spend(self, cost: int = 1) -> bool:
        now = self._clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self._at) * self.per_s) - cost
        self._at = now
        return self.tokens >= 0


class _RankStream:
    __slots__ = ("parts", "size", "task", "timeout_s")

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.parts: list[bytes] = []
        self.size = 0
        self.task: asyncio.Task[None] | None = None


class _PassThrough:
    """A client stream relayed to the router's own gRPC server; the upstream's frames come back
    through the StreamSink methods."""

    __slots__ = ("door", "stream_id", "upstream", "upstream_stream")

    def __init__(self, door: FrontDoorConnection, stream_id: int, upstream: Upstream) -> None:
        self.door = door
        self.stream_id = stream_id
        self.upstream = upstream
        self.upstream_stream = 0

    def upstream_headers(self, block: bytes, end_stream: bool) -> None:
        self.door.relay_headers(self.stream_id, block, end_stream)

    def upstream_data(self, data: bytes, end_stream: bool) -> None:
        self.door.relay_data(self.stream_id, data, end_stream)

    def upstream_reset(self, code: int) -> None:
        self.door.relay_reset(self.stream_id, code)


class FrontDoorConnection(Endpoint):
    """The server side of one client connection."""

    def __init__(self, door: FrontDoor) -> None:
        super().__init__()
        self.door = door
        self.max_header_block_bytes = door.max_header_block_bytes
        self._decoder = HeaderDecoder(door.max_header_list_bytes)
        self._resets = ResetBudget(door.reset_burst, door.reset_rate_per_s)
        self._ranks: dict[int, _RankStream] = {}
        self._passed: dict[int, _PassThrough] = {}
        self._newest = 0  # the highest stream id this client has opened

    def local_settings(self) -> list[tuple[int, int]]:
        # The client's header blocks are decoded here, never forwarded as they are: let it use
        # its dynamic table (smaller blocks, cheaper to decode).
        # MAX_HEADER_LIST_SIZE is advisory (RFC 9113 6.5.2): a client that honours it fails an
        # oversized call itself; one that does not is answered RESOURCE_EXHAUSTED here.
        return [
            (key, value) for key, value in super().local_settings() if key != h2wire.HEADER_TABLE_SIZE
        ] + [
            (h2wire.MAX_CONCURRENT_STREAMS, self.door.max_concurrent_streams),
            (h2wire.MAX_HEADER_LIST_SIZE, self.door.max_header_list_bytes),
        ]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.door.connections.add(self)

    def on_lost(self, exc: Exception | None) -> None:
        self.door.connections.discard(self)
        if self.door.draining and not self.door.connections:
            self.door.all_closed.set()
        for stream in self._ranks.values():
            if stream.task is not None:
                stream.task.cancel()
        self._ranks.clear()
        passed, self._passed = self._passed, {}
        for link in passed.values():
            link.upstream.close_stream(link.upstream_stream)

    def on_error(self, error: H2Error) -> None:
        log.info("client_protocol_error", error=error.message)
        if self.door.on_protocol_error is not None:
            self.door.on_protocol_error("client", error.code)

    # ------------------------------------------------------------------ client frames

    def on_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        # Decoded first, whatever becomes of the stream: the HPACK state must follow every block.
        decoded = _decode(self._decoder, block)
        link = self._passed.get(stream_id)
        rank = self._ranks.get(stream_id)
        if link is None and rank is None:
            if stream_id <= self._newest:
                raise H2Error(h2wire.PROTOCOL_ERROR, f"stream {stream_id} reopened (STREAM_CLOSED)")
            self._newest = stream_id
        headers = decoded.headers
        if headers is None:
            self._refuse_headers(stream_id, decoded.size, len(block), end_stream)
            return
        if link is not None:  # the client's trailers on a passed-through stream
            link.upstream.send_headers(link.upstream_stream, literal_block(headers), end_stream)
            link.upstream.flush()
            return
        if rank is not None:
            if rank.task is not None or not end_stream:
                raise H2Error(h2wire.PROTOCOL_ERROR, "HEADERS after END_STREAM, or trailers without it")
            self._start_rank(stream_id, rank)
            return
        if len(self._ranks) + len(self._passed) >= self.door.max_concurrent_streams:
            self._refused("too_many_streams")
            self.reset(stream_id, h2wire.REFUSED_STREAM)
            return
        fields = dict(headers)
        if fields.get(b":method") != b"POST" or not fields.get(b"content-type", b"").startswith(
            _GRPC_CONTENT_TYPE
        ):
            self._answer(stream_id, grpc.StatusCode.UNIMPLEMENTED, "only gRPC calls are served here")
            return
        if self.door.draining:
            self.reset(stream_id, h2wire.REFUSED_STREAM)
            return
        encoding = fields.get(b"grpc-encoding", b"identity")
        if fields.get(b":path") == RANK_PATH and encoding == b"identity":
            try:
                timeout_s = grpc_timeout(fields.get(b"grpc-timeout"))
            except ValueError as exc:
                self._answer(stream_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
            rank = _RankStream(timeout_s)
            self._ranks[stream_id] = rank
            if end_stream:
                self._start_rank(stream_id, rank)
            return
        self._pass_through(stream_id, headers, end_stream)

    def on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        rank = self._ranks.get(stream_id)
        if rank is not None:
            if rank.task is not None:
                raise H2Error(h2wire.PROTOCOL_ERROR, "DATA after END_STREAM")
            rank.size += len(data)
            if rank.size > self.door.max_message_bytes + 5:
                del self._ranks[stream_id]
                self._answer(stream_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"request larger than {self.door.max_message_bytes} bytes")  # fmt: skip
                self.reset(stream_id, h2wire.NO_ERROR)  # stop sending the rest
                return
            rank.parts.append(data)
            if end_stream:
                self._start_rank(stream_id, rank)
            return
        link = self._passed.get(stream_id)
        if link is not None:
            link.upstream.send_message(link.upstream_stream, data, end_stream)
            link.upstream.flush()
        # DATA on a stream we answered already: ignored (the client may not have seen the answer)

    def on_reset(self, stream_id: int, code: int) -> None:
        rank = self._ranks.pop(stream_id, None)
        if rank is not None and rank.task is not None:
            rank.task.cancel()  # the client gave up: so does the forwarded call
        link = self._passed.pop(stream_id, None)
        if link is not None:
            link.upstream.close_stream(link.upstream_stream)
        self._spend()

    # ------------------------------------------------------------------ refusals

    def _spend(self, cost: int = 1) -> None:
        """Charges the client's ResetBudget; closes the connection once it is overdrawn."""
        if not self._resets.spend(cost):
            raise H2Error(h2wire.ENHANCE_YOUR_CALM, "too many streams reset or refused")

    def _refused(self, reason: str) -> None:
        if self.door.on_refused is not None:
            self.door.on_refused(reason)

    def _refuse_headers(self, stream_id: int, size: int, block_bytes: int, end_stream: bool) -> None:
        """Fails the one stream whose header list is over the limit: RESOURCE_EXHAUSTED (or, if
        its response has begun, RST_STREAM ENHANCE_YOUR_CALM, which gRPC reads the same); the
        connection goes on. Costs the client's budget by the block's size (decoding it cost us)."""
        limit = self.door.max_header_list_bytes
        log.info("client_header_list_too_large", stream=stream_id, size=size, limit=limit)
        self._refused("header_list_too_large")
        rank = self._ranks.pop(stream_id, None)
        if rank is not None and rank.task is not None:
            rank.task.cancel()
        link = self._passed.pop(stream_id, None)
        if link is not None:
            link.upstream.close_stream(link.upstream_stream)
        if stream_id in self._send:  # our response headers went out already
            self.reset(stream_id, h2wire.ENHANCE_YOUR_CALM)
        else:
            message = f"request header list of {size} bytes exceeds the router's limit of {limit} bytes"
            self._answer(stream_id, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            if not end_stream:
                self.reset(stream_id, h2wire.NO_ERROR)  # a complete response: stop sending the rest
        self._spend(1 + block_bytes // 4096)

    # ------------------------------------------------------------------ Rank

    def _start_rank(self, stream_id: int, rank: _RankStream) -> None:
        data = b"".join(rank.parts)
        rank.parts.clear()
        if len(data) < 5 or data[0] != 0 or int.from_bytes(data[1:5], "big") != len(data) - 5:
            del self._ranks[stream_id]
            self._answer(stream_id, grpc.StatusCode.INTERNAL if data[:1] not in (b"", b"\x00")
                         else grpc.StatusCode.INVALID_ARGUMENT,
                         "a Rank call carries exactly one uncompressed message")  # fmt: skip
            return
        rank.task = asyncio.ensure_future(self._serve_rank(stream_id, rank, data[5:]))

    async def _serve_rank(self, stream_id: int, rank: _RankStream, message: bytes) -> None:
        try:
            reply = await self.door.handle_rank(message, rank.timeout_s)
        except FrontDoorError as exc:
            if self._ranks.pop(stream_id, None) is not None:
                self._answer(stream_id, exc.code, exc.message)
            return
        except asyncio.CancelledError:
            return
        except Exception as exc:  # a bug must cost this call, not the connection
            log.error("rank_relay_failed", error=repr(exc))
            if self._ranks.pop(stream_id, None) is not None:
                self._answer(stream_id, grpc.StatusCode.INTERNAL, "router error")
            return
        if self._ranks.pop(stream_id, None) is None or self.closed:
            return
        self.send_headers(stream_id, reply.header_block)
        self.open_send(stream_id)
        self.send_message(stream_id, reply.data, end_stream=True, trailers=reply.trailer_block)
        self.flush()
        self._maybe_finish_drain()

    def _answer(self, stream_id: int, code: grpc.StatusCode, message: str) -> None:
        self.send_headers(stream_id, status_block(code, message), end_stream=True)
        self.flush()
        self._maybe_finish_drain()

    # ------------------------------------------------------------------ pass-through

    def _pass_through(self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        upstream = self.door.internal
        if upstream is None or not upstream.usable:
            self._answer(stream_id, grpc.StatusCode.UNAVAILABLE, "router is starting or stopping")
            return
        kept = [(name, value) for name, value in headers if name.lower() not in _HOP_BY_HOP]
        if self.door.on_pass_through is not None:
            self.door.on_pass_through()
        link = _PassThrough(self, stream_id, upstream)
        self._passed[stream_id] = link
        link.upstream_stream = upstream.open_stream(literal_block(kept), end_stream, link)

    def relay_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        if stream_id not in self._passed or self.closed:
            return
        if end_stream:
            del self._passed[stream_id]
            if stream_id in self._send:  # data queued behind the window goes first
                self.send_message(stream_id, b"", end_stream=True, trailers=block)
            else:
                self.send_headers(stream_id, block, end_stream=True)
        else:
            self.send_headers(stream_id, block)
            self.open_send(stream_id)
        self.flush()
        self._maybe_finish_drain()

    def relay_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        if stream_id not in self._passed or self.closed:
            return
        if end_stream:
            del self._passed[stream_id]
        self.send_message(stream_id, data, end_stream)
        self.flush()

    def relay_reset(self, stream_id: int, code: int) -> None:
        if self._passed.pop(stream_id, None) is not None and not self.closed:
            self.reset(stream_id, code)
            self.flush()

    # ------------------------------------------------------------------ shutdown

    @property
    def busy(self) -> bool:
        return bool(self._ranks or self._passed)

    def send_goaway_notice(self) -> None:
        """GOAWAY(NO_ERROR) naming the last stream accepted: the client opens new calls elsewhere
        (or on a new connection); the ones already here finish."""
        if self.closed:
            return
        self.send_goaway()
        if not self.busy:
            self.close()

    def _maybe_finish_drain(self) -> None:
        if self.door.draining and not self.busy:
            self.close()


class ClientConnection(Protocol):
    """What a front door asks of its client connections when it drains."""

    def send_goaway_notice(self) -> None: ...

    def close(self) -> None: ...


class FrontDoor:
    """The relay's listening socket and its connections."""

    def __init__(
        self,
        handle_rank: RankHandler,
        internal_target: str,
        max_message_bytes: int,
        max_concurrent_streams: int = 1000,
        on_protocol_error: ErrorHook | None = None,
        on_pass_through: Callable[[], None] | None = None,
        *,
        max_header_list_bytes: int = 65_536,
        max_header_block_bytes: int = 262_144,
        reset_burst: int = 1000,
        reset_rate_per_s: float = 100.0,
        on_refused: RefusalHook | None = None,
    ) -> None:
        """`max_header_list_bytes`: a client stream whose header list is larger fails alone;
        `max_header_block_bytes`: a header block larger than this closes its connection;
        `reset_burst` / `reset_rate_per_s`: each connection's ResetBudget."""
        self.handle_rank = handle_rank
        self.internal_target = internal_target
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self.max_header_list_bytes = max_header_list_bytes
        self.max_header_block_bytes = max_header_block_bytes
        self.reset_burst = reset_burst
        self.reset_rate_per_s = reset_rate_per_s
        self.on_refused = on_refused
        self.connections: set[ClientConnection] = set()
        self.internal: Upstream | None = None
        self.draining = False
        self.all_closed = asyncio.Event()  # set once draining and the last connection has closed
        self._server: asyncio.Server | None = None
        self.on_protocol_error = on_protocol_error
        self.on_pass_through = on_pass_through  # told of each stream relayed to the router's own server
        self._internal_pool = UpstreamPool(max_message_bytes, on_protocol_error=on_protocol_error)
        self._keeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Connects to the internal server, listens on host:port (TLS with `ssl_context`); returns
        the bound port."""
        self.internal = await self._internal_pool.get(self.internal_target)
        self._keeper = asyncio.ensure_future(self._keep_internal())
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port, ssl=ssl_context)
        return int(self._server.sockets[0].getsockname()[1])

    def _connection(self) -> asyncio.Protocol:
        """A new client connection's protocol."""
        return FrontDoorConnection(self)

    async def _keep_internal(self) -> None:
        """Reconnects to the router's own server if that connection ever closes."""
        while True:
            await asyncio.sleep(0.2)
            if self.internal is None or not self.internal.usable:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    self.internal = await self._internal_pool.get(self.internal_target)

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, tells every client GOAWAY, waits up to grace_s for their calls."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.send_goaway_notice()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.all_closed.wait(), grace_s)
        for conn in list(self.connections):
            conn.close()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        self._internal_pool.close()


__all__ = [
    "RANK_PATH",
    "FrontDoor",
    "FrontDoorError",
    "RelayReply",
    "ResetBudget",
    "Upstream",
    "UpstreamPool",
    "grpc_frame",
    "grpc_timeout",
    "percent_decode",
    "percent_encode",
    "rpc_error",
    "status_block",
    "timeout_header",
]
