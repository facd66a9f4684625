"""The router's front door on the `h2` library (RELAYGR_ROUTER_FRONT_DOOR=h2).

The same job as `relay.FrontDoor`, with python-hyper's HTTP/2 state machine (`h2`) in place of
the hand-written frame layer (`h2wire`) and HPACK decoder (`h2headers`) on the public port: Rank
(unary, identity encoding) is handed to the router's placement and retries (`handle_rank`, i.e.
RouterService.relay_rank); every other stream is passed through to the router's own gRPC server
on loopback. It exists to be measured beside the hand-written relay (bench/router.py).

The upstream side is relay.py's, shared: Rank goes to the rankers over the router's `UpstreamPool`
(RouterService._relay_call), pass-through streams over an `Upstream` to the router's own server.
So a comparison of the two relays differs only in the client-facing HTTP/2. What that costs here:
`h2` takes header lists, not encoded blocks, so the upstream's reply blocks are decoded before
h2 encodes them again (`ReplyHeaders`; they are self-contained, since an Upstream announces
HEADER_TABLE_SIZE 0, so each distinct block is decoded once and cached).

Limits, as the relay's where h2 allows:
* a request header list over `max_header_list_bytes` fails its own stream (trailers-only
  RESOURCE_EXHAUSTED) and the connection goes on: h2 decodes every block whole (its HPACK state
  stays in step), the list's size is checked here. h2's decoder cuts a connection off
  (ENHANCE_YOUR_CALM) at `max_header_block_bytes` of *decoded* headers (the relay caps the
  encoded block), and at 64 CONTINUATION frames of one block;
* streams a client resets, or has refused for their headers, spend its `ResetBudget` (rapid
  reset, CVE-2023-44487): overdrawn, the connection is closed with ENHANCE_YOUR_CALM;
* a client that opens more concurrent streams than announced loses the connection
  (PROTOCOL_ERROR: h2's rule; the hand-written relay refuses the one stream);
* a Rank request over `max_message_bytes` fails alone (RESOURCE_EXHAUSTED).
With mutual TLS configured, the listener uses it (the router passes its server context).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, cast

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
from hyperframe.frame import GoAwayFrame

from services.router.frontdoor.h2wire import MAX_WINDOW, literal_block
from services.router.frontdoor.relay import (
    RANK_PATH,
    FrontDoor,
    FrontDoorError,
    ResetBudget,
    Upstream,
    grpc_timeout,
    percent_encode,
)
from shared.logging import get_logger

log = get_logger("router.frontdoor.h2lib")

Headers = list[tuple[bytes, bytes]]
_GRPC_CONTENT_TYPE = b"application/grpc"
_ENHANCE_YOUR_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


def header_list_size(headers: Headers) -> int:
    """HTTP/2's size of a header list (RFC 9113 6.5.2): name + value + 32 per field."""
    return sum(len(name) + len(value) + 32 for name, value in headers)


def status_headers(code: grpc.StatusCode, message: str) -> Headers:
    """A trailers-only response: HTTP 200, gRPC status `code` with `message`."""
    headers = [(b":status", b"200"), (b"content-type", _GRPC_CONTENT_TYPE),
               (b"grpc-status", b"%d" % code.value[0])]  # fmt: skip
    if message:
        headers.append((b"grpc-message", percent_encode(message)))
    return headers


class ReplyHeaders:
    """Header lists of the self-contained blocks an Upstream receives (its peers encode with no
    dynamic table), decoded once per distinct block: a ranker sends the same few blocks on every
    reply. Bounded: past `max_entries` distinct blocks the cache starts over."""

    def __init__(self, max_list_bytes: int, max_entries: int = 256) -> None:
        self.max_list_bytes = max_list_bytes
        self.max_entries = max_entries
        self._known: dict[bytes, Headers] = {}

    def decode(self, block: bytes) -> Headers | None:
        """The block's header list; None if it does not decode without a dynamic table."""
        headers = self._known.get(block)
        if headers is not None:
            return headers
        decoder = hpack.Decoder(max_header_list_size=self.max_list_bytes)
        decoder.header_table_size = decoder.max_allowed_table_size = 0  # as the Upstream announced
        try:
            headers = [(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)]
        except hpack.HPACKError:
            return None
        if len(self._known) >= self.max_entries:
            self._known.clear()
        self._known[block] = headers
        return headers


class _Rank:
    __slots__ = ("parts", "size", "task", "timeout_s")

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.parts: list[bytes] = []
        self.size = 0
        self.task: asyncio.Task[None] | None = None


class _Outbox:
    """What waits for a stream's flow-control window: data, then (once `end`) its trailers."""

    __slots__ = ("data", "end", "trailers")

    def __init__(self) -> None:
        self.data = bytearray()
        self.end = False
        self.trailers: Headers | None = None


class _PassThrough:
    """A client stream relayed to the router's own gRPC server; the upstream's frames (encoded
    blocks) come back through the StreamSink methods."""

    __slots__ = ("conn", "stream_id", "upstream", "upstream_stream")

    def __init__(self, conn: H2FrontDoorConnection, stream_id: int, upstream: Upstream) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.upstream = upstream
        self.upstream_stream = 0

    def upstream_headers(self, block: bytes, end_stream: bool) -> None:
        self.conn.relay_headers(self.stream_id, block, end_stream)

    def upstream_data(self, data: bytes, end_stream: bool) -> None:
        self.conn.relay_data(self.stream_id, data, end_stream)

    def upstream_reset(self, code: int) -> None:
        self.conn.relay_reset(self.stream_id, code)


class H2FrontDoorConnection(asyncio.Protocol):
    """The server side of one client connection: bytes in, h2 events, our replies out. Every
    send goes through h2 and is written once per read (or per reply, outside a read)."""

    def __init__(self, door: H2FrontDoor) -> None:
        self.door = door
        # Outbound headers are the router's own or decoded from a gRPC server's reply: valid
        # already, so h2 need not check or normalise them again; inbound ones (a public port) it checks.
        config = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                           validate_outbound_headers=False, normalize_outbound_headers=False)  # fmt: skip
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: door.max_concurrent_streams,
                # Advisory (RFC 9113 6.5.2): a client that honours it fails an oversized call itself.
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: door.max_header_list_bytes,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: MAX_WINDOW,
                h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: 0,
            },
        )
        # Initial values are in force at once (no ACK pending), so this outlives the client's ACK:
        # h2 cuts the connection off only at the block cap, a list over the list limit fails alone.
        self.conn.decoder.max_header_list_size = door.max_header_block_bytes
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reading = False
        self._resets = ResetBudget(door.reset_burst, door.reset_rate_per_s)
        self._ranks: dict[int, _Rank] = {}
        self._passed: dict[int, _PassThrough] = {}
        self._outbox: dict[int, _Outbox] = {}

    # ------------------------------------------------------------------ transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.door.connections.add(self)
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(MAX_WINDOW - 65_535)  # the connection's window too
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.door.connections.discard(self)
        if self.door.draining and not self.door.connections:
            self.door.all_closed.set()
        for rank in self._ranks.values():
            if rank.task is not None:
                rank.task.cancel()
        self._ranks.clear()
        passed, self._passed = self._passed, {}
        for link in passed.values():
            link.upstream.close_stream(link.upstream_stream)
        self._outbox.clear()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def flush(self) -> None:
        """Writes what h2 holds, unless a read is in progress (it writes once when it ends)."""
        if not self._reading:
            self._flush()

    def close(self) -> None:
        """Writes what h2 holds (a GOAWAY, when one was queued) and closes; idempotent."""
        if self.closed or self.transport is None:
            return
        self._flush()
        self.closed = True
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._reading = True
        try:
            events = self.conn.receive_data(data)
            for event in events:
                self._on_event(event)
        except h2.exceptions.ProtocolError as exc:  # h2 has queued its GOAWAY
            self._protocol_error(int(exc.error_code), str(exc))
        except _Overdrawn as exc:  # GOAWAY names the last stream taken: the one that overdrew it
            self._protocol_error(_ENHANCE_YOUR_CALM, "too many streams reset or refused", exc.stream_id)
        except Exception as exc:  # a bug here must cost this connection, never the service
            log.error("h2_front_door_failed", error=repr(exc))
            self._protocol_error(h2.errors.ErrorCodes.INTERNAL_ERROR, "internal error", 0)
        finally:
            self._reading = False
            self._flush()

    def _protocol_error(self, code: int, message: str, last_stream_id: int | None = None) -> None:
        """Closes the connection for `code`; with `last_stream_id` the GOAWAY is sent here (else
        h2 has queued its own)."""
        log.info("client_protocol_error", error=message)
        if self.door.on_protocol_error is not None:
            self.door.on_protocol_error("client", code)
        if last_stream_id is not None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.close_connection(code, message.encode()[:256], last_stream_id or None)
        self.close()

    # ------------------------------------------------------------------ client events

    def _on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request(event.stream_id, cast(Headers, event.headers), event.stream_ended is not None)
        elif isinstance(event, h2.events.DataReceived):
            self._data(
                event.stream_id, event.data, event.flow_controlled_length, event.stream_ended is not None
            )
        elif isinstance(event, h2.events.TrailersReceived):
            self._trailers(event.stream_id, cast(Headers, event.headers))
        elif isinstance(event, h2.events.StreamReset):
            if event.remote_reset:
                self._client_reset(event.stream_id)
        elif isinstance(event, h2.events.WindowUpdated):
            for stream_id in [event.stream_id] if event.stream_id else list(self._outbox):
                self._pump(stream_id)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.close()  # the client's GOAWAY: h2 sends nothing more on this connection

    def _request(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        size = header_list_size(headers)
        if size > self.door.max_header_list_bytes:
            self._refuse_headers(stream_id, size, end_stream)
            return
        fields = dict(headers)
        if fields.get(b":method") != b"POST" or not fields.get(b"content-type", b"").startswith(
            _GRPC_CONTENT_TYPE
        ):
            self._answer(stream_id, grpc.StatusCode.UNIMPLEMENTED, "only gRPC calls are served here")
            return
        if self.door.draining:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if fields.get(b":path") == RANK_PATH and fields.get(b"grpc-encoding", b"identity") == b"identity":
            try:
                timeout_s = grpc_timeout(fields.get(b"grpc-timeout"))
            except ValueError as exc:
                self._answer(stream_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
            rank = self._ranks[stream_id] = _Rank(timeout_s)
            if end_stream:
                self._start_rank(stream_id, rank)
            return
        self._pass_through(stream_id, headers, end_stream)

    def _data(self, stream_id: int, data: bytes, flow_length: int, end_stream: bool) -> None:
        # Acknowledged at once (the windows are large): a slow upstream queues, as on the relay.
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.conn.acknowledge_received_data(flow_length, stream_id)
        rank = self._ranks.get(stream_id)
        if rank is not None:
            rank.size += len(data)
            if rank.size > self.door.max_message_bytes + 5:
                del self._ranks[stream_id]
                self._answer(stream_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"request larger than {self.door.max_message_bytes} bytes")  # fmt: skip
                self._reset(stream_id, h2.errors.ErrorCodes.NO_ERROR)  # stop sending the rest
                return
            rank.parts.append(data)
            if end_stream:
                self._start_rank(stream_id, rank)
            return
        link = self._passed.get(stream_id)
        if link is not None:
            link.upstream.send_message(link.upstream_stream, data, end_stream)
            link.upstream.flush()

    def _trailers(self, stream_id: int, headers: Headers) -> None:
        link = self._passed.get(stream_id)
        if link is not None:
            link.upstream.send_headers(link.upstream_stream, literal_block(headers), end_stream=True)
            link.upstream.flush()
            return
        rank = self._ranks.get(stream_id)
        if rank is not None:  # trailers end a unary request as END_STREAM on its DATA would
            self._start_rank(stream_id, rank)

    def _client_reset(self, stream_id: int) -> None:
        rank = self._ranks.pop(stream_id, None)
        if rank is not None and rank.task is not None:
            rank.task.cancel()  # the client gave up: so does the forwarded call (its upstream stream is reset)
        link = self._passed.pop(stream_id, None)
        if link is not None:
            link.upstream.close_stream(link.upstream_stream)
        self._outbox.pop(stream_id, None)
        self._spend(stream_id)

    # ------------------------------------------------------------------ refusals

    def _spend(self, stream_id: int, cost: int = 1) -> None:
        """Charges the client's ResetBudget for `stream_id`; raises _Overdrawn once it is overdrawn."""
        if not self._resets.spend(cost):
            raise _Overdrawn(stream_id)

    def _refuse_headers(self, stream_id: int, size: int, end_stream: bool) -> None:
        """Fails the one stream whose header list is over the limit (RESOURCE_EXHAUSTED); the
        connection goes on. Costs the client's budget by the list's size (decoding it cost us)."""
        limit = self.door.max_header_list_bytes
        log.info("client_header_list_too_large", stream=stream_id, size=size, limit=limit)
        if self.door.on_refused is not None:
            self.door.on_refused("header_list_too_large")
        message = f"request header list of {size} bytes exceeds the router's limit of {limit} bytes"
        self._answer(stream_id, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        if not end_stream:
            self._reset(stream_id, h2.errors.ErrorCodes.NO_ERROR)  # a complete response: stop sending
        self._spend(stream_id, 1 + size // 4096)

    # ------------------------------------------------------------------ Rank

    def _start_rank(self, stream_id: int, rank: _Rank) -> None:
        if rank.task is not None:
            return
        data = b"".join(rank.parts)
        rank.parts.clear()
        if len(data) < 5 or data[0] != 0 or int.from_bytes(data[1:5], "big") != len(data) - 5:
            del self._ranks[stream_id]
            self._answer(stream_id, grpc.StatusCode.INTERNAL if data[:1] not in (b"", b"\x00")
                         else grpc.StatusCode.INVALID_ARGUMENT,
                         "a Rank call carries exactly one uncompressed message")  # fmt: skip
            return
        rank.task = asyncio.ensure_future(self._serve_rank(stream_id, data[5:], rank.timeout_s))

    async def _serve_rank(self, stream_id: int, message: bytes, timeout_s: float | None) -> None:
        try:
            reply = await self.door.handle_rank(message, timeout_s)
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
        headers = self.door.reply_headers.decode(reply.header_block)
        trailers = self.door.reply_headers.decode(reply.trailer_block)
        if headers is None or trailers is None:
            self._answer(stream_id, grpc.StatusCode.INTERNAL, "a ranker's reply headers do not decode")
            return
        try:
            self.conn.send_headers(stream_id, headers)
        except h2.exceptions.StreamClosedError:
            return
        self._send(stream_id, reply.data, end=True, trailers=trailers)
        self.flush()
        self._maybe_finish_drain()

    def _answer(self, stream_id: int, code: grpc.StatusCode, message: str) -> None:
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.conn.send_headers(stream_id, status_headers(code, message), end_stream=True)
        self.flush()
        self._maybe_finish_drain()

    def _reset(self, stream_id: int, code: int) -> None:
        self._outbox.pop(stream_id, None)
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.conn.reset_stream(stream_id, code)

    # ------------------------------------------------------------------ sending

    def _send(self, stream_id: int, data: bytes, end: bool, trailers: Headers | None = None) -> None:
        """Queues `data` for the stream (then, with `end`, its trailers or END_STREAM) and sends
        what the windows allow; the rest goes out as WINDOW_UPDATEs arrive."""
        box = self._outbox.get(stream_id)
        if box is None:
            box = self._outbox[stream_id] = _Outbox()
        box.data += data
        box.end = end
        box.trailers = trailers
        self._pump(stream_id)

    def _pump(self, stream_id: int) -> None:
        box = self._outbox.get(stream_id)
        if box is None:
            return
        try:  # flushed on every way out, the early one (a closed window) included
            ended = False
            while box.data:
                room = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
                if room <= 0:
                    return
                chunk = bytes(box.data[:room])
                del box.data[:room]
                ended = not box.data and box.end and box.trailers is None
                self.conn.send_data(stream_id, chunk, end_stream=ended)
            if not box.end:
                return
            del self._outbox[stream_id]
            if box.trailers is not None:
                self.conn.send_headers(stream_id, box.trailers, end_stream=True)
            elif not ended:
                self.conn.end_stream(stream_id)
        except h2.exceptions.StreamClosedError:
            self._outbox.pop(stream_id, None)
        finally:
            self.flush()

    # ------------------------------------------------------------------ pass-through

    def _pass_through(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        upstream = self.door.internal
        if upstream is None or not upstream.usable:
            self._answer(stream_id, grpc.StatusCode.UNAVAILABLE, "router is starting or stopping")
            return
        if self.door.on_pass_through is not None:
            self.door.on_pass_through()
        link = self._passed[stream_id] = _PassThrough(self, stream_id, upstream)
        link.upstream_stream = upstream.open_stream(literal_block(headers), end_stream, link)

    def relay_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        if stream_id not in self._passed or self.closed:
            return
        headers = self.door.reply_headers.decode(block)
        if headers is None:
            self.relay_reset(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
            return
        if end_stream:
            del self._passed[stream_id]
            if stream_id in self._outbox:  # data queued behind the window goes first
                self._send(stream_id, b"", end=True, trailers=headers)
            else:
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    self.conn.send_headers(stream_id, headers, end_stream=True)
        else:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self.conn.send_headers(stream_id, headers)
        self.flush()
        self._maybe_finish_drain()

    def relay_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        if stream_id not in self._passed or self.closed:
            return
        if end_stream:
            del self._passed[stream_id]
        self._send(stream_id, data, end=end_stream)

    def relay_reset(self, stream_id: int, code: int) -> None:
        link = self._passed.pop(stream_id, None)
        if link is not None and not self.closed:
            link.upstream.close_stream(link.upstream_stream)
            self._reset(stream_id, code)
            self.flush()

    # ------------------------------------------------------------------ shutdown

    @property
    def busy(self) -> bool:
        return bool(self._ranks or self._passed or self._outbox)

    def send_goaway_notice(self) -> None:
        """GOAWAY(NO_ERROR) naming the last stream accepted: the client opens new calls elsewhere;
        the ones here finish. Written as a frame of its own: h2's close_connection would also
        stop the streams in flight."""
        if self.closed or self.transport is None:
            return
        self._flush()
        notice = GoAwayFrame(0, last_stream_id=self.conn.highest_inbound_stream_id, error_code=0)
        self.transport.write(notice.serialize())
        if not self.busy:
            self.close()

    def _maybe_finish_drain(self) -> None:
        if self.door.draining and not self.busy:
            self.close()


class _Overdrawn(Exception):
    """A client overdrew its ResetBudget on `stream_id` (caught in data_received: the connection
    closes)."""

    def __init__(self, stream_id: int) -> None:
        super().__init__(stream_id)
        self.stream_id = stream_id


class H2FrontDoor(FrontDoor):
    """The h2-library relay's listening socket and its connections: relay.FrontDoor's
    constructor, start, stop and connections, with this module's connections."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Decoded headers of one block beyond max_header_block_bytes close the connection.
        self.reply_headers = ReplyHeaders(self.max_header_block_bytes)

    def _connection(self) -> asyncio.Protocol:
        return H2FrontDoorConnection(self)


__all__ = ["H2FrontDoor", "H2FrontDoorConnection", "ReplyHeaders", "header_list_size", "status_headers"]
