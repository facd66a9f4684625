"""Helpers for tests that talk to rankers."""

from __future__ import annotations

from relaygr.synthetic import Shape, batch
from services.ranker.wire import preinfer_request, rank_request

__all__ = ["preinfer_request", "rank_request", "users"]


def users(seed: int, n: int, prefix_len: int = 600, recent: int = 8, candidates: int = 16):
    return batch(seed, [Shape(3, prefix_len, recent, candidates)] * n)
