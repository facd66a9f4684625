"""services.router.forwarding.Forwarder alone: the retry order when only the attempt cap stood in
the way (no gRPC server: a fake membership and an `invoke` that answers per target)."""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.router.config import RouterConfig
from services.router.forwarding import Forwarder, ForwardError
from services.router.metrics import RouterMetrics
from services.router.residency import ResidencyMap
from shared.config import load_config
from shared.placement import Instance

PICKY, GONE = "127.0.0.1:1001", "127.0.0.1:1002"


class FakeMembership:
    """Both instances healthy until a call marks one failed (as the real membership does)."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = tuple(targets)
        self.up = set(targets)

    def members(self) -> list[str]:
        return [t for t in self.targets if t in self.up]

    def healthy(self) -> list[Instance]:
        return [Instance(t, 0.0) for t in self.members()]

    def is_healthy(self, target: str) -> bool:
        return target in self.up

    def mark_failed(self, target: str, reason: str = "") -> None:
        self.up.discard(target)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def forwarder(membership: FakeMembership) -> Forwarder:
    config = load_config(RouterConfig, ["--rankers", ",".join(membership.targets), "--rank-attempt-timeout-ms", "1000"],
                         env={})  # fmt: skip
    return Forwarder(config, membership, ResidencyMap(), RouterMetrics(CollectorRegistry()))  # type: ignore[arg-type]


def user_ordered(first: str, fwd: Forwarder) -> int:
    """A user whose placement order starts at `first`."""
    return next(u for u in range(1000) if fwd.place(u, 1, "rank").order[0] == first)


@pytest.mark.parametrize("first", [PICKY, GONE])
async def test_an_instance_that_refused_a_capped_attempt_gets_the_whole_deadline_when_the_rest_is_gone(first):
    # A ranker refuses a call it cannot finish within half the time it is shown; the router shows
    # it the attempt cap (1 s) while another instance is healthy. When that other instance turns
    # out to be gone, the call must get one uncapped try on the refusing one, not fail.
    membership = FakeMembership([PICKY, GONE])
    fwd = forwarder(membership)
    attempts: list[tuple[str, float]] = []

    async def invoke(target: str, method: str, request: bytes, timeout_s: float) -> bytes:
        attempts.append((target, timeout_s))
        if target == GONE:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection lost")
        if timeout_s < 3.0:
            raise rpc_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "~1049 ms to answer, the call has 1000 ms left"
            )
        return b"scores"

    user = user_ordered(first, fwd)
    target, reply = await fwd.forward("rank", user, 1, b"request", time.monotonic() + 10.0, invoke=invoke)
    assert (target, reply) == (PICKY, b"scores")
    assert attempts[-1][0] == PICKY
    assert attempts[-1][1] > 3.0  # the caller's whole remaining deadline


async def test_a_fleet_that_refuses_with_the_whole_deadline_is_not_asked_again():
    membership = FakeMembership([PICKY, GONE])
    fwd = forwarder(membership)
    attempts: list[str] = []

    async def invoke(target: str, method: str, request: bytes, timeout_s: float) -> bytes:
        attempts.append(target)
        if target == GONE:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection lost")
        raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")

    with pytest.raises(ForwardError) as err:
        await fwd.forward(
            "rank", user_ordered(PICKY, fwd), 1, b"request", time.monotonic() + 10.0, invoke=invoke
        )
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert attempts == [PICKY, GONE, PICKY]  # one uncapped retry, refused again: the answer stands
