"""The router retries a ranker's refusal on admission on the next instance, but not a late
refusal (admitted, then not started within its queue budget: shared/overload.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shared.overload import LATE_REFUSAL, is_late_refusal
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.unit.test_router_service import FakeRanker, requests_for, start_router, target


class LateRanker(FakeRanker):
    """Refuses every call late, as a ranker whose engine did not start it in time."""

    async def Rank(self, request, context):
        self.calls += 1
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"ranker {self.name} overloaded ({LATE_REFUSAL}): waited 412 ms for the engine, past the 400 ms "
            "its admission allowed for 348 tokens in full",
        )


@pytest.fixture
async def late_then_ok():
    late, ok = LateRanker("late", "late"), FakeRanker("ok", "ok")
    for fake in (late, ok):
        await fake.start()
    yield late, ok
    for fake in (late, ok):
        await fake.stop()


def test_the_marker_tells_a_late_refusal_from_one_on_admission():
    assert is_late_refusal(f"ranker a overloaded ({LATE_REFUSAL}): waited 412 ms")
    assert not is_late_refusal("ranker a overloaded: 3 ranking calls in flight (120 ms of predicted work)")
    assert not is_late_refusal("")
    assert not is_late_refusal(None)


async def test_a_late_refusal_is_answered_not_retried(late_then_ok):
    late, ok = late_then_ok
    # The late instance first in every call's order: only it, the caller's deadline long.
    router = await start_router([target(late.port), target(ok.port)], "--overload-retries", "1")
    try:
        channel = grpc.aio.insecure_channel(target(router.port))
        stub = pb_grpc.RankerStub(channel)
        outcomes = await asyncio.gather(
            *(stub.Rank(r, timeout=5) for r in requests_for(16)), return_exceptions=True
        )
        refusals = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        replies = [o for o in outcomes if isinstance(o, pb.RankReply)]
        assert len(refusals) + len(replies) == 16
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refusals)
        assert all(is_late_refusal(e.details()) for e in refusals)
        assert {r.instance_id for r in replies} == {"ok"}
        answered_late, served = len(refusals), len(replies)
        # Calls placed on the late instance first got its refusal, and no second attempt.
        assert answered_late == late.calls > 0
        assert served == ok.calls == 16 - answered_late
        assert router.metrics.retries.labels("rank")._value.get() == 0
        await channel.close()
    finally:
        await router.shutdown(grace_s=0.2)
