"""The expander daemon: one per host, owning the arena and the entry table.

Two unix sockets, both created owner-only (0600) before they listen, in a directory created 0700
when missing, and removed at shutdown:

- `socket_path`: the control protocol (shared/expander/protocol.py), served by asyncio. Every
  operation runs to completion on the event loop, so the store needs no locks.
- `socket_path + ".fd"`: a thread accepts, sends the arena's memfd with SCM_RIGHTS, and closes.

A background task sweeps expired leases and entries every 100 ms and refreshes the Prometheus
gauges; it runs for the daemon's life, and its failure stops the daemon (exit status 1). Leases taken over a connection end (writes aborted, pins released) when that connection
closes, so a ranker that dies frees its space at once instead of at its lease deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import socket
import stat
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.expander.arena import Arena
from services.expander.config import ExpanderConfig, mem_available_bytes
from services.expander.store import LeaseError, Refusal, Store
from shared.expander import protocol as p
from shared.lifecycle import Lifecycle
from shared.logging import get_logger
from shared.metrics import LATENCY_MS_BUCKETS, HostStalls, serve_metrics

SWEEP_INTERVAL_S = 0.1
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class DaemonStartError(RuntimeError):
    """The daemon cannot start (socket path taken by a live daemon or by a non-socket, ...)."""


@dataclass
class _Connection:
    conn_id: int
    owner: str
    leases: set[int] = field(default_factory=set)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "relaygr_expander_requests",
            "Control requests by op and outcome",
            ["op", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "relaygr_expander_request_ms", "Control request handling time (ms)", ["op"],
            buckets=LATENCY_MS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.evictions = Counter(
            "relaygr_expander_evictions", "READY entries evicted for space", registry=registry
        )
        self.expirations = Counter(
            "relaygr_expander_expirations",
            "Expirations: entry (TTL), write (write lease deadline), pin (read lease deadline)",
            ["kind"],
            registry=registry,
        )
        self.disconnect_leases = Counter(
            "relaygr_expander_disconnect_leases",
            "Leases ended because their connection closed",
            registry=registry,
        )
        self.bytes = Gauge(
            "relaygr_expander_bytes", "Arena bytes: capacity, used, free, largest_free, stored", ["kind"],
            registry=registry,
        )  # fmt: skip
        self.entries = Gauge("relaygr_expander_entries", "Entries by state", ["state"], registry=registry)
        self.pinned = Gauge(
            "relaygr_expander_pinned_entries", "READY entries with read leases", registry=registry
        )
        self.read_leases = Gauge("relaygr_expander_read_leases", "Live read leases", registry=registry)
        self.connections = Gauge(
            "relaygr_expander_connections", "Open control connections", registry=registry
        )


class ExpanderDaemon:
    """Owns the arena, the store, both sockets, the sweeper and the metrics endpoint.

    `await run()` runs the daemon through its `Lifecycle` (shared/lifecycle.py): it starts
    everything, logs "expander_ready", and serves until `shutdown()`, SIGTERM / SIGINT (when run
    on the main thread) or the failure of the sweeper; then it stops accepting connections, closes
    those it has (their handlers finish the request in hand; the leases taken over them end),
    and closes the sockets, removes the socket files and closes the memfd. It returns the exit
    status: 0 when asked to stop, 1 when start-up failed (logged as "expander_failed", after
    undoing what it did) or the sweeper died. Rankers' existing mappings of the arena remain valid
    after the daemon exits.
    """

    def __init__(self, config: ExpanderConfig, *, serve_metrics_http: bool = True) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self._stalls: HostStalls | None = None
        self.generation: str | None = None
        self.arena_bytes = config.arena_bytes  # sized at start (config.sized_arena_bytes)
        self.metrics_port: int | None = None
        self.lifecycle = Lifecycle("expander")
        self._serve_metrics_http = serve_metrics_http
        self._log = get_logger("services.expander")
        self._metrics = _Metrics(self.registry)
        self._last_counts: dict[str, int] = {}
        self._arena: Arena | None = None
        self._store: Store | None = None
        self._server: asyncio.Server | None = None
        self._bound: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino) of the socket we bound
        self._fd_sock: socket.socket | None = None
        self._fd_thread: threading.Thread | None = None
        self._fd_stop = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()  # one per open control connection
        self._conn_ids = itertools.count(1)
        self._done = asyncio.Event()
        self._running = False
        self.ready = asyncio.Event()

    # ----- lifecycle (the hooks shared.lifecycle.Lifecycle calls, in this order) -----

    async def run(self, install_signals: bool = True) -> int:
        """Serves until stopped; returns the exit status (see the class docstring). Blocks (awaits)
        for the daemon's life; SIGTERM / SIGINT stop it when `install_signals` (main thread only)."""
        if self._running:
            raise RuntimeError("ExpanderDaemon.run() called twice")
        self._running = True
        try:
            return await self.lifecycle.run(self, install_signals=install_signals)
        finally:
            self._done.set()

    async def shutdown(self) -> None:
        """Asks run() to stop and waits until it has cleaned up. Safe to call at any time, twice."""
        self.lifecycle.request_stop("shutdown")
        if self._running:
            await self._done.wait()

    async def start(self) -> None:
        """Binds both sockets, maps the arena, starts the fd thread, the sweeper and the metrics
        endpoint. Raises DaemonStartError (or OSError) when the daemon cannot serve; `close` then
        undoes what was done."""
        try:
            await self._start()
        except Exception as exc:
            self._log.error("expander_failed", error=str(exc))
            raise
        self._stalls = HostStalls(self.registry)  # beside the rankers': a host-wide stall shows in all
        self._log.info(
            "expander_ready",
            socket_path=self.config.socket_path,
            fd_socket_path=self.config.fd_socket_path,
            arena_bytes=self.arena_bytes,
            generation=self.generation,
            metrics_port=self.metrics_port,
            ttl_s=self.config.ttl_s,
            max_lease_s=self.config.max_lease_s,
            pid=os.getpid(),
        )
        self.ready.set()

    async def stop_intake(self) -> None:
        """No new connections on either socket; those open are served until `drain` closes them."""
        if self._server is not None:
            self._server.close()
        self._fd_stop.set()

    async def drain(self) -> None:
        """Closes every control connection and waits for their handlers: a request in hand is
        answered first (each runs to completion on the loop), then the handler sees the end of
        the stream and ends the leases taken over it."""
        for writer in list(self._writers):
            writer.close()
        if self._handlers:
            await asyncio.wait(list(self._handlers))

    async def close(self) -> None:
        """Undoes whatever `start` did; never raises (each step is independent)."""
        if self._stalls is not None:
            self._stalls.close()
            self._stalls = None
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):  # a drain cut short by its grace period
                writer.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._fd_stop.set()
        if self._fd_thread is not None:
            await asyncio.to_thread(self._fd_thread.join, 2.0)
        if self._fd_sock is not None:
            self._fd_sock.close()
        for path, identity in list(self._bound.items()):
            _unlink_if_ours(path, identity)
        self._bound.clear()
        if self._arena is not None:
            self._arena.close()
        if self._store is not None:
            self._sync_metrics()
        self._log.info("expander_stopped", socket_path=self.config.socket_path, generation=self.generation)

    async def _start(self) -> None:
        cfg = self.config
        _prepare_directory(os.path.dirname(cfg.socket_path))
        for path in (cfg.socket_path, cfg.fd_socket_path):
            _claim_path(path)
        available = mem_available_bytes()
        self.arena_bytes = cfg.sized_arena_bytes(available)
        self._log.info("arena_sized", arena_bytes=self.arena_bytes, arena_gib=round(self.arena_bytes / 2**30, 2),
                       source="configured" if cfg.arena_bytes else "fraction", fraction=cfg.arena_fraction,
                       host_available_bytes=available)  # fmt: skip
        # Prefaulting a large arena takes a while: keep the loop (and signals) responsive.
        self._arena = await asyncio.to_thread(Arena, self.arena_bytes, presence_slots=cfg.presence_slots)
        self.generation = self._arena.generation
        self._store = Store(
            self.arena_bytes, ttl_s=cfg.ttl_s, max_lease_s=cfg.max_lease_s, presence=self._arena.presence
        )
        self._fd_sock = self._bind(cfg.fd_socket_path)
        self._fd_thread = threading.Thread(
            target=self._serve_fds, args=(self._fd_sock, self._arena), name="expander-fd", daemon=True
        )
        self._fd_thread.start()
        # The control socket goes last: once it answers, the fd socket is there too.
        control = self._bind(cfg.socket_path)
        self._server = await asyncio.start_unix_server(self._handle, sock=control, limit=p.MAX_FRAME + 16)
        if self._serve_metrics_http:
            self.metrics_port = serve_metrics(self.registry, cfg.metrics_port)
        self._sync_metrics()
        self.lifecycle.spawn(self._sweep(), "sweep")

    def _bind(self, path: str) -> socket.socket:
        """Unix stream socket at path, mode 0600 before it listens (no window where others connect)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
            st = os.stat(path)
            self._bound[path] = (st.st_dev, st.st_ino)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return sock

    # ----- fd socket (thread) -----

    def _serve_fds(self, listener: socket.socket, arena: Arena) -> None:
        listener.settimeout(0.2)  # poll the stop flag
        while not self._fd_stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._fd_stop.is_set():
                    break
                self._log.warning("fd_accept_failed", error=str(exc))
                time.sleep(0.05)
                continue
            with conn:
                try:
                    conn.settimeout(1.0)
                    if not _peer_allowed(conn):
                        self._log.warning("fd_peer_refused", peer=_peer(conn))
                        continue
                    arena.send_to(conn)
                except (OSError, ValueError) as exc:
                    self._log.warning("fd_send_failed", error=str(exc))

    # ----- control connections -----

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(next(self._conn_ids), owner="")
        conn.owner = f"conn{conn.conn_id}"
        sock = writer.get_extra_info("socket")
        if sock is not None and not _peer_allowed(sock):
            self._log.warning("control_peer_refused", peer=_peer(sock))
            writer.close()
            return
        self._writers.add(writer)
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        self._metrics.connections.inc()
        try:
            while True:
                try:
                    body = await p.read_frame(reader)
                except p.FrameTooLarge as exc:
                    self._metrics.requests.labels("none", exc.kind).inc()
                    writer.write(p.encode_frame(p.error_reply(None, exc.kind, exc.reason)))
                    await writer.drain()
                    break  # the oversized body is still in the stream: the connection cannot resync
                if body is None:
                    break
                writer.write(p.encode_frame(self._dispatch(body, conn)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away mid-frame or mid-reply
        finally:
            self._writers.discard(writer)
            if handler is not None:
                self._handlers.discard(handler)
            self._metrics.connections.dec()
            self._end_leases(conn)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _end_leases(self, conn: _Connection) -> None:
        if self._store is None or not conn.leases:
            return
        ended = sum(1 for lease_id in conn.leases if self._store.cancel(lease_id))
        conn.leases.clear()
        if ended:
            self._metrics.disconnect_leases.inc(ended)
            self._log.info("connection_leases_ended", owner=conn.owner, leases=ended)

    def _dispatch(self, body: bytes, conn: _Connection) -> dict[str, Any]:
        """One request in, one reply out. Never raises: a daemon bug becomes an "internal" reply."""
        started = time.perf_counter()
        op, rid = "none", None
        try:
            message = p.decode_message(body)
            rid = p.request_id(message)
            raw_op = message.get("op")
            op = raw_op if isinstance(raw_op, str) and raw_op in p.OPS else "unknown"  # bounded label set
            reply = self._execute(p.parse_request(message, default_owner=conn.owner), rid, conn)
        except p.ProtocolError as exc:
            reply = p.error_reply(rid, exc.kind, exc.reason)
        except LeaseError as exc:
            reply = p.error_reply(rid, "lease", exc.reason)
        except Exception as exc:  # keep serving: one bad request must not take the host's cache down
            self._log.exception("request_failed", op=op, owner=conn.owner)
            reply = p.error_reply(rid, "internal", f"{type(exc).__name__}: {exc}")
        if reply["ok"]:
            outcome = "ok" if reply.get("found", True) else "miss"
        elif reply["error"] == "refused":
            outcome = f"refused_{reply['reason']}"
        else:
            outcome = reply["error"]
        self._metrics.requests.labels(op, outcome).inc()
        self._metrics.latency.labels(op).observe((time.perf_counter() - started) * 1e3)
        return reply

    def _execute(self, req: p.Request, rid: int | None, conn: _Connection) -> dict[str, Any]:
        store, arena = self._store, self._arena
        assert store is not None
        assert arena is not None
        now = time.monotonic()
        match req:
            case p.Ping():
                return p.ok_reply(rid, generation=arena.generation)
            case p.Hello(owner=owner):
                conn.owner = owner or conn.owner
                return p.ok_reply(
                    rid,
                    arena_bytes=arena.nbytes,
                    generation=arena.generation,
                    ttl_s=store.ttl_s,
                    max_lease_s=store.max_lease_s,
                    protocol=p.PROTOCOL_VERSION,
                )
            case p.Lookup(key=key):
                info = store.lookup(key, now)
                return p.ok_reply(rid, found=info is not None, entry=p.entry_to_wire(info) if info else None)
            case p.Reserve(key=key, nbytes=nbytes, meta=meta, owner=owner, lease_s=lease_s):
                self._check_lease(lease_s)
                result = store.reserve(key, nbytes, meta, owner, lease_s, now)
                if isinstance(result, Refusal):
                    return p.error_reply(rid, "refused", result.reason)
                conn.leases.add(result.lease_id)
                return p.ok_reply(rid, **p.reservation_to_wire(result))
            case p.Commit(lease_id=lease_id):
                conn.leases.discard(lease_id)  # whatever happens, the lease is over
                store.commit(lease_id, now)
                return p.ok_reply(rid)
            case p.Abort(lease_id=lease_id):
                conn.leases.discard(lease_id)
                store.abort(lease_id)
                return p.ok_reply(rid)
            case p.Acquire(key=key, owner=owner, lease_s=lease_s):
                self._check_lease(lease_s)
                acquired = store.acquire(key, owner, lease_s, now)
                if acquired is None:
                    return p.ok_reply(rid, found=False)
                conn.leases.add(acquired.lease_id)
                return p.ok_reply(rid, found=True, **p.acquired_to_wire(acquired))
            case p.Release(lease_id=lease_id):
                conn.leases.discard(lease_id)
                store.release(lease_id)
                return p.ok_reply(rid)
            case p.Stats():
                return p.ok_reply(rid, stats=p.stats_to_wire(store.stats()))
        raise AssertionError(f"unhandled request {req!r}")

    def _check_lease(self, lease_s: float) -> None:
        if lease_s > self.config.max_lease_s:
            raise p.ProtocolError(
                "invalid", f"lease_s {lease_s} exceeds max_lease_s {self.config.max_lease_s}"
            )

    # ----- sweeping and metrics -----

    async def _sweep(self) -> None:
        """Expires leases and entries past their deadlines. A failure here is fatal (the lifecycle
        stops the daemon with status 1): a daemon that no longer expires anything would fill its
        arena with dead rankers' leases and serve on."""
        assert self._store is not None
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                counts = self._store.expire(time.monotonic())
                if counts.writes or counts.pins:
                    # A writer or reader missed its deadline: worth a line (usually a dead ranker).
                    self._log.info("leases_expired", writes=counts.writes, pins=counts.pins)
                self._sync_metrics()
            except Exception:
                self._log.exception("sweep_failed")  # the traceback; the lifecycle logs the stop
                raise

    def _sync_metrics(self) -> None:
        assert self._store is not None
        stats = asdict(self._store.stats())
        m = self._metrics
        for kind in ("capacity", "used_bytes", "free_bytes", "largest_free", "stored_bytes"):
            m.bytes.labels(kind.removesuffix("_bytes")).set(stats[kind])
        m.entries.labels("ready").set(stats["ready"])
        m.entries.labels("writing").set(stats["writing"])
        m.pinned.set(stats["pinned"])
        m.read_leases.set(stats["read_leases"])
        # The store keeps cumulative counts; Prometheus counters get the increase since last time.
        for name, counter in (
            ("evictions", m.evictions),
            ("expirations", m.expirations.labels("entry")),
            ("write_expirations", m.expirations.labels("write")),
            ("pin_expirations", m.expirations.labels("pin")),
        ):
            delta = stats[name] - self._last_counts.get(name, 0)
            if delta > 0:
                counter.inc(delta)
            self._last_counts[name] = stats[name]


# ----- filesystem helpers -----


def _prepare_directory(directory: str) -> None:
    """Creates the socket directory 0700 if missing (parents too). An existing one is left as is."""
    if not directory:
        return
    try:
        os.makedirs(directory, mode=0o700)
        os.chmod(directory, 0o700)  # makedirs applies the umask
    except FileExistsError:
        if not os.path.isdir(directory):
            raise DaemonStartError(f"{directory} exists and is not a directory") from None


def _claim_path(path: str) -> None:
    """Removes a stale socket left by a dead daemon; refuses a live one or any other file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonStartError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise DaemonStartError(f"cannot tell whether {path} is in use: {exc}") from exc
    else:
        raise DaemonStartError(f"another process is serving at {path}")
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _unlink_if_ours(path: str, identity: tuple[int, int]) -> None:
    """Unlinks path only if it is still the socket this daemon bound (not a successor's)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(path)


def _peer(sock: Any) -> tuple[int, int, int] | None:
    try:
        pid, uid, gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return None
    return pid, uid, gid


def _peer_allowed(sock: Any) -> bool:
    """Same user or root: defence in depth behind the 0600 socket mode (the arena is everything)."""
    peer = _peer(sock)
    return peer is not None and peer[1] in (os.getuid(), 0)
