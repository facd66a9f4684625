"""The open-loop replayer: plays a planned Workload against a running stack.

For every planned request, at its t_retrieval_s the RetrievalEvent goes to Kafka (key: the user
id in decimal ASCII), and at its t_rank_s the Rank call goes to the router. Open loop: every send
is its own task at its absolute time and no send waits for any reply, so a slow server sees the
same offered load as a fast one. Messages are built in a background task a short lookahead ahead
of their send time, so building 16k-token requests never delays a send; when the replayer still
falls behind (an overloaded client machine), the lag is recorded per request and reported.

Latency is measured as the caller sees it: from the moment the Rank call is issued to its reply.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from relaygr.workload import Materializer, PlannedRequest, Workload
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.stats import percentile

OK = "OK"
# The replay's clock: the default loop's time() (CLOCK_MONOTONIC), also under uvloop, whose
# loop.time() is libuv's cached millisecond clock.
_now = time.monotonic
_LOOP_PROBE_S = 0.005  # the load generator's loop-lag probe sleeps this long
SERVED_BY = ("hbm_hit", "inflight_join", "partial_prefix", "dram_reload", "full_recompute")
# (elapsed_s, sent, completed, p99 ms of the last 2000 OK calls), about once a second and at the end.
ProgressFn = Callable[[float, int, int, float], None]


class Producer(Protocol):
    """What the replayer needs of a Kafka producer (aiokafka's AIOKafkaProducer has it)."""

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[Any]: ...


class RankStub(Protocol):
    """What the replayer needs of the router's stub (ranker_pb2_grpc.RankerStub has it)."""

    def Rank(self, request: pb.RankRequest, *, timeout: float) -> Any: ...


@dataclass
class RequestRecord:
    """What happened to one planned request."""

    index: int  # position in the workload
    planned: PlannedRequest
    status: str = ""  # "OK", a gRPC status code name, or "ERROR:<exception type>"; "" if never sent
    latency_ms: float = float("nan")  # Rank issued -> reply, as the caller sees it
    served_by: str = ""  # one of SERVED_BY ("" unless OK)
    instance_id: str = ""
    cache_ms: float = float("nan")  # the reply's server-side timings
    queue_ms: float = float("nan")
    compute_ms: float = float("nan")
    server_total_ms: float = float("nan")
    launch_ms: float = float("nan")  # host time issuing the call's batch (see StageTimings)
    batch: int = 0  # calls in the batch that computed this one
    batch_tokens: int = 0  # tokens that batch computed
    batch_seq: int = 0  # that batch's number on its instance (0: not reported)
    psi_kept: bool = False  # a full ranking that left its prefix's psi in the cache
    lag_ms: float = float("nan")  # Rank issued - scheduled time
    retrieval_lag_ms: float = float("nan")  # event handed to the producer - scheduled time
    publish_error: str = ""  # the event could not be published (type: message)
    # Scheduled time -> the broker's ack of the event: the first leg of the signal path, which
    # the trigger's event lag includes (a slow broker shows here, a slow trigger does not).
    publish_ack_ms: float = float("nan")
    scores: list[float] | None = None  # kept for the deterministic sample only
    sent_at_s: float = float("nan")  # Rank issued, seconds from the replay's start

    @property
    def request_id(self) -> str:
        return self.planned.request_id

    @property
    def user_id(self) -> int:
        return self.planned.user_id

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def network_ms(self) -> float:
        """Client latency minus the server's own total: transport, serialization, the router hop
        (and its earlier attempts: a refusal elsewhere, a prefix_required answer before the resend)."""
        return self.latency_ms - self.server_total_ms

    def breakdown(self) -> dict[str, Any]:
        """Where this call's time went, flat (for a dump of the slowest calls): what it was
        (prefix and computed tokens, first or returning request), who served it and how, and the
        client latency split into the server's stages, the rest of the server's total, and what
        the server did not see (network_ms); lag_ms is the load generator's own delay."""
        p = self.planned
        rest = self.server_total_ms - self.cache_ms - self.queue_ms - self.compute_ms
        return {
            "index": self.index,
            "at_s": round(self.sent_at_s, 3),
            "status": self.status,
            "served_by": self.served_by,
            "instance": self.instance_id,
            "user_id": p.user_id,
            "session_index": p.session_index,
            "prefix_len": p.prefix_len,
            "suffix_len": p.recent_len + p.candidates,
            "returning": p.returning,
            "batch": self.batch,
            "batch_tokens": self.batch_tokens,
            "batch_seq": self.batch_seq,
            "psi_kept": self.psi_kept,
            **{
                k: round(v, 1)
                for k, v in (
                    ("latency_ms", self.latency_ms),
                    ("cache_ms", self.cache_ms),
                    ("queue_ms", self.queue_ms),
                    ("compute_ms", self.compute_ms),
                    ("launch_ms", self.launch_ms),
                    ("server_other_ms", rest),
                    ("server_total_ms", self.server_total_ms),
                    ("network_ms", self.network_ms),
                    ("lag_ms", self.lag_ms),
                )
            },
        }


@dataclass
class ReplayResult:
    """Per-request records (in workload order) and run-level facts."""

    records: list[RequestRecord]
    planned_duration_s: float
    wall_s: float  # replay start -> last reply
    score_sample_every: int
    materializer_hits: int = 0
    materializer_misses: int = 0
    # How late the load generator's own event loop woke from 5 ms sleeps during the replay (ms):
    # a reply that arrives while the loop is busy is timed late by as much, so client latency
    # includes it (building requests, publishing events, a garbage collection).
    loop_lag_ms: list[float] = field(default_factory=list)
    # The load generator's own garbage-collector pauses during the replay (ms): each one stalls
    # its loop, and with it every call in flight (client_loop_lag_ms names the stall, this its cause).
    gc_pause_ms: list[float] = field(default_factory=list)

    @property
    def measured(self) -> list[RequestRecord]:
        """The records of the measured window: every one but the lead-in's (WorkloadConfig.lead_in_s)."""
        return [r for r in self.records if not r.planned.lead_in]

    def sampled(self) -> list[RequestRecord]:
        """The OK requests whose scores were kept (every score_sample_every-th of the workload)."""
        return [r for r in self.records if r.scores is not None]

    def slowest_ok(self, fraction: float = 0.02) -> list[RequestRecord]:
        """The slowest `fraction` of the OK calls (at least one when any is OK), slowest first."""
        if not 0 < fraction <= 1:
            raise ValueError("fraction must be within (0, 1]")
        ok = sorted((r for r in self.measured if r.ok), key=lambda r: r.latency_ms, reverse=True)
        return ok[: max(1, math.ceil(fraction * len(ok)))] if ok else []

    def summary(self, slo_ms: float) -> dict[str, Any]:
        """The measured window of the run in one flat dict (nested only for per-code / per-path
        counts); a lead-in's calls are left out of every figure.

        Keys: slo_ms; planned, sent, ok, failed, failed_by_code, publish_failed; p50_ms, p90_ms, p99_ms,
        p999_ms, max_ms (client latency of OK calls); {cache,queue,compute,launch,server_total,network}
        _ms_{p50,p99} (the replies' server timings; network = client latency - server total);
        batch_p50, batch_p99 (calls in the batch that computed each call);
        hbm_hit, inflight_join, dram_reload, full_recompute (fractions of OK calls) and
        served_by_counts; by_served (per path that served calls: calls, latency / queue /
        compute P50 and P99, batch P50); by_user (new and returning users' calls apart: calls,
        the paths' fractions, latency P99); slo_attainment (OK calls within slo_ms / OK calls) and
        slo_attainment_all (/ sent); meets_slo (every planned call sent, none failed, p99 <=
        slo_ms); offered_rps (realized: sends per second between the first and last send),
        planned_rps; lag_ms_{p99,max} and retrieval_lag_ms_{p99,max} (behind schedule);
        publish_ack_ms_{p50,p99} (scheduled retrieval time -> the broker's ack); wall_s;
        materializer_hits / _misses."""
        records = self.measured  # a lead-in is replayed, not measured
        sent = [r for r in records if r.status]
        ok = [r for r in sent if r.ok]
        failed: dict[str, int] = collections.Counter(r.status for r in sent if not r.ok)
        lat = [r.latency_ms for r in ok]
        out: dict[str, Any] = {
            "slo_ms": slo_ms,
            "planned": len(records),
            "sent": len(sent),
            "ok": len(ok),
            "failed": sum(failed.values()),
            "failed_by_code": dict(sorted(failed.items())),
            "publish_failed": sum(1 for r in records if r.publish_error),
            # Client-side ranking latency of OK calls (the headline numbers).
            "p50_ms": percentile(lat, 50),
            "p90_ms": percentile(lat, 90),
            "p99_ms": percentile(lat, 99),
            "p999_ms": percentile(lat, 99.9),
            "max_ms": max(lat, default=float("nan")),
        }
        stages = {
            "cache": [r.cache_ms for r in ok],
            "queue": [r.queue_ms for r in ok],
            "compute": [r.compute_ms for r in ok],
            "launch": [r.launch_ms for r in ok],
            "server_total": [r.server_total_ms for r in ok],
            "network": [r.network_ms for r in ok],
        }
        for stage, values in stages.items():
            out[f"{stage}_ms_p50"] = percentile(values, 50)
            out[f"{stage}_ms_p99"] = percentile(values, 99)
        batches = [float(r.batch) for r in ok]
        out["batch_p50"], out["batch_p99"] = percentile(batches, 50), percentile(batches, 99)
        served = collections.Counter(r.served_by for r in ok)
        for k in SERVED_BY:  # fractions of OK calls, flat: "hbm_hit", "dram_reload", ...
            out[k] = served[k] / len(ok) if ok else 0.0
        out["served_by_counts"] = {k: served[k] for k in SERVED_BY}
        # Each path on its own (where the relay's time goes, path by path): P50 / P99 of the
        # client latency and of the server's queue and compute, for the paths that served calls.
        out["by_served"] = {
            k: {
                "calls": served[k],
                **{
                    f"{name}_ms_{tag}": percentile([getattr(r, attr) for r in ok if r.served_by == k], q)
                    for name, attr in (
                        ("latency", "latency_ms"),
                        ("queue", "queue_ms"),
                        ("compute", "compute_ms"),
                    )
                    for tag, q in (("p50", 50), ("p99", 99))
                },
                "batch_p50": percentile([float(r.batch) for r in ok if r.served_by == k], 50),
            }
            for k in SERVED_BY
            if served[k]
        }
        # New users' calls (a session's first: served by pre-inference or in full) and returning
        # ones (psi kept, or in DRAM) apart: a tier may help one and cost the other (k22, k23).
        out["by_user"] = {
            kind: {
                "calls": len(group),
                **{
                    k: sum(1 for r in group if r.served_by == k) / len(group) if group else 0.0
                    for k in SERVED_BY
                },
                "latency_ms_p99": percentile([r.latency_ms for r in group], 99),
            }
            for kind, group in (
                ("new", [r for r in ok if not r.planned.returning]),
                ("returning", [r for r in ok if r.planned.returning]),
            )
        }
        under = sum(1 for x in lat if x <= slo_ms)
        out["slo_attainment"] = under / len(ok) if ok else 0.0  # of OK calls
        out["slo_attainment_all"] = under / len(sent) if sent else 0.0  # failures count as misses
        p99 = out["p99_ms"]
        out["meets_slo"] = bool(ok) and p99 <= slo_ms and out["failed"] == 0 and len(sent) == len(records)
        times = sorted(r.sent_at_s for r in sent)
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        out["offered_rps"] = (len(times) - 1) / span if span > 0 else float("nan")
        out["planned_rps"] = len(records) / self.planned_duration_s
        lags = [r.lag_ms for r in sent]
        out["lag_ms_p99"] = percentile(lags, 99)
        out["lag_ms_max"] = max(lags, default=float("nan"))
        rlags = [r.retrieval_lag_ms for r in records if r.retrieval_lag_ms == r.retrieval_lag_ms]
        out["retrieval_lag_ms_p99"] = percentile(rlags, 99)
        out["retrieval_lag_ms_max"] = max(rlags, default=float("nan"))
        acks = [r.publish_ack_ms for r in records if r.publish_ack_ms == r.publish_ack_ms]
        out["publish_ack_ms_p50"] = percentile(acks, 50)
        out["publish_ack_ms_p99"] = percentile(acks, 99)
        out["wall_s"] = self.wall_s
        out["client_loop_lag_ms_p99"] = percentile(self.loop_lag_ms, 99) if self.loop_lag_ms else 0.0
        out["client_loop_lag_ms_max"] = max(self.loop_lag_ms, default=0.0)
        out["client_gc_pause_ms_max"] = max(self.gc_pause_ms, default=0.0)
        out["client_gc_pause_ms_total"] = sum(self.gc_pause_ms)
        out["materializer_hits"] = self.materializer_hits
        out["materializer_misses"] = self.materializer_misses
        return out


@dataclass
class _State:
    sent: int = 0
    completed: int = 0
    recent_ok_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2000))


async def replay(
    workload: Workload,
    *,
    producer: Producer,
    retrieval_topic: str,
    router_stub: RankStub,
    materializer: Materializer,
    slo_ms: float,
    progress: ProgressFn | None = None,
    rank_timeout_s: float = 10.0,
    lookahead_s: float = 0.5,
    start_delay_s: float = 0.2,
    score_sample_every: int = 50,
    freeze_gc: bool = True,
    start_at: float | None = None,
    indices: Sequence[int] | None = None,
) -> ReplayResult:
    """Replays `workload` open loop and returns what happened to every request.

    The replay's time zero is `start_delay_s` after the call (room to build the first requests).
    Messages are built `lookahead_s` ahead (a 16k-token prefix: ~1.7 ms cold, ~0.2 ms from the
    materializer's cache, on the build machine); each built request holds two copies of its
    prefix (~0.65 MB at 16k tokens) until sent, so memory grows with rate x lookahead.
    Each event carries `event_time_unix_ms` = its scheduled wall time and
    `ranking_deadline_unix_ms` = the scheduled wall time of its Rank call + slo_ms. Every Rank call
    has the deadline rank_timeout_s. Publishing is fire-and-forget past the producer's buffer
    (delivery failures are recorded); a failed publish never holds back the Rank call. The scores
    of every `score_sample_every`-th request (by workload index, 0 included) are kept. Returns
    after the last reply (at most rank_timeout_s after the last send).

    `start_at` (a time.monotonic() value, host-wide) sets time zero instead of start_delay_s, so
    that several processes replaying shards of one workload share it (relaygr/load.py); `indices`
    gives each request its index in that whole workload (records and score sampling use it).

    With `freeze_gc` the objects that exist at the start are moved to the collector's permanent
    generation for the run (`gc.freeze()`, undone at the end; process-wide), so that garbage
    collections during the replay do not stall the sends.
    """
    requests = workload.requests
    if indices is not None and len(indices) != len(requests):
        raise ValueError(f"{len(indices)} indices for {len(requests)} requests")
    index_of = list(indices) if indices is not None else list(range(len(requests)))
    records = [RequestRecord(index_of[i], r) for i, r in enumerate(requests)]
    state = _State()
    if freeze_gc:
        # A full collection traversing the plan and the records stalled the loop ~170 ms at 30k
        # requests (measured): move everything that exists now out of the collector's sight.
        gc.collect()
        gc.freeze()
    gc_pause_ms: list[float] = []
    gc_started = [0.0]

    def on_gc(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pause_ms.append((time.perf_counter() - gc_started[0]) * 1e3)

    gc.callbacks.append(on_gc)
    delay_s = start_delay_s if start_at is None else start_at - _now()
    t0 = _now() + delay_s
    wall0 = time.time() + delay_s  # the wall time of the replay's time zero

    async def sleep_until(t: float) -> None:
        delay = t0 + t - _now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def publish(i: int, p: PlannedRequest, event: ev.RetrievalEvent) -> None:
        rec = records[i]
        await sleep_until(p.t_retrieval_s)
        rec.retrieval_lag_ms = (_now() - t0 - p.t_retrieval_s) * 1e3
        event.event_time_unix_ms = int((wall0 + p.t_retrieval_s) * 1e3)
        event.ranking_deadline_unix_ms = int((wall0 + p.t_rank_s) * 1e3 + slo_ms)
        try:
            delivery = await producer.send(
                retrieval_topic, event.SerializeToString(), key=str(p.user_id).encode()
            )
            await delivery
            rec.publish_ack_ms = (_now() - t0 - p.t_retrieval_s) * 1e3
        except Exception as exc:  # recorded: the report says how many events never made it
            rec.publish_error = f"{type(exc).__name__}: {exc}"

    async def rank(i: int, p: PlannedRequest, request: pb.RankRequest) -> None:
        rec = records[i]
        await sleep_until(p.t_rank_s)
        issued = _now()
        rec.sent_at_s = issued - t0
        rec.lag_ms = (issued - t0 - p.t_rank_s) * 1e3
        state.sent += 1
        start = time.perf_counter()
        try:
            reply = await router_stub.Rank(request, timeout=rank_timeout_s)
        except grpc.aio.AioRpcError as exc:
            rec.latency_ms = (time.perf_counter() - start) * 1e3
            rec.status = exc.code().name
        except Exception as exc:  # never lose a request silently
            rec.latency_ms = (time.perf_counter() - start) * 1e3
            rec.status = f"ERROR:{type(exc).__name__}"
        else:
            rec.latency_ms = (time.perf_counter() - start) * 1e3
            rec.status = OK
            rec.served_by = pb.ServedBy.Name(reply.served_by).lower()
            rec.instance_id = reply.instance_id
            t = reply.timings
            rec.cache_ms, rec.queue_ms, rec.compute_ms, rec.server_total_ms = (
                t.cache_ms, t.queue_ms, t.compute_ms, t.total_ms,
            )  # fmt: skip
            rec.launch_ms, rec.batch, rec.batch_tokens = t.launch_ms, t.batch, t.batch_tokens
            rec.batch_seq, rec.psi_kept = t.batch_seq, t.psi_kept
            if score_sample_every > 0 and rec.index % score_sample_every == 0:
                rec.scores = list(reply.scores)
            state.recent_ok_ms.append(rec.latency_ms)
        state.completed += 1

    # Pending send tasks only (done ones drop out): a long run does not keep 10^5 finished tasks.
    pending: set[asyncio.Task[None]] = set()

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def builder() -> None:
        """Builds each request's messages `lookahead_s` before its retrieval time, then hands
        them to its own timed tasks. Yields between requests so sends stay on time."""
        for i, p in enumerate(requests):
            await sleep_until(p.t_retrieval_s - lookahead_s)
            spawn(publish(i, p, materializer.retrieval_event(p)))
            spawn(rank(i, p, materializer.rank_request(p)))
            await asyncio.sleep(0)

    async def reporter() -> None:
        assert progress is not None
        while True:
            await asyncio.sleep(1.0)
            recent = list(state.recent_ok_ms)
            progress(_now() - t0, state.sent, state.completed, percentile(recent, 99))

    loop_lag_ms: list[float] = []

    async def watch_loop() -> None:
        while True:
            before = _now()
            await asyncio.sleep(_LOOP_PROBE_S)
            loop_lag_ms.append(max(0.0, (_now() - before - _LOOP_PROBE_S) * 1e3))

    reporting = asyncio.create_task(reporter()) if progress is not None else None
    watching = asyncio.create_task(watch_loop())
    try:
        await builder()
        # No task is spawned after the builder returns: waiting for these is waiting for all.
        if pending:
            await asyncio.gather(*pending)
    finally:
        for task in list(pending):
            task.cancel()
        for side_task in (reporting, watching):
            if side_task is not None:
                side_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await side_task
        gc.callbacks.remove(on_gc)
        if freeze_gc:
            gc.unfreeze()
    wall_s = _now() - t0
    if progress is not None:
        progress(wall_s, state.sent, state.completed, percentile(list(state.recent_ok_ms), 99))
    return ReplayResult(
        records,
        planned_duration_s=workload.config.duration_s,
        wall_s=wall_s,
        score_sample_every=score_sample_every,
        materializer_hits=materializer.hits,
        materializer_misses=materializer.misses,
        loop_lag_ms=loop_lag_ms,
        gc_pause_ms=gc_pause_ms,
    )
