"""The sequence-aware trigger: retrieval events in, pre-infer signals out, for requests at risk.

One owner object, `TriggerService`, with `start()` / `run()` / `shutdown()` and named background
tasks: the consumer loop (a consumer-group member on the retrieval topic: it scales by partitions)
and the rankers' Stats poller (which calibrates the latency model and the per-instance ledgers).

Delivery: at-least-once. Offsets are committed after every signal and dead letter of the batch
was acknowledged by the broker; a restart may resend signals, which PreInfer absorbs (idempotent
by request id and by psi key). A malformed event goes to the dead-letter topic with its reason and
its offset is committed with the rest; nothing else is lost and nothing crashes the loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import signal
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.router.membership import Membership
from services.router.placement import preference
from services.trigger.admission import Bounds, InstanceLedger, OfferedLoad, Policy, Reason, decide
from services.trigger.config import TriggerConfig
from services.trigger.latency_model import LatencyModel, Sample
from shared.kafka import ensure_topics, make_consumer, make_producer
from shared.lifecycle import settle_heap
from shared.logging import get_logger
from shared.metrics import serve_metrics
from shared.modelspec import preset
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.wire import RequestLimits

log = get_logger("trigger")
SCHEMA_VERSION = 1
_DECISION_US_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


class EventError(ValueError):
    """A retrieval event that cannot be acted on (it goes to the dead-letter topic)."""


@dataclass(frozen=True)
class EventMeta:
    """What the trigger reads of a retrieval event (it never decodes the token arrays)."""

    request_id: str
    user_id: int
    prefix_version: int
    prefix_len: int
    ranking_deadline_unix_ms: int


def parse_event(raw: bytes | None, limits: RequestLimits) -> tuple[EventMeta, ev.RetrievalEvent]:
    """Decodes and checks the structure of a retrieval event. Raises EventError with the reason."""
    if not raw:
        raise EventError("empty event")
    event = ev.RetrievalEvent()
    try:
        event.ParseFromString(raw)
    except Exception as exc:  # protobuf raises DecodeError, and others on garbage
        raise EventError(f"not a RetrievalEvent: {type(exc).__name__}") from None
    if event.schema_version != SCHEMA_VERSION:
        raise EventError(f"unsupported schema_version {event.schema_version} (expected {SCHEMA_VERSION})")
    if not event.request_id:
        raise EventError("request_id is required")
    if not event.HasField("prefix"):
        raise EventError("prefix is required")
    p = event.prefix
    if p.user_id != event.user_id or p.prefix_version != event.prefix_version:
        raise EventError("prefix.user_id / prefix_version must equal the event's")
    lt = p.long_term
    if len(p.profile_le) % 8 or len(lt.items_le) % 8 or len(lt.timestamps_le) % 8 or len(lt.actions_le) % 4:
        raise EventError("token arrays must hold whole little-endian values")
    n = len(lt.items_le) // 8
    if len(lt.timestamps_le) // 8 != n or len(lt.actions_le) // 4 != n:
        raise EventError("items, actions and timestamps must have one entry per behaviour")
    if n > limits.max_prefix_tokens or len(p.profile_le) // 8 > limits.max_profile_tokens:
        raise EventError("prefix exceeds the size limits")
    if event.prefix_len != n + len(p.profile_le) // 8:
        raise EventError(
            f"prefix_len {event.prefix_len} does not match the prefix ({n + len(p.profile_le) // 8})"
        )
    if event.ranking_deadline_unix_ms <= 0:
        raise EventError("ranking_deadline_unix_ms is required")
    meta = EventMeta(event.request_id, event.user_id, event.prefix_version, event.prefix_len,
                     event.ranking_deadline_unix_ms)  # fmt: skip
    return meta, event


def dead_letter(reason: str, record: Any, service: str) -> bytes:
    return orjson.dumps(
        {
            "reason": reason,
            "service": service,
            "source_topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            "key": record.key.decode(errors="replace") if record.key else None,
            "value_b64": base64.b64encode(record.value or b"").decode(),
        }
    )


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("relaygr_trigger_decisions_total", "admission decisions", ["reason"],
                                 registry=registry)  # fmt: skip
        self.dead_letters = Counter(
            "relaygr_trigger_dead_letters_total", "malformed events", registry=registry
        )
        self.decision_us = Histogram("relaygr_trigger_decision_us", "per-event decision time", registry=registry,
                                     buckets=_DECISION_US_BUCKETS)  # fmt: skip
        self.calibrated = Gauge(
            "relaygr_trigger_latency_model_calibrated", "1 once fitted", registry=registry
        )
        self.at_risk_from = Gauge("relaygr_trigger_at_risk_from_prefix_tokens",
                                  "shortest prefix judged at risk on an idle instance (-1: none)",
                                  registry=registry)  # fmt: skip


class TriggerService:
    def __init__(self, config: TriggerConfig) -> None:
        self.config = config
        self.policy = Policy(config.policy)
        self.bounds = Bounds(
            config.slo_ms, config.risk_fraction, config.footprint_fraction, config.max_backlog
        )
        self.spec = preset(config.preset)
        self.latency = LatencyModel(self.spec, config.assumed_tflops)
        self.limits = RequestLimits()
        self.ledgers: dict[str, InstanceLedger] = {t: InstanceLedger() for t in config.rankers}
        self.membership = (
            Membership(list(config.rankers), check_interval_s=config.stats_interval_s, tls=config)
            if config.rankers
            else None
        )
        self.registry = CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self.counts: dict[str, int] = {r.value: 0 for r in Reason} | {"dead_letter": 0}
        self.decision_ns: list[int] = []  # recent per-event decision times (bench reads them)
        self._queue_depth: dict[str, int] = {}
        self._offered: dict[str, OfferedLoad] = {}
        self._seen_seq: dict[str, int] = {}
        self._psi_per_token: dict[str, int] = {}
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._stopping = False
        self.metrics_port = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        c = self.config
        await ensure_topics(c, {c.retrieval_topic: c.topic_partitions, c.signal_topic: c.topic_partitions,
                                c.dlq_topic: 1})  # fmt: skip
        self._producer = make_producer(c)
        await self._producer.start()
        self._consumer = make_consumer(c, [c.retrieval_topic], c.group_id, max_poll_records=1000)
        await self._consumer.start()
        if self.membership is not None:
            await self.membership.start()
            self._tasks.append(asyncio.create_task(self._poll_stats(), name="trigger-stats"))
        self._tasks.append(asyncio.create_task(self._consume(), name="trigger-consume"))
        self.metrics_port = serve_metrics(self.registry, c.metrics_port)
        settle_heap()  # decision-time collections then never traverse the libraries' objects
        log.info("trigger_ready", policy=self.policy.value, rankers=list(c.rankers), slo_ms=c.slo_ms,
                 metrics_port=self.metrics_port, topic=c.retrieval_topic)  # fmt: skip

    async def run(self) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stops intake; the batch in hand is finished (signals out, offsets committed) first."""
        if self._stopping:
            return
        self._stopping = True
        try:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._consumer is not None:
                await self._consumer.stop()
            if self._producer is not None:
                await self._producer.stop()
            if self.membership is not None:
                await self.membership.close()
            log.info("trigger_stopped", decisions=self.counts)
        finally:
            self._stopped.set()  # whatever failed above, the process must still exit

    # ------------------------------------------------------------------ the consumer loop

    async def _consume(self) -> None:
        assert self._consumer is not None
        while True:
            batch: dict[Any, list[Any]] = {}
            try:
                batch = await self._consumer.getmany(timeout_ms=100, max_records=1000)
                if not batch:
                    continue
                deliveries = []
                for records in batch.values():
                    for record in records:
                        delivery = await self._handle(record)
                        if delivery is not None:
                            deliveries.append(delivery)
                # Commit only once every signal and dead letter of the batch is acknowledged.
                await asyncio.gather(*deliveries)
                await self._consumer.commit()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker trouble: recreate what a restarted broker lost, retry
                log.warning("trigger_batch_failed", error=repr(exc))
                await self._recover(batch)

    async def _recover(self, batch: dict[Any, list[Any]]) -> None:
        """After a broker failure: topics again (a memory-only broker forgets them), then the
        batch in hand from the last commit. Never raises."""
        c = self.config
        with contextlib.suppress(Exception):
            await ensure_topics(c, {c.retrieval_topic: c.topic_partitions, c.signal_topic: c.topic_partitions,
                                    c.dlq_topic: 1}, timeout_s=2.0)  # fmt: skip
        with contextlib.suppress(Exception):
            await self._rewind(batch)
        await asyncio.sleep(0.2)

    async def _rewind(self, batch: dict[Any, list[Any]]) -> None:
        assert self._consumer is not None
        for tp in batch:
            committed = await self._consumer.committed(tp)
            with contextlib.suppress(Exception):
                self._consumer.seek(tp, committed if committed is not None else batch[tp][0].offset)

    async def _handle(self, record: Any) -> asyncio.Future[Any] | None:
        """Decides one event; returns the delivery future of its signal or dead letter, if any."""
        assert self._producer is not None
        t0 = time.perf_counter_ns()
        try:
            meta, event = parse_event(record.value, self.limits)
        except EventError as exc:
            self.counts["dead_letter"] += 1
            self.metrics.dead_letters.inc()
            log.info("event_dead_lettered", reason=str(exc), partition=record.partition, offset=record.offset)
            return await self._producer.send(self.config.dlq_topic, dead_letter(str(exc), record, "trigger"),
                                             key=record.key)  # fmt: skip
        reason, target = self.decide(meta)
        self.counts[reason.value] += 1
        self.metrics.decisions.labels(reason.value).inc()
        delivery = None
        if reason is Reason.ADMITTED:
            lease_ms = meta.ranking_deadline_unix_ms + int(self.config.lease_slack_ms)
            signal_msg = ev.PreInferSignal(
                schema_version=SCHEMA_VERSION,
                request_id=meta.request_id,
                signal_time_unix_ms=int(time.time() * 1e3),
                prefix=event.prefix,
                lease_deadline_unix_ms=lease_ms,
                expected_instance=target or "",
            )
            delivery = await self._producer.send(
                self.config.signal_topic, signal_msg.SerializeToString(), key=str(meta.user_id).encode()
            )
        elapsed = time.perf_counter_ns() - t0
        self.metrics.decision_us.observe(elapsed / 1e3)
        if len(self.decision_ns) < 200_000:
            self.decision_ns.append(elapsed)
        return delivery

    def decide(self, meta: EventMeta) -> tuple[Reason, str | None]:
        """The decision for one event, and the instance it was accounted on (pure but for the ledger)."""
        if self.policy is Policy.OFF:
            return Reason.NOT_AT_RISK, None
        instances = self.membership.healthy() if self.membership is not None else []
        if not instances:
            return Reason.LOAD_BOUND, None  # no ranker to pre-infer on
        target = preference(meta.user_id, instances, self.config.load_factor, slack=self.config.load_slack)[0]
        ledger = self.ledgers[target]
        now = time.monotonic()
        ledger.forget_expired(now)
        tokens = meta.prefix_len + self.config.suffix_tokens_estimate
        predicted = self.latency.predict(tokens, self._queue_depth.get(target, 0), tokens)
        offered = self._offered.get(target)
        if offered is None:
            offered = self._offered[target] = OfferedLoad(self.config.load_window_s)
        offered.add(now, self.latency.full_ms(tokens))
        load = offered.fraction(now)
        per_token = self._psi_per_token.get(target)
        psi_bytes = per_token * meta.prefix_len if per_token else self.spec.psi_bytes(meta.prefix_len)
        key = (meta.user_id, meta.prefix_version)
        reason = decide(self.policy, self.bounds, predicted, psi_bytes, ledger, key, now, load)
        if reason is Reason.ADMITTED:
            lease_s = (
                max(0.0, meta.ranking_deadline_unix_ms / 1e3 - time.time()) + self.config.lease_slack_ms / 1e3
            )
            ledger.admit(key, psi_bytes, now, now + lease_s)
        return reason, target

    # ------------------------------------------------------------------ rankers' Stats

    async def _poll_stats(self) -> None:
        """Absorbs the rankers' Stats, which the membership polls with its health checks."""
        assert self.membership is not None
        reported: dict[str, int] = dict(self.counts)
        next_report = time.monotonic() + self.config.report_interval_s
        while True:
            was_calibrated = self.latency.calibrated
            for target, stats in self.membership.stats().items():
                self._absorb(target, stats)
            self.metrics.calibrated.set(1 if self.latency.calibrated else 0)
            at_risk_from = self.at_risk_from_prefix_tokens()
            self.metrics.at_risk_from.set(-1 if at_risk_from is None else at_risk_from)
            if self.latency.calibrated and not was_calibrated:
                log.info("latency_model_calibrated", at_risk_from_prefix_tokens=at_risk_from,
                         **self.latency.describe())  # fmt: skip
            now = time.monotonic()
            if now >= next_report:
                next_report = now + self.config.report_interval_s
                # Periodic, so that a trigger that admits nothing says so (and why) while it runs.
                if self.counts != reported:
                    reported = dict(self.counts)
                    log.info("trigger_decisions", decisions=reported, at_risk_from_prefix_tokens=at_risk_from,
                             risk_ms=self.bounds.risk_fraction * self.bounds.slo_ms,
                             offered_load={t: round(o.fraction(now), 3) for t, o in self._offered.items()},
                             **self.latency.describe())  # fmt: skip
            await asyncio.sleep(self.config.stats_interval_s)

    def at_risk_from_prefix_tokens(self) -> int | None:
        """The shortest prefix whose full ranking on an idle instance is predicted to exceed
        risk_fraction x SLO (None: none is). Queues ahead of a request lower it."""
        tokens = self.latency.min_tokens_over(self.bounds.risk_fraction * self.bounds.slo_ms)
        if tokens is None:
            return None
        return max(0, tokens - self.config.suffix_tokens_estimate)

    def _absorb(self, target: str, stats: pb.StatsReply) -> None:
        ledger = self.ledgers[target]
        backlog = stats.preinfer_backlog
        ledger.report(time.monotonic(), stats.hbm_budget_bytes, stats.hbm_leased_bytes, backlog,
                      stats.rank_queue_depth)  # fmt: skip
        self._queue_depth[target] = stats.rank_queue_depth
        if stats.psi_bytes_per_token:
            self._psi_per_token[target] = stats.psi_bytes_per_token
        newest = max((s.seq for s in stats.recent_batches), default=0)
        seen = self._seen_seq.get(target, 0)
        if newest < seen:  # the instance restarted: its sequence numbers start over
            seen = 0
        fresh = [s for s in stats.recent_batches if s.seq > seen and s.full and s.batch > 0]
        self._seen_seq[target] = max(seen, newest)
        self.latency.observe([Sample(max(1, s.tokens // s.batch), s.compute_ms) for s in fresh])


def serve(config: TriggerConfig) -> None:
    import uvloop

    async def main() -> None:
        await TriggerService(config).run()

    uvloop.run(main())
