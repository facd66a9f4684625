"""The load generator's shards (relaygr/load.py): users split across processes, each request
replayed by exactly one shard at its planned time, and the shards' records merged back into the
one-process result, in workload order. Replays here run in this process against fakes; the
worker processes themselves are exercised in tests/integration/test_replay.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from relaygr.load import LoadGenerator, merge_results, shard_indices
from relaygr.replay import ReplayResult, RequestRecord, replay
from relaygr.workload import Materializer, Workload, WorkloadConfig, generate
from shared.protos import ranker_pb2 as pb


def workload(seed: int = 5) -> Workload:
    return generate(WorkloadConfig(seed=seed, rate_rps=60, duration_s=0.6, users=30, recent_tokens=4,
                                   candidates=8, fixed_prefix_len=32, session_mean_requests=3.0,
                                   think_scale=0.001))  # fmt: skip


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_shards_partition_the_requests_by_user(shards):
    w = workload()
    parts = [shard_indices(w.requests, k, shards) for k in range(shards)]
    assert sorted(i for part in parts for i in part) == list(range(len(w)))  # each request once
    for k, part in enumerate(parts):
        assert part == sorted(part)  # in plan order
        assert {w.requests[i].user_id % shards for i in part} <= {k}
    users = [{w.requests[i].user_id for i in part} for part in parts]
    for a in range(shards):  # a user's requests never straddle shards
        for b in range(a + 1, shards):
            assert not users[a] & users[b]


def test_a_shard_outside_the_range_is_refused():
    with pytest.raises(ValueError, match="shard 2 is not in"):
        shard_indices(workload().requests, 2, 2)


class _Producer:
    def __init__(self) -> None:
        self.keys: list[bytes] = []

    async def send(self, topic: str, value: bytes, key: bytes):
        self.keys.append(key)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class _Router:
    def __init__(self) -> None:
        self.request_ids: list[str] = []

    async def Rank(self, request, *, timeout: float):  # noqa: ASYNC109 (the stub's signature)
        self.request_ids.append(request.request_id)
        return pb.RankReply(served_by=pb.FULL_RECOMPUTE, scores=[0.5, 0.25])


async def test_shards_replayed_from_one_time_zero_merge_into_the_whole_replay():
    w = workload()
    shards = 3
    start_at = time.monotonic() + 0.2
    producers, routers, parts = [], [], []
    for k in range(shards):
        indices = shard_indices(w.requests, k, shards)
        part = Workload(w.config, [w.requests[i] for i in indices], sessions=0)
        producers.append(_Producer())
        routers.append(_Router())
        parts.append(
            replay(
                part,
                producer=producers[-1],
                retrieval_topic="t",
                router_stub=routers[-1],
                materializer=Materializer.for_workload(part),
                slo_ms=1000.0,
                score_sample_every=4,
                start_at=start_at,
                indices=indices,
                freeze_gc=False,
                lookahead_s=0.1,
            )
        )
    merged = merge_results(w, await asyncio.gather(*parts))
    assert [r.index for r in merged.records] == list(range(len(w)))
    assert [r.planned for r in merged.records] == w.requests
    assert all(r.ok for r in merged.records)
    # Scores sampled by the index in the whole workload, whichever shard sent the call.
    assert [r.index for r in merged.sampled()] == [i for i in range(len(w)) if i % 4 == 0]
    # Each call went out at its planned time on the shared clock (generous: a loaded CI host).
    assert max(r.lag_ms for r in merged.records) < 150.0
    assert all(abs(r.sent_at_s - r.planned.t_rank_s) < 0.15 for r in merged.records)
    # Every shard sent only its own users' calls and events.
    for k in range(shards):
        assert {int(key) % shards for key in producers[k].keys} <= {k}
        assert len(routers[k].request_ids) == len(shard_indices(w.requests, k, shards))
    assert merged.summary(1000.0)["sent"] == len(w.measured)


def test_merging_refuses_a_lost_or_doubled_request():
    w = workload()

    def part(indices: list[int]) -> ReplayResult:
        return ReplayResult([RequestRecord(i, w.requests[i]) for i in indices], planned_duration_s=1.0,
                            wall_s=1.0, score_sample_every=0)  # fmt: skip

    everything = list(range(len(w)))
    assert len(merge_results(w, [part(everything[::2]), part(everything[1::2])]).records) == len(w)
    with pytest.raises(ValueError, match="records for"):
        merge_results(w, [part(everything[1:])])
    with pytest.raises(ValueError, match="records for"):
        merge_results(w, [part(everything), part([0])])
    swapped = part(everything)
    swapped.records[0] = dataclasses.replace(swapped.records[0], planned=w.requests[1])
    with pytest.raises(ValueError, match="not"):
        merge_results(w, [swapped])


@pytest.mark.parametrize("processes", [0, 1, -2])
def test_a_load_generator_needs_two_processes_or_more(processes):
    with pytest.raises(ValueError, match="in-process replay"):
        LoadGenerator(processes)
