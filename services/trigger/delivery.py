"""Getting the trigger's outputs (pre-infer signals, dead letters) onto the broker, per record.

Nothing is replayed for ever and nothing blocks a partition for long:
  * a failure of the record itself (too large, refused as invalid) is not retried;
  * any other error the broker gives for one record is retried `record_attempts` times in all,
    with a doubling backoff;
  * the broker being unreachable (connection lost, timed out, topic gone with a restarted memory-
    only broker) is retried for `broker_retry_s`, the topics re-created in between: the whole
    partition waits then, as it must, since nothing can be written anywhere;
  * a signal that still cannot be delivered is dead-lettered with the reason; a dead letter that
    cannot be written is logged with its source partition and offset, counted and skipped.
Decisions are never re-made on a retry: only the output is sent again.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka.errors import (
    CorruptRecordException,
    InvalidTopicError,
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from prometheus_client import CollectorRegistry, Counter

from shared.dlq import REASON, dead_letter_headers
from shared.logging import get_logger

log = get_logger("trigger")
_MAX_BACKOFF_S = 1.0
# Errors of the record itself: sending it again cannot succeed.
_PERMANENT = (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError, CorruptRecordException,
              InvalidTopicError)  # fmt: skip


class Sender(Protocol):
    """What the outbox needs of a producer (AIOKafkaProducer)."""

    async def send(
        self, topic: str, value: bytes | None, *, key: bytes | None, headers: list[tuple[str, bytes]] | None
    ) -> asyncio.Future[Any]: ...


class Kind(enum.Enum):
    SIGNAL = "signal"
    DEAD_LETTER = "dead_letter"


@dataclass
class Output:
    """One record to write, and the retrieval record it comes from."""

    source: Any  # the ConsumerRecord it was made from
    kind: Kind
    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]] | None = None
    attempts: int = 0
    failing_since: float | None = None


@dataclass(frozen=True)
class RetryPolicy:
    record_attempts: int = 3  # attempts in all, for an error the broker gives for one record
    backoff_s: float = 0.05  # first wait between attempts; doubles, at most 1 s
    broker_retry_s: float = 30.0  # how long an unreachable broker is retried

    def backoff(self, round_: int) -> float:
        return min(self.backoff_s * (2**round_), _MAX_BACKOFF_S)


class ErrorKind(enum.Enum):
    PERMANENT = "permanent"  # the record itself: never retried
    BROKER = "broker"  # the broker unreachable: retried for broker_retry_s
    RECORD = "record"  # anything else: retried record_attempts times


def classify(exc: BaseException) -> ErrorKind:
    if isinstance(exc, _PERMANENT):
        return ErrorKind.PERMANENT
    if isinstance(exc, KafkaConnectionError | KafkaTimeoutError) or getattr(exc, "retriable", False):
        return ErrorKind.BROKER
    return ErrorKind.RECORD


def dead_letter(source: Any, reason: str, dlq_topic: str, service: str = "trigger") -> Output:
    """The dead letter of a retrieval record: its own key, value and headers, and the reason."""
    headers = dead_letter_headers(source, reason, service, int(time.time() * 1e3))
    return Output(source, Kind.DEAD_LETTER, dlq_topic, source.value, source.key, headers)


class Outbox:
    """Writes a batch's outputs with per-record retries; `deliver` returns when each one is on
    the broker or given up (never raises but for cancellation)."""

    def __init__(self, producer: Sender, dlq_topic: str, policy: RetryPolicy,
                 registry: CollectorRegistry, recover: Callable[[], Awaitable[None]]) -> None:  # fmt: skip
        self.producer = producer
        self.dlq_topic = dlq_topic
        self.policy = policy
        self._recover = recover
        self.counts = {"retries": 0, "signals_dead_lettered": 0, "undeliverable": 0}
        self._retries = Counter("relaygr_trigger_delivery_retries_total", "outputs sent again after an error",
                                ["kind"], registry=registry)  # fmt: skip
        self._signals_dead_lettered = Counter("relaygr_trigger_signals_dead_lettered_total",
                                              "admitted events whose signal could not be delivered (dead-lettered)",
                                              registry=registry)  # fmt: skip
        self._undeliverable = Counter("relaygr_trigger_undeliverable_total",
                                      "records that could not even be dead-lettered (logged and skipped)",
                                      registry=registry)  # fmt: skip

    async def deliver(self, outputs: list[Output]) -> None:
        pending, round_ = outputs, 0
        while pending:
            sent = [(out, await self._send(out)) for out in pending]
            results = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
            now, retry, broker_down = time.monotonic(), [], False
            for (out, _), result in zip(sent, results, strict=True):
                if isinstance(result, BaseException):
                    broker_down |= classify(result) is ErrorKind.BROKER
                    again = self._after_failure(out, result, now)
                    if again is not None:
                        retry.append(again)
            pending = retry
            if pending:
                if broker_down:
                    await self._recover()
                await asyncio.sleep(self.policy.backoff(round_))
                round_ += 1

    async def _send(self, out: Output) -> asyncio.Future[Any]:
        out.attempts += 1
        try:
            return await self.producer.send(out.topic, out.value, key=out.key, headers=out.headers)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused before it left (too large, no metadata): same path
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    def _after_failure(self, out: Output, exc: BaseException, now: float) -> Output | None:
        """The output to send next for a failed one: itself again, the dead letter of its source,
        or None (given up: logged and counted)."""
        kind = classify(exc)
        if out.failing_since is None:
            out.failing_since = now
        if kind is ErrorKind.BROKER:
            give_up = now - out.failing_since >= self.policy.broker_retry_s
        else:
            give_up = kind is ErrorKind.PERMANENT or out.attempts >= self.policy.record_attempts
        src = out.source
        if not give_up:
            self.counts["retries"] += 1
            self._retries.labels(out.kind.value).inc()
            log.warning("delivery_retry", kind=out.kind.value, attempt=out.attempts, error=repr(exc),
                        partition=src.partition, offset=src.offset)  # fmt: skip
            return out
        if out.kind is Kind.SIGNAL:
            self.counts["signals_dead_lettered"] += 1
            self._signals_dead_lettered.inc()
            reason = f"pre-infer signal not delivered after {out.attempts} attempt(s): {exc!r}"
            log.warning("signal_dead_lettered", reason=reason, partition=src.partition, offset=src.offset)
            return dead_letter(src, reason, self.dlq_topic)
        self.counts["undeliverable"] += 1
        self._undeliverable.inc()
        reason = dict(out.headers or ()).get(REASON, b"").decode("utf-8", "replace")
        log.error("dead_letter_undeliverable", topic=src.topic, partition=src.partition, offset=src.offset,
                  reason=reason, attempts=out.attempts, error=repr(exc), value_bytes=len(src.value or b""))  # fmt: skip
        return None
