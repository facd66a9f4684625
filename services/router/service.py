"""The affinity router's process: its lifecycle and its gRPC handlers (the Ranker API it serves).

One owner object, `RouterService`, whose start / stop_intake / drain / close are the hooks of a
`shared.lifecycle.Lifecycle`: `run()` serves until SIGTERM / SIGINT (then stops intake, drains the
calls in flight and the signal batch in hand, and closes) or until the first failure of one of its
named background tasks ("membership-health", "residency-expire", "signals"), after which it does
the same and returns exit status 1, so that a supervisor restarts it.

The rooms, one job each:
  * forwarding.py: placement (residency, else rendezvous hashing) and retries; ForwardError;
  * signals.py: the Kafka pre-infer signal consumer, which dead-letters malformed signals;
  * stats.py: the Stats answer (the fleet's sums, this router's Rank latencies);
  * frontdoor/: the public port when it is not the gRPC server itself (an HTTP/2 relay);
  * here: start-up and shutdown, and the handlers, which turn requests into forwards and
    ForwardErrors into statuses.

Pass-through: Rank and PreInfer are received and forwarded as the caller's serialized bytes, and
the ranker's reply bytes go back unchanged (no parse and re-serialise of requests that carry whole
prefixes). Placement reads user_id and prefix_version from the bytes (`passthrough`); a request
that is not a protobuf message at all is answered INVALID_ARGUMENT here, anything subtler is the
ranker's to reject (its status passes through). A PreInfer's reply is parsed (it is small) for
the outcome the residency map needs. Stats is the router's own answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from functools import partial
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from services.router.config import RouterConfig
from services.router.forwarding import Forwarder, ForwardError
from services.router.frontdoor import H2_ERROR_NAMES, FrontDoor, FrontDoorError, RelayReply, UpstreamPool
from services.router.metrics import RouterMetrics
from services.router.passthrough import MalformedMessage, preinfer_key, rank_by_reference, rank_key
from services.router.residency import ResidencyMap
from services.router.signals import SignalConsumer
from services.router.stats import RankLatencies, fleet_stats
from shared.lifecycle import Lifecycle, settle_heap
from shared.logging import get_logger
from shared.membership import FORWARDED_METHODS, ROUTER_ID_PREFIX, Membership
from shared.metrics import HostStalls, serve_metrics
from shared.protos import ranker_pb2 as pb

log = get_logger("router")
SERVICE_NAME = "relaygr.v1.Router"
RANKER_SERVICE = pb.DESCRIPTOR.services_by_name["Ranker"].full_name
RESIDENCY_EXPIRE_S = 0.5  # how often passed leases leave the residency map
SHUTDOWN_GRACE_S = 5.0  # how long a drain waits for calls in flight and the signal batch in hand


class RouterService:
    """The router (see the module). `run()` for a process; `start()` then `shutdown()` where the
    caller owns the loop and the signals (tests, tools)."""

    def __init__(self, config: RouterConfig) -> None:
        if not config.rankers:
            raise ValueError("RouterConfig.rankers is empty: load it with load_config (it validates)")
        self.config = config
        self.life = Lifecycle("router", grace_s=SHUTDOWN_GRACE_S)
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self._stalls: HostStalls | None = None
        self.membership = Membership(
            config.rankers,
            check_interval_s=config.check_interval_s,
            check_timeout_s=config.check_timeout_ms / 1e3,
            fail_after=config.fail_after,
            max_message_mb=config.max_message_mb,
            on_change=self._members_changed,
            tls=config,
        )
        self.residency = ResidencyMap(config.residency_max_entries)
        self.forwarder = Forwarder(config, self.membership, self.residency, self.metrics)
        self.signals = (
            SignalConsumer(config, self.forwarder.preinfer, self.metrics.signals)
            if config.consume_signals
            else None
        )
        self._rank_ms = RankLatencies()
        self._server: grpc.aio.Server | None = None
        self._front_door: FrontDoor | None = None
        self._upstreams = UpstreamPool(
            int(config.max_message_mb * 2**20),
            on_protocol_error=self._relay_error,
            ssl_context=config.client_ssl_context() if config.tls_enabled else None,
        )
        self._health = health.aio.HealthServicer()
        self._health_updates: set[asyncio.Future[None]] = set()
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # what start spawned through self.life
        self.ready = asyncio.Event()  # set once start() has finished: the router serves
        self._intake_stopped = False
        self._closed = False
        self.port = 0
        self.metrics_port = 0

    @property
    def instance_id(self) -> str:
        return f"{ROUTER_ID_PREFIX}{self.config.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    async def run(self, install_signals: bool = True) -> int:
        """Starts, serves until SIGTERM / SIGINT or a background task's failure, drains, closes;
        returns the exit status (0: asked to stop; 1: the start or a background task failed)."""
        return await self.life.run(self, install_signals)

    async def start(self) -> None:
        """Checks the rankers once, binds gRPC, starts the front door, metrics and (when enabled)
        the signal consumer, and the background tasks. Raises when it cannot serve (a port in
        use, no broker); `close` then undoes what it did."""
        await self.membership.start(spawn=self.life.spawn)
        self.metrics.members.set(len(self.membership.healthy()))
        self._server = self._grpc_server()
        grpc_port = self._bind_grpc(self._server)
        if self.signals is not None:
            await self.signals.start()
        await self._server.start()
        self.port = await self._start_front_door(grpc_port)
        self.metrics_port = serve_metrics(self.registry, self.config.metrics_port, self.config.host)
        self._spawn(self._expire_loop(), "residency-expire")
        if self.signals is not None:
            self._spawn(self.signals.run(), "signals")
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._sync_ranker_health()
        settle_heap()  # request-time collections then never traverse the libraries' objects
        self._stalls = HostStalls(self.registry)  # beside the rankers': a host-wide stall shows in all
        self.ready.set()
        log.info("router_ready", port=self.port, metrics_port=self.metrics_port, rankers=list(self.config.rankers),
                 front_door=self.config.front_door, healthy=len(self.membership.healthy()),
                 consume_signals=self.config.consume_signals)  # fmt: skip

    def _grpc_server(self) -> grpc.aio.Server:
        """The gRPC server with the Ranker API (Rank and PreInfer as bytes in, bytes out; Stats
        parsed), health and reflection; not yet bound."""
        size = int(self.config.max_message_mb * 2**20)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),
                # One metadata limit, as the relay's (grpcio's soft limit would refuse some calls
                # at random between it and the hard one): a call over it fails alone,
                # RESOURCE_EXHAUSTED.
                ("grpc.max_metadata_size", self.config.max_header_list_bytes),
                ("grpc.absolute_max_metadata_size", self.config.max_header_list_bytes),
            ]
        )
        handlers = {
            "Rank": grpc.unary_unary_rpc_method_handler(self.Rank),
            "PreInfer": grpc.unary_unary_rpc_method_handler(self.PreInfer),
            "Stats": grpc.unary_unary_rpc_method_handler(
                self.Stats,
                request_deserializer=pb.StatsRequest.FromString,
                response_serializer=pb.StatsReply.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RANKER_SERVICE, handlers),))
        server.add_registered_method_handlers(RANKER_SERVICE, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        # Reflection describes the Ranker service from the descriptor pool, handlers aside.
        names = (
            RANKER_SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        return server

    def _bind_grpc(self, server: grpc.aio.Server) -> int:
        """Binds the gRPC server: on the public address when it is the front door, else on
        loopback, where only the front door in this process connects to it."""
        if self.config.relay_front_door:
            address = "127.0.0.1:0"
            port = server.add_insecure_port(address)
        else:
            address = f"{self.config.host}:{self.config.port}"
            port = self.config.add_port(server, address)
        if not port:
            raise OSError(f"cannot bind {address}")
        return port

    async def _start_front_door(self, grpc_port: int) -> int:
        """Starts the front door that config.front_door names and returns the public port.

        "grpc": the gRPC server is the front door (already started on the public address).
        "relay": the HTTP/2 frame relay owns the public port, serves Rank itself (`relay_rank`)
        and passes every other stream through to the gRPC server on loopback (`grpc_port`)."""
        if not self.config.relay_front_door:
            return grpc_port
        door = self._front_door = FrontDoor(
            self.relay_rank, f"127.0.0.1:{grpc_port}", int(self.config.max_message_mb * 2**20),
            on_protocol_error=self._relay_error, on_pass_through=self.metrics.relay_passed.inc,
            max_header_list_bytes=self.config.max_header_list_bytes,
            max_header_block_bytes=self.config.max_header_block_bytes,
            reset_burst=self.config.reset_burst, reset_rate_per_s=self.config.reset_rate_per_s,
            on_refused=lambda reason: self.metrics.relay_refused.labels(reason).inc(),
        )  # fmt: skip
        tls = self.config.server_ssl_context() if self.config.tls_enabled else None
        port = await door.start(self.config.host, self.config.port, tls)
        self.metrics.relay_connections.set_function(lambda: len(door.connections))
        return port

    async def stop_intake(self) -> None:
        """Health NOT_SERVING (a load balancer stops sending), no new signal batch. Idempotent."""
        if self._intake_stopped:
            return
        self._intake_stopped = True
        if self.signals is not None:
            self.signals.stop_intake()
        await self._health.enter_graceful_shutdown()

    async def drain(self) -> None:
        """Lets the signal batch in hand finish and commit, then the calls in flight, each
        within what is left of the lifecycle's grace period; the ports stop accepting."""
        await self._drain(self.life.grace_s)

    async def _drain(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        consuming = self._tasks.get("signals")
        if consuming is not None:  # it ends after the batch in hand (not cancelled on a timeout)
            await asyncio.wait([consuming], timeout=grace_s)
        if self._front_door is not None:
            await self._front_door.stop(max(0.0, deadline - time.monotonic()))
        if self._server is not None:
            await self._server.stop(max(0.0, deadline - time.monotonic()))

    async def close(self) -> None:
        """Stops what is still running (calls still in flight are cancelled), the background
        tasks, the Kafka clients and the ranker channels. Safe after a failed or partial start;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stalls is not None:
            self._stalls.close()
        if self._front_door is not None:
            await self._front_door.stop(0)
        if self._server is not None:
            await self._server.stop(0)
        self._upstreams.close()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self.signals is not None:
            await self.signals.close()
        await self.membership.close()
        log.info("router_stopped", port=self.port, failure=self.life.failure)

    async def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stops a router started with `start()` (not `run`): stop intake, drain for at most
        grace_s, close. Idempotent."""
        self.life.request_stop("shutdown")  # the background tasks' ends are no failure now
        try:
            await self.stop_intake()
            await asyncio.wait_for(self._drain(grace_s), grace_s + 1.0)
        except TimeoutError:
            log.warning("drain_timed_out", grace_s=grace_s)
        finally:
            await self.close()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks[name] = self.life.spawn(coro, name)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(RESIDENCY_EXPIRE_S)
            self.residency.expire(time.monotonic())
            self.metrics.residency.set(len(self.residency))

    def _members_changed(self, members: list[str]) -> None:
        self.metrics.members.set(len(members))
        if self._server is not None:  # health is served: follow the change
            task = asyncio.ensure_future(self._sync_ranker_health())
            self._health_updates.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self._health_updates.discard)

    async def _sync_ranker_health(self) -> None:
        """Health of "relaygr.v1.Ranker", the API this router serves: SERVING while at least one
        ranker is healthy, NOT_SERVING otherwise (Watch follows). Reads membership when it runs, so
        however the updates interleave, the last one states the current membership. (A router
        listed as a ranker still never joins: membership refuses an instance whose Stats names a
        router.)"""
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self.membership.members() else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set(RANKER_SERVICE, status)

    # ------------------------------------------------------------------ gRPC handlers

    async def Rank(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A serialized RankRequest, forwarded unchanged to the user's instance (residency, else
        hash), retrying as forwarding.py says; the ranker's RankReply bytes are the answer."""
        started = time.perf_counter()
        try:
            user_id, prefix_version = rank_key(request)
            slim = partial(rank_by_reference, request) if self.config.rank_by_reference else None
            _, reply = await self.forwarder.forward(
                "rank", user_id, prefix_version, request, self._deadline(context), slim
            )
        except MalformedMessage as exc:
            self._observe("rank", "invalid_argument", started)
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed RankRequest: {exc}")
        except ForwardError as exc:
            self._observe("rank", exc.code.name.lower(), started)
            await _abort(context, exc.code, exc.message)
        self._observe("rank", "ok", started, context)
        return reply

    async def relay_rank(self, request: bytes, timeout_s: float | None) -> RelayReply:
        """Rank for the relay front door: the same placement, retries and errors as `Rank`; the
        ranker's reply comes back whole (headers, message, trailers) to be relayed unchanged."""
        started = time.perf_counter()
        if timeout_s is None:
            timeout_s = self.config.default_timeout_ms / 1e3
        try:
            user_id, prefix_version = rank_key(request)
            slim = partial(rank_by_reference, request) if self.config.rank_by_reference else None
            _, reply = await self.forwarder.forward(
                "rank", user_id, prefix_version, request, time.monotonic() + timeout_s, slim, self._relay_call
            )
        except MalformedMessage as exc:
            self._observe("rank", "invalid_argument", started)
            raise FrontDoorError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed RankRequest: {exc}") from None
        except ForwardError as exc:
            self._observe("rank", exc.code.name.lower(), started)
            raise FrontDoorError(exc.code, exc.message) from None
        self._observe("rank", "ok", started, deferred=True)
        assert isinstance(reply, RelayReply)
        return reply

    def _relay_error(self, peer: str, code: int) -> None:
        self.metrics.relay_errors_of(peer, H2_ERROR_NAMES.get(code, str(code))).inc()

    async def _relay_call(self, target: str, method: str, request: bytes, timeout_s: float) -> RelayReply:
        """One attempt over the relay's own HTTP/2 connection to `target`."""
        upstream = await self._upstreams.get(target)
        call = upstream.unary(FORWARDED_METHODS[method].encode(), request, timeout_s)
        return await self.membership.tracked(target, call)

    async def PreInfer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A serialized PreInferRequest, forwarded with the same placement as Rank; an accepted one
        is recorded in the residency map so the user's ranking call follows it."""
        started = time.perf_counter()
        try:
            user_id, prefix_version, lease_ms = preinfer_key(request)
            _, reply = await self.forwarder.preinfer(
                request, user_id, prefix_version, lease_ms, self._deadline(context)
            )
        except MalformedMessage as exc:
            self._observe("preinfer", "invalid_argument", started)
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed PreInferRequest: {exc}")
        except ForwardError as exc:
            self._observe("preinfer", exc.code.name.lower(), started)
            await _abort(context, exc.code, exc.message)
        self._observe("preinfer", "ok", started, context)
        return reply

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        """The fleet as this router sees it: stats.fleet_stats over the healthy rankers."""
        return fleet_stats(self.instance_id, self.membership.stats().values(), self._rank_ms)

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            remaining = self.config.default_timeout_ms / 1e3
        return time.monotonic() + remaining

    def _observe(
        self,
        method: str,
        result: str,
        started: float,
        context: grpc.aio.ServicerContext | None = None,
        *,
        deferred: bool = False,
    ) -> None:
        """Records one call's latency, measured now; with `context`, the metric updates run once
        the reply has been sent (gRPC's done callback), off the call's own latency; `deferred`
        (the relay, which writes the reply in the same loop step) runs them on the next step."""
        ms = (time.perf_counter() - started) * 1e3

        def record(_context: object = None) -> None:
            self.metrics.latency_of(method, result).observe(ms)
            if method == "rank" and result == "ok":
                self._rank_ms.append(ms)

        if context is not None:
            context.add_done_callback(record)
        elif deferred:
            asyncio.get_running_loop().call_soon(record)
        else:
            record()


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


def serve(config: RouterConfig) -> int:
    """Runs the router on uvloop until it stops; returns the exit status (RouterService.run)."""
    import uvloop

    async def main() -> int:
        return await RouterService(config).run()

    return uvloop.run(main())
