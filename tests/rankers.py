"""Helpers for tests that talk to rankers: request builders and an in-process ranker fixture."""

from __future__ import annotations

from bench.synthetic import Shape, batch
from services.ranker.sequences import RankingSuffix, UserPrefix
from services.ranker.wire import prefix_to_proto, suffix_fields
from shared.protos import ranker_pb2 as pb


def rank_request(prefix: UserPrefix, suffix: RankingSuffix, request_id: str) -> pb.RankRequest:
    p = prefix_to_proto(prefix)
    return pb.RankRequest(
        request_id=request_id,
        user_id=p.user_id,
        prefix_version=p.prefix_version,
        prefix=p,
        **suffix_fields(suffix),  # type: ignore[arg-type]
    )


def preinfer_request(
    prefix: UserPrefix, request_id: str, lease_deadline_unix_ms: int = 0
) -> pb.PreInferRequest:
    return pb.PreInferRequest(
        request_id=request_id, prefix=prefix_to_proto(prefix), lease_deadline_unix_ms=lease_deadline_unix_ms
    )


def users(seed: int, n: int, prefix_len: int = 600, recent: int = 8, candidates: int = 16):
    return batch(seed, [Shape(3, prefix_len, recent, candidates)] * n)
