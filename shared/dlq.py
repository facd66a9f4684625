"""Dead letters, as Kafka Connect writes them: the original record, what went wrong in headers.

A dead letter carries the original key and value bytes unchanged (a tombstone stays a tombstone)
and the original headers, then these headers (UTF-8; numbers as decimal ASCII):

    relaygr.dlq.reason      why the record could not be handled (cut at MAX_REASON_BYTES)
    relaygr.dlq.topic       the topic, partition and offset it was read from
    relaygr.dlq.partition
    relaygr.dlq.offset
    relaygr.dlq.service     the service that gave up on it ("trigger", "router")
    relaygr.dlq.time_ms     when (Unix milliseconds)

So a dead letter is never larger than the original record plus DEAD_LETTER_HEADROOM_BYTES
(shared/wire.py), and anything the broker accepted on the source topic fits the dead-letter topic
(created with the same limit plus that headroom). Original headers under the `relaygr.dlq.`
prefix (a dead letter replayed and dead-lettered again) are replaced, not repeated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.wire import DEAD_LETTER_HEADROOM_BYTES, MAX_REASON_BYTES

PREFIX = "relaygr.dlq."
REASON, TOPIC, PARTITION, OFFSET, SERVICE, TIME_MS = (
    PREFIX + name for name in ("reason", "topic", "partition", "offset", "service", "time_ms")
)
__all__ = ["DEAD_LETTER_HEADROOM_BYTES", "DeadLetter", "dead_letter_headers", "read_dead_letter"]


def _cut(reason: str) -> bytes:
    raw = reason.encode("utf-8", "replace")
    if len(raw) <= MAX_REASON_BYTES:
        return raw
    return raw[: MAX_REASON_BYTES - 3].decode("utf-8", "ignore").encode() + b"..."


def dead_letter_headers(record: Any, reason: str, service: str, time_ms: int) -> list[tuple[str, bytes]]:
    """The headers of the dead letter of `record` (a ConsumerRecord): its own, then the error's."""
    kept = [(k, v) for k, v in (record.headers or ()) if not k.startswith(PREFIX)]
    return [
        *kept,
        (REASON, _cut(reason)),
        (TOPIC, str(record.topic).encode()),
        (PARTITION, str(record.partition).encode()),
        (OFFSET, str(record.offset).encode()),
        (SERVICE, service.encode()),
        (TIME_MS, str(time_ms).encode()),
    ]


@dataclass(frozen=True)
class DeadLetter:
    """A dead letter as read back from the dead-letter topic."""

    reason: str
    source_topic: str
    partition: int
    offset: int
    service: str
    time_ms: int
    key: bytes | None
    value: bytes | None  # the original bytes (None: the original was a tombstone)
    headers: tuple[tuple[str, bytes], ...]  # the original record's own headers


def read_dead_letter(record: Any) -> DeadLetter:
    """Reads a dead letter (a ConsumerRecord of the dead-letter topic). Raises ValueError for a
    record that does not carry the dead-letter headers."""
    headers: Sequence[tuple[str, bytes]] = record.headers or ()
    ours = {k: v.decode("utf-8", "replace") for k, v in headers if k.startswith(PREFIX)}
    missing = [h for h in (REASON, TOPIC, PARTITION, OFFSET, SERVICE, TIME_MS) if h not in ours]
    if missing:
        raise ValueError(f"not a dead letter: no {', '.join(missing)} header")
    try:
        partition, offset, time_ms = int(ours[PARTITION]), int(ours[OFFSET]), int(ours[TIME_MS])
    except ValueError:
        raise ValueError("not a dead letter: partition, offset and time_ms must be integers") from None
    return DeadLetter(
        reason=ours[REASON],
        source_topic=ours[TOPIC],
        partition=partition,
        offset=offset,
        service=ours[SERVICE],
        time_ms=time_ms,
        key=record.key,
        value=record.value,
        headers=tuple((k, v) for k, v in headers if not k.startswith(PREFIX)),
    )
