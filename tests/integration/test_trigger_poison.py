"""The trigger against the real broker (Tansu) and a ranker on the CPU: poison records never block a
partition, dead letters carry the original bytes, the largest valid event gets its signal, a
failed write is retried without deciding twice, shutdown finishes the batch in hand.

Reproductions of issue 12's findings 1 and 2: an ~800 KB and a 1 MiB malformed event (and 2 MB)
ahead of valid events on one partition blocked it for ever (their base64 dead letters were over
the producer's 1 MiB); a valid 60k-token event lost its 1.2 MB signal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaConnectionError

from services.ranker.config import RankerConfig
from services.ranker.service import RankerService
from services.trigger.config import TriggerConfig
from services.trigger.service import TriggerService
from shared.broker import EmbeddedBroker
from shared.config import load_config
from shared.dlq import read_dead_letter
from shared.kafka import KafkaSettings, ensure_topics, make_producer
from shared.protos import events_pb2 as ev
from shared.wire import prefix_message

pytestmark = pytest.mark.integration

RETRIEVAL, SIGNALS, DLQ, GROUP = "it.trg.retrieval", "it.trg.signals", "it.trg.dlq", "it-trigger"
BOUND_S = 60.0  # upper bound for "eventually": never a speed claim


async def eventually(check: Callable[[], Awaitable[Any]], what: str, bound_s: float = BOUND_S) -> Any:
    deadline = time.monotonic() + bound_s
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {bound_s}s: {what}"
        await asyncio.sleep(0.05)


def event(user: int, request_id: str, tokens: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    prefix = prefix_message(user, 1, rng.integers(0, 1000, 4), rng.integers(0, 10**6, tokens),
                            rng.integers(0, 4, tokens), np.sort(rng.integers(10**9, 2 * 10**9, tokens)))  # fmt: skip
    return ev.RetrievalEvent(schema_version=1, request_id=request_id, event_time_unix_ms=int(time.time() * 1e3),
                             user_id=user, prefix_version=1, prefix_len=tokens + 4, prefix=prefix,
                             ranking_deadline_unix_ms=int(time.time() * 1e3) + 60_000).SerializeToString()  # fmt: skip


@pytest.fixture(scope="module")
def broker() -> Any:
    with EmbeddedBroker.start() as running:
        yield running


@pytest.fixture
async def ranker() -> AsyncIterator[RankerService]:
    service = RankerService(load_config(RankerConfig, ["--device", "cpu"]))
    await service.start()
    yield service
    await service.shutdown(grace_s=0.5)


_suffix = iter(range(10**6))


def topics() -> tuple[str, str, str, str]:
    """Fresh topics and group per test (the broker is shared by the module)."""
    n = next(_suffix)
    return f"{RETRIEVAL}.{n}", f"{SIGNALS}.{n}", f"{DLQ}.{n}", f"{GROUP}.{n}"


async def start_trigger(broker: Any, ranker: RankerService | None, *flags: str,
                        names: tuple[str, str, str, str] | None = None) -> TriggerService:  # fmt: skip
    retrieval, signals, dlq, group = names or topics()
    rankers = ["--rankers", f"127.0.0.1:{ranker.port}", "--policy", "all"] if ranker else ["--policy", "off"]
    config = load_config(TriggerConfig, ["--bootstrap", broker.bootstrap, "--retrieval-topic", retrieval,
                                         "--signal-topic", signals, "--dlq-topic", dlq, "--group-id", group,
                                         "--topic-partitions", "1", *rankers, *flags])  # fmt: skip
    trigger = TriggerService(config)
    await trigger.start()
    if trigger.membership is not None:
        await eventually(lambda: _healthy(trigger), "the trigger sees the ranker healthy")
    return trigger


async def _healthy(trigger: TriggerService) -> bool:
    assert trigger.membership is not None
    return bool(trigger.membership.healthy())


async def read_all(broker: Any, topic: str, n: int) -> list[ConsumerRecord[bytes, bytes]]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=8 << 20)  # fmt: skip
    await consumer.start()
    got: list[ConsumerRecord[bytes, bytes]] = []
    try:

        async def enough() -> bool:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                got.extend(records)
            return len(got) >= n

        await eventually(enough, f"{n} records on {topic}")
        await asyncio.sleep(0.3)  # nothing more than expected (a duplicate would show here)
        for records in (await consumer.getmany(timeout_ms=300)).values():
            got.extend(records)
    finally:
        await consumer.stop()
    return got


async def publish(broker: Any, topic: str, records: list[tuple[bytes | None, bytes | None]]) -> None:
    producer = make_producer(KafkaSettings(bootstrap=broker.bootstrap), max_request_size=8 << 20)
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(topic, value, key=key, partition=0)
    finally:
        await producer.stop()


async def committed(trigger: TriggerService) -> int:
    assert trigger._consumer is not None
    return await trigger._consumer.committed(TopicPartition(trigger.config.retrieval_topic, 0)) or 0


def admitted(trigger: TriggerService) -> float:
    return trigger.metrics.decisions.labels("admitted")._value.get()


async def test_oversized_malformed_events_do_not_block_the_partition(broker, ranker):
    """Finding 1: ~800 KB, 1 MiB and 2 MB of garbage, each followed by a valid event, one partition."""
    trigger = await start_trigger(broker, ranker)
    try:
        bad = {size: b"\xff" + bytes(np.random.default_rng(size).integers(0, 256, size - 1, dtype=np.uint8))
               for size in (800_000, 1 << 20, 2_000_000)}  # fmt: skip
        records: list[tuple[bytes | None, bytes | None]] = []
        for i, garbage in enumerate(bad.values()):
            records += [(str(i).encode(), event(i, f"ok{i}", 100, seed=i)), (b"999", garbage)]
        records.append((b"7", event(7, "ok7", 100)))
        await publish(broker, trigger.config.retrieval_topic, records)

        signals = await read_all(broker, trigger.config.signal_topic, 4)
        assert sorted(ev.PreInferSignal.FromString(r.value).request_id for r in signals) == [
            "ok0", "ok1", "ok2", "ok7"
        ]  # fmt: skip
        letters = [read_dead_letter(r) for r in await read_all(broker, trigger.config.dlq_topic, 3)]
        assert sorted(len(d.value or b"") for d in letters) == sorted(bad)
        for d in letters:
            assert d.value == bad[len(d.value or b"")]  # the original bytes, unchanged
            assert d.key == b"999"
            assert d.reason.startswith("not a RetrievalEvent: at byte 0")
            assert (d.source_topic, d.partition, d.service) == (trigger.config.retrieval_topic, 0, "trigger")
        assert sorted(d.offset for d in letters) == [1, 3, 5]
        # Nothing decided or dead-lettered twice, offsets committed past the last record.
        assert admitted(trigger) == 4
        assert trigger.metrics.dead_letters._value.get() == 3
        assert await eventually(lambda: _at(trigger, 7), "offsets committed to the end")
    finally:
        await trigger.shutdown()


async def _at(trigger: TriggerService, offset: int) -> bool:
    return await committed(trigger) == offset


async def test_a_60k_token_event_gets_its_signal(broker, ranker):
    """Finding 2: 60k tokens (inside the 65,536 limit): a signal over 1 MiB, delivered once."""
    trigger = await start_trigger(broker, ranker)
    try:
        big = event(5, "big", 60_000)
        assert len(big) > 1_200_000
        await publish(broker, trigger.config.retrieval_topic, [(b"5", big), (b"6", event(6, "after", 50))])
        signals = await read_all(broker, trigger.config.signal_topic, 2)
        by_id = {ev.PreInferSignal.FromString(r.value).request_id: r for r in signals}
        assert set(by_id) == {"big", "after"}
        assert len(by_id["big"].value) > 1 << 20
        sig = ev.PreInferSignal.FromString(by_id["big"].value)
        assert sig.prefix == ev.RetrievalEvent.FromString(big).prefix
        assert admitted(trigger) == 2
        assert trigger.outbox_counts()["signals_dead_lettered"] == 0
    finally:
        await trigger.shutdown()


class FlakyProducer:
    """The service's real producer, with the first `failures` sends to `topic` failing as a broker
    would (fault injection: everything else goes through)."""

    def __init__(self, producer: Any, topic: str, failures: int, error: Exception) -> None:
        self._producer, self.topic, self.failures, self.error = producer, topic, failures, error
        self.calls = 0

    async def send(
        self, topic: str, value: bytes | None, *, key: bytes | None, headers: list[tuple[str, bytes]] | None
    ) -> asyncio.Future[Any]:
        if topic == self.topic:
            self.calls += 1
            if self.calls <= self.failures:
                failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                failed.set_exception(self.error)
                return failed
        return await self._producer.send(topic, value, key=key, headers=headers)


async def test_a_failed_signal_write_is_retried_without_deciding_twice(broker, ranker):
    trigger = await start_trigger(broker, ranker)
    try:
        assert trigger._outbox is not None
        flaky = FlakyProducer(
            trigger._outbox.producer, trigger.config.signal_topic, 2, KafkaConnectionError()
        )
        trigger._outbox.producer = flaky
        await publish(broker, trigger.config.retrieval_topic, [(b"3", event(3, "r3", 200))])
        signals = await read_all(broker, trigger.config.signal_topic, 1)
        assert [ev.PreInferSignal.FromString(r.value).request_id for r in signals] == ["r3"]
        assert flaky.calls == 3  # two failures, then delivered
        assert admitted(trigger) == 1  # decided once
        assert sum(len(led._admitted) for led in trigger.ledgers.values()) == 1
        assert trigger.outbox_counts()["retries"] == 2
        assert await eventually(lambda: _at(trigger, 1), "offset committed")
    finally:
        await trigger.shutdown()


async def test_a_signal_that_cannot_be_written_is_dead_lettered(broker, ranker):
    trigger = await start_trigger(broker, ranker, "--record-attempts", "2")
    try:
        assert trigger._outbox is not None
        flaky = FlakyProducer(
            trigger._outbox.producer, trigger.config.signal_topic, 10**6, ValueError("refused")
        )
        trigger._outbox.producer = flaky
        original = event(4, "r4", 30)
        await publish(broker, trigger.config.retrieval_topic, [(b"4", original)])
        [letter] = [read_dead_letter(r) for r in await read_all(broker, trigger.config.dlq_topic, 1)]
        assert letter.value == original
        assert letter.key == b"4"
        assert "pre-infer signal not delivered after 2 attempt(s)" in letter.reason
        assert flaky.calls == 2
        assert admitted(trigger) == 1
        assert await eventually(lambda: _at(trigger, 1), "offset committed")
    finally:
        await trigger.shutdown()


async def test_a_record_that_cannot_even_be_dead_lettered_is_skipped(broker):
    """A dead letter over the producer's limit (the trigger told the topics hold 64 KiB records;
    Tansu enforces no limit, so the broker took a larger one): logged, counted, skipped."""
    trigger = await start_trigger(broker, None, "--max-record-bytes", str(64 << 10))
    try:
        huge = b"\xff" * 300_000
        await publish(broker, trigger.config.retrieval_topic, [(b"1", huge), (b"2", b"\xff short")])
        letters = [read_dead_letter(r) for r in await read_all(broker, trigger.config.dlq_topic, 1)]
        assert [d.offset for d in letters] == [1]  # the small one; the huge one could not be written
        assert trigger.outbox_counts()["undeliverable"] == 1
        assert trigger.metrics.dead_letters._value.get() == 2
        assert await eventually(lambda: _at(trigger, 2), "offsets committed past both")
    finally:
        await trigger.shutdown()


class GatedProducer:
    """Holds every send until the gate opens: a batch in hand at shutdown."""

    def __init__(self, producer: Any) -> None:
        self._producer, self.gate, self.waiting = producer, asyncio.Event(), asyncio.Event()

    async def send(
        self, topic: str, value: bytes | None, *, key: bytes | None, headers: list[tuple[str, bytes]] | None
    ) -> asyncio.Future[Any]:
        self.waiting.set()
        await self.gate.wait()
        return await self._producer.send(topic, value, key=key, headers=headers)


async def test_shutdown_finishes_the_batch_in_hand(broker):
    names = topics()
    # Both records wait on the topic before the trigger starts: its first fetch takes them as one batch.
    await ensure_topics(KafkaSettings(bootstrap=broker.bootstrap), {names[0]: 1})
    await publish(broker, names[0], [(b"1", b"\xff bad"), (b"2", b"")])
    trigger = await start_trigger(broker, None, names=names)
    assert trigger._outbox is not None
    gated = GatedProducer(trigger._outbox.producer)
    trigger._outbox.producer = gated
    await asyncio.wait_for(gated.waiting.wait(), BOUND_S)
    stopping = asyncio.ensure_future(trigger.shutdown())
    await asyncio.sleep(0.2)
    assert not stopping.done()  # waiting for the batch in hand
    offset_before = await committed(trigger)
    gated.gate.set()
    await asyncio.wait_for(stopping, BOUND_S)
    assert offset_before == 0
    letters = [read_dead_letter(r) for r in await read_all(broker, trigger.config.dlq_topic, 2)]
    first, second = sorted(letters, key=lambda d: d.offset)
    assert first.reason.startswith("not a RetrievalEvent: at byte 0 (field 527): invalid wire type 7")
    assert second.reason == "empty value: 0 bytes is not a RetrievalEvent"
    # The commit happened before the consumer stopped: a fresh member of the group starts after both.
    consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=trigger.config.group_id)
    await consumer.start()
    try:
        assert await consumer.committed(TopicPartition(trigger.config.retrieval_topic, 0)) == 2
    finally:
        await consumer.stop()


async def test_records_read_again_before_their_commit_are_not_decided_twice(broker, ranker):
    """A failed commit, then the partition read again from the committed offset (as after a
    rebalance): the batch's events are neither counted, accounted nor signalled twice."""
    names = topics()
    await ensure_topics(KafkaSettings(bootstrap=broker.bootstrap), {names[0]: 1})
    await publish(broker, names[0], [(str(u).encode(), event(u, f"r{u}", 100, seed=u)) for u in (11, 12, 13)])
    trigger = await start_trigger(broker, ranker, names=names)
    try:
        consumer = trigger._consumer
        assert consumer is not None
        commit = consumer.commit
        failures: list[Any] = []

        async def commit_fails_once(offsets: Any = None) -> None:
            if not failures:
                failures.append(offsets)
                consumer.seek(TopicPartition(names[0], 0), 0)  # the group's committed offset: none yet
                raise CommitFailedError("injected: the group rebalanced")
            await commit(offsets)

        consumer.commit = commit_fails_once
        signals = await read_all(broker, trigger.config.signal_topic, 3)
        assert sorted(ev.PreInferSignal.FromString(r.value).request_id for r in signals) == [
            "r11",
            "r12",
            "r13",
        ]
        assert await eventually(lambda: _at(trigger, 3), "offsets committed after the failure")
        assert failures
        assert trigger.metrics.redelivered._value.get() == 3
        assert admitted(trigger) == 3
        assert sum(trigger.counts.values()) == 3  # not decided again (already_resident) either
        assert sum(len(led._admitted) for led in trigger.ledgers.values()) == 3
    finally:
        await trigger.shutdown()
