"""Where a call goes and what happens when an instance does not answer: placement, retries, and
the error a caller gets (ForwardError).

Placement (the same for a user's pre-inference and its ranking call, so both find one psi):
  1. the residency map: where this router forwarded an accepted PreInfer for this user and prefix
     version, while its lease has not passed and that instance is healthy;
  2. otherwise `shared.placement.preference` (rendezvous hashing with bounded load) over the
     healthy instances; the rest of that order is the retry order.
The no-affinity ablation (placement "round_robin") sends ranking calls round the members instead.

Forwarding (Rank and PreInfer are both idempotent, so retrying is safe): each attempt gets the
caller's remaining deadline (capped by rank_attempt_timeout_ms when set). UNAVAILABLE marks the
instance failed (it leaves membership until a health check passes) and retries on the next one;
RESOURCE_EXHAUSTED (overloaded: at most overload_retries more instances, so a shedding fleet
answers fast instead of multiplying its load), CANCELLED (server going away) and an attempt's own
DEADLINE_EXCEEDED (only when the cap, not the caller's deadline, ran out) retry on the next one
without marking it. Any other status (INVALID_ARGUMENT, ...) is the caller's answer and passes
through unchanged. No healthy instance: UNAVAILABLE "no healthy ranker instance".

A ranking call to the instance the residency map names may go by reference to the resident psi
(`slim`); that instance answering prefix_required gets the whole call at once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from services.router.config import Placement, RouterConfig
from services.router.metrics import RouterMetrics
from services.router.residency import ResidencyMap
from shared.logging import get_logger
from shared.membership import Membership
from shared.placement import preference
from shared.protos import ranker_pb2 as pb

log = get_logger("router.forwarding")

ACCEPTED = frozenset(
    {
        pb.PreInferReply.ACCEPTED,
        pb.PreInferReply.ALREADY_RESIDENT,
        pb.PreInferReply.ALREADY_PRODUCING,
        pb.PreInferReply.RELOAD_SCHEDULED,
    }
)
"""PreInfer outcomes after which psi is (or will be) on the instance: recorded as resident."""

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


class Route(NamedTuple):
    """A call's placement: its instance order (first choice first) and why it is that order."""

    order: list[str]
    source: str  # "residency" | "hash" | "round_robin" | "none"
    fingerprint: int = 0  # content of the psi the residency entry names (source "residency")


class _Attempts:
    """One forwarded call's progress along its placement order: where it is, what it has tried,
    and what it will answer if nothing does."""

    __slots__ = (
        "capped_refusals",
        "extended",
        "failures",
        "last_code",
        "made",
        "order",
        "overloaded",
        "position",
    )

    def __init__(self, order: list[str]) -> None:
        self.order = order  # grows by one target at most (`extended`)
        self.position = -1
        self.made = 0  # attempts sent
        self.overloaded = 0  # RESOURCE_EXHAUSTED answers so far
        self.extended = False
        self.capped_refusals: list[str] = []  # refused (RESOURCE_EXHAUSTED) with a capped deadline
        self.last_code = grpc.StatusCode.UNAVAILABLE
        self.failures: list[str] = []

    def advance(self) -> str | None:
        """The next target in the order, None past its end."""
        if self.position + 1 >= len(self.order):
            return None
        self.position += 1
        return self.order[self.position]

    def later(self) -> list[str]:
        """The targets after the current one."""
        return self.order[self.position + 1 :]

    def failed(self, target: str, code: grpc.StatusCode, details: str = "") -> None:
        self.last_code = code
        self.failures.append(f"{target}: {code.name} {details}".rstrip())

    def error(self) -> ForwardError:
        """What the caller gets when the order ran out, or the deadline did."""
        detail = "; ".join(self.failures) if self.failures else "no attempt made"
        if self.last_code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return ForwardError(self.last_code, f"deadline exceeded after {self.made} attempt(s): {detail}")
        return ForwardError(self.last_code, f"no ranker instance answered ({self.made} attempt(s)): {detail}")


class Forwarder:
    """Places and forwards the router's calls (see the module). Driven from one event loop."""

    def __init__(
        self, config: RouterConfig, membership: Membership, residency: ResidencyMap, metrics: RouterMetrics
    ) -> None:
        self.config = config
        self.membership = membership
        self.residency = residency
        self.metrics = metrics
        self._round_robin = 0

    def place(self, user_id: int, prefix_version: int, method: str) -> Route:
        """The instance order for this user: a live residency entry on a healthy instance first,
        then the rendezvous / bounded-load order. Empty when no instance is healthy."""
        members = self.membership.members()
        if not members:
            return Route([], "none")
        if method == "rank" and self.config.placement == Placement.ROUND_ROBIN:
            # The no-affinity ablation: ranking calls ignore where psi lives (signals still hash).
            self._round_robin += 1
            start = self._round_robin % len(members)
            order = list(members[start:] + members[:start])
            self.metrics.placement_of(method, "round_robin").inc()
            return Route(order, "round_robin")
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
            return Route(order, "residency", entry.fingerprint)
        self.metrics.placement_of(method, "hash").inc()
        return Route(order, "hash")

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
        attempt), `deadline` on time.monotonic(). `slim`, for a ranking call, makes the request by
        reference to the resident psi's fingerprint (see passthrough.rank_by_reference): sent
        instead of `request` to the instance the residency map names, and followed by `request`
        there when that instance answers prefix_required. `invoke` makes one attempt (default:
        the ranker's gRPC channel, the reply as bytes; the relay front door passes its own).
        Returns (target, the reply); raises ForwardError with the status the caller should get.
        """
        invoke = invoke or self.membership.call
        route = self.place(user_id, prefix_version, method)
        if not route.order:
            raise ForwardError(
                grpc.StatusCode.UNAVAILABLE,
                f"no healthy ranker instance (0 of {len(self.membership.targets)} up)",
            )
        slim_to = route.order[0] if slim is not None and route.source == "residency" else None
        call = _Attempts(route.order)
        while (target := call.advance()) is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                call.last_code = grpc.StatusCode.DEADLINE_EXCEEDED
                break
            if call.made and not self.membership.is_healthy(target):
                continue  # dropped since the order was computed (e.g. by a concurrent call)
            if call.made:
                self.metrics.retries_of(method).inc()
            call.made += 1
            timeout = self._attempt_timeout(call, remaining)
            by_reference = (
                partial(slim, route.fingerprint) if slim is not None and target == slim_to else None
            )
            try:
                reply = await self._call(invoke, target, method, request, timeout, by_reference)
            except grpc.aio.AioRpcError as exc:
                if self._goes_on(call, route, method, target, exc, timeout >= remaining, user_id):
                    continue
                break
            self.metrics.attempts_of(method, "ok").inc()
            return target, reply
        raise call.error()

    def _attempt_timeout(self, call: _Attempts, remaining: float) -> float:
        """The cap lets a frozen instance cost a retry, not the whole deadline; the last healthy
        candidate gets all that is left (there is nowhere else to go)."""
        cap = self.config.rank_attempt_timeout_ms / 1e3
        if (
            cap > 0
            and call.position + 1 < len(call.order)
            and any(map(self.membership.is_healthy, call.later()))
        ):
            return min(remaining, cap)
        return remaining

    def _goes_on(
        self,
        call: _Attempts,
        route: Route,
        method: str,
        target: str,
        exc: grpc.aio.AioRpcError,
        callers_deadline: bool,
        user_id: int,
    ) -> bool:
        """Books a failed attempt; True when the call should try its next target, False when it
        should stop (the caller's deadline is gone, or the fleet is shedding). Raises ForwardError
        for a status that is the caller's answer. `callers_deadline`: the attempt had all the
        time the caller had left."""
        code = exc.code()
        details = exc.details() or ""
        self.metrics.attempts_of(method, code.name.lower()).inc()
        if code not in _RETRYABLE:
            raise ForwardError(code, details or code.name, client_error=True) from None
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and callers_deadline:
            call.failed(target, code)  # the caller's own deadline ran out, not just this attempt's
            return False
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            call.overloaded += 1
            call.failed(target, code, details)
            if not callers_deadline:
                # Refused against the capped deadline it was shown: a ranker refuses a call it
                # cannot finish within a fraction of the time left, so with the caller's whole
                # deadline it may serve it (used below when the rest of the order fails).
                call.capped_refusals.append(target)
            # The fleet is shedding: answer now rather than spread the load further.
            return call.overloaded <= self.config.overload_retries
        if code is grpc.StatusCode.UNAVAILABLE:
            self.membership.mark_failed(target, f"{method} UNAVAILABLE")
        if not call.extended and not any(self.membership.is_healthy(t) for t in call.later()):
            # No other healthy instance is left (one may have failed meanwhile): one last,
            # uncapped try where only the cap stood in the way: an instance whose capped attempt
            # timed out (this one) or that refused a capped attempt, where it is healthy.
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                last = [t for t in route.order if self.membership.is_healthy(t)][:1]
            else:
                last = [t for t in call.capped_refusals if self.membership.is_healthy(t)][:1]
            if last:
                call.order = call.order + last
                call.extended = True
        call.failed(target, code, details)
        log.debug("attempt_failed", method=method, target=target, code=code.name, user=user_id)
        return True

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

    async def preinfer(
        self, request: bytes, user_id: int, prefix_version: int, lease_deadline_unix_ms: int, deadline: float
    ) -> tuple[pb.PreInferReply, bytes]:
        """Forwards a serialized PreInferRequest (its placement key and lease already read from it);
        an accepted one is recorded in the residency map, so the user's ranking call follows it.
        Returns the reply parsed and as sent; raises ForwardError as `forward` does, and INTERNAL
        for a reply that does not parse."""
        target, raw = await self.forward("preinfer", user_id, prefix_version, request, deadline)
        try:
            reply = pb.PreInferReply.FromString(raw)
        except DecodeError:
            raise ForwardError(
                grpc.StatusCode.INTERNAL, f"{target} sent an undecodable PreInferReply"
            ) from None
        if reply.outcome in ACCEPTED:
            self.residency.record(
                user_id,
                prefix_version,
                target,
                self._lease_deadline(lease_deadline_unix_ms),
                time.monotonic(),
                fingerprint=reply.fingerprint,
            )
        return reply, raw

    def _lease_deadline(self, lease_deadline_unix_ms: int) -> float:
        """A lease on the wall clock -> time.monotonic() (the residency map's clock)."""
        if lease_deadline_unix_ms <= 0:
            return time.monotonic() + self.config.default_lease_ms / 1e3
        return time.monotonic() + (lease_deadline_unix_ms - time.time() * 1e3) / 1e3
