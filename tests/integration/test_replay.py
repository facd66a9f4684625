"""The open-loop replayer end to end on the CPU: the embedded broker, one in-process ranker (tiny
model) behind an in-process router, and ~3 s of a low-rate workload with tiny prefixes.

Every request is sent and answered, its retrieval event is on the topic keyed by user, and the
summary carries what the reports need. No claims on speed beyond generous bounds."""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest
from aiokafka import AIOKafkaConsumer

from relaygr.load import LoadGenerator
from relaygr.replay import SERVED_BY, replay
from relaygr.workload import Materializer, WorkloadConfig, generate
from services.ranker.config import RankerConfig
from services.ranker.service import RankerService
from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.broker import EmbeddedBroker
from shared.config import load_config
from shared.kafka import KafkaSettings, ensure_topics, make_producer
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
TOPIC = "replay.retrieval"
SLO_MS = 5_000.0  # generous: the test checks the plumbing, not the speed


@pytest.fixture
async def stack():
    with EmbeddedBroker.start() as broker:
        settings = KafkaSettings(bootstrap=broker.bootstrap)
        await ensure_topics(settings, {TOPIC: 2})
        ranker = RankerService(load_config(RankerConfig, ["--device", "cpu"]))
        await ranker.start()
        router = RouterService(
            load_config(RouterConfig, ["--rankers", f"127.0.0.1:{ranker.port}", "--consume-signals", "false"])
        )
        await router.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        producer = make_producer(settings)
        await producer.start()
        try:
            yield {"broker": broker, "stub": pb_grpc.RankerStub(channel), "producer": producer,
                   "ranker": ranker, "target": f"127.0.0.1:{router.port}"}  # fmt: skip
        finally:
            await producer.stop()
            await channel.close()
            await router.shutdown(grace_s=0.5)
            await ranker.shutdown(grace_s=0.5)


async def read_events(
    bootstrap: str, n: int, timeout_s: float = 20.0
) -> list[tuple[bytes, ev.RetrievalEvent]]:
    consumer = AIOKafkaConsumer(TOPIC, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    out: list[tuple[bytes, ev.RetrievalEvent]] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                out += [(r.key, ev.RetrievalEvent.FromString(r.value)) for r in records]
    finally:
        await consumer.stop()
    return out


async def test_replay_sends_every_request_and_records_what_happened(stack):
    config = WorkloadConfig(seed=1, duration_s=3.0, rate_rps=12.0, users=40, length_scale=0.5,
                            max_prefix_len=300, profile_tokens=4, recent_tokens=8, candidates=16,
                            session_mean_requests=2.0, think_scale=0.01)  # fmt: skip
    workload = generate(config)
    assert 10 <= len(workload) <= 100
    ticks: list[tuple[float, int, int, float]] = []
    started = time.time()
    result = await replay(
        workload,
        producer=stack["producer"],
        retrieval_topic=TOPIC,
        router_stub=stack["stub"],
        materializer=Materializer.for_workload(workload),
        slo_ms=SLO_MS,
        progress=lambda *a: ticks.append(a),
        rank_timeout_s=30.0,
        score_sample_every=5,
    )
    summary = result.summary(SLO_MS)
    n = len(workload)
    assert summary["sent"] == n
    assert summary["ok"] == n, summary["failed_by_code"]
    assert summary["failed"] == 0
    assert summary["publish_failed"] == 0
    # Every event's ack from the broker came after its scheduled time, and is in the summary.
    assert all(r.publish_ack_ms >= 0 for r in result.records)
    assert 0 <= summary["publish_ack_ms_p50"] <= summary["publish_ack_ms_p99"]
    assert summary["meets_slo"]
    assert [r.planned for r in result.records] == workload.requests
    assert all(r.served_by in SERVED_BY for r in result.records)
    assert summary["full_recompute"] == 1.0  # no trigger: nothing was pre-inferred
    assert {r.instance_id for r in result.records} == {stack["ranker"].instance_id}
    for key in ("p50_ms", "p99_ms", "p999_ms", "hbm_hit", "dram_reload", "cache_ms_p99", "queue_ms_p99",
                "compute_ms_p99", "network_ms_p99", "slo_attainment", "offered_rps", "lag_ms_max",
                "lag_ms_p99"):  # fmt: skip
        assert key in summary, key
    assert 0 < summary["compute_ms_p50"] <= summary["p99_ms"]
    # Each reply names its batch: calls, tokens computed (at least this call's), host issue time.
    for r in result.records:
        p = r.planned
        assert r.batch >= 1
        assert r.batch_tokens >= p.prefix_len + p.recent_len + p.candidates
        assert 0 < r.launch_ms <= r.compute_ms
        assert r.breakdown()["batch"] == r.batch
    assert 1 <= summary["batch_p50"] <= summary["batch_p99"]
    assert summary["launch_ms_p99"] > 0
    assert summary["slo_attainment"] == 1.0
    assert summary["lag_ms_max"] < 500  # generous: one process on a small CPU
    assert summary["retrieval_lag_ms_max"] < 500
    # Open loop: the calls went out on schedule, so the replay took about the plan's length.
    assert time.time() - started < config.duration_s + 10
    rank_times = sorted(r.t_rank_s for r in workload.requests)
    planned_rps = (n - 1) / (rank_times[-1] - rank_times[0])
    assert summary["offered_rps"] == pytest.approx(planned_rps, rel=0.2)
    assert len(result.sampled()) == len(range(0, n, 5))
    assert all(len(r.scores or []) == config.candidates for r in result.sampled())
    assert ticks
    assert ticks[-1][1:3] == (n, n)

    events = await read_events(stack["broker"].bootstrap, n)
    assert len(events) == n
    by_id = {e.request_id: (k, e) for k, e in events}
    for planned in workload.requests:
        kafka_key, event = by_id[planned.request_id]
        assert kafka_key == str(planned.user_id).encode()
        assert (event.user_id, event.prefix_version, event.prefix_len) == (
            planned.user_id, planned.prefix_version, planned.prefix_len,
        )  # fmt: skip
        # The deadline is the scheduled ranking time + SLO, and ranking comes after retrieval.
        gap_ms = event.ranking_deadline_unix_ms - SLO_MS - event.event_time_unix_ms
        assert gap_ms == pytest.approx((planned.t_rank_s - planned.t_retrieval_s) * 1e3, abs=2)


async def test_a_dead_router_is_recorded_as_failures_not_lost(stack):
    """Nothing listens on the target: every call fails UNAVAILABLE and is counted, none is lost."""
    workload = generate(WorkloadConfig(seed=2, duration_s=1.0, rate_rps=10.0, fixed_prefix_len=20,
                                       profile_tokens=4, recent_tokens=4, candidates=4))  # fmt: skip
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        result = await replay(
            workload,
            producer=stack["producer"],
            retrieval_topic=TOPIC,
            router_stub=pb_grpc.RankerStub(channel),
            materializer=Materializer.for_workload(workload),
            slo_ms=SLO_MS,
            rank_timeout_s=2.0,
        )
    finally:
        await channel.close()
    summary = result.summary(SLO_MS)
    assert summary["sent"] == len(workload)
    assert summary["ok"] == 0
    assert summary["failed_by_code"] == {"UNAVAILABLE": len(workload)}
    assert not summary["meets_slo"]


async def test_a_load_generator_of_two_processes_replays_every_request_once(stack):
    """relaygr/load.py: two spawned worker processes, each with its own producer and channel,
    replay the users' shards from one time zero; the merged result is the whole workload's."""
    config = WorkloadConfig(seed=2, duration_s=2.0, rate_rps=15.0, users=40, length_scale=0.5,
                            max_prefix_len=300, profile_tokens=4, recent_tokens=8, candidates=16,
                            session_mean_requests=2.0, think_scale=0.01)  # fmt: skip
    workload = generate(config)
    n = len(workload)
    with LoadGenerator(2) as load:
        assert len(set(load.pids.values()) | {os.getpid()}) == 3  # two workers, neither this process
        for _ in range(2):  # the workers are reused from point to point
            result = await load.replay(workload, bootstrap=stack["broker"].bootstrap,
                                       router_target=stack["target"], retrieval_topic=TOPIC, slo_ms=SLO_MS,
                                       rank_timeout_s=30.0, score_sample_every=5)  # fmt: skip
            summary = result.summary(SLO_MS)
            assert summary["ok"] == n, summary["failed_by_code"]
            assert [r.planned for r in result.records] == workload.requests
            assert [r.index for r in result.sampled()] == list(range(0, n, 5))
            assert all(len(r.scores or []) == config.candidates for r in result.sampled())
            assert summary["lag_ms_max"] < 1000  # generous: three processes on a small CPU
            assert summary["offered_rps"] > 0
    assert load.pids == {}  # ended with the block
    events = await read_events(stack["broker"].bootstrap, 2 * n)
    assert len(events) == 2 * n  # each request's event, once per replay
    for key, event in events:
        assert key == str(event.user_id).encode()


async def test_a_failed_worker_fails_the_replay_and_its_workers_are_replaced():
    """No broker at the address: each worker's producer cannot start. The replay says why, and
    the next replay gets fresh workers (no late reply from the failed one is read as its own)."""
    workload = generate(WorkloadConfig(seed=4, duration_s=0.5, rate_rps=10.0, users=10, fixed_prefix_len=16,
                                       profile_tokens=4, recent_tokens=4, candidates=4))  # fmt: skip
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with LoadGenerator(2) as load:
        first = set(load.pids.values())
        with pytest.raises(RuntimeError, match=r"load worker \d+ failed"):
            await load.replay(workload, bootstrap=f"127.0.0.1:{port}", router_target=f"127.0.0.1:{port}",
                              retrieval_topic=TOPIC, slo_ms=SLO_MS)  # fmt: skip
        assert load.pids == {}  # ended after the failure
        load.start()
        assert len(load.pids) == 2
        assert not set(load.pids.values()) & first
