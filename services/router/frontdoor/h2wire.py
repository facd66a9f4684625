"""HTTP/2 for the router's frame relay (services/router/frontdoor/relay.py): frames, flow control and
header blocks, nothing gRPC-specific and no I/O policy.

Why not a full HTTP/2 stack: a forwarded Rank call through grpc.aio (or through the `h2`
library) decodes and re-encodes every frame and header on both connections and hands each event
between threads; on the 2-core build machine that is ~0.6-0.7 ms of CPU per call, most of what the
router adds (bench/router.py). A relay only needs to read the request's headers and message and
the reply's status: the reply's header blocks travel to the client unchanged. That works because
the router tells every upstream peer to use no HPACK dynamic table (SETTINGS_HEADER_TABLE_SIZE =
0), so each header block it receives is self-contained and valid on any connection.

`Endpoint` is one HTTP/2 connection as an asyncio protocol, client or server side:
* frames are parsed from a buffer with RFC 9113's limits (frame size, padding, CONTINUATION
  sequences, stream id rules); a violation is a connection error: GOAWAY with its code, then close;
* a header block being assembled (HEADERS + CONTINUATIONs) is bounded in bytes and in frames
  (`max_header_block_bytes`): past either, the connection is closed with ENHANCE_YOUR_CALM, so an
  endless CONTINUATION sequence (CVE-2024-27316) costs at most that much memory;
* flow control both ways: what we send waits for the peer's windows (stream and connection) and is
  queued meanwhile; what we receive is acknowledged in large steps against the big windows we
  advertise (the router's memory bound is the message size limit, enforced by the subclass);
* writes made while handling one read are coalesced into one socket write;
* SETTINGS, PING and WINDOW_UPDATE are answered here; a subclass sees only complete header
  blocks, data, resets, GOAWAY and the connection's end.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from collections.abc import Iterable
from typing import cast

__all__ = [
    "CONNECTION_PREFACE",
    "ENHANCE_YOUR_CALM",
    "H2_ERROR_NAMES",
    "Endpoint",
    "H2Error",
    "literal_block",
]

CONNECTION_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
# Flags.
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Settings.
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 2, 3, 4, 5
MAX_HEADER_LIST_SIZE = 6
# Error codes.
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB

H2_ERROR_NAMES = {
    NO_ERROR: "no_error", PROTOCOL_ERROR: "protocol_error", INTERNAL_ERROR: "internal_error",
    FLOW_CONTROL_ERROR: "flow_control_error", FRAME_SIZE_ERROR: "frame_size_error",
    REFUSED_STREAM: "refused_stream", CANCEL: "cancel", COMPRESSION_ERROR: "compression_error",
    ENHANCE_YOUR_CALM: "enhance_your_calm",
}  # fmt: skip

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
# What we accept: the default frame size (every peer must send at most this until told more).
OUR_MAX_FRAME_SIZE = DEFAULT_FRAME_SIZE
# Received bytes are acknowledged once this much is unacknowledged (per stream and connection);
# the windows we advertise are MAX_WINDOW, so a sender never waits on us in practice.
_REPLENISH_AT = 1 << 24
# A header block's frames average at least this many bytes, or the connection is closed: empty
# CONTINUATIONs cost CPU without ever reaching the byte cap.
_MIN_BLOCK_BYTES_PER_FRAME = 1024


class H2Error(Exception):
    """A connection error: the connection is closed with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def frame(frame_type: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, frame_type, flags, stream_id) + payload


def settings_frame(pairs: Iterable[tuple[int, int]]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", key, value) for key, value in pairs))


def _hpack_length(value: bytes) -> bytes:
    """An HPACK string (not Huffman-coded): 7-bit prefix length, then the bytes."""
    n = len(value)
    if n < 127:
        return bytes((n,)) + value
    out = bytearray((127,))
    n -= 127
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out) + value


def literal_block(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """An HPACK header block of literals without indexing (RFC 7541 6.2.2): touches no dynamic
    table, so it is valid on any connection whatever was sent there before."""
    return b"".join(b"\x00" + _hpack_length(name) + _hpack_length(value) for name, value in headers)


class _SendStream:
    """Send-side state of one stream: its window and what waits for it."""

    __slots__ = ("closed", "queue", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.queue: deque[tuple[bytes, bool, bytes | None]] = deque()  # (data, end, trailers)
        self.closed = False


class Endpoint(asyncio.Protocol):
    """One HTTP/2 connection (see the module doc). Subclasses implement the `on_*` hooks."""

    client_side = False
    max_header_block_bytes = 1 << 20
    """The most bytes one header block (HEADERS + CONTINUATIONs) may carry; more is a connection
    error (ENHANCE_YOUR_CALM). A subclass or instance may set its own."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._awaiting_preface = not self.client_side
        self._out: list[bytes] = []
        self._reading = False
        self._closed = False
        self.peer_window_init = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME_SIZE
        self.send_window = DEFAULT_WINDOW  # the connection's, towards the peer
        self._send: dict[int, _SendStream] = {}
        self._blocked: deque[int] = deque()  # streams with queued data, in arrival order
        self._recv_unacked = 0
        self._stream_unacked: dict[int, int] = {}
        self._block: bytearray | None = None  # a header block being assembled
        self._block_stream = 0
        self._block_end_stream = False
        self._block_frames = 0
        self.last_peer_stream = 0  # the highest stream id the peer opened
        self.goaway_received: int | None = None  # the peer's last-stream-id once it sent GOAWAY

    # ------------------------------------------------------------------ transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = settings_frame(self.local_settings())
        self._write((CONNECTION_PREFACE + hello) if self.client_side else hello)
        self._write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW)))
        self._flush()

    def local_settings(self) -> list[tuple[int, int]]:
        """What we announce. HEADER_TABLE_SIZE 0: the peer's header blocks are self-contained."""
        return [
            (HEADER_TABLE_SIZE, 0),
            (ENABLE_PUSH, 0),
            (INITIAL_WINDOW_SIZE, MAX_WINDOW),
            (MAX_FRAME_SIZE, OUR_MAX_FRAME_SIZE),
        ]

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.on_lost(exc)

    def _write(self, data: bytes) -> None:
        self._out.append(data)

    def _flush(self) -> None:
        if self._out and self.transport is not None and not self._closed:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def flush(self) -> None:
        """Sends what was written outside a read callback (reads flush when they end)."""
        if not self._reading:
            self._flush()

    def send_goaway(self, code: int = NO_ERROR, message: str = "") -> None:
        """GOAWAY(code) naming the last stream the peer opened: it opens no new ones here."""
        if self._closed or self.transport is None:
            return
        payload = struct.pack(">II", self.last_peer_stream, code) + message.encode()[:256]
        self._write(frame(GOAWAY, 0, 0, payload))
        self.flush()

    def close(self, code: int = NO_ERROR, message: str = "") -> None:
        """GOAWAY(code) and close (idempotent)."""
        if self._closed or self.transport is None:
            return
        self.send_goaway(code, message)
        self._flush()
        self._closed = True
        self.transport.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ reading

    def data_received(self, data: bytes) -> None:
        self._reading = True
        try:
            self._parse(data)
        except H2Error as exc:
            self.on_error(exc)
            self.close(exc.code, exc.message)
        except Exception as exc:  # a bug here must cost this connection, never the service
            self.on_error(H2Error(INTERNAL_ERROR, f"internal error: {exc!r}"))
            self.close(INTERNAL_ERROR, "internal error")
        finally:
            self._reading = False
            self._flush()

    def _parse(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        pos = 0
        if self._awaiting_preface:
            if len(buf) < len(CONNECTION_PREFACE):
                if not CONNECTION_PREFACE.startswith(bytes(buf)):
                    raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if bytes(buf[:24]) != CONNECTION_PREFACE:
                raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._awaiting_preface = False
            pos = 24
        end = len(buf)
        while end - pos >= 9 and not self._closed:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if length > OUR_MAX_FRAME_SIZE:
                raise H2Error(FRAME_SIZE_ERROR, f"frame of {length} bytes (limit {OUR_MAX_FRAME_SIZE})")
            if end - pos - 9 < length:
                break
            frame_type = buf[pos + 3]
            flags = buf[pos + 4]
            stream_id = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9 : pos + 9 + length])
            pos += 9 + length
            self._frame(frame_type, flags, stream_id, payload)
        del buf[:pos]

    def _frame(self, frame_type: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and (frame_type != CONTINUATION or stream_id != self._block_stream):
            raise H2Error(PROTOCOL_ERROR, "header block interrupted")
        if frame_type == DATA:
            self._data(flags, stream_id, payload)
        elif frame_type == HEADERS:
            self._headers(flags, stream_id, payload)
        elif frame_type == CONTINUATION:
            if self._block is None:
                raise H2Error(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._block += payload
            self._block_frames += 1
            self._check_block()
            if flags & END_HEADERS:
                self._end_block()
        elif frame_type == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif frame_type == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif frame_type == PING:
            if stream_id or len(payload) != 8:
                raise H2Error(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif frame_type == RST_STREAM:
            if not stream_id or len(payload) != 4:
                raise H2Error(PROTOCOL_ERROR, "bad RST_STREAM")
            if not self.client_side and stream_id > self.last_peer_stream:
                raise H2Error(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")  # RFC 9113 6.4
            self._forget(stream_id)
            self.on_reset(stream_id, int.from_bytes(payload, "big"))
        elif frame_type == GOAWAY:
            if stream_id or len(payload) < 8:
                raise H2Error(PROTOCOL_ERROR, "bad GOAWAY")
            last, code = struct.unpack_from(">II", payload)
            self.goaway_received = last & 0x7FFFFFFF
            self.on_goaway(last & 0x7FFFFFFF, code, payload[8:])
        elif frame_type == PUSH_PROMISE:
            raise H2Error(PROTOCOL_ERROR, "PUSH_PROMISE (push is disabled)")
        elif frame_type == PRIORITY and len(payload) != 5:
            raise H2Error(FRAME_SIZE_ERROR, "bad PRIORITY")
        # Unknown frame types are ignored (RFC 9113 4.1).

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise H2Error(PROTOCOL_ERROR, "padding exceeds the frame")
        return payload[1 : len(payload) - payload[0]]

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2Error(PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise H2Error(FRAME_SIZE_ERROR, "HEADERS priority block truncated")
            payload = payload[5:]
        if not self.client_side and stream_id > self.last_peer_stream:
            if stream_id % 2 == 0:
                raise H2Error(PROTOCOL_ERROR, "a client opened an even stream id")
            self.last_peer_stream = stream_id
        self._block = bytearray(payload)
        self._block_stream = stream_id
        self._block_end_stream = bool(flags & END_STREAM)
        self._block_frames = 1
        self._check_block()
        if flags & END_HEADERS:
            self._end_block()

    def _check_block(self) -> None:
        """The bounds on a header block being assembled (see the module doc)."""
        assert self._block is not None
        size, cap = len(self._block), self.max_header_block_bytes
        if size > cap:
            raise H2Error(ENHANCE_YOUR_CALM, f"header block over {cap} bytes")
        if self._block_frames > 16 and size < self._block_frames * _MIN_BLOCK_BYTES_PER_FRAME:
            raise H2Error(ENHANCE_YOUR_CALM, f"header block of {self._block_frames} frames, {size} bytes")

    def _end_block(self) -> None:
        assert self._block is not None
        block, stream_id, end_stream = bytes(self._block), self._block_stream, self._block_end_stream
        self._block = None
        self.on_headers(stream_id, block, end_stream)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2Error(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)  # padding counts against flow control too
        data = self._unpad(flags, payload)
        self._recv_unacked += size
        if self._recv_unacked >= _REPLENISH_AT:
            self._write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._recv_unacked)))
            self._recv_unacked = 0
        end_stream = bool(flags & END_STREAM)
        if not end_stream and size:
            unacked = self._stream_unacked.get(stream_id, 0) + size
            if unacked >= _REPLENISH_AT:
                self._write(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", unacked)))
                unacked = 0
            self._stream_unacked[stream_id] = unacked
        elif end_stream:
            self._stream_unacked.pop(stream_id, None)
        self.on_data(stream_id, data, end_stream)

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise H2Error(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2Error(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise H2Error(FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(FLOW_CONTROL_ERROR, "initial window above 2^31-1")
                delta = value - self.peer_window_init
                self.peer_window_init = value
                for stream in self._send.values():
                    stream.window += delta
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= (1 << 24) - 1:
                    raise H2Error(PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} out of range")
                self.peer_max_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        self._drain()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2Error(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise H2Error(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise H2Error(FLOW_CONTROL_ERROR, "connection window above 2^31-1")
        else:
            stream = self._send.get(stream_id)
            if stream is None:
                return  # a stream we are done sending on
            stream.window += increment
        self._drain()

    # ------------------------------------------------------------------ sending

    def open_send(self, stream_id: int) -> None:
        """Starts send-side accounting for a stream (before its first DATA)."""
        self._send[stream_id] = _SendStream(self.peer_window_init)

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool = False) -> None:
        """A header block on `stream_id` (split into CONTINUATIONs when larger than a frame)."""
        limit = self.peer_max_frame
        flags = END_STREAM if end_stream else 0
        if len(block) <= limit:
            self._write(frame(HEADERS, flags | END_HEADERS, stream_id, block))
        else:
            self._write(frame(HEADERS, flags, stream_id, block[:limit]))
            for offset in range(limit, len(block), limit):
                last = offset + limit >= len(block)
                self._write(
                    frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[offset : offset + limit])
                )
        if end_stream:
            self._forget(stream_id)

    def send_message(
        self, stream_id: int, data: bytes, end_stream: bool, trailers: bytes | None = None
    ) -> None:
        """DATA within the peer's windows (the rest queues until they open), then `trailers`
        (a header block that ends the stream) when given. `open_send` must have been called."""
        stream = self._send.get(stream_id)
        if stream is None or stream.closed:
            return
        if stream.queue:
            stream.queue.append((data, end_stream, trailers))
            return
        self._send_some(stream_id, stream, data, end_stream, trailers)

    def _send_some(
        self, stream_id: int, stream: _SendStream, data: bytes, end_stream: bool, trailers: bytes | None
    ) -> bool:
        """Sends what fits; queues the rest at the front. True when all of it went."""
        sent = 0
        total = len(data)
        while sent < total:
            room = min(stream.window, self.send_window, self.peer_max_frame, total - sent)
            if room <= 0:
                stream.queue.appendleft((data[sent:], end_stream, trailers))
                if stream_id not in self._blocked:
                    self._blocked.append(stream_id)
                return False
            last = sent + room == total
            chunk = data[sent : sent + room]
            self._write(
                frame(DATA, END_STREAM if last and end_stream and trailers is None else 0, stream_id, chunk)
            )
            stream.window -= room
            self.send_window -= room
            sent += room
        if not total and end_stream and trailers is None:
            self._write(frame(DATA, END_STREAM, stream_id))
        if trailers is not None:
            self.send_headers(stream_id, trailers, end_stream=True)
        elif end_stream:
            self._forget(stream_id)
        return True

    def _drain(self) -> None:
        """Sends queued data that the windows now allow, streams in the order they blocked."""
        for _ in range(len(self._blocked)):
            if self.send_window <= 0:
                return
            stream_id = self._blocked.popleft()
            stream = self._send.get(stream_id)
            while stream is not None and stream.queue:
                data, end_stream, trailers = stream.queue.popleft()
                if not self._send_some(stream_id, stream, data, end_stream, trailers):
                    break
        self.flush()

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """RST_STREAM(code) and forget the stream's send side."""
        self._forget(stream_id)
        self._write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))

    def _forget(self, stream_id: int) -> None:
        stream = self._send.pop(stream_id, None)
        if stream is not None:
            stream.closed = True
            stream.queue.clear()
        self._stream_unacked.pop(stream_id, None)

    # ------------------------------------------------------------------ hooks

    def on_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        raise NotImplementedError

    def on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        raise NotImplementedError

    def on_reset(self, stream_id: int, code: int) -> None:
        """The peer reset the stream."""

    def on_goaway(self, last_stream_id: int, code: int, debug: bytes) -> None:
        """The peer opens nothing above `last_stream_id` any more."""

    def on_error(self, error: H2Error) -> None:
        """The connection is about to close for `error` (log it)."""

    def on_lost(self, exc: Exception | None) -> None:
        """The connection is gone."""
