"""The router's pre-infer signal consumer (Kafka, consumer group, manual commits).

Every record of a batch is forwarded as a PreInfer, dead-lettered (malformed, or refused by the
ranker as the caller's error: the original record with the reason in headers, shared/dlq.py),
dropped as stale (its lease has passed: its ranking call is over), or counted lost (no instance
took it after a few tries); only then is the batch's offset committed. At-least-once: PreInfer is
idempotent, so a redelivered signal is harmless. A signal's prefix is validated by the same rules
the ranker applies (shared/prefix_check.py, numpy only), so a malformed one is dead-lettered here
instead of costing a ranker a call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from services.router.config import RouterConfig
from services.router.forwarding import ACCEPTED, ForwardError
from shared.dlq import dead_letter_headers
from shared.kafka import CommitPacer, ensure_topics, make_consumer, make_producer
from shared.logging import get_logger
from shared.prefix_check import check_prefix, check_prefix_ref
from shared.protos import events_pb2
from shared.protos import ranker_pb2 as pb
from shared.wire import RequestLimits, WireError

log = get_logger("router.signals")
SIGNAL_SCHEMA_VERSION = 1
BATCH_RETRY_PAUSE_S = 0.5  # after a failed fetch or batch: the broker or the DLQ gets a moment

PreInfer = Callable[[bytes, int, int, int, float], Awaitable[tuple[pb.PreInferReply, bytes]]]
"""(serialized PreInferRequest, user id, prefix version, lease deadline unix ms, deadline on
time.monotonic()) -> the reply parsed and as sent; raises ForwardError (Forwarder.preinfer)."""


class MalformedSignal(ValueError):
    """A signal that can never be forwarded: it goes to the DLQ with this reason."""


def decode_signal(value: bytes | None, limits: RequestLimits) -> events_pb2.PreInferSignal:
    """A record's value -> the PreInferSignal it holds, fully validated (schema version, request
    id, the prefix by the ranker's rules); raises MalformedSignal with the reason."""
    if value is None:
        raise MalformedSignal("empty value")
    signal = events_pb2.PreInferSignal()
    try:
        signal.ParseFromString(value)
    except DecodeError as exc:
        raise MalformedSignal(f"undecodable PreInferSignal: {exc}") from None
    if signal.schema_version != SIGNAL_SCHEMA_VERSION:
        raise MalformedSignal(f"schema_version {signal.schema_version} is not {SIGNAL_SCHEMA_VERSION}")
    if not signal.request_id:
        raise MalformedSignal("request_id is required")
    if signal.HasField("prefix_ref"):
        # Named, not carried: a prefetch only brings back psi already held, it never computes it.
        if not signal.prefetch_only:
            raise MalformedSignal("prefix_ref: only a prefetch-only signal may name its prefix")
        if signal.HasField("prefix"):
            raise MalformedSignal("prefix and prefix_ref: a signal carries its prefix or names it, not both")
        try:
            check_prefix_ref(signal.prefix_ref, limits)
        except WireError as exc:
            raise MalformedSignal(f"invalid prefix_ref: {exc}") from None
        return signal
    if not signal.HasField("prefix"):
        raise MalformedSignal("prefix is required (or, prefetch-only, prefix_ref)")
    try:
        check_prefix(signal.prefix, limits)
    except WireError as exc:
        raise MalformedSignal(f"invalid prefix: {exc}") from None
    return signal


def _user_of(signal: events_pb2.PreInferSignal) -> int:
    """The user a signal is for, whether it carries its prefix or names it."""
    return signal.user_id if signal.HasField("prefix_ref") else signal.prefix.user_id


class SignalConsumer:
    """Consumes the signal topic batch by batch (`run`) until `stop_intake`; `start` creates the
    topics and connects, `close` disconnects. Outcomes are counted on `outcomes` by label
    ("forwarded", "refused", "dlq", "lost", "stale")."""

    def __init__(self, config: RouterConfig, preinfer: PreInfer, outcomes: Counter) -> None:
        self.config = config
        self._preinfer = preinfer
        self._outcomes = outcomes
        self.consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None  # the DLQ's
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Creates the signal and DLQ topics if missing, starts the DLQ producer and joins the
        consumer group. Raises KafkaError (or OSError) when the broker cannot be reached."""
        c = self.config
        await ensure_topics(c, {c.signal_topic: c.topic_partitions, c.dlq_topic: c.topic_partitions})
        self._producer = make_producer(c)
        await self._producer.start()
        self.consumer = make_consumer(c, [c.signal_topic], c.group_id)
        await self.consumer.start()

    async def run(self) -> None:
        """Batch by batch until `stop_intake`; a batch in hand is finished first. Finished
        batches' offsets are committed together at most every commit_interval_ms, whenever a
        fetch finds nothing new, and at the end (shared/kafka.py CommitPacer). Nothing that goes
        wrong in a batch ends the loop (the batch is read again)."""
        assert self.consumer is not None, "start() first"
        pacer = CommitPacer(self.config.commit_interval_ms / 1e3)
        while not self._stopping.is_set():
            try:
                finished = await self._consume_batch(self.consumer)
            except Exception as exc:
                log.error("signal_consumer_error", error=repr(exc))
                await asyncio.sleep(BATCH_RETRY_PAUSE_S)
                continue
            if finished:
                pacer.finished(finished)
            offsets = pacer.due(time.monotonic(), idle=finished is None)
            if offsets:
                await self._commit(self.consumer, offsets)
        offsets = pacer.take()
        if offsets:
            await self._commit(self.consumer, offsets)

    def stop_intake(self) -> None:
        """No batch is fetched after the one in hand."""
        self._stopping.set()

    async def close(self) -> None:
        """Leaves the group and stops the producer; never raises for a client that is half started."""
        self._stopping.set()
        for client in (self.consumer, self._producer):
            if client is not None:
                with contextlib.suppress(KafkaError):
                    await client.stop()

    async def _consume_batch(self, consumer: AIOKafkaConsumer) -> dict[TopicPartition, int] | None:
        """Forwards or dead-letters every record of one batch; returns the offsets after its
        records (to commit), {} when the batch is to be read again (e.g. the DLQ unwritable: it is
        re-read from its first offsets), None when the fetch found nothing."""
        try:
            batch = await consumer.getmany(timeout_ms=200, max_records=self.config.signal_batch)
        except KafkaError as exc:
            log.warning("signal_fetch_failed", error=repr(exc))
            await asyncio.sleep(BATCH_RETRY_PAUSE_S)
            return {}
        if not batch:
            return None
        try:
            await self._handle_batch(batch)
        except Exception as exc:
            log.error("signal_batch_failed", error=repr(exc), records=sum(map(len, batch.values())))
            for tp, records in batch.items():
                with contextlib.suppress(Exception):  # the partition may have been revoked meanwhile
                    consumer.seek(tp, records[0].offset)
            await asyncio.sleep(BATCH_RETRY_PAUSE_S)
            return {}
        return {tp: records[-1].offset + 1 for tp, records in batch.items()}

    @staticmethod
    async def _commit(consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> None:
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # e.g. a rebalance: the records come again (at-least-once)
            log.warning("signal_commit_failed", error=repr(exc))

    async def _handle_batch(self, batch: dict[TopicPartition, list[ConsumerRecord[Any, Any]]]) -> None:
        """Records of one user (one key) in order; different users concurrently, bounded."""
        by_key: dict[bytes | None, list[ConsumerRecord[Any, Any]]] = collections.defaultdict(list)
        for records in batch.values():
            for record in records:
                by_key[record.key].append(record)
        limit = asyncio.Semaphore(self.config.signal_concurrency)

        async def run(records: list[ConsumerRecord[Any, Any]]) -> None:
            async with limit:
                for record in records:
                    outcome = await self._handle_signal(record)
                    self._outcomes.labels(outcome).inc()

        await asyncio.gather(*(run(records) for records in by_key.values()))

    async def _handle_signal(self, record: ConsumerRecord[Any, Any]) -> str:
        """One signal -> "forwarded" | "refused" | "dlq" | "lost" | "stale". Raises only when the
        DLQ itself cannot be written (the batch is then retried)."""
        try:
            signal = decode_signal(record.value, self.config.limits)
        except MalformedSignal as exc:
            await self._dead_letter(record, str(exc))
            return "dlq"
        lease_ms = signal.lease_deadline_unix_ms
        if 0 < lease_ms <= time.time() * 1e3:
            log.info("signal_stale", request_id=signal.request_id, user=_user_of(signal))
            return "stale"  # its ranking call is over: pre-inferring now would only waste work
        if signal.HasField("prefix_ref"):
            user_id, prefix_version = signal.user_id, signal.prefix_version
            request = pb.PreInferRequest(
                request_id=signal.request_id, lease_deadline_unix_ms=lease_ms, prefetch_only=True,
                user_id=user_id, prefix_version=prefix_version, prefix_ref=signal.prefix_ref,
                signal_time_unix_ms=signal.signal_time_unix_ms,
                ranking_deadline_unix_ms=signal.ranking_deadline_unix_ms,
            ).SerializeToString()  # fmt: skip
        else:
            user_id, prefix_version = signal.prefix.user_id, signal.prefix.prefix_version
            request = pb.PreInferRequest(
                request_id=signal.request_id,
                prefix=signal.prefix,
                lease_deadline_unix_ms=lease_ms,
                prefetch_only=signal.prefetch_only,
                signal_time_unix_ms=signal.signal_time_unix_ms,
                ranking_deadline_unix_ms=signal.ranking_deadline_unix_ms,
            ).SerializeToString()
        error: ForwardError | None = None
        for attempt in range(self.config.signal_retries):
            if attempt:
                await asyncio.sleep(min(self.config.check_interval_s, 0.5) * attempt)
            try:
                reply, _ = await self._preinfer(
                    request,
                    user_id,
                    prefix_version,
                    lease_ms,
                    time.monotonic() + self.config.preinfer_timeout_ms / 1e3,
                )
            except ForwardError as exc:
                if exc.client_error:
                    await self._dead_letter(record, f"ranker rejected: {exc.code.name}: {exc.message}")
                    return "dlq"
                error = exc
                continue
            return "forwarded" if reply.outcome in ACCEPTED else "refused"
        log.warning("signal_lost", request_id=signal.request_id, user=_user_of(signal),
                    error=error.message if error else "")  # fmt: skip
        return "lost"

    async def _dead_letter(self, record: ConsumerRecord[Any, Any], reason: str) -> None:
        """The original record, the reason in headers (shared/dlq.py). A dead letter that can never
        be written (too large) is logged and skipped; other errors raise (the batch is retried)."""
        assert self._producer is not None
        headers = dead_letter_headers(record, reason, "router", int(time.time() * 1e3))
        try:
            await self._producer.send_and_wait(
                self.config.dlq_topic, record.value, key=record.key, headers=headers
            )
        except (MessageSizeTooLargeError, RecordTooLargeError) as exc:
            log.error("dead_letter_undeliverable", reason=reason, topic=record.topic, partition=record.partition,
                      offset=record.offset, error=repr(exc))  # fmt: skip
            return
        log.warning("signal_dead_lettered", reason=reason, topic=record.topic, partition=record.partition,
                    offset=record.offset)  # fmt: skip
