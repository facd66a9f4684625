"""The affinity router: the Ranker gRPC API as a front door, and the pre-infer signal consumer.

One owner object, `RouterService`, with `start()` / `run()` / `shutdown()` and named background
tasks ("membership-health", "residency-expire", "signals").

Pass-through: Rank and PreInfer are received and forwarded as the caller's serialized bytes, and
the ranker's reply bytes go back unchanged (no parse and re-serialise of requests that carry whole
prefixes). Placement reads user_id and prefix_version from the bytes (`passthrough`); a request
that is not a protobuf message at all is answered INVALID_ARGUMENT here, anything subtler is the
ranker's to reject (its status passes through). A PreInfer's reply is parsed (it is small) for
the outcome the residency map needs. Stats is the router's own answer.

Placement (the same for a user's pre-inference and its ranking call, so both find one psi):
  1. the residency map: where this router forwarded an accepted PreInfer for this user and prefix
     version, while its lease has not passed and that instance is healthy;
  2. otherwise `placement.preference` (rendezvous hashing with bounded load) over the healthy
     instances; the rest of that order is the retry order.

Forwarding (Rank and PreInfer are both idempotent, so retrying is safe): each attempt gets the
caller's remaining deadline (capped by rank_attempt_timeout_ms when set). UNAVAILABLE marks the
instance failed (it leaves membership until a health check passes) and retries on the next one;
RESOURCE_EXHAUSTED (overloaded: at most overload_retries more instances, so a shedding fleet
answers fast instead of multiplying its load), CANCELLED (server going away) and an attempt's own
DEADLINE_EXCEEDED (only when the cap, not the caller's deadline, ran out) retry on the next one
without marking it. Any other status (INVALID_ARGUMENT, ...) is the caller's answer and passes
through unchanged. No healthy instance: UNAVAILABLE "no healthy ranker instance".

Signals (Kafka, consumer group, manual commits): every record of a batch is forwarded as a
PreInfer, dead-lettered (malformed: a JSON record on the DLQ topic), or counted lost (no instance
took it after a few tries); only then is the batch's offset committed. At-least-once: PreInfer
is idempotent, so a redelivered signal is harmless.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NamedTuple, NoReturn

import grpc
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.ranker.wire import prefix_from_proto
from services.router.config import RouterConfig
from services.router.frontdoor import H2_ERROR_NAMES, FrontDoor, FrontDoorError, RelayReply, UpstreamPool
from services.router.frontdoor.h2lib import H2FrontDoor
from services.router.membership import FORWARDED_METHODS, ROUTER_ID_PREFIX, Membership
from services.router.passthrough import MalformedMessage, preinfer_key, rank_by_reference, rank_key
from services.router.placement import preference
from services.router.residency import ResidencyMap
from shared.dlq import dead_letter_headers
from shared.kafka import ensure_topics, make_consumer, make_producer
from shared.lifecycle import settle_heap
from shared.logging import get_logger
from shared.metrics import LATENCY_MS_BUCKETS, serve_metrics
from shared.protos import events_pb2
from shared.protos import ranker_pb2 as pb
from shared.stats import percentile
from shared.wire import WireError

log = get_logger("router")
SERVICE_NAME = "relaygr.v1.Router"
RANKER_SERVICE = pb.DESCRIPTOR.services_by_name["Ranker"].full_name
SIGNAL_SCHEMA_VERSION = 1
_ACCEPTED = frozenset(
    {
        pb.PreInferReply.ACCEPTED,
        pb.PreInferReply.ALREADY_RESIDENT,
        pb.PreInferReply.ALREADY_PRODUCING,
        pb.PreInferReply.RELOAD_SCHEDULED,
    }
)
# Statuses after which the same call may go to the next instance (the calls are idempotent).
_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


Invoke = Callable[[str, str, bytes, float], Awaitable[Any]]
"""One forwarding attempt: (target, method, serialized request, timeout_s) -> the reply."""


class ForwardError(Exception):
    """A forwarded call got no answer from any instance, or a non-retryable status from one.
    `code` is what the router's caller gets; `client_error` marks a status passed through."""

    def __init__(self, code: grpc.StatusCode, message: str, client_error: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.client_error = client_error


class _Malformed(ValueError):
    """A signal that can never be forwarded: it goes to the DLQ with this reason."""


class _Placement(NamedTuple):
    order: list[str]
    source: str  # "residency" | "hash" | "round_robin" | "none"
    fingerprint: int = 0  # content of the psi the residency entry names (source "residency")


class _Children:
    """A labelled metric's children, looked up once per label values: `labels()` validates and
    takes a lock on every call, too slow for every routed call (children are never removed)."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency_ms = Histogram(
            "relaygr_router_latency_ms", "routed call latency (entry to reply)", ["method", "result"],
            registry=registry, buckets=LATENCY_MS_BUCKETS,
        )  # fmt: skip
        self.attempts = Counter("relaygr_router_attempts_total", "forwarding attempts by result",
                                ["method", "result"], registry=registry)  # fmt: skip
        self.retries = Counter("relaygr_router_retries_total", "attempts after the first", ["method"],
                               registry=registry)  # fmt: skip
        self.placement = Counter("relaygr_router_placement_total", "placement decisions by source",
                                 ["method", "source"], registry=registry)  # fmt: skip
        self.members = Gauge(
            "relaygr_router_healthy_instances", "healthy ranker instances", registry=registry
        )
        self.residency = Gauge("relaygr_router_residency_entries", "users in the residency map",
                               registry=registry)  # fmt: skip
        self.signals = Counter("relaygr_router_signals_total", "pre-infer signals by outcome "
                               "(forwarded, refused, dlq, lost, stale)", ["outcome"], registry=registry)  # fmt: skip
        self.latency_of = _Children(self.latency_ms)
        self.attempts_of = _Children(self.attempts)
        self.retries_of = _Children(self.retries)
        self.placement_of = _Children(self.placement)
        self.by_reference = Counter("relaygr_router_rank_by_reference_total",
                                    "ranking calls forwarded with a prefix reference, by result (hit: "
                                    "answered; resent: prefix_required, the whole call followed)",
                                    ["result"], registry=registry)  # fmt: skip
        self.by_reference_of = _Children(self.by_reference)
        self.relay_connections = Gauge("relaygr_router_relay_connections",
                                       "client connections open on the relay front door", registry=registry)  # fmt: skip
        self.relay_errors = Counter("relaygr_router_relay_protocol_errors_total",
                                    "HTTP/2 connections the relay closed for a protocol error, by peer and code",
                                    ["peer", "code"], registry=registry)  # fmt: skip
        self.relay_errors_of = _Children(self.relay_errors)
        self.relay_passed = Counter("relaygr_router_relay_passed_through_total",
                                    "streams the relay passed to the router's gRPC server (all but Rank)",
                                    registry=registry)  # fmt: skip
        self.relay_refused = Counter("relaygr_router_relay_refused_streams_total",
                                     "client streams the relay refused while their connection went on, by "
                                     "reason (header_list_too_large, too_many_streams)",
                                     ["reason"], registry=registry)  # fmt: skip


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        if not config.rankers:
            raise ValueError("RouterConfig.rankers is empty: load it with load_config (it validates)")
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = _Metrics(self.registry)
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
        self._round_robin = 0
        self._rank_ms: collections.deque[float] = collections.deque(maxlen=2048)
        self._server: grpc.aio.Server | None = None
        self._front_door: FrontDoor | H2FrontDoor | None = None
        self._upstreams = UpstreamPool(
            int(config.max_message_mb * 2**20),
            on_protocol_error=self._relay_error,
            ssl_context=config.client_ssl_context() if config.tls_enabled else None,
        )
        # The relay's request header block to each (method, target), less the grpc-timeout that
        # follows it (literals: a block can be concatenated from parts).
        self._health = health.aio.HealthServicer()
        self._health_updates: set[asyncio.Future[None]] = set()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._background: dict[str, asyncio.Task[None]] = {}
        self._stop_intake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._started = False
        self.port = 0
        self.metrics_port = 0

    @property
    def instance_id(self) -> str:
        return f"{ROUTER_ID_PREFIX}{self.config.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Checks the rankers once, binds gRPC, starts metrics and (when enabled) the consumer."""
        self._started = True
        await self.membership.start()
        self.metrics.members.set(len(self.membership.healthy()))
        size = int(self.config.max_message_mb * 2**20)
        opts = [
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            ("grpc.so_reuseport", 0),
            # One metadata limit, as the relay's (grpcio's soft limit would refuse some calls at random
            # between it and the hard one): a call over it fails alone, RESOURCE_EXHAUSTED.
            ("grpc.max_metadata_size", self.config.max_header_list_bytes),
            ("grpc.absolute_max_metadata_size", self.config.max_header_list_bytes),
        ]
        self._server = grpc.aio.server(options=opts)
        # Rank and PreInfer: bytes in, bytes out (no deserializer / serializer); Stats is parsed.
        handlers = {
            "Rank": grpc.unary_unary_rpc_method_handler(self.Rank),
            "PreInfer": grpc.unary_unary_rpc_method_handler(self.PreInfer),
            "Stats": grpc.unary_unary_rpc_method_handler(
                self.Stats,
                request_deserializer=pb.StatsRequest.FromString,
                response_serializer=pb.StatsReply.SerializeToString,
            ),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(RANKER_SERVICE, handlers),)
        )
        self._server.add_registered_method_handlers(RANKER_SERVICE, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        # Reflection describes the Ranker service from the descriptor pool, handlers aside.
        names = (
            RANKER_SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self._server)
        relay = self.config.relay_front_door
        # With the relay front door, the gRPC server listens on loopback only: the relay owns the
        # public port and passes every stream it does not serve itself through to it.
        if relay:  # only the relay, in this process, connects to it
            address = "127.0.0.1:0"
            grpc_port = self._server.add_insecure_port(address)
        else:
            address = f"{self.config.host}:{self.config.port}"
            grpc_port = self.config.add_port(self._server, address)
        if not grpc_port:
            raise OSError(f"cannot bind {address}")
        if self.config.consume_signals:
            await self._start_kafka()
        await self._server.start()
        self.port = grpc_port
        if relay:
            relay_type = H2FrontDoor if self.config.front_door == "h2" else FrontDoor
            door = self._front_door = relay_type(
                self.relay_rank, f"127.0.0.1:{grpc_port}", size,
                on_protocol_error=self._relay_error, on_pass_through=self.metrics.relay_passed.inc,
                max_header_list_bytes=self.config.max_header_list_bytes,
                max_header_block_bytes=self.config.max_header_block_bytes,
                reset_burst=self.config.reset_burst, reset_rate_per_s=self.config.reset_rate_per_s,
                on_refused=lambda reason: self.metrics.relay_refused.labels(reason).inc(),
            )  # fmt: skip
            tls = self.config.server_ssl_context() if self.config.tls_enabled else None
            self.port = await door.start(self.config.host, self.config.port, tls)
            self.metrics.relay_connections.set_function(lambda: len(door.connections))
        self.metrics_port = serve_metrics(self.registry, self.config.metrics_port, self.config.host)
        self._spawn(self._expire_loop(), "residency-expire")
        if self._consumer is not None:
            self._spawn(self._consume_loop(self._consumer), "signals")
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._sync_ranker_health()
        settle_heap()  # request-time collections then never traverse the libraries' objects
        log.info("router_ready", port=self.port, metrics_port=self.metrics_port, rankers=list(self.config.rankers),
                 front_door=self.config.front_door,
                 healthy=len(self.membership.healthy()), consume_signals=self.config.consume_signals)  # fmt: skip

    async def _start_kafka(self) -> None:
        await ensure_topics(
            self.config,
            {
                self.config.signal_topic: self.config.topic_partitions,
                self.config.dlq_topic: self.config.topic_partitions,
            },
        )
        self._producer = make_producer(self.config)
        await self._producer.start()
        self._consumer = make_consumer(self.config, [self.config.signal_topic], self.config.group_id)
        await self._consumer.start()

    async def run(self) -> None:
        """Starts, serves until SIGTERM / SIGINT, shuts down. A failed start cleans up and raises."""
        try:
            await self.start()
        except BaseException:
            await self.shutdown(grace_s=0)
            raise
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))
        await self._stopped.wait()

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stops intake (health NOT_SERVING, no new batches), lets the current signal batch finish
        and commit, drains in-flight calls (up to grace_s), then closes the Kafka clients and the
        ranker channels. Idempotent."""
        if self._stopped.is_set() or self._stop_intake.is_set():
            return
        self._stop_intake.set()
        try:
            await self._health.enter_graceful_shutdown()
            consumer_task = self._background.get("signals")
            if consumer_task is not None:
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(consumer_task), grace_s)
            if self._front_door is not None:
                await self._front_door.stop(grace_s)
            if self._server is not None:
                await self._server.stop(grace_s)
            self._upstreams.close()
            for task in list(self._background.values()):
                task.cancel()
            await asyncio.gather(*self._background.values(), return_exceptions=True)
            if self._consumer is not None:
                with contextlib.suppress(KafkaError):
                    await self._consumer.stop()
            if self._producer is not None:
                with contextlib.suppress(KafkaError):
                    await self._producer.stop()
            if self._started:
                await self.membership.close()
            log.info("router_stopped", port=self.port)
        finally:
            self._stopped.set()  # whatever failed above, the process must still exit

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

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(_log_unexpected_exit)
        self._background[name] = task

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.residency.expire(time.monotonic())
            self.metrics.residency.set(len(self.residency))

    # ------------------------------------------------------------------ placement and forwarding

    def place(self, user_id: int, prefix_version: int, method: str) -> _Placement:
        """The instance order for this user: a live residency entry on a healthy instance first,
        then the rendezvous / bounded-load order. Empty when no instance is healthy."""
        members = self.membership.members()
        if not members:
            return _Placement([], "none")
        if method == "rank" and self.config.placement == "round_robin":
            # The no-affinity ablation: ranking calls ignore where psi lives (signals still hash).
            self._round_robin += 1
            start = self._round_robin % len(members)
            order = list(members[start:] + members[:start])
            self.metrics.placement_of(method, "round_robin").inc()
            return _Placement(order, "round_robin")
        if len(members) == 1:
            order = [members[0]]  # what preference() returns for one instance, without hashing
        else:
            order = preference(
                user_id, self.membership.healthy(), self.config.load_factor, slack=self.config.load_slack
            )
        entry = self.residency.lookup(user_id, prefix_version, time.monotonic())
        if entry is not None and entry.instance in order:
            order.remove(entry.instance)
            order.insert(0, entry.instance)
            self.metrics.placement_of(method, "residency").inc()
            return _Placement(order, "residency", entry.fingerprint)
        self.metrics.placement_of(method, "hash").inc()
        return _Placement(order, "hash")

    async def forward(
        self,
        method: str,
        user_id: int,
        prefix_version: int,
        request: bytes,
        deadline: float,
        slim: Callable[[int], bytes | None] | None = None,
        invoke: Invoke | None = None,
    ) -> tuple[str, Any]:
        """Sends one idempotent call along the user's placement order until an instance answers.

        `method` is "rank" or "preinfer", `request` the serialized request (sent unchanged to each
        attempt), `deadline` on time.monotonic(). `slim`, for a ranking call, makes the request
        by reference to the resident psi's fingerprint (see rank_by_reference): sent instead of
        `request` to the instance the residency map names, and followed by `request` there when
        that instance answers prefix_required. `invoke` makes one attempt (default: the ranker's gRPC channel, the reply
        as bytes; the relay front door passes its own). Returns (target, the reply); raises
        ForwardError with the status the caller should get.
        """
        invoke = invoke or self.membership.call
        placement = self.place(user_id, prefix_version, method)
        slim_to = placement.order[0] if slim is not None and placement.source == "residency" else None
        if not placement.order:
            raise ForwardError(
                grpc.StatusCode.UNAVAILABLE,
                f"no healthy ranker instance (0 of {len(self.membership.targets)} up)",
            )
        cap = self.config.rank_attempt_timeout_ms / 1e3
        failures: list[str] = []
        last_code = grpc.StatusCode.UNAVAILABLE
        attempt = 0
        order = placement.order
        extended = False
        overloaded = 0  # RESOURCE_EXHAUSTED answers so far
        position = -1
        while position + 1 < len(order):
            position += 1
            target = order[position]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last_code = grpc.StatusCode.DEADLINE_EXCEEDED
                break
            if attempt and not self.membership.is_healthy(target):
                continue  # dropped since the order was computed (e.g. by a concurrent call)
            if attempt:
                self.metrics.retries_of(method).inc()
            attempt += 1
            # The cap lets a frozen instance cost a retry, not the whole deadline; the last healthy
            # candidate gets all that is left (there is nowhere else to go).
            timeout = remaining
            if (
                cap > 0
                and position + 1 < len(order)
                and any(self.membership.is_healthy(t) for t in order[position + 1 :])
            ):
                timeout = min(remaining, cap)
            try:
                reply = await self._call(
                    invoke,
                    target,
                    method,
                    request,
                    timeout,
                    partial(slim, placement.fingerprint) if slim is not None and target == slim_to else None,
                )
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                self.metrics.attempts_of(method, code.name.lower()).inc()
                if code not in _RETRYABLE:
                    raise ForwardError(code, exc.details() or code.name, client_error=True) from None
                if code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout >= remaining:
                    last_code = code  # the caller's own deadline ran out, not just this attempt's
                    failures.append(f"{target}: {code.name}")
                    break
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded += 1
                    last_code = code
                    failures.append(f"{target}: {code.name} {exc.details() or ''}".rstrip())
                    if overloaded > self.config.overload_retries:
                        break  # the fleet is shedding: answer now rather than spread the load further
                    continue
                if code is grpc.StatusCode.UNAVAILABLE:
                    self.membership.mark_failed(target, f"{method} UNAVAILABLE")
                elif (
                    code is grpc.StatusCode.DEADLINE_EXCEEDED
                    and not extended
                    and not any(self.membership.is_healthy(t) for t in order[position + 1 :])
                ):
                    # Only the cap ran out and no other healthy instance is left (one may have
                    # failed meanwhile): one last, uncapped try where it is healthy.
                    order = order + [t for t in placement.order if self.membership.is_healthy(t)][:1]
                    extended = True
                last_code = code
                failures.append(f"{target}: {code.name} {exc.details() or ''}".rstrip())
                log.debug("attempt_failed", method=method, target=target, code=code.name, user=user_id)
                continue
            self.metrics.attempts_of(method, "ok").inc()
            return target, reply
        detail = "; ".join(failures) if failures else "no attempt made"
        if last_code is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise ForwardError(last_code, f"deadline exceeded after {attempt} attempt(s): {detail}")
        raise ForwardError(last_code, f"no ranker instance answered ({attempt} attempt(s)): {detail}")

    async def _call(
        self,
        invoke: Invoke,
        target: str,
        method: str,
        request: bytes,
        timeout_s: float,
        slim: Callable[[], bytes | None] | None,
    ) -> Any:
        """One attempt; by reference first when `slim` is given and makes a reference."""
        by_reference = slim() if slim is not None else None
        if by_reference is None:
            return await invoke(target, method, request, timeout_s)
        started = time.monotonic()
        try:
            reply = await invoke(target, method, by_reference, timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION or "prefix_required" not in (
                exc.details() or ""
            ):
                raise
            # The psi went (expired, evicted, instance restarted): the whole call, same instance,
            # where a reload or the full computation can still serve it.
            self.metrics.by_reference_of("resent").inc()
            return await invoke(target, method, request, max(0.001, timeout_s - (time.monotonic() - started)))
        self.metrics.by_reference_of("hit").inc()
        return reply

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            remaining = self.config.default_timeout_ms / 1e3
        return time.monotonic() + remaining

    def _lease_deadline(self, lease_deadline_unix_ms: int) -> float:
        """A lease on the wall clock -> time.monotonic() (the residency map's clock)."""
        if lease_deadline_unix_ms <= 0:
            return time.monotonic() + self.config.default_lease_ms / 1e3
        return time.monotonic() + (lease_deadline_unix_ms - time.time() * 1e3) / 1e3

    async def _preinfer(
        self, request: bytes, user_id: int, prefix_version: int, lease_deadline_unix_ms: int, deadline: float
    ) -> tuple[pb.PreInferReply, bytes]:
        """Forwards a serialized PreInferRequest (its placement key and lease already read from it);
        an accepted one is recorded in the residency map. Returns the reply parsed and as sent."""
        target, raw = await self.forward("preinfer", user_id, prefix_version, request, deadline)
        try:
            reply = pb.PreInferReply.FromString(raw)
        except DecodeError:
            raise ForwardError(
                grpc.StatusCode.INTERNAL, f"{target} sent an undecodable PreInferReply"
            ) from None
        if reply.outcome in _ACCEPTED:
            now = time.monotonic()
            self.residency.record(
                user_id,
                prefix_version,
                target,
                self._lease_deadline(lease_deadline_unix_ms),
                now,
                fingerprint=reply.fingerprint,
            )
        return reply, raw

    # ------------------------------------------------------------------ gRPC handlers

    async def Rank(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A serialized RankRequest, forwarded unchanged to the user's instance (residency, else
        hash), retrying as the module says; the ranker's RankReply bytes are the answer."""
        started = time.perf_counter()
        try:
            user_id, prefix_version = rank_key(request)
            slim = partial(rank_by_reference, request) if self.config.rank_by_reference else None
            _, reply = await self.forward(
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
            _, reply = await self.forward(
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
            _, reply = await self._preinfer(
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
        """The fleet as this router sees it (the contract is in ranker.proto, StatsReply):
        instance_id "router@host:port"; every byte, backlog, queue and counter field (hbm_hits,
        hbm_misses, demotions, reloads, psi_produced, psi_expired, preinfers_refused, ...) is the sum
        over the healthy rankers' last polled Stats (up to one check interval old; a ranker that
        leaves membership leaves the sums, so they can fall); model_version is the rankers'
        common version ("" when they differ); lead_time_p50_ms is the highest ranker's;
        rank_p50/p99 are this router's own end-to-end Rank latencies (recent window);
        recent_batches is empty; expander_connected is true only if every healthy ranker has its
        host tier."""
        stats = list(self.membership.stats().values())
        versions = {s.model_version for s in stats}
        window = list(self._rank_ms)
        return pb.StatsReply(
            instance_id=self.instance_id,
            model_version=versions.pop() if len(versions) == 1 else "",
            hbm_budget_bytes=sum(s.hbm_budget_bytes for s in stats),
            hbm_resident_bytes=sum(s.hbm_resident_bytes for s in stats),
            hbm_leased_bytes=sum(s.hbm_leased_bytes for s in stats),
            hbm_evictable_bytes=sum(s.hbm_evictable_bytes for s in stats),
            preinfer_backlog=sum(s.preinfer_backlog for s in stats),
            rank_queue_depth=sum(s.rank_queue_depth for s in stats),
            preinfers_refused=sum(s.preinfers_refused for s in stats),
            rank_p50_ms=percentile(window, 50) if window else 0.0,
            rank_p99_ms=percentile(window, 99) if window else 0.0,
            expander_connected=bool(stats) and all(s.expander_connected for s in stats),
            psi_bytes_per_token=stats[0].psi_bytes_per_token if stats else 0,
            demotions=sum(s.demotions for s in stats),
            reloads=sum(s.reloads for s in stats),
            psi_produced=sum(s.psi_produced for s in stats),
            psi_expired=sum(s.psi_expired for s in stats),
            lead_time_p50_ms=max((s.lead_time_p50_ms for s in stats), default=0.0),
            hbm_hits=sum(s.hbm_hits for s in stats),
            hbm_misses=sum(s.hbm_misses for s in stats),
            prefix_content_mismatches=sum(s.prefix_content_mismatches for s in stats),
        )

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

    # ------------------------------------------------------------------ signals

    async def _consume_loop(self, consumer: AIOKafkaConsumer) -> None:
        """Batch by batch until intake stops. Nothing that goes wrong in a batch ends the loop."""
        while not self._stop_intake.is_set():
            try:
                await self._consume_batch(consumer)
            except Exception as exc:
                log.error("signal_consumer_error", error=repr(exc))
                await asyncio.sleep(0.5)

    async def _consume_batch(self, consumer: AIOKafkaConsumer) -> None:
        """Forwards or dead-letters every record of one batch, then commits its offsets. A batch
        that could not be finished (e.g. the DLQ unwritable) is re-read from its first offsets."""
        try:
            batch = await consumer.getmany(timeout_ms=200, max_records=self.config.signal_batch)
        except KafkaError as exc:
            log.warning("signal_fetch_failed", error=repr(exc))
            await asyncio.sleep(0.5)
            return
        if not batch:
            return
        try:
            await self._handle_batch(batch)
        except Exception as exc:
            log.error("signal_batch_failed", error=repr(exc), records=sum(map(len, batch.values())))
            for tp, records in batch.items():
                with contextlib.suppress(Exception):  # the partition may have been revoked meanwhile
                    consumer.seek(tp, records[0].offset)
            await asyncio.sleep(0.5)
            return
        offsets = {tp: records[-1].offset + 1 for tp, records in batch.items()}
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # e.g. a rebalance: the records come again (at-least-once)
            log.warning("signal_commit_failed", error=repr(exc))

    async def _handle_batch(self, batch: dict[TopicPartition, list[ConsumerRecord[Any, Any]]]) -> None:
        """Records of one user (one key) in order; different users concurrently, bounded."""
        by_key: dict[bytes | None, list[ConsumerRecord[Any, Any]]] = collections.defaultdict(list)
        for records in batch.values():
            for record in records:
                by_key[record.key].append(record)
        limit = asyncio.Semaphore(self.config.signal_concurrency)

        async def run(records: list[ConsumerRecord[Any, Any]]) -> None:
            async with limit:
                for record in records:
                    outcome = await self._handle_signal(record)
                    self.metrics.signals.labels(outcome).inc()

        await asyncio.gather(*(run(records) for records in by_key.values()))

    def _decode_signal(self, record: ConsumerRecord[Any, Any]) -> events_pb2.PreInferSignal:
        if record.value is None:
            raise _Malformed("empty value")
        signal_msg = events_pb2.PreInferSignal()
        try:
            signal_msg.ParseFromString(record.value)
        except DecodeError as exc:
            raise _Malformed(f"undecodable PreInferSignal: {exc}") from None
        if signal_msg.schema_version != SIGNAL_SCHEMA_VERSION:
            raise _Malformed(f"schema_version {signal_msg.schema_version} is not {SIGNAL_SCHEMA_VERSION}")
        if not signal_msg.request_id:
            raise _Malformed("request_id is required")
        if not signal_msg.HasField("prefix"):
            raise _Malformed("prefix is required")
        try:
            prefix_from_proto(signal_msg.prefix, self.config.limits)
        except WireError as exc:
            raise _Malformed(f"invalid prefix: {exc}") from None
        return signal_msg

    async def _handle_signal(self, record: ConsumerRecord[Any, Any]) -> str:
        """One signal -> "forwarded" | "refused" | "dlq" | "lost" | "stale". Raises only when the
        DLQ itself cannot be written (the batch is then retried)."""
        try:
            signal_msg = self._decode_signal(record)
        except _Malformed as exc:
            await self._dead_letter(record, str(exc))
            return "dlq"
        lease_ms = signal_msg.lease_deadline_unix_ms
        if 0 < lease_ms <= time.time() * 1e3:
            log.info("signal_stale", request_id=signal_msg.request_id, user=signal_msg.prefix.user_id)
            return "stale"  # its ranking call is over: pre-inferring now would only waste work
        prefix = signal_msg.prefix
        request = pb.PreInferRequest(
            request_id=signal_msg.request_id, prefix=prefix, lease_deadline_unix_ms=lease_ms
        ).SerializeToString()
        error: ForwardError | None = None
        for attempt in range(self.config.signal_retries):
            if attempt:
                await asyncio.sleep(min(self.config.check_interval_s, 0.5) * attempt)
            try:
                reply, _ = await self._preinfer(
                    request,
                    prefix.user_id,
                    prefix.prefix_version,
                    lease_ms,
                    time.monotonic() + self.config.preinfer_timeout_ms / 1e3,
                )
            except ForwardError as exc:
                if exc.client_error:
                    await self._dead_letter(record, f"ranker rejected: {exc.code.name}: {exc.message}")
                    return "dlq"
                error = exc
                continue
            return "forwarded" if reply.outcome in _ACCEPTED else "refused"
        log.warning("signal_lost", request_id=signal_msg.request_id, user=signal_msg.prefix.user_id,
                    error=error.message if error else "")  # fmt: skip
        return "lost"

    async def _dead_letter(self, record: ConsumerRecord[Any, Any], reason: str) -> None:
        """The original record, the reason in headers (shared/dlq.py). A dead letter that can never
        be written (too large) is logged and skipped; other errors raise (the batch is retried)."""
        assert self._producer is not None
        headers = dead_letter_headers(record, reason, "router", int(time.time() * 1e3))
        try:
            await self._producer.send_and_wait(
                self.config.dlq_topic, record.value, key=record.key, headers=headers
            )
        except (MessageSizeTooLargeError, RecordTooLargeError) as exc:
            log.error("dead_letter_undeliverable", reason=reason, topic=record.topic, partition=record.partition,
                      offset=record.offset, error=repr(exc))  # fmt: skip
            return
        log.warning("signal_dead_lettered", reason=reason, topic=record.topic, partition=record.partition,
                    offset=record.offset)  # fmt: skip


def _log_unexpected_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background_task_died", task=task.get_name(), error=repr(task.exception()))


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


def serve(config: RouterConfig) -> None:
    import uvloop

    async def main() -> None:
        await RouterService(config).run()

    uvloop.run(main())
