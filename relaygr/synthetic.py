"""Seeded synthetic users and requests for tests, the demo and the microbenchmarks.

(The workload generator for end-to-end runs, with a real length distribution and arrivals, is a
separate module; this one only makes valid model inputs of chosen shapes.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.ranker.sequences import Behaviors, RankingSuffix, UserPrefix

EPOCH = 1_700_000_000  # seconds; behaviour timestamps are drawn after it


@dataclass(frozen=True)
class Shape:
    profile: int  # |U|
    long_term: int  # |S_l|
    recent: int  # |eS_l|
    candidates: int  # |I|


def behaviors(gen: torch.Generator, n: int, t0: int, span: int) -> Behaviors:
    items = torch.randint(0, 10**9, (n,), generator=gen)
    actions = torch.randint(0, 64, (n,), generator=gen)
    times = torch.sort(torch.randint(t0, t0 + max(span, 1), (n,), generator=gen)).values
    return Behaviors(items, actions, times)


def request(
    gen: torch.Generator, user_id: int, shape: Shape, prefix_version: int = 1
) -> tuple[UserPrefix, RankingSuffix]:
    """One user's prefix and ranking suffix; recent behaviours and the query come after the prefix."""
    history_end = EPOCH + 90 * 86_400
    prefix = UserPrefix(
        user_id=user_id,
        prefix_version=prefix_version,
        profile=torch.randint(0, 10**6, (shape.profile,), generator=gen),
        long_term=behaviors(gen, shape.long_term, EPOCH, history_end - EPOCH),
    )
    suffix = RankingSuffix(
        recent=behaviors(gen, shape.recent, history_end, 3_600),
        candidates=torch.randint(0, 10**9, (shape.candidates,), generator=gen),
        query_time=history_end + 3_600 + int(torch.randint(0, 60, (1,), generator=gen)),
    )
    return prefix, suffix


def batch(seed: int, shapes: list[Shape]) -> tuple[list[UserPrefix], list[RankingSuffix]]:
    gen = torch.Generator().manual_seed(seed)
    pairs = [request(gen, user_id, s) for user_id, s in enumerate(shapes)]
    return [p for p, _ in pairs], [s for _, s in pairs]
