"""Dead-letter headers, the trigger's processed-record memory, error classes and the broker's record limits."""

from __future__ import annotations

import pytest
from aiokafka import ConsumerRecord
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotLeaderForPartitionError,
    UnknownTopicOrPartitionError,
)
from aiokafka.protocol.admin import DescribeConfigsResponse_v0, DescribeConfigsResponse_v2

from services.trigger.delivery import ErrorKind, RetryPolicy, classify
from services.trigger.progress import Processed
from shared.dlq import dead_letter_headers, read_dead_letter
from shared.kafka import KafkaSettings, consumer_args, parse_record_limits, producer_args
from shared.wire import DEAD_LETTER_HEADROOM_BYTES, DEFAULT_MAX_RECORD_BYTES, MAX_REASON_BYTES


def record(offset: int = 5, value: bytes | None = b"v", timestamp: int = 100, headers=()) -> ConsumerRecord:
    return ConsumerRecord(topic="src", partition=2, offset=offset, timestamp=timestamp, timestamp_type=0, key=b"k",
                          value=value, checksum=None, serialized_key_size=1, serialized_value_size=len(value or b""),
                          headers=list(headers))  # fmt: skip


def as_dlq_record(source: ConsumerRecord, headers: list[tuple[str, bytes]]) -> ConsumerRecord:
    return ConsumerRecord(topic="dlq", partition=0, offset=0, timestamp=1, timestamp_type=0, key=source.key,
                          value=source.value, checksum=None, serialized_key_size=1, serialized_value_size=1,
                          headers=headers)  # fmt: skip


def test_headers_carry_the_reason_and_the_source():
    src = record(headers=[("trace", b"abc")])
    letter = read_dead_letter(as_dlq_record(src, dead_letter_headers(src, "bad thing", "trigger", 1234)))
    assert (letter.reason, letter.source_topic, letter.partition, letter.offset, letter.service, letter.time_ms) == (
        "bad thing", "src", 2, 5, "trigger", 1234
    )  # fmt: skip
    assert (letter.key, letter.value, letter.headers) == (b"k", b"v", (("trace", b"abc"),))


def test_a_long_reason_is_cut_and_the_headroom_holds():
    src = record(headers=[])
    headers = dead_letter_headers(src, "é" * 10_000, "trigger", 1)
    reason = dict(headers)["relaygr.dlq.reason"]
    assert len(reason) <= MAX_REASON_BYTES
    assert reason.endswith(b"...")
    reason.decode()  # still UTF-8: never cut inside a character
    assert sum(len(k) + len(v) for k, v in headers) < DEAD_LETTER_HEADROOM_BYTES


def test_a_dead_letter_dead_lettered_again_keeps_one_set_of_headers():
    src = record()
    first = dead_letter_headers(src, "first", "router", 1)
    again = dead_letter_headers(as_dlq_record(src, first), "second", "trigger", 2)
    assert [v for k, v in again if k == "relaygr.dlq.reason"] == [b"second"]


def test_a_record_without_the_headers_is_not_a_dead_letter():
    with pytest.raises(ValueError, match=r"not a dead letter: no relaygr\.dlq\.reason"):
        read_dead_letter(record())
    bad = dead_letter_headers(record(), "r", "s", 1)
    bad = [(k, b"x" if k == "relaygr.dlq.offset" else v) for k, v in bad]
    with pytest.raises(ValueError, match="must be integers"):
        read_dead_letter(as_dlq_record(record(), bad))


def test_processed_skips_the_same_record_until_committed():
    seen = Processed()
    a = record(offset=5)
    seen.add("tp", a)
    assert seen.seen("tp", a)
    assert not seen.seen("other", a)
    # A different record at the same offset (a memory-only broker restarted): not a duplicate.
    assert not seen.seen("tp", record(offset=5, timestamp=999))
    assert not seen.seen("tp", record(offset=5, value=None))
    seen.committed("tp", 5)
    assert seen.seen("tp", a)  # offset 5 is not below the committed offset
    seen.committed("tp", 6)
    assert not seen.seen("tp", a)
    assert len(seen) == 0


def test_processed_is_bounded():
    seen = Processed(max_entries=3)
    for offset in range(5):
        seen.add("tp", record(offset=offset))
    assert len(seen) == 3
    assert not seen.seen("tp", record(offset=0))
    assert seen.seen("tp", record(offset=4))
    with pytest.raises(ValueError, match="max_entries"):
        Processed(0)


def test_error_classes():
    assert classify(MessageSizeTooLargeError()) is ErrorKind.PERMANENT
    for exc in (KafkaConnectionError(), KafkaTimeoutError(), UnknownTopicOrPartitionError(),
                NotLeaderForPartitionError()):  # fmt: skip
        assert classify(exc) is ErrorKind.BROKER
    assert classify(ValueError("x")) is ErrorKind.RECORD
    policy = RetryPolicy(backoff_s=0.05)
    assert [policy.backoff(r) for r in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_record_limits_from_describe_configs():
    v2 = DescribeConfigsResponse_v2(
        throttle_time_ms=0,
        resources=[
            (0, None, 2, "a", [("max.message.bytes", "2097152", False, 5, False, [])]),
            (0, None, 2, "b", []),  # Tansu, for a topic created without the config
            (3, "unknown topic", 2, "c", []),
        ],
    )
    v0 = DescribeConfigsResponse_v0(
        throttle_time_ms=0,
        resources=[(0, None, 2, "d", [("max.message.bytes", "1048588", False, True, False)])],
    )
    assert parse_record_limits([v2, v0], ["a", "b", "c", "d"]) == {
        "a": 2_097_152,
        "b": None,
        "c": None,
        "d": 1_048_588,
    }


def test_clients_are_sized_for_the_record_limit():
    settings = KafkaSettings()
    assert settings.max_record_bytes == DEFAULT_MAX_RECORD_BYTES
    assert (
        producer_args(settings)["max_request_size"] == DEFAULT_MAX_RECORD_BYTES + DEAD_LETTER_HEADROOM_BYTES
    )
    assert consumer_args(settings, "g")["max_partition_fetch_bytes"] >= DEFAULT_MAX_RECORD_BYTES
