"""psi is named by content (issue 12, finding 3): a ranking call whose prefix tokens differ from
those of psi held under the same (user, prefix version) is ranked from its own tokens, never
from that psi, whether the psi is resident, being produced, or named by a reference; and it is
counted. Through the ranker's gRPC service, in process on the CPU (float32: exact to 1e-5)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from services.ranker.config import RankerConfig
from services.ranker.sequences import Behaviors, RankingSuffix, UserPrefix
from services.ranker.service import RankerService
from services.ranker.wire import by_reference
from shared.config import load_config
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from tests.rankers import preinfer_request, rank_request, users

TOL = 1e-5


@pytest.fixture
async def ranker():
    service = RankerService(load_config(RankerConfig, ["--device", "cpu"]))
    await service.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    yield service, pb_grpc.RankerStub(channel)
    await channel.close()
    await service.shutdown(grace_s=0.5)


def other_tokens(prefix: UserPrefix) -> UserPrefix:
    """The same user, prefix version and length, other long-term items (the last one changed)."""
    items = prefix.long_term.items.clone()
    items[-1] = (items[-1] + 1) % 1000
    lt = prefix.long_term
    return UserPrefix(
        prefix.user_id, prefix.prefix_version, prefix.profile, Behaviors(items, lt.actions, lt.timestamps)
    )


def full(service: RankerService, prefix: UserPrefix, suffix: RankingSuffix) -> torch.Tensor:
    return service.model.full([prefix], [suffix])[0]


def max_diff(scores, expected: torch.Tensor) -> float:
    return float((torch.tensor(list(scores)) - expected).abs().max())


def mismatches(service: RankerService) -> float:
    return service.registry.get_sample_value("relaygr_ranker_prefix_content_mismatch_total") or 0.0


async def wait_produced(stub: pb_grpc.RankerStub, count: int = 1) -> None:
    for _ in range(500):
        if (await stub.Stats(pb.StatsRequest(), timeout=5)).psi_produced >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("psi never produced")


async def test_finding_3_other_tokens_under_a_pre_inferred_key_are_ranked_from_their_own(ranker):
    """Pre-infer prefix A; rank prefix B (same user, prefix version and length, one token
    changed): B's scores are a full ranking of B, not A's; counted; A's psi is left for A."""
    service, stub = ranker
    prefixes, suffixes = users(31, 1, prefix_len=1000)
    a, suffix = prefixes[0], suffixes[0]
    b = other_tokens(a)
    assert b.length == a.length
    assert b.fingerprint.digest != a.fingerprint.digest
    want_a, want_b = full(service, a, suffix), full(service, b, suffix)
    assert float((want_a - want_b).abs().max()) > 1e-3  # serving A's psi to B would be caught
    await stub.PreInfer(preinfer_request(a, "pa"), timeout=5)
    await wait_produced(stub)

    got = await stub.Rank(rank_request(b, suffix, "rb"), timeout=30)
    assert got.served_by == pb.FULL_RECOMPUTE
    assert max_diff(got.scores, want_b) <= TOL
    assert mismatches(service) == 1
    assert (await stub.Stats(pb.StatsRequest(), timeout=5)).prefix_content_mismatches == 1

    hit = await stub.Rank(rank_request(a, suffix, "ra"), timeout=30)
    assert hit.served_by == pb.HBM_HIT  # the mismatching call neither consumed nor dropped it
    assert max_diff(hit.scores, want_a) <= TOL
    assert mismatches(service) == 1


async def test_a_call_with_other_tokens_never_joins_an_in_flight_psi(ranker):
    service, stub = ranker
    prefixes, suffixes = users(32, 1, prefix_len=2500)  # long enough to still be in flight
    a, suffix = prefixes[0], suffixes[0]
    b = other_tokens(a)
    lease = int(time.time() * 1e3) + 30_000  # B's full ranking must not outlast A's lease here
    accepted = await stub.PreInfer(preinfer_request(a, "pa", lease), timeout=5)
    assert accepted.outcome == pb.PreInferReply.ACCEPTED
    assert service.cache.producing == 1  # A's psi is being produced as B's call arrives
    got = await stub.Rank(rank_request(b, suffix, "rb"), timeout=60)
    assert got.served_by == pb.FULL_RECOMPUTE
    assert max_diff(got.scores, full(service, b, suffix)) <= TOL
    assert mismatches(service) == 1
    # A itself still uses its psi: resident, or joined or completed while being built.
    joined = await stub.Rank(rank_request(a, suffix, "ra"), timeout=60)
    assert joined.served_by in (pb.INFLIGHT_JOIN, pb.HBM_HIT, pb.PARTIAL_PREFIX)
    assert max_diff(joined.scores, full(service, a, suffix)) <= TOL


async def test_a_reference_is_served_only_by_psi_of_its_fingerprint(ranker):
    service, stub = ranker
    prefixes, suffixes = users(33, 1, prefix_len=400)
    a, suffix = prefixes[0], suffixes[0]
    accepted = await stub.PreInfer(preinfer_request(a, "pa"), timeout=5)
    assert accepted.fingerprint == a.fingerprint.digest  # what the router records
    await wait_produced(stub)
    right = by_reference(rank_request(a, suffix, "ra"))
    assert right.prefix_ref.fingerprint == a.fingerprint.digest
    for wrong_fingerprint in (0, a.fingerprint.digest ^ 1, other_tokens(a).fingerprint.digest):
        wrong = by_reference(rank_request(a, suffix, "rw"))
        wrong.prefix_ref.fingerprint = wrong_fingerprint
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Rank(wrong, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "prefix_required" in (err.value.details() or "")
    assert mismatches(service) == 3  # psi of other content was held under that name each time
    hit = await stub.Rank(right, timeout=30)
    assert hit.served_by == pb.HBM_HIT
    assert max_diff(hit.scores, full(service, a, suffix)) <= TOL
