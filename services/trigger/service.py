"""The sequence-aware trigger: retrieval events in, pre-infer signals out, for requests at risk.

One owner object, `TriggerService`, run by shared.lifecycle.Lifecycle: `start` / `stop_intake` /
`drain` (the batch in hand is finished: its outputs written or given up, its offsets committed) /
`close`, with named background tasks spawned through the lifecycle: the consumer loop (a
consumer-group member on the retrieval topic: it scales by partitions), the rankers' Stats poller
(which calibrates the latency model and the per-instance ledgers) and the membership's checks. The
first failure of any of them stops intake, drains and exits 1, so a supervisor restarts the
trigger instead of it deciding on stale loads. `run` returns the exit status; `start` plus
`shutdown` run it without the lifecycle's signal handling (tests, benchmarks).

Delivery: at-least-once, and nothing blocks a partition. Each record of a batch is validated in
full (services/trigger/events.py) and decided once; its output (a signal, or a dead letter: the
original record with the reason in headers, shared/dlq.py) is written with per-record retries
(services/trigger/delivery.py); offsets are committed once every output of the batch is on the
broker or given up. A record seen again before its offset was committed is skipped
(services/trigger/progress.py), so a redelivered batch neither counts nor signals twice. A
restart may resend signals, which PreInfer absorbs (idempotent by request id and by psi key).

Sizes (shared/wire.py): the producer takes records up to the record limit of the topics (read
from the broker at start-up, else RELAYGR_KAFKA_MAX_RECORD_BYTES) plus a dead letter's headroom,
so whatever the broker accepted on the retrieval topic can be dead-lettered; an event whose
signal would not fit the signal topic is refused up front, with that reason.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import statistics
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.trigger.admission import (
    Bounds,
    InstanceLedger,
    OfferedLoad,
    Policy,
    Reason,
    ReturnRate,
    adds_little_work,
    decide,
    host_has_spare,
    reuse_pays,
    risk_threshold_ms,
    spare_outweighs_waits,
    spare_shortens,
    too_late,
)
from services.trigger.config import ADMISSION_SETTINGS, TriggerConfig
from services.trigger.delivery import Kind, Outbox, Output, RetryPolicy, dead_letter
from services.trigger.events import (
    SCHEMA_VERSION,
    EventError,
    EventMeta,
    parse_event,
    parse_record,
    signal_size_bound,
)
from services.trigger.latency_model import LatencyModel, Sample
from services.trigger.progress import Processed
from shared.fingerprint import prefix_fingerprint
from shared.kafka import CommitPacer, ensure_topics, make_consumer, make_producer, record_limits
from shared.lifecycle import Lifecycle, settle_heap
from shared.logging import get_logger
from shared.membership import Membership
from shared.metrics import LATENCY_MS_BUCKETS, HostStalls, serve_metrics
from shared.modelspec import preset
from shared.placement import preference
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.wire import DEAD_LETTER_HEADROOM_BYTES, RequestLimits

__all__ = ["SCHEMA_VERSION", "EventError", "EventMeta", "TriggerService", "parse_event", "serve"]

log = get_logger("trigger")
_DECISION_US_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
# Trigger -> Kafka -> router -> ranker for a pre-infer signal, generously (consumers poll every
# 5 ms), until the target's rankers report a measured trip (StatsReply.signal_trip_p90_ms).
_SIGNAL_TRIP_S = 0.05
# A measured trip counts at least this much: the report's p90 lags a path that slows.
_MIN_SIGNAL_TRIP_S = 0.005
MIN_PREINFER_SAMPLES = 5  # measured pre-inferences before their fit prices admission
# The latency models refit at most once a second (LatencyModel.refit_interval_s): costs move
# on the scale of seconds, and a refit on every 0.2 s Stats poll stalled the event loop.
REFIT_INTERVAL_S = 1.0
# A signal record's framing and key (a user id) besides its value.
_SIGNAL_RECORD_OVERHEAD_BYTES = 512


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter("relaygr_trigger_decisions_total", "admission decisions", ["reason"],
                                 registry=registry)  # fmt: skip
        self.dead_letters = Counter(
            "relaygr_trigger_dead_letters_total", "malformed events", registry=registry
        )
        self.redelivered = Counter("relaygr_trigger_redelivered_total",
                                   "records seen again before their offset was committed (skipped)",
                                   registry=registry)  # fmt: skip
        self.decision_us = Histogram("relaygr_trigger_decision_us", "per-event decision time", registry=registry,
                                     buckets=_DECISION_US_BUCKETS)  # fmt: skip
        # The first leg of the signal path (the ranker times the second, signal -> PreInfer): a
        # pre-inference that starts late may have been decided late.
        self.event_lag_ms = Histogram("relaygr_trigger_event_lag_ms",
                                      "a retrieval event's time -> the trigger's decision on it (wall clocks)",
                                      registry=registry, buckets=LATENCY_MS_BUCKETS)  # fmt: skip
        self.admitted_by = Counter("relaygr_trigger_admitted_total",
                                   "admissions by ground: risk (this call's latency), reuse (work saved "
                                   "over the calls expected on the psi) or spare (a new key, pre-inferred "
                                   "off the critical path while the device has room)", ["ground"],
                                   registry=registry)  # fmt: skip
        self.returning = Counter("relaygr_trigger_events_returning_total",
                                 "events whose (user, prefix version) was seen within the reuse window",
                                 ["returning"], registry=registry)  # fmt: skip
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
        self.latency = LatencyModel(self.spec, config.assumed_tflops, refit_interval_s=REFIT_INTERVAL_S)
        # Device work per call, for admission by reuse (a batch's time shared by its calls:
        # batching makes a full ranking cheaper per call than its latency says), and the device
        # time of a whole pre-inference, from the rankers' measurements.
        self.full_work = LatencyModel(self.spec, config.assumed_tflops, refit_interval_s=REFIT_INTERVAL_S)
        self.preinfer_work = LatencyModel(self.spec, config.assumed_tflops, refit_interval_s=REFIT_INTERVAL_S)
        # What each ranker plans a psi to cost (StatsReply.preinfer_plan), and a fit through it:
        # the price before pre-inferences were measured.
        self._preinfer_plans: dict[str, tuple[tuple[int, float], ...]] = {}
        self._plan_models: dict[str, LatencyModel] = {}
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
        self.retry = RetryPolicy(config.record_attempts, config.retry_backoff_ms / 1e3, config.broker_retry_s)
        # Until start() reads the topics' limits from the broker: the configured record limit.
        self.signal_limit_bytes = config.max_record_bytes - _SIGNAL_RECORD_OVERHEAD_BYTES
        self._instance_name_bytes = max((len(t.encode()) for t in config.rankers), default=0)
        self._processed = Processed()
        self._queue_depth: dict[str, int] = {}
        self._offered: dict[str, OfferedLoad] = {}
        self._seen_seq: dict[str, int] = {}
        self._psi_per_token: dict[str, int] = {}
        # Per target: its rankers' full rankings keep psi from this prefix length on (0: none).
        self._ranking_psi_min: dict[str, int] = {}
        self._device_busy: dict[str, float] = {}  # per target: its last reported busy share
        self._host_ms: dict[str, float] = {}  # per target: host CPU ms per request, as reported
        # Per target: its ranking calls (hits + misses) at its last report, and the rate they
        # came at (calls/s, smoothed over load_window_s): every caller's, where this trigger sees
        # only its partitions' events.
        self._calls_reported: dict[str, tuple[float, int]] = {}
        self._call_rate: dict[str, float] = {}
        self._signal_trip_s: dict[str, float] = {}  # per target: its reported signal trip (p90)
        # Reuse: how often keys come back (from the events) and what a cached call costs (from
        # the rankers' cached batches: their time per call).
        self.returns = ReturnRate(config.reuse_window_s)
        self._cached_ms: collections.deque[float] = collections.deque(maxlen=128)
        self._cached_median_ms: float | None = None  # of _cached_ms, until it changes (every event reads it)
        self._seen_preinfer_seq: dict[str, int] = {}
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._outbox: Outbox | None = None
        self.life = Lifecycle("trigger", grace_s=config.drain_timeout_s)
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # what start spawned through self.life
        self._stop_intake = asyncio.Event()
        self._closed = False
        self.metrics_port = 0
        self._stalls: HostStalls | None = None

    # ------------------------------------------------------------------ lifecycle

    def _topics(self) -> dict[str, int]:
        c = self.config
        return {c.retrieval_topic: c.topic_partitions, c.signal_topic: c.topic_partitions, c.dlq_topic: 1}

    async def run(self, install_signals: bool = True) -> int:
        """Starts, serves until SIGTERM / SIGINT or a background task's failure, finishes the batch
        in hand, closes; returns the exit status (0: asked to stop; 1: the start or a background
        task failed)."""
        return await self.life.run(self, install_signals)

    async def start(self) -> None:
        """Creates the topics, starts the Kafka clients, the rankers' checks and the background
        tasks. Raises when the trigger cannot serve (no broker); `close` then undoes what it did."""
        c = self.config
        await ensure_topics(c, self._topics())
        producer_limit = await self._size_limits()
        self._producer = make_producer(c, max_request_size=producer_limit)
        await self._producer.start()
        self._outbox = Outbox(self._producer, c.dlq_topic, self.retry, self.registry, self._recover_topics)
        self._consumer = make_consumer(c, [c.retrieval_topic], c.group_id, max_poll_records=1000)
        await self._consumer.start()
        if self.membership is not None:
            await self.membership.start(spawn=self._spawn)
            self._spawn(self._poll_stats(), "stats")
        self._spawn(self._consume(), "consume")
        self.metrics_port = serve_metrics(self.registry, c.metrics_port)
        settle_heap()  # decision-time collections then never traverse the libraries' objects
        self._stalls = HostStalls(self.registry)  # beside the rankers': a host-wide stall shows in all
        log.info("trigger_ready", policy=self.policy.value, rankers=list(c.rankers), slo_ms=c.slo_ms,
                 metrics_port=self.metrics_port, topic=c.retrieval_topic,
                 signal_limit_bytes=self.signal_limit_bytes, producer_limit_bytes=producer_limit,
                 admission=self.admission_settings())  # fmt: skip

    def admission_settings(self) -> dict[str, Any]:
        """The settings its admission runs with (ADMISSION_SETTINGS): in its start-up line, so that
        a run's record says what the trigger did (the capacity model reads them from there)."""
        return {name: getattr(self.config, name) for name in ADMISSION_SETTINGS}

    async def _size_limits(self) -> int:
        """Sets the signal limit from the broker's view of the topics; returns the producer's
        max_request_size: room for a dead letter of anything the retrieval topic accepts."""
        c = self.config
        reported = await record_limits(c, [c.retrieval_topic, c.signal_topic, c.dlq_topic])
        retrieval = reported[c.retrieval_topic] or c.max_record_bytes
        signals = reported[c.signal_topic] or c.max_record_bytes
        dlq = reported[c.dlq_topic] or c.max_record_bytes + DEAD_LETTER_HEADROOM_BYTES
        self.signal_limit_bytes = signals - _SIGNAL_RECORD_OVERHEAD_BYTES
        if dlq < retrieval + DEAD_LETTER_HEADROOM_BYTES:
            log.warning("dlq_smaller_than_retrieval", retrieval_max_message_bytes=retrieval, dlq_max_message_bytes=dlq,
                        consequence="a malformed event this large cannot be dead-lettered: logged and skipped")  # fmt: skip
        return max(retrieval, signals, c.max_record_bytes) + DEAD_LETTER_HEADROOM_BYTES

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = self._tasks[name] = self.life.spawn(coro, name)
        return task

    async def stop_intake(self) -> None:
        """No new batch is fetched; the one in hand goes on. Idempotent."""
        self._stop_intake.set()

    async def drain(self) -> None:
        """Waits for the consumer loop to finish the batch in hand (outputs written or given up,
        offsets committed) and return. The lifecycle bounds this by drain_timeout_s."""
        consume = self._tasks.get("consume")
        if consume is not None:
            # asyncio.wait neither raises the loop's failure (the lifecycle has it already) nor,
            # when the grace runs out and this wait is cancelled, cancels the loop (close does).
            await asyncio.wait({consume})

    async def close(self) -> None:
        """Cancels the background tasks, stops the Kafka clients and the rankers' checks. Safe
        after a failed or partial start; idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
        if self._producer is not None:
            await self._producer.stop()
        if self.membership is not None:
            await self.membership.close()
        if self._stalls is not None:
            self._stalls.close()
            self._stalls = None
        log.info("trigger_stopped", decisions=self.counts, failure=self.life.failure)

    async def shutdown(self) -> None:
        """Stops a trigger started with `start()` (not `run`): stop intake, finish the batch in
        hand for at most drain_timeout_s, close. Idempotent."""
        self.life.request_stop("shutdown")  # the consumer loop's return is no failure now
        await self.stop_intake()
        try:
            await asyncio.wait_for(self.drain(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("trigger_drain_timed_out", timeout_s=self.config.drain_timeout_s)
        finally:
            await self.close()

    def outbox_counts(self) -> dict[str, int]:
        """Writes retried, signals dead-lettered, dead letters given up (zeros before start)."""
        if self._outbox is None:
            return {"retries": 0, "signals_dead_lettered": 0, "undeliverable": 0}
        return dict(self._outbox.counts)

    # ------------------------------------------------------------------ the consumer loop

    async def _consume(self) -> None:
        """Batch by batch until intake stops; a batch is always finished once it is fetched, and
        its offsets committed once its outputs are written: together with other batches' at
        most every commit_interval_ms (shared/kafka.py CommitPacer), and at the end."""
        assert self._consumer is not None
        pacer = CommitPacer(self.config.commit_interval_ms / 1e3)
        while not self._stop_intake.is_set():
            try:
                batch = await self._consumer.getmany(timeout_ms=100, max_records=1000)
            except KafkaError as exc:
                log.warning("trigger_fetch_failed", error=repr(exc))
                await asyncio.sleep(0.2)
                continue
            if batch:
                await self._process(batch)
                pacer.finished({tp: records[-1].offset + 1 for tp, records in batch.items()})
            offsets = pacer.due(time.monotonic(), idle=not batch)
            if offsets:
                await self._commit(offsets)
        offsets = pacer.take()
        if offsets:
            await self._commit(offsets)

    async def _process(self, batch: dict[Any, list[Any]]) -> None:
        """Decides every new record of the batch, then writes their outputs. Never raises (but
        for cancellation): a record whose handling fails unexpectedly is dead-lettered."""
        assert self._outbox is not None
        outputs: list[Output] = []
        for tp, records in batch.items():
            for record in records:
                if self._processed.seen(tp, record):
                    self.metrics.redelivered.inc()
                    continue
                try:
                    output = self._handle(record)
                except Exception as exc:  # a bug must not block the partition: the record is set aside
                    log.error("event_handling_failed", error=repr(exc), partition=record.partition,
                              offset=record.offset)  # fmt: skip
                    output = dead_letter(record, f"internal error: {exc!r}", self.config.dlq_topic)
                self._processed.add(tp, record)
                if output is not None:
                    outputs.append(output)
        await self._outbox.deliver(outputs)

    async def _commit(self, offsets: dict[Any, int]) -> None:
        assert self._consumer is not None
        try:
            await self._consumer.commit(offsets)
        except Exception as exc:  # e.g. a rebalance: the records may come again, and are skipped
            log.warning("trigger_commit_failed", error=repr(exc))
            return
        for tp, offset in offsets.items():
            self._processed.committed(tp, offset)

    async def _recover_topics(self) -> None:
        """After a broker failure: the topics again (a memory-only broker forgets them). Never raises."""
        with contextlib.suppress(Exception):
            await ensure_topics(self.config, self._topics(), timeout_s=2.0)

    def _handle(self, record: Any) -> Output | None:
        """Validates and decides one record; returns its output (a signal or a dead letter), if any."""
        t0 = time.perf_counter_ns()
        try:
            meta, event = parse_record(record.key, record.value, self.limits)
            bound = signal_size_bound(event, self._instance_name_bytes)
            if bound > self.signal_limit_bytes:
                raise EventError(f"a pre-infer signal for this event would take up to {bound} bytes, over the "
                                 f"signal topic's record limit of {self.signal_limit_bytes}")  # fmt: skip
        except EventError as exc:
            self.counts["dead_letter"] += 1
            self.metrics.dead_letters.inc()
            log.info("event_dead_lettered", reason=str(exc), partition=record.partition, offset=record.offset)
            return dead_letter(record, str(exc), self.config.dlq_topic)
        self.metrics.event_lag_ms.observe(max(0.0, time.time() * 1e3 - event.event_time_unix_ms))
        reason, target = self.decide(meta)
        self.counts[reason.value] += 1
        self.metrics.decisions.labels(reason.value).inc()
        output = None
        if reason in (Reason.ADMITTED, Reason.PREFETCH):
            lease_ms = self.lease_deadline_unix_ms(meta, int(time.time() * 1e3))
            signal_msg = ev.PreInferSignal(
                schema_version=SCHEMA_VERSION,
                request_id=meta.request_id,
                signal_time_unix_ms=int(time.time() * 1e3),
                lease_deadline_unix_ms=lease_ms,
                expected_instance=target or "",
                ranking_deadline_unix_ms=meta.ranking_deadline_unix_ms,
            )
            if reason is Reason.PREFETCH:
                # Named, not carried: a prefetch never computes psi, so the ranker needs only its
                # name (an 80 KB prefix at 4096 tokens otherwise, decoded on its event loop).
                p, lt = event.prefix, event.prefix.long_term
                fingerprint = prefix_fingerprint(p.profile_le, lt.items_le, lt.actions_le, lt.timestamps_le)
                signal_msg.prefetch_only = True
                signal_msg.user_id, signal_msg.prefix_version = p.user_id, p.prefix_version
                signal_msg.prefix_ref.length = fingerprint.length
                signal_msg.prefix_ref.fingerprint = fingerprint.digest
            else:
                signal_msg.prefix.CopyFrom(event.prefix)
            output = Output(record, Kind.SIGNAL, self.config.signal_topic, signal_msg.SerializeToString(),
                            str(meta.user_id).encode())  # fmt: skip
        elapsed = time.perf_counter_ns() - t0
        self.metrics.decision_us.observe(elapsed / 1e3)
        if len(self.decision_ns) < 200_000:
            self.decision_ns.append(elapsed)
        return output

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
        key = (meta.user_id, meta.prefix_version)
        returning = self.returns.observe(key, now)
        tokens = meta.prefix_len + self.config.suffix_tokens_estimate
        predicted = self.latency.predict(tokens, self._queue_depth.get(target, 0), tokens)
        offered = self._offered.get(target)
        if offered is None:
            offered = self._offered[target] = OfferedLoad(self.config.load_window_s)
        offered.add(now, self.latency.full_ms(tokens))
        load = offered.fraction(now)
        per_token = self._psi_per_token.get(target)
        psi_bytes = per_token * meta.prefix_len if per_token else self.spec.psi_bytes(meta.prefix_len)
        pays = self.reuse_pays(meta.prefix_len, tokens, target)
        # No prefetch where the target's full rankings keep no psi of this length (nothing there
        # to bring back but what an earlier pre-inference left, rarely at such lengths).
        keeps = self._ranking_psi_min.get(target, 0)
        prefetch = self.config.prefetch and not 0 < meta.prefix_len < keeps
        adds_little = self.risk_adds_little(meta.prefix_len, tokens, target)
        spare = (
            self.has_spare(target)
            and self.host_has_spare(target, offered, now)
            and self.spare_shortens(tokens)
            and (
                not self.config.spare_prices_waits
                or self.spare_outweighs_waits(meta.prefix_len, tokens, target, offered, now)
            )
        )
        now_unix_ms = int(time.time() * 1e3)
        # The ranking call's planned time: its deadline less the SLO it was given.
        lead_s = (meta.ranking_deadline_unix_ms - self.config.slo_ms - now_unix_ms) / 1e3
        # Its deadline on this clock: the order the ranker builds pre-inferences in.
        due = now + (meta.ranking_deadline_unix_ms - now_unix_ms) / 1e3
        trip_s = self.signal_trip_s(target)
        ahead = ledger.backlog_ahead(now, due)
        late = too_late(lead_s, trip_s, self.preinfer_ms(meta.prefix_len), ahead)
        reason = decide(self.policy, self.bounds, predicted, psi_bytes, ledger, key, now, load, pays,
                        adds_little, returning, prefetch, spare, late)  # fmt: skip
        self.metrics.returning.labels("yes" if returning else "no").inc()
        if reason is Reason.ADMITTED:
            at_risk = predicted > risk_threshold_ms(self.bounds, load) and adds_little
            self.metrics.admitted_by.labels("risk" if at_risk else "reuse" if pays else "spare").inc()
            lease_s = max(0, self.lease_deadline_unix_ms(meta, now_unix_ms) - now_unix_ms) / 1e3
            # Its pre-inference leaves the instance's queue after the signal's trip and the
            # pre-inferences ahead of it.
            queued_s = trip_s + self.preinfer_ms(meta.prefix_len) / 1e3 * (1 + ahead)
            ledger.admit(key, psi_bytes, now, now + lease_s, queued_until=now + queued_s, due=due)
        return reason, target

    def signal_trip_s(self, target: str) -> float:
        """Seconds from this trigger's signal to its PreInfer's arrival at `target`: the
        target's reported p90 (StatsReply.signal_trip_p90_ms), at least _MIN_SIGNAL_TRIP_S;
        before any report, _SIGNAL_TRIP_S. A fixed 50 ms refused as too late every event whose
        call came sooner than that, however fast the path (the benchmark's gaps of 20-200 ms:
        one event in six)."""
        measured = self._signal_trip_s.get(target)
        if measured is None:
            return _SIGNAL_TRIP_S
        return max(measured, _MIN_SIGNAL_TRIP_S)

    def has_spare(self, target: str) -> bool:
        """Whether `target`'s device has room for pre-inference off the critical path: its last
        reported busy share (StatsReply.device_busy) under spare_busy_max (admission docstring).
        False before any report, and with spare_busy_max 0."""
        busy = self._device_busy.get(target)
        return busy is not None and busy < self.config.spare_busy_max

    def host_has_spare(self, target: str, offered: OfferedLoad, now: float) -> bool:
        """Whether `target`'s host has room for the spare term (admission.host_has_spare): its
        reported host ms per request at its call rate (calls_per_s)."""
        rate = self.calls_per_s(target, offered, now)
        return host_has_spare(self._host_ms.get(target), rate, self.config.spare_host_max)

    def calls_per_s(self, target: str, offered: OfferedLoad, now: float) -> float:
        """`target`'s ranking calls per second: the higher of what its reports say (every
        caller's calls) and the events this trigger routes to it (one trigger of several sees
        only its partitions' share)."""
        return max(offered.rate(now), self._call_rate.get(target, 0.0))

    def spare_shortens(self, tokens: int) -> bool:
        """Whether a call of `tokens` gets enough shorter against psi for the spare term
        (admission.spare_shortens); False before any full ranking was measured."""
        return self.full_work.measured and spare_shortens(
            self.full_work.full_ms(tokens),
            self.cached_call_ms(),
            self.config.slo_ms,
            self.config.spare_min_saving,
        )

    def spare_outweighs_waits(
        self, prefix_len: int, tokens: int, target: str, offered: OfferedLoad, now: float
    ) -> bool:
        """Whether the spare term's saving on this call outweighs the waits its pre-inference
        would impose on `target`'s other calls (admission.spare_outweighs_waits), at its call
        rate (calls_per_s)."""
        rate = self.calls_per_s(target, offered, now)
        return spare_outweighs_waits(
            self.full_work.full_ms(tokens), self.cached_call_ms(), self.preinfer_ms(prefix_len), rate
        )

    def _absorb_call_rate(self, target: str, now: float, calls: int) -> None:
        """`target`'s ranking calls per second between its reports, smoothed over load_window_s
        (a count that went back: the instance restarted; the next interval counts from its new
        count)."""
        before = self._calls_reported.get(target)
        self._calls_reported[target] = (now, calls)
        if before is None or calls < before[1] or now <= before[0]:
            return
        dt = now - before[0]
        observed = (calls - before[1]) / dt
        weight = 1.0 - math.exp(-dt / self.config.load_window_s)
        rate = self._call_rate.get(target, observed)
        self._call_rate[target] = rate + weight * (observed - rate)

    def cached_call_ms(self) -> float:
        """A cached ranking call's device work: the median over the rankers' recent cached
        batches of their time per call, or before any, a full ranking of the suffix alone."""
        if self._cached_ms:
            if self._cached_median_ms is None:
                self._cached_median_ms = statistics.median(self._cached_ms)
            return self._cached_median_ms
        return self.full_work.full_ms(self.config.suffix_tokens_estimate)

    def preinfer_ms(self, prefix_len: int) -> float:
        """A pre-inference's device work: fitted on the rankers' whole pre-inferences once there
        are MIN_PREINFER_SAMPLES of them; before that what the rankers plan a psi of that length
        to cost (their scheduler's measured steps, StatsReply.preinfer_plan), and before any plan
        a full ranking of the prefix. Not from the first one or two: a fresh ranker's first
        pre-inferences can include compiles seconds long, and a price set by them admitted no
        pre-inference by reuse again, so no sample came to correct it (a GPU run on the mix).
        Not the full ranking's while a plan exists: a graph step builds psi cheaper than a full
        ranking of the prefix costs, and priced so at 4096 tokens on an H200 (k11a, 4 samples
        from the warm-up) every at-risk event added work by the test, so none was admitted and
        no sample came either (the same run without the host tier measured ~2/3 of that price)."""
        if self.preinfer_work.sample_count >= MIN_PREINFER_SAMPLES:
            return self.preinfer_work.full_ms(prefix_len)
        planned = self.planned_preinfer_ms(prefix_len)
        return planned if planned is not None else self.full_work.full_ms(prefix_len)

    def _absorb_plan(self, target: str, plan: Sequence[pb.PreinferSample]) -> None:
        """Keeps `target`'s planned psi prices, and a fit through them when they changed (to
        10 us: the ranker's step fit moves them a little with every step it measures, and a
        refit on every Stats poll would cost the event loop for nothing)."""
        prices = tuple(
            (p.prefix_len, round(p.device_ms, 2)) for p in plan if p.prefix_len > 0 and p.device_ms > 0
        )
        if self._preinfer_plans.get(target, ()) == prices:
            return
        self._preinfer_plans[target] = prices
        if not prices:
            self._plan_models.pop(target, None)
            return
        model = LatencyModel(self.spec, self.config.assumed_tflops, window=len(prices))
        model.observe([Sample(n, ms) for n, ms in prices])
        self._plan_models[target] = model

    def planned_preinfer_ms(self, prefix_len: int) -> float | None:
        """The highest price the rankers plan for psi of this length (a pre-inference may land
        on any of them); None before any reported a plan."""
        return max((m.full_ms(prefix_len) for m in self._plan_models.values()), default=None)

    def host_ms(self, target: str) -> float:
        """What one request costs `target`'s host (StatsReply.host_ms_per_request) where the
        work is priced with it (host_cost); 0 otherwise, and before it reported one."""
        return self._host_ms.get(target, 0.0) if self.config.host_cost else 0.0

    def reuse_pays(self, prefix_len: int, tokens: int, target: str = "") -> bool:
        """Whether pre-inferring this prefix saves work over the calls expected on it
        (admission.reuse_pays) on `target`, whose full rankings may keep psi themselves: each
        request, the pre-inference's signal too, costs its device work (plus, with host_cost,
        what a request costs the target's host). Never with the reuse window at 0, nor before any full ranking was
        measured (the FLOPs prior says nothing of a device's fixed costs per step)."""
        if self.config.reuse_window_s <= 0 or not self.full_work.measured:
            return False
        keeps = self._ranking_psi_min.get(target, 0)
        host = self.host_ms(target)
        return reuse_pays(self.full_work.full_ms(tokens) + host, self.preinfer_ms(prefix_len) + host,
                          self.cached_call_ms() + host, self.returns.expected_later(),
                          0 < keeps <= prefix_len)  # fmt: skip

    def risk_adds_little(self, prefix_len: int, tokens: int, target: str = "") -> bool:
        """Whether pre-inferring this prefix for risk alone adds little work on `target`
        (admission.adds_little_work, by max_extra_work): the pre-inference and the call against
        its psi are two requests where the full ranking is one, each at its device work (plus,
        with host_cost, what a request costs the target's host). On an H200 at 4096 tokens (k11e), priced by device
        time alone (2.1 + 1.15 ms against a full ranking's 3.3), 1627 pre-inferences were admitted
        at 250 req/s on a host-bound ranker and its limit fell from 250 to 197.5 req/s; with
        ~1.3 ms of host a request they add work (5.85 against 4.6 ms). True before any full
        ranking was measured (nothing to judge by: the latency test alone decides, as before)."""
        if not self.full_work.measured:
            return True
        host = self.host_ms(target)
        return adds_little_work(self.full_work.full_ms(tokens) + host, self.preinfer_ms(prefix_len) + host,
                                self.cached_call_ms() + host, self.config.max_extra_work)  # fmt: skip

    def lease_deadline_unix_ms(self, meta: EventMeta, now_unix_ms: int) -> int:
        """When an admitted pre-inference's lease ends: its ranking deadline plus the slack, but
        never more than max_lease_ms from now (the rankers grant no longer lease, and the ledger
        would otherwise reserve the psi's bytes until a far-off deadline)."""
        wanted = meta.ranking_deadline_unix_ms + int(self.config.lease_slack_ms)
        return min(wanted, now_unix_ms + int(self.config.max_lease_ms))

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
                             return_fraction=round(self.returns.fraction(), 3),
                             cached_call_ms=round(self.cached_call_ms(), 3),
                             full_work=self.full_work.describe(), preinfer_work=self.preinfer_work.describe(),
                             planned_preinfer_4k_ms=_rounded(self.planned_preinfer_ms(4096)),
                             host_ms_per_request={t: round(ms, 3) for t, ms in self._host_ms.items()},
                             call_rate={t: round(r, 1) for t, r in self._call_rate.items()},
                             host_cost=self.config.host_cost,
                             preinfer_4k_ms=round(self.preinfer_ms(4096), 3),
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
        now = time.monotonic()
        ledger.report(now, stats.hbm_budget_bytes, stats.hbm_leased_bytes, backlog, stats.rank_queue_depth,
                      [now + ms / 1e3 for ms in stats.preinfer_due_in_ms])  # fmt: skip
        self._queue_depth[target] = stats.rank_queue_depth
        if stats.psi_bytes_per_token:
            self._psi_per_token[target] = stats.psi_bytes_per_token
        self._ranking_psi_min[target] = stats.ranking_psi_min_tokens
        self._device_busy[target] = stats.device_busy
        self._absorb_call_rate(target, now, stats.hbm_hits + stats.hbm_misses)
        if stats.host_ms_per_request > 0:
            self._host_ms[target] = stats.host_ms_per_request
        if stats.signal_trip_p90_ms > 0:
            self._signal_trip_s[target] = stats.signal_trip_p90_ms / 1e3
        newest = max((s.seq for s in stats.recent_batches), default=0)
        seen = self._seen_seq.get(target, 0)
        if newest < seen:  # the instance restarted: its sequence numbers start over
            seen = 0
        fresh = [s for s in stats.recent_batches if s.seq > seen and s.full and s.batch > 0]
        self._cached_ms.extend(s.compute_ms / s.batch for s in stats.recent_batches
                               if s.seq > seen and not s.full and s.batch > 0)  # fmt: skip
        self._cached_median_ms = None
        self._seen_seq[target] = max(seen, newest)
        self.full_work.observe([Sample(max(1, s.tokens // s.batch), s.compute_ms / s.batch) for s in fresh])
        newest_pre = max((p.seq for p in stats.recent_preinfers), default=0)
        seen_pre = self._seen_preinfer_seq.get(target, 0)
        if newest_pre < seen_pre:
            seen_pre = 0
        self._seen_preinfer_seq[target] = max(seen_pre, newest_pre)
        self._absorb_plan(target, stats.preinfer_plan)
        self.preinfer_work.observe([Sample(p.prefix_len, p.device_ms) for p in stats.recent_preinfers
                                    if p.seq > seen_pre and p.prefix_len > 0])  # fmt: skip
        self.latency.observe([Sample(max(1, s.tokens // s.batch), s.compute_ms) for s in fresh])


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def serve(config: TriggerConfig) -> int:
    """Runs the trigger on uvloop until it stops; returns the exit status (TriggerService.run)."""
    import uvloop

    return uvloop.run(TriggerService(config).run())
