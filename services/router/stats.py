"""The router's Stats answer: the fleet as this router sees it, and its own Rank latencies."""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterable

from shared.protos import ranker_pb2 as pb
from shared.stats import percentile
from shared.wire import MAX_PREINFER_DUES

RANK_WINDOW = 2048  # the recent Rank latencies rank_p50 / rank_p99 are taken over


class RankLatencies:
    """This router's end-to-end latencies of its recent successful Rank calls (ms)."""

    def __init__(self, window: int = RANK_WINDOW) -> None:
        self._ms: collections.deque[float] = collections.deque(maxlen=window)

    def append(self, ms: float) -> None:
        self._ms.append(ms)

    def percentile(self, q: float) -> float:
        """The q-th percentile of the window; 0.0 while it is empty."""
        return percentile(list(self._ms), q) if self._ms else 0.0


def fleet_stats(instance_id: str, rankers: Iterable[pb.StatsReply], rank: RankLatencies) -> pb.StatsReply:
    """The router's StatsReply (the contract is in ranker.proto, StatsReply): `instance_id`
    ("router@host:port"); every byte, backlog, queue and counter field (hbm_hits, hbm_misses,
    demotions, reloads, psi_produced, psi_expired, preinfers_refused, ...) is the sum over
    `rankers`, the healthy rankers' last polled Stats (up to one check interval old; a ranker that
    leaves membership leaves the sums, so they can fall); model_version is the rankers' common
    version ("" when they differ); ranking_psi_min_tokens the smallest positive one (0: no ranker
    keeps psi); lead_time_p50_ms, device_busy and signal_trip_p90_ms are the highest ranker's
    (a trigger that asks the router judges the room for pre-inference by the busiest device and
    the slowest signal path); rank_p50/p99 are this router's own (`rank`); recent_batches is
    empty; expander_connected is true only if every ranker has its host tier;
    preinfer_due_in_ms the rankers' lists merged, the earliest MAX_PREINFER_DUES; preinfer_plan
    the highest price any ranker plans for each length (a pre-inference may land on the slowest),
    and host_ms_per_request the highest ranker's."""
    stats = list(rankers)
    versions = {s.model_version for s in stats}
    return pb.StatsReply(
        instance_id=instance_id,
        model_version=versions.pop() if len(versions) == 1 else "",
        hbm_budget_bytes=sum(s.hbm_budget_bytes for s in stats),
        hbm_resident_bytes=sum(s.hbm_resident_bytes for s in stats),
        hbm_leased_bytes=sum(s.hbm_leased_bytes for s in stats),
        hbm_evictable_bytes=sum(s.hbm_evictable_bytes for s in stats),
        preinfer_backlog=sum(s.preinfer_backlog for s in stats),
        rank_queue_depth=sum(s.rank_queue_depth for s in stats),
        preinfers_refused=sum(s.preinfers_refused for s in stats),
        rank_p50_ms=rank.percentile(50),
        rank_p99_ms=rank.percentile(99),
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
        hbm_evictions=sum(s.hbm_evictions for s in stats),
        hbm_released=sum(s.hbm_released for s in stats),
        hbm_evicted_undemoted=sum(s.hbm_evicted_undemoted for s in stats),
        prefetches_issued=sum(s.prefetches_issued for s in stats),
        prefetches_used=sum(s.prefetches_used for s in stats),
        prefetches_wasted=sum(s.prefetches_wasted for s in stats),
        prefetches_failed=sum(s.prefetches_failed for s in stats),
        demotion_lag_p99_ms=max((s.demotion_lag_p99_ms for s in stats), default=0.0),
        ranking_psi_min_tokens=min(
            (s.ranking_psi_min_tokens for s in stats if s.ranking_psi_min_tokens > 0), default=0
        ),
        psi_from_rankings=sum(s.psi_from_rankings for s in stats),
        device_busy=max((s.device_busy for s in stats), default=0.0),
        signal_trip_p90_ms=max((s.signal_trip_p90_ms for s in stats), default=0.0),
        preinfer_due_in_ms=heapq.nsmallest(
            MAX_PREINFER_DUES, itertools.chain.from_iterable(s.preinfer_due_in_ms for s in stats)
        ),
        preinfer_plan=_highest_plan(stats),
        host_ms_per_request=max((s.host_ms_per_request for s in stats), default=0.0),
    )


def _highest_plan(stats: list[pb.StatsReply]) -> list[pb.PreinferSample]:
    """Per prefix length, the highest planned device time among the rankers' preinfer_plan."""
    highest: dict[int, float] = {}
    for s in stats:
        for sample in s.preinfer_plan:
            highest[sample.prefix_len] = max(highest.get(sample.prefix_len, 0.0), sample.device_ms)
    return [pb.PreinferSample(prefix_len=n, device_ms=ms) for n, ms in sorted(highest.items())]
