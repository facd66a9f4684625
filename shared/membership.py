"""Which ranker instances are up, and how loaded: a static target list, health-checked.

Shared by the router (which forwards calls to the instances) and the trigger (which accounts
pre-inference per instance): both must see the same instances to compute the same placement.

One grpc.aio channel per target, created inside the running loop by `start()` and reused by every
call (health checks, Stats polls, forwarded Rank / PreInfer). Rank and PreInfer are forwarded as
serialized bytes (`call`): methods with no serializers, registered with the channel once. A
background task (spawned by the owner's lifecycle when it passes one) checks every target each
`check_interval_s`:

* grpc.health.v1 `Check` on "relaygr.v1.Ranker" with a short deadline. A target is dropped after
  `fail_after` consecutive failures, i.e. within about fail_after x (interval + timeout) of dying,
  and at once when it answers NOT_SERVING (it is draining) or when a caller reports a failed real
  call (`mark_failed`). It rejoins after one successful check.
* `Stats`, for the load figure placement balances on: rank_queue_depth + preinfer_backlog.

The load an instance reports to `healthy()` is max(polled load, calls this router has in flight to
it): the poll sees every router's work but is up to one interval old; the local count is exact for
this router and immediate, so a burst between two polls still spreads.

Only the "relaygr.v1.Ranker" health name counts, and never for a target whose Stats names a
router (ROUTER_ID_PREFIX): a router also answers "relaygr.v1.Ranker" (the API it serves), but one
listed by mistake as a ranker never joins, so routers cannot forward in a loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.logging import get_logger
from shared.placement import Instance
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from shared.tls import PLAINTEXT, TlsSettings

log = get_logger("membership")
T = TypeVar("T")
Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task[Any]]
"""Starts a named background task (e.g. shared.lifecycle.Lifecycle.spawn)."""
CHECK_TASK_NAME = "membership-health"
RANKER_HEALTH_NAME = "relaygr.v1.Ranker"
ROUTER_ID_PREFIX = "router@"  # a router's Stats instance_id: "router@host:port"
# The methods forwarded as bytes (`Membership.call`), by the router's method name.
FORWARDED_METHODS = {"rank": "/relaygr.v1.Ranker/Rank", "preinfer": "/relaygr.v1.Ranker/PreInfer"}


@dataclass
class _Target:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.RankerStub
    health: health_pb2_grpc.HealthStub
    # Bytes in, bytes out: the router passes requests and replies through unchanged.
    raw: dict[str, grpc.aio.UnaryUnaryMultiCallable]
    healthy: bool = False
    failures: int = 0
    polled_load: float = 0.0
    inflight: int = 0
    stats: pb.StatsReply | None = None


def channel_options(max_message_mb: float) -> list[tuple[str, int]]:
    """Large messages (prefixes travel as bytes) and fast reconnects: gRPC's default reconnect
    backoff grows to 120 s, which would keep a restarted ranker out for minutes."""
    size = int(max_message_mb * 2**20)
    return [
        ("grpc.max_receive_message_length", size),
        ("grpc.max_send_message_length", size),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class Membership:
    """The live view of a static list of ranker targets (host:port). Driven from one loop."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        check_interval_s: float = 0.2,
        check_timeout_s: float = 0.25,
        fail_after: int = 2,
        max_message_mb: float = 64.0,
        on_change: Callable[[list[str]], None] | None = None,
        tls: TlsSettings = PLAINTEXT,
    ) -> None:
        if not targets:
            raise ValueError("Membership needs at least one target")
        if len(set(targets)) != len(targets):
            raise ValueError("targets must be distinct")
        if fail_after < 1:
            raise ValueError("fail_after must be >= 1")
        self.targets: tuple[str, ...] = tuple(targets)
        self.check_interval_s = check_interval_s
        self.check_timeout_s = check_timeout_s
        self.fail_after = fail_after
        self.max_message_mb = max_message_mb
        self._on_change = on_change
        self.tls = tls
        self._state: dict[str, _Target] = {}
        self._members: tuple[str, ...] = ()  # the healthy targets, kept by _set
        self._task: asyncio.Task[Any] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, spawn: Spawn | None = None) -> None:
        """Opens the channels (in the running loop), runs one round of checks so `healthy()` is
        meaningful on return, then keeps checking in a background task named CHECK_TASK_NAME,
        started with `spawn` when given (the owner's lifecycle then watches it), else on the
        running loop. `close` cancels it either way."""
        if self._state:
            raise RuntimeError("Membership already started")
        opts = channel_options(self.max_message_mb)
        for address in self.targets:
            channel = self.tls.channel(address, options=opts)
            raw = {
                name: channel.unary_unary(path, _registered_method=True)
                for name, path in FORWARDED_METHODS.items()
            }
            self._state[address] = _Target(
                address, channel, pb_grpc.RankerStub(channel), health_pb2_grpc.HealthStub(channel), raw
            )
        await self._round()
        for state in self._state.values():
            if not state.healthy:
                log.warning("ranker_not_ready", target=state.address, failures=state.failures)
        if spawn is None:
            self._task = asyncio.get_running_loop().create_task(self._check_loop(), name=CHECK_TASK_NAME)
        else:
            self._task = spawn(self._check_loop(), CHECK_TASK_NAME)

    async def close(self) -> None:
        """Stops checking and closes every channel (calls still in flight on them are cancelled)."""
        if self._task is not None:
            self._task.cancel()
            # Its failure, if it failed, is the owner's lifecycle's to report: closing goes on.
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for target in self._state.values():
            await target.channel.close()

    # ------------------------------------------------------------------ queries

    def healthy(self) -> list[Instance]:
        """The instances currently up, in target-list order, with their load figure."""
        return [
            Instance(t.address, max(t.polled_load, float(t.inflight)))
            for t in self._state.values()
            if t.healthy
        ]

    def members(self) -> tuple[str, ...]:
        """The healthy targets in target-list order: what `healthy()` lists, without building load
        figures (the routed call's fast path, when there is no choice to balance)."""
        return self._members

    def is_healthy(self, target: str) -> bool:
        state = self._state.get(target)
        return state is not None and state.healthy

    def stub(self, target: str) -> pb_grpc.RankerStub:
        """The Ranker stub on the target's shared channel (KeyError for an unknown target)."""
        return self._state[target].stub

    def stats(self) -> dict[str, pb.StatsReply]:
        """The last Stats reply of every healthy target that has answered one."""
        return {t.address: t.stats for t in self._state.values() if t.healthy and t.stats is not None}

    async def call(self, target: str, method: str, request: bytes, timeout_s: float) -> bytes:
        """One forwarded call ("rank" | "preinfer", FORWARDED_METHODS) of serialized `request` to
        `target`, counted as in flight to it while it runs; the reply's bytes, unparsed. Raises
        grpc.aio.AioRpcError as the call does, KeyError for an unknown target or method."""
        reply: bytes = await self.tracked(target, self._state[target].raw[method](request, timeout=timeout_s))
        return reply

    async def tracked(self, target: str, call: Awaitable[T]) -> T:
        """Awaits `call` (any call to `target`) counted as in flight to it while it runs."""
        state = self._state[target]
        state.inflight += 1
        try:
            return await call
        finally:
            state.inflight -= 1

    # ------------------------------------------------------------------ failures

    def mark_failed(self, target: str, reason: str = "call failed") -> None:
        """A real call to `target` failed as if the instance were gone: drop it now. It rejoins
        after its next successful health check."""
        state = self._state.get(target)
        if state is None:
            return
        state.failures = max(state.failures, self.fail_after)
        self._set(state, False, reason)

    def _set(self, state: _Target, healthy: bool, reason: str) -> None:
        if state.healthy == healthy:
            return
        state.healthy = healthy
        if not healthy:
            state.stats = None
        members = [t.address for t in self._state.values() if t.healthy]
        self._members = tuple(members)
        log.info(
            "ranker_joined" if healthy else "ranker_left",
            target=state.address,
            reason=reason,
            members=len(members),
        )
        if self._on_change is not None:
            self._on_change(members)

    # ------------------------------------------------------------------ checks

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                await self._round()
            except Exception as exc:  # a bug in one round must not end health checking
                log.error("membership_round_failed", error=repr(exc))

    async def _round(self) -> None:
        await asyncio.gather(*(self._check(state) for state in self._state.values()))

    async def _check(self, state: _Target) -> None:
        health_call = state.health.Check(
            health_pb2.HealthCheckRequest(service=RANKER_HEALTH_NAME), timeout=self.check_timeout_s
        )
        stats_call = state.stub.Stats(pb.StatsRequest(), timeout=self.check_timeout_s)
        results: tuple[Any, Any] = await asyncio.gather(health_call, stats_call, return_exceptions=True)
        health, stats = results
        if isinstance(stats, pb.StatsReply):
            state.stats = stats
            state.polled_load = float(stats.rank_queue_depth + stats.preinfer_backlog)
        if state.stats is not None and state.stats.instance_id.startswith(ROUTER_ID_PREFIX):
            state.failures = self.fail_after
            self._set(state, False, "a router, not a ranker")
            return
        if isinstance(health, health_pb2.HealthCheckResponse):
            if health.status == health_pb2.HealthCheckResponse.SERVING:
                state.failures = 0
                self._set(state, True, "health check passed")
                return
            # NOT_SERVING is the instance's own word that it is draining: no need to wait.
            state.failures = max(state.failures + 1, self.fail_after)
            reason = f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
        elif isinstance(health, grpc.aio.AioRpcError):
            state.failures += 1
            reason = f"health check {health.code().name}"
        elif isinstance(health, BaseException):
            if isinstance(health, asyncio.CancelledError):
                raise health
            state.failures += 1
            reason = f"health check error {health!r}"
        else:  # pragma: no cover - gather returns a reply or an exception
            return
        if state.failures >= self.fail_after:
            self._set(state, False, reason)
