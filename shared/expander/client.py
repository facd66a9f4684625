"""ExpanderClient: a ranker's async handle on its host's expander daemon.

    client = await ExpanderClient.connect("/run/user/1000/expander.sock", owner="ranker-gpu0")
    # demote: reserve, copy psi bytes into the arena, commit
    r = await client.reserve(key, nbytes, meta={"prefix_len": P})
    client.arena.view(r.offset, r.nbytes)[:] = psi_bytes   # or .tensor(...).copy_(gpu_tensor)
    await client.commit(r.lease_id)
    # reload: acquire (pins the entry), copy out, release
    a = await client.acquire(key)
    if a is not None:
        gpu.copy_(client.arena.tensor(a.offset, a.nbytes)); await client.release(a.lease_id)

Errors, two kinds (both subclass ExpanderError):

- ExpanderUnavailable: the daemon cannot be reached or its state is gone: socket missing or
  refused, connection lost, no reply within the call's timeout, a reply that breaks the protocol,
  or a daemon restart (new generation). After a failure during a request the client is broken
  (every later call raises it too): close it, connect again, and treat every lease taken over it
  as lost. Callers should fall back to recomputing psi.
- ExpanderRefused(reason): the daemon is fine and said no. reserve: "too_large", "no_space",
  "exists"; commit/abort/release: "unknown_lease", "lease_expired", "wrong_lease_kind"; a request
  the daemon rejects (a bug or version skew): "invalid", "unknown_op", "bad_frame"; a daemon bug:
  "internal". The connection stays usable.

acquire() and lookup() report absence as None, not as an error.

Leases taken over this client end (writes aborted, pins released) when its connection closes.
One connection per client, shared by the tasks of one event loop (not across threads or loops).
Requests are pipelined: each is written as it is made and its reply, which the daemon sends in
order and tagged with the request's id, is handed to its caller by one reader task. With one
request at a time, a reload's acquire waited behind every demotion's reserve and commit queued
before it, each a round trip through two busy event loops (H200, L4096, 262.5 req/s: a reload's
call waited 67 ms for psi whose copy took ~9 ms). A caller cancelled while its request is on the
wire leaves the client usable: its reply is read and dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
from collections.abc import Callable
from typing import Any, TypeVar

from shared.expander import protocol as p
from shared.expander.entries import Acquired, EntryInfo, EntryKey, Reservation, StoreStats
from shared.expander.mapping import ArenaHandshakeError, ArenaMapping, receive_arena

__all__ = [
    "ExpanderClient",
    "ExpanderError",
    "ExpanderRefused",
    "ExpanderUnavailable",
]

T = TypeVar("T")


class ExpanderError(Exception):
    """Base of the client's errors."""


class ExpanderUnavailable(ExpanderError):
    """The daemon cannot serve this client (see the module docstring)."""


class ExpanderRefused(ExpanderError):
    """The daemon answered no; `reason` is machine-readable, `detail` for humans."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ExpanderClient:
    """One control connection plus the mapped arena. Build it with `await ExpanderClient.connect(...)`.

    Every method waits at most `call_timeout_s` for its reply and raises ExpanderUnavailable or ExpanderRefused as described in the module
    docstring. Methods never block the event loop.
    """

    def __init__(
        self,
        socket_path: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        arena: ArenaMapping,
        *,
        owner: str,
        call_timeout_s: float,
        lease_s: float,
        ttl_s: float,
        max_lease_s: float,
    ) -> None:
        """Internal: use connect()."""
        self._socket_path = socket_path
        self._reader = reader
        self._writer = writer
        self._arena = arena
        self._owner = owner
        self._call_timeout_s = call_timeout_s
        self._lease_s = min(lease_s, max_lease_s)
        self._ttl_s = ttl_s
        self._max_lease_s = max_lease_s
        self._ids = itertools.count(1)
        self._broken: str | None = None
        # Requests on the wire, in the order they were written (the daemon's replies come in it).
        self._pending: collections.OrderedDict[int, asyncio.Future[dict[str, Any]]] = (
            collections.OrderedDict()
        )
        self._reader_task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls,
        socket_path: str,
        timeout_s: float = 2.0,
        *,
        owner: str | None = None,
        call_timeout_s: float | None = None,
        lease_s: float = 10.0,
    ) -> ExpanderClient:
        """Receives and maps the arena (fd socket `socket_path + ".fd"`, in a thread), opens the
        control connection and checks with hello that both belong to the same daemon start.

        timeout_s bounds each connection step; call_timeout_s (default timeout_s) bounds every later
        call. owner names this client in the daemon's logs (default "pid<N>"). lease_s is the default
        lease for reserve/acquire (capped at the daemon's max_lease_s). Raises ExpanderUnavailable.
        """
        owner = owner or f"pid{os.getpid()}"
        loop = asyncio.get_running_loop()
        try:
            arena = await asyncio.wait_for(
                loop.run_in_executor(None, receive_arena, socket_path + ".fd", timeout_s), timeout_s + 0.5
            )
        except (OSError, TimeoutError) as exc:  # ArenaHandshakeError is a ConnectionError
            raise ExpanderUnavailable(f"cannot get the arena from {socket_path}.fd: {exc!r}") from exc
        writer: asyncio.StreamWriter | None = None
        client: ExpanderClient | None = None
        try:
            reader, opened = await asyncio.wait_for(
                asyncio.open_unix_connection(socket_path, limit=p.MAX_FRAME + 16), timeout_s
            )
            writer = opened
            client = cls(
                socket_path,
                reader,
                opened,
                arena,
                owner=owner,
                call_timeout_s=call_timeout_s or timeout_s,
                lease_s=lease_s,
                ttl_s=1.0,
                max_lease_s=lease_s,
            )
            hello = p.hello_from_wire(await client._call(p.Hello(owner)))
            if hello.protocol != p.PROTOCOL_VERSION:
                # Keys are not understood alike across versions (v2 added the content fingerprint).
                raise p.ProtocolError(
                    "invalid", f"daemon speaks protocol {hello.protocol}, this client {p.PROTOCOL_VERSION}"
                )
            if hello.generation != arena.generation or hello.arena_bytes != arena.nbytes:
                raise ArenaHandshakeError(
                    f"daemon restarted during connect (arena generation {arena.generation}, "
                    f"control {hello.generation})"
                )
            client._ttl_s = hello.ttl_s
            client._max_lease_s = hello.max_lease_s
            client._lease_s = min(lease_s, hello.max_lease_s)
            return client
        except BaseException as exc:
            if client is not None:
                client._break("connect failed")
                if client._reader_task is not None:
                    client._reader_task.cancel()
            elif writer is not None:
                writer.close()
            arena.close()
            if isinstance(exc, ExpanderUnavailable):
                raise
            if isinstance(exc, (OSError, TimeoutError, p.ProtocolError)):
                raise ExpanderUnavailable(f"cannot connect to {socket_path}: {exc!r}") from exc
            raise

    # ----- properties -----

    @property
    def arena(self) -> ArenaMapping:
        """The mapped arena: copy psi bytes in and out through it (valid until close())."""
        return self._arena

    @property
    def generation(self) -> str:
        return self._arena.generation

    @property
    def socket_path(self) -> str:
        return self._socket_path

    @property
    def ttl_s(self) -> float:
        """The daemon's idle TTL for READY entries."""
        return self._ttl_s

    @property
    def max_lease_s(self) -> float:
        return self._max_lease_s

    @property
    def broken(self) -> str | None:
        """Why this client can no longer be used, or None while it is healthy."""
        return self._broken

    # ----- operations -----

    async def ping(self) -> None:
        """Round trip; raises ExpanderUnavailable if the daemon is gone or has restarted."""
        reply = await self._call(p.Ping())
        if reply.get("generation") != self.generation:
            self._break("daemon generation changed")
            raise ExpanderUnavailable("daemon restarted (generation changed)")

    def may_hold(self, key: EntryKey) -> bool:
        """False only if the daemon's presence index says it holds no readable psi under key (no
        round trip; shared/expander/presence.py). True: it may, ask with lookup() (also when the
        daemon keeps no index)."""
        presence = self._arena.presence
        return presence is None or presence.may_hold(key)

    async def lookup(self, key: EntryKey) -> EntryInfo | None:
        """The live entry under key (WRITING or READY), or None. Changes nothing in the daemon."""
        reply = await self._call(p.Lookup(key))
        found = reply.get("found")
        return self._parse(lambda: p.entry_from_wire(reply.get("entry")) if found else None)

    async def reserve(
        self,
        key: EntryKey,
        nbytes: int,
        meta: dict[str, Any] | None = None,
        owner: str | None = None,
        lease_s: float | None = None,
    ) -> Reservation:
        """A block of nbytes in the arena under a write lease of lease_s (default: the client's).
        Fill `arena.view(r.offset, r.nbytes)`, then commit(r.lease_id) before the lease runs out
        (or abort). meta (JSON-able, <= 16 KiB encoded) is handed to readers unchanged; owner
        (default: the client's) names the lease in the daemon's logs. Raises
        ExpanderRefused("too_large" | "no_space" | "exists"), ValueError for nbytes <= 0."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        request = p.Reserve(key, nbytes, dict(meta or {}), owner or self._owner, self._lease(lease_s))
        reply = await self._call(request)
        return self._parse(lambda: p.reservation_from_wire(reply))

    async def commit(self, lease_id: int) -> None:
        """Publishes a reserved block (WRITING -> READY). Raises ExpanderRefused("unknown_lease" |
        "lease_expired" | "wrong_lease_kind")."""
        await self._call(p.Commit(lease_id))

    async def abort(self, lease_id: int) -> None:
        """Gives a reserved block back unpublished. Raises ExpanderRefused like commit."""
        await self._call(p.Abort(lease_id))

    async def acquire(
        self, key: EntryKey, owner: str | None = None, lease_s: float | None = None
    ) -> Acquired | None:
        """Pins the READY entry under key for lease_s (default: the client's; never evicted
        meanwhile) and returns where its bytes are and its meta; None if there is none. release()
        it once copied out. owner as in reserve."""
        reply = await self._call(p.Acquire(key, owner or self._owner, self._lease(lease_s)))
        if not reply.get("found"):
            return None
        return self._parse(lambda: p.acquired_from_wire(reply))

    async def release(self, lease_id: int) -> None:
        """Unpins. Raises ExpanderRefused("unknown_lease" | "wrong_lease_kind"); unknown_lease also
        when the pin was dropped after its deadline."""
        await self._call(p.Release(lease_id))

    async def stats(self) -> StoreStats:
        reply = await self._call(p.Stats())
        return self._parse(lambda: p.stats_from_wire(reply.get("stats")))

    async def close(self) -> None:
        """Closes the connection (the daemon ends this client's leases) and the arena mapping
        (deferred while views or tensors of it are alive, see ArenaMapping.close). Idempotent."""
        self._break("closed")
        with contextlib.suppress(OSError, RuntimeError):
            await self._writer.wait_closed()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        self._arena.close()

    async def __aenter__(self) -> ExpanderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----- internals -----

    async def _call(self, request: p.Request) -> dict[str, Any]:
        """Sends one request and returns the ok reply. No reply within the call's timeout, or a
        connection error, breaks the client: a reply that came later could no longer be told
        from a daemon that is stuck."""
        if self._broken is not None:
            raise ExpanderUnavailable(f"client unusable: {self._broken}")
        request_id = next(self._ids)
        frame = p.encode_frame(p.request_to_wire(request, request_id))  # FrameTooLarge: caller's bug
        reply_future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        # Registered and written in one step (no await between): the order of _pending is the
        # order on the wire.
        self._pending[request_id] = reply_future
        try:
            self._writer.write(frame)
        except (OSError, RuntimeError) as exc:
            self._break(f"connection lost: {exc!r}")
            raise ExpanderUnavailable(f"connection to the expander lost: {exc!r}") from exc
        if self._reader_task is None:
            self._reader_task = asyncio.ensure_future(self._read_replies())
        try:
            async with asyncio.timeout(self._call_timeout_s):
                await self._writer.drain()
                reply = await reply_future
        except TimeoutError:
            self._break("timed out waiting for a reply")
            raise ExpanderUnavailable(f"no reply within {self._call_timeout_s}s") from None
        except ConnectionError as exc:  # from drain; the reader reports its own errors
            self._break(f"connection lost: {exc!r}")
            raise ExpanderUnavailable(f"connection to the expander lost: {exc!r}") from exc
        if reply.get("ok") is True:
            return reply
        kind, reason = str(reply.get("error")), str(reply.get("reason", ""))
        if kind in ("refused", "lease"):
            raise ExpanderRefused(reason)
        raise ExpanderRefused(kind, reason)

    async def _read_replies(self) -> None:
        """Hands each reply to the request it answers (the oldest on the wire: the daemon answers
        in order), until the connection ends or breaks the protocol."""
        try:
            while self._broken is None:
                body = await p.read_frame(self._reader)
                if body is None:
                    self._break("daemon closed the connection")
                    return
                reply = p.decode_message(body)
                if reply.get("error") == "frame_too_large":  # answers no id; the daemon hangs up
                    self._break("daemon rejected a frame")
                    return
                if not self._pending:
                    self._break("a reply to no request")
                    return
                request_id, reply_future = self._pending.popitem(last=False)
                if reply.get("id") != request_id:
                    self._break(f"reply id {reply.get('id')!r} for request {request_id}")
                    return
                if not reply_future.done():  # else its caller was cancelled: dropped
                    reply_future.set_result(reply)
        except p.ProtocolError as exc:
            self._break(f"garbled reply: {exc.reason}")
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._break(f"connection lost: {exc!r}")

    def _parse(self, build: Callable[[], T]) -> T:
        """Runs a reply parser; a malformed reply means a broken daemon or stream."""
        try:
            return build()
        except p.ProtocolError as exc:
            self._break(f"malformed reply: {exc.reason}")
            raise ExpanderUnavailable(f"malformed reply: {exc.reason}") from exc

    def _lease(self, lease_s: float | None) -> float:
        return self._lease_s if lease_s is None else lease_s

    def _break(self, why: str) -> None:
        """The client is unusable from now on: every request on the wire fails with `why`."""
        if self._broken is None:
            self._broken = why
        self._writer.close()
        pending, self._pending = self._pending, collections.OrderedDict()
        for reply_future in pending.values():
            if not reply_future.done():
                reply_future.set_exception(ExpanderUnavailable(f"client unusable: {self._broken}"))
