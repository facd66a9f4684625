"""The router's signal consumer against a real Kafka-compatible broker (Tansu) and a ranker on the
CPU: a valid PreInferSignal is pre-inferred on the ranker, malformed ones land in the DLQ with a
reason, and the consumer group's committed offsets cover every record."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from services.ranker.config import RankerConfig
from services.ranker.service import RankerService
from services.ranker.wire import prefix_to_proto
from services.router.config import RouterConfig
from services.router.service import RouterService
from shared.broker import EmbeddedBroker
from shared.config import load_config
from shared.dlq import DeadLetter, read_dead_letter
from shared.kafka import KafkaSettings, make_producer
from shared.protos import events_pb2
from shared.protos import ranker_pb2 as pb
from tests.rankers import users

pytestmark = pytest.mark.integration

SIGNALS, DLQ, GROUP = "it.router.signals", "it.router.dlq", "it-router"
BOUND_S = 30.0  # upper bound for "eventually": never a speed claim


async def eventually(check, what: str):
    deadline = time.monotonic() + BOUND_S
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {BOUND_S}s: {what}"
        await asyncio.sleep(0.1)


@pytest.fixture
def broker():
    with EmbeddedBroker.start() as running:
        yield running


async def test_signals_are_forwarded_or_dead_lettered_and_committed(broker):
    ranker = RankerService(load_config(RankerConfig, ["--device", "cpu"]))
    await ranker.start()
    router = RouterService(
        load_config(
            RouterConfig,
            ["--rankers", f"127.0.0.1:{ranker.port}", "--bootstrap", broker.bootstrap,
             "--signal-topic", SIGNALS, "--dlq-topic", DLQ, "--group-id", GROUP, "--topic-partitions", "2"],
        )
    )  # fmt: skip
    await router.start()
    settings = KafkaSettings(bootstrap=broker.bootstrap)
    producer = make_producer(settings)
    await producer.start()
    dlq = AIOKafkaConsumer(DLQ, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest")
    try:
        prefixes, _ = users(21, 1, prefix_len=300)
        prefix = prefixes[0]
        valid = events_pb2.PreInferSignal(
            schema_version=1,
            request_id="sig-1",
            signal_time_unix_ms=int(time.time() * 1e3),
            prefix=prefix_to_proto(prefix),
            lease_deadline_unix_ms=int(time.time() * 1e3) + 20_000,
            ranking_deadline_unix_ms=int(time.time() * 1e3) + 5_000,
        )
        # When its call is due reaches the ranker, as the order of its pre-inference.
        needed_in_s: list[float] = []
        produce = ranker.relay.produce

        async def recording_produce(*args, **kwargs):
            needed_in_s.append(kwargs.get("need_by", math.inf) - time.monotonic())
            return await produce(*args, **kwargs)

        ranker.relay.produce = recording_produce  # type: ignore[method-assign]
        future_schema = events_pb2.PreInferSignal()
        future_schema.CopyFrom(valid)
        future_schema.schema_version = 2
        # Prefetch-only by reference (as the trigger sends it), for a user whose psi nobody
        # holds: forwarded as a named prefetch, refused, never computed.
        other = users(22, 1, prefix_len=300)[0][0]
        prefetch = events_pb2.PreInferSignal(
            schema_version=1, request_id="sig-4", signal_time_unix_ms=int(time.time() * 1e3),
            lease_deadline_unix_ms=int(time.time() * 1e3) + 20_000, prefetch_only=True, user_id=other.user_id,
            prefix_version=other.prefix_version,
            prefix_ref=pb.PrefixRef(length=other.fingerprint.length, fingerprint=other.fingerprint.digest),
        )  # fmt: skip
        garbage = b"\xff\xff\xff not a protobuf"
        await producer.send_and_wait(SIGNALS, prefetch.SerializeToString(), key=str(other.user_id).encode())
        await producer.send_and_wait(SIGNALS, valid.SerializeToString(), key=str(prefix.user_id).encode())
        await producer.send_and_wait(SIGNALS, garbage, key=b"77")
        await producer.send_and_wait(SIGNALS, future_schema.SerializeToString(), key=b"78")

        def recorded():
            return router.residency.lookup(prefix.user_id, prefix.prefix_version, time.monotonic())

        async def resident() -> bool:
            # The ranker holds psi bytes once it accepts the PreInfer; the router records the
            # residency when the reply reaches it, a moment later: wait for both.
            return ranker.cache.used_bytes > 0 and recorded() is not None

        await eventually(
            resident, "the valid signal is pre-inferred on the ranker and recorded by the router"
        )
        stats = await ranker.Stats(pb.StatsRequest(), None)
        assert stats.hbm_resident_bytes > 0
        assert any(0 < s <= 5 for s in needed_in_s), needed_in_s  # the valid signal's
        # The router passed the signal's time on: the ranker measured the trip (wall clocks).
        assert 0 < stats.signal_trip_p90_ms < BOUND_S * 1e3
        entry = recorded()
        assert entry is not None
        assert entry.instance == f"127.0.0.1:{ranker.port}"

        await dlq.start()
        records: list[DeadLetter] = []

        async def two_dead_letters() -> bool:
            batch = await dlq.getmany(timeout_ms=200)
            records.extend(read_dead_letter(r) for rs in batch.values() for r in rs)
            return len(records) >= 2

        await eventually(two_dead_letters, "two records on the DLQ")
        by_key = {r.key: r for r in records}
        assert set(by_key) == {b"77", b"78"}
        assert "undecodable" in by_key[b"77"].reason
        assert "schema_version 2" in by_key[b"78"].reason
        assert by_key[b"77"].value == garbage  # the original bytes (shared/dlq.py)
        for record in records:
            assert record.service == "router"
            assert record.source_topic == SIGNALS
            assert record.partition in (0, 1)
            assert record.offset >= 0

        assert router.signals is not None
        consumer = router.signals.consumer
        assert consumer is not None
        tps = [TopicPartition(SIGNALS, p) for p in (0, 1)]
        ends = await consumer.end_offsets(tps)
        assert sum(ends.values()) == 4

        async def committed() -> bool:
            offsets = [await consumer.committed(tp) or 0 for tp in tps]
            return offsets == [ends[tp] for tp in tps]

        await eventually(committed, "the group's committed offsets cover all four signals")
        assert router.metrics.signals.labels("forwarded")._value.get() == 1
        assert router.metrics.signals.labels("refused")._value.get() == 1  # the prefetch: nothing held
        assert ranker.cache.lookup(ranker.model.psi_key(other.user_id, other.prefix_version,
                                                        other.fingerprint.digest)) is None  # fmt: skip

        async def produced() -> bool:  # the valid signal's pre-inference may still be running
            return (await ranker.Stats(pb.StatsRequest(), None)).psi_produced >= 1

        await eventually(produced, "the valid signal's psi produced")
        assert (await ranker.Stats(pb.StatsRequest(), None)).psi_produced == 1  # and nothing else
        assert router.metrics.signals.labels("dlq")._value.get() == 2
    finally:
        await dlq.stop()
        await producer.stop()
        await router.shutdown(grace_s=1.0)
        await ranker.shutdown(grace_s=0.5)
