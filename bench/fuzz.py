"""Malformed retrieval events against the real trigger on the embedded broker.

A seeded stream of well-formed events interleaved with malformed ones (random bytes, truncated
messages, valid events with one field broken at a time, and records whose key is not the user id,
null keys and tombstones) goes to the retrieval topic. The trigger must survive (crashes: its
process exited), dead-letter every malformed event with a reason (dlq_events: records on the DLQ
that read as dead letters, shared/dlq.py; dlq_unreadable: any that do not), decide every
well-formed one (lost_events: well-formed events never decided), and commit offsets up to the
end of every partition.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from relaygr.processes import ServiceProcess
from relaygr.synthetic import Shape, request
from services.ranker.wire import prefix_to_proto
from shared.broker import EmbeddedBroker
from shared.dlq import read_dead_letter
from shared.kafka import KafkaSettings, ensure_topics, make_producer
from shared.protos import events_pb2 as ev

RETRIEVAL, SIGNALS, DLQ, GROUP = "fuzz.retrieval", "fuzz.signals", "fuzz.dlq", "fuzz-trigger"


def _valid(rng: random.Random, i: int) -> ev.RetrievalEvent:
    import torch

    prefix, _ = request(torch.Generator().manual_seed(i), i, Shape(2, rng.randint(0, 40), 0, 1))
    return ev.RetrievalEvent(schema_version=1, request_id=f"f{i}", event_time_unix_ms=1, user_id=i, prefix_version=1,
                             prefix_len=prefix.length, prefix=prefix_to_proto(prefix),
                             ranking_deadline_unix_ms=int(time.time() * 1e3) + 60_000)  # fmt: skip


def malformed(rng: random.Random, base: ev.RetrievalEvent) -> bytes:
    """One malformed encoding of an event (never a well-formed one)."""
    kind = rng.randrange(11)
    e = ev.RetrievalEvent()
    e.CopyFrom(base)
    if kind == 0:
        return b"\xff" + bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))  # 0xff: an invalid tag
    if kind == 1:
        raw = e.SerializeToString()
        return raw[: rng.randint(1, max(1, len(raw) - 1))] + b"\xff\xff"  # truncated, then garbage
    if kind == 2:
        e.schema_version = rng.choice([0, 2, 99])
    elif kind == 3:
        e.request_id = ""
    elif kind == 4:
        e.prefix_len += rng.randint(1, 5)
    elif kind == 5:
        e.prefix.long_term.items_le += b"\x01"  # ragged
    elif kind == 6:
        e.user_id += 1
    elif kind == 7:
        e.ranking_deadline_unix_ms = 0
    elif kind == 8 and e.prefix.long_term.items_le:
        e.prefix.long_term.items_le = (-1).to_bytes(8, "little", signed=True) + e.prefix.long_term.items_le[
            8:
        ]
    elif kind == 9:
        e.event_time_unix_ms = -rng.randint(1, 10**12)
    else:
        e.ClearField("prefix")
    return e.SerializeToString()


def malformed_record(rng: random.Random, base: ev.RetrievalEvent) -> tuple[bytes | None, bytes | None]:
    """(key, value) of a malformed retrieval record: a malformed value under the user's key, or a
    well-formed value under a wrong, non-numeric or null key, or a tombstone."""
    key = str(base.user_id).encode()
    kind = rng.randrange(12)
    if kind == 0:
        return str(base.user_id + 1).encode(), base.SerializeToString()
    if kind == 1:
        return b"user-" + key, base.SerializeToString()
    if kind == 2:
        return None, base.SerializeToString()
    if kind == 3:
        return key, None
    return key, malformed(rng, base)


PARTITIONS = 4


async def _committed(bootstrap: str, topic: str) -> dict[TopicPartition, int | None]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False)
    await consumer.start()
    try:
        return {
            tp: await consumer.committed(tp) for tp in (TopicPartition(topic, p) for p in range(PARTITIONS))
        }
    finally:
        await consumer.stop()


async def _dead_letters(bootstrap: str, topic: str, timeout_s: float) -> tuple[int, int]:
    """(records that read as dead letters, records that do not) on the DLQ."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    n = bad = 0
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            records = [r for v in batch.values() for r in v]
            for record in records:
                try:
                    n += bool(read_dead_letter(record).reason)
                except ValueError:
                    bad += 1
            if not records and n + bad:
                break
    finally:
        await consumer.stop()
    return n, bad


def run_fuzz(malformed_count: int = 10_000, good_count: int = 500, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    with EmbeddedBroker.start() as broker:
        settings = KafkaSettings(bootstrap=broker.bootstrap)

        async def publish() -> dict[TopicPartition, int]:
            """Publishes everything; returns each partition's end offset, from the acks (Tansu's
            ListOffsets answer is not reliable)."""
            await ensure_topics(settings, {RETRIEVAL: PARTITIONS, SIGNALS: PARTITIONS, DLQ: 1})
            producer = make_producer(settings, linger_ms=5)
            await producer.start()
            base = _valid(rng, 0)
            order = ["bad"] * malformed_count + ["good"] * good_count
            rng.shuffle(order)
            acks = []
            for i, kind in enumerate(order):
                if kind == "bad":
                    key, value = malformed_record(rng, base)
                else:
                    key, value = str(i + 1).encode(), _valid(rng, i + 1).SerializeToString()
                acks.append(await producer.send(RETRIEVAL, value, key=key))
            ends: dict[TopicPartition, int] = {}
            for meta in await asyncio.gather(*acks):
                tp = TopicPartition(RETRIEVAL, meta.partition)
                ends[tp] = max(ends.get(tp, 0), meta.offset + 1)
            await producer.stop()
            return ends

        end = asyncio.run(publish())
        trigger = ServiceProcess("services.trigger", "--bootstrap", broker.bootstrap, "--policy", "off",
                                 "--retrieval-topic", RETRIEVAL, "--signal-topic", SIGNALS, "--dlq-topic", DLQ,
                                 "--group-id", GROUP, "--topic-partitions", str(PARTITIONS))  # fmt: skip
        try:
            port = int(trigger.wait_event("trigger_ready", 120)["metrics_port"])
            total = malformed_count + good_count
            deadline = time.monotonic() + 120
            decided = dead = 0.0
            while time.monotonic() < deadline and trigger.proc.poll() is None:
                dead = trigger.metric(port, "relaygr_trigger_dead_letters_total")
                decided = trigger.metric(port, "relaygr_trigger_decisions_total")
                if dead + decided >= total:
                    break
                time.sleep(0.2)
            time.sleep(0.5)  # the last commit
            crashed = trigger.proc.poll() is not None
            committed = asyncio.run(_committed(broker.bootstrap, RETRIEVAL))
            dlq_events, dlq_unreadable = asyncio.run(_dead_letters(broker.bootstrap, DLQ, 20.0))
        finally:
            trigger.stop()
    return {
        "scenario": "fuzz_retrieval_events",
        "inputs": malformed_count,
        "well_formed": good_count,
        "crashes": int(crashed),
        "dlq_events": dlq_events,
        "dlq_unreadable": dlq_unreadable,
        "lost_events": max(0, good_count - int(decided)),
        "offsets_committed": bool(end) and all(committed.get(tp) == off for tp, off in end.items()),
    }
