"""The ranker instance: gRPC PreInfer / Rank / Stats over one accelerator.

One owner object, `RankerService`, with `run()` / `shutdown()`. The asyncio loop does routing and
bookkeeping only (HBM cache, leases, host tier); the engine thread does every tensor operation.

Lifecycle (shared.lifecycle.Lifecycle): start (warm-up, engine, gRPC, host tier, the lease-expiry
loop), serve until SIGTERM / SIGINT, `shutdown()` or the first failure of a background task, then
stop intake (health NOT_SERVING, the gRPC server takes no new call), drain the calls in flight,
close (the engine, the host tier). A failed background task exits with status 1: without its
expiry loop a ranker would never expire a lease and fill HBM, so it stops and is restarted instead.

Rooms: this servicer decodes, validates, admits and replies; the relay cache
(services/ranker/relay_cache.py) owns the cache policy (produce, claim, join, reload, demote,
leases) over the HBM cache and the host tier; the engine and its iteration scheduler
(services/ranker/engine.py, scheduler.py) own the device.

Rank always answers with scores: psi in HBM (HBM_HIT), psi being produced and awaited
(INFLIGHT_JOIN), psi built in part and completed by the call (PARTIAL_PREFIX, with the fraction
reused in the reply's timings), psi reloaded from host DRAM when the cost model says that beats
recomputing (DRAM_RELOAD), else the whole sequence (FULL_RECOMPUTE). Any failure on a cached path
falls back to full inference; only bad input (INVALID_ARGUMENT) and overload
(RESOURCE_EXHAUSTED, refused at once) are not answered with scores.

Overload: every Rank call first passes the admission limiter (services/ranker/admission.py), an
O(1) decision made before the request is decoded into tensors or touches the engine: each call is
weighed by its predicted engine time (from its token counts and the costs measured on this
instance's batches), against a bound on the predicted work in flight and the call's remaining
deadline. While it refuses ranking calls, PreInfer is refused too (REFUSED, reason "rank_overloaded").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kernels.device import Accelerator, accelerator
from services.ranker.admission import AdmissionLimiter, Refusal
from services.ranker.call_cost import CallWork
from services.ranker.config import Demotion, Keep, LayerKernels, RankerConfig
from services.ranker.copy_stages import CopyStagesCollector
from services.ranker.cost_model import CostModel
from services.ranker.demotion_gate import DemotionGate
from services.ranker.device_time import DeviceTimeCollector
from services.ranker.engine import Engine, EngineConfig, NonFiniteScores, Overdue
from services.ranker.graphs import GraphLimits, GraphStatsCollector
from services.ranker.hbm_cache import HbmCache, Lease
from services.ranker.hbm_headroom import Verdict, judge
from services.ranker.host_cost import HostCost
from services.ranker.keep_gate import KeepGate
from services.ranker.loop_lag import LoopLag
from services.ranker.loop_time import LoopTimeCollector
from services.ranker.loop_watch import LoopWatch
from services.ranker.model import HSTURanker, PrefixChunk
from services.ranker.psi import PsiKey, PsiSizeClasses
from services.ranker.relay_cache import Produce, Ranked, RelayCache, Served
from services.ranker.sequences import Behaviors, RankingSuffix, UserPrefix
from services.ranker.takeover import TakeoverPassCollector
from services.ranker.task_cpu import CpuMeterCollector
from services.ranker.wire import PrefixRequired, preinfer_prefix, rank_inputs
from services.ranker.yield_gate import YieldGate
from shared.config import ConfigError
from shared.lifecycle import Lifecycle, pin_process, set_timer_slack, settle_heap
from shared.logging import get_logger
from shared.metrics import LATENCY_MS_BUCKETS, GcPauses, HostStalls, serve_metrics
from shared.modelspec import preset
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc
from shared.stats import percentile, percentiles
from shared.wire import WireError

if TYPE_CHECKING:
    from services.ranker.host_tier import HostTier

log = get_logger("ranker")
SERVICE_NAME = "relaygr.v1.Ranker"
_SERVED = {
    Served.HBM_HIT: pb.HBM_HIT,
    Served.INFLIGHT_JOIN: pb.INFLIGHT_JOIN,
    Served.PARTIAL_PREFIX: pb.PARTIAL_PREFIX,
    Served.DRAM_RELOAD: pb.DRAM_RELOAD,
    Served.FULL_RECOMPUTE: pb.FULL_RECOMPUTE,
}
_OUTCOME: dict[Produce, pb.PreInferReply.Outcome] = {
    Produce.ACCEPTED: pb.PreInferReply.ACCEPTED,
    Produce.RELOAD_SCHEDULED: pb.PreInferReply.RELOAD_SCHEDULED,
    Produce.ALREADY_RESIDENT: pb.PreInferReply.ALREADY_RESIDENT,
    Produce.ALREADY_PRODUCING: pb.PreInferReply.ALREADY_PRODUCING,
    Produce.REFUSED: pb.PreInferReply.REFUSED,
}


def _or_nan(read: Callable[[], float | None]) -> Callable[[], float]:
    """A gauge's reading of a figure that may not be measured yet (None: NaN)."""

    def value() -> float:
        figure = read()
        return math.nan if figure is None else figure

    return value


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rank_ms = Histogram(
            "relaygr_ranker_rank_latency_ms", "Rank handler latency", ["served_by"],
            registry=registry, buckets=LATENCY_MS_BUCKETS,
        )  # fmt: skip
        self.rank_errors = Counter("relaygr_ranker_rank_errors_total", "Rank calls not answered", ["code"],
                                   registry=registry)  # fmt: skip
        self.rank_refusals = Counter("relaygr_ranker_rank_refusals_total",
                                     "Rank calls refused by admission control (limit: the cap on calls, "
                                     "work: the bound on predicted work, "
                                     "deadline: the call's remaining deadline, late: admitted, and "
                                     "still waiting for the engine past its queue budget)", ["reason"],
                                     registry=registry)  # fmt: skip
        self.rank_inflight = Gauge("relaygr_ranker_rank_inflight", "Rank calls in flight (queued + running)",
                                   registry=registry)  # fmt: skip
        self.rank_inflight_work = Gauge("relaygr_ranker_rank_inflight_work_ms",
                                        "predicted engine time of the Rank calls in flight",
                                        registry=registry)  # fmt: skip
        self.rank_drain_factor = Gauge("relaygr_ranker_rank_drain_factor", "busy seconds per predicted "
                                       "second of served Rank work (admission scales queued work by it)",
                                       registry=registry)  # fmt: skip
        self.rank_admission_limit = Gauge("relaygr_ranker_rank_admission_limit",
                                          "the cap on Rank calls in flight", registry=registry)  # fmt: skip
        self.rank_throughput = Gauge("relaygr_ranker_rank_throughput_rps",
                                     "measured Rank calls/s while busy (the prior until calls complete)",
                                     registry=registry)  # fmt: skip
        self.preinfers = Counter(
            "relaygr_ranker_preinfer_total", "PreInfer outcomes", ["outcome"], registry=registry
        )
        self.reload_decisions = Counter("relaygr_ranker_reload_decisions_total", "reload vs recompute",
                                        ["decision"], registry=registry)  # fmt: skip
        self.signal_trip_ms = Histogram(
            "relaygr_ranker_signal_trip_ms", "trigger's pre-infer signal -> its PreInfer's arrival (wall clocks)",
            registry=registry, buckets=LATENCY_MS_BUCKETS,
        )  # fmt: skip
        self.late_signals = Counter("relaygr_ranker_late_signals",
                                    "PreInfer signals refused because their ranking call had come already",
                                    registry=registry)  # fmt: skip
        self.preinfers_expired = Counter("relaygr_ranker_preinfers_expired",
                                         "pre-inferences dropped unstarted at the end of their lease",
                                         registry=registry)  # fmt: skip
        self.host_lookups = Counter("relaygr_ranker_host_lookups_total",
                                    "HBM misses asked of the host tier: found, absent, absent_local (its "
                                    "presence index said so, no round trip), or found with no HBM room",
                                    ["result"], registry=registry)  # fmt: skip
        self.reloads = Counter("relaygr_ranker_reloads_total", "psi reloads from host DRAM", ["result"],
                               registry=registry)  # fmt: skip
        self.demotions = Counter("relaygr_ranker_demotions_total", "psi demotions to host DRAM", ["result"],
                                 registry=registry)  # fmt: skip
        self.fallbacks = Counter("relaygr_ranker_fallbacks_total", "cached paths that fell back to full",
                                 ["reason"], registry=registry)  # fmt: skip
        self.prefetches = Counter("relaygr_ranker_prefetches_total",
                                  "reloads from host DRAM ahead of the ranking call: issued, then used, wasted "
                                  "or failed", ["outcome"], registry=registry)  # fmt: skip
        self.ranking_psi = Counter("relaygr_ranker_psi_from_rankings",
                                   "full rankings that kept their prefix's psi in the cache (written by the "
                                   "same pass) for the user's next call", registry=registry)  # fmt: skip
        self.ranking_psi_declined = Counter("relaygr_ranker_ranking_psi_declined",
                                            "full rankings long enough to keep psi that did not: reads of "
                                            "kept psi did not pay for keeping it (keep_gate.py)",
                                            registry=registry)  # fmt: skip
        self.ranking_psi_probed = Counter("relaygr_ranker_ranking_psi_probed",
                                          "full rankings long enough to keep psi left unkept while too few "
                                          "plain ones ran to measure a keep's device time (keep_gate.py)",
                                          registry=registry)  # fmt: skip
        self.keep_device_us_per_token = Gauge("relaygr_ranker_keep_device_us_per_token",
                                              "device us a full ranking spends per prefix token of psi it keeps, "
                                              "fitted from the ranking batches (keep_gate.py; NaN while the fit "
                                              "cannot tell)", registry=registry)  # fmt: skip
        self.ranking_psi_shed = Counter("relaygr_ranker_ranking_psi_shed",
                                        "full rankings long enough to keep psi that did not because the event "
                                        "loop was behind (loop_lag.py)", registry=registry)  # fmt: skip
        self.event_loop_lag_ms = Gauge("relaygr_ranker_event_loop_lag_ms",
                                       "how late the event loop's 50 ms tick wakes, smoothed over 0.5 s: what "
                                       "every call waits before its handler runs (loop_lag.py)",
                                       registry=registry)  # fmt: skip
        self.content_mismatch = Counter("relaygr_ranker_prefix_content_mismatch",
                                        "ranking calls whose prefix tokens differ from those of psi held under "
                                        "the same (user, prefix version): ranked without it",
                                        registry=registry)  # fmt: skip
        # What the gates weigh (yield_gate.py), read at scrape time: why psi is or is not kept
        # by full rankings and copied to host DRAM. NaN while not yet measured (the gate is open).
        self.gate_returns = Gauge("relaygr_ranker_gate_returns_per_action",
                                  "keep gate: later calls reading psi per psi kept by a full ranking; "
                                  "demotion gate: reloads per copy to host DRAM (recent; NaN before measured)",
                                  ["gate"], registry=registry)  # fmt: skip
        self.host_ms_per_request = Gauge("relaygr_ranker_host_ms_per_request",
                                         "host CPU ms per request (Rank or PreInfer) over a recent window, "
                                         "the device loop's waits excluded, as Stats reports it to the trigger "
                                         "(host_cost.py; NaN before measured)", registry=registry)  # fmt: skip
        self.host_ms_per_request.set(math.nan)
        self.gate_cost_ms = Gauge("relaygr_ranker_gate_host_ms_per_action",
                                  "host time one action costs, as the gate weighs it: keeping a full "
                                  "ranking's psi, or copying psi to host DRAM (NaN before measured)",
                                  ["gate"], registry=registry)  # fmt: skip
        self.hbm_bytes = Gauge("relaygr_ranker_hbm_bytes", "psi bytes in accelerator memory", ["kind"],
                               registry=registry)  # fmt: skip
        self.device_memory_short = Counter("relaygr_ranker_device_memory_short",
                                           "allocations the device refused (out of memory) that the HBM budget "
                                           "allowed, by path; each lowers the budget (relay_cache.py)", ["path"],
                                           registry=registry)  # fmt: skip
        self.expander_up = Gauge("relaygr_ranker_expander_connected", "1 when the host tier is usable",
                                 registry=registry)  # fmt: skip
        self.device_memory = Gauge("relaygr_ranker_device_memory_bytes",
                                   "caching allocator: bytes reserved from the device, allocated to tensors",
                                   ["kind"], registry=registry)  # fmt: skip
        self.alloc_retries = Counter("relaygr_ranker_allocator_retries",
                                     "allocations that freed every cached block and retried (a device-wide "
                                     "synchronising stall)", registry=registry)  # fmt: skip
        self.device_mallocs = Counter("relaygr_ranker_device_mallocs",
                                      "memory the caching allocator reserved from the device (cudaMalloc: slow; "
                                      "psi blocks should come from its cache)", registry=registry)  # fmt: skip
        self.device_frees = Counter("relaygr_ranker_device_frees",
                                    "memory the caching allocator gave back to the device (cudaFree: synchronises "
                                    "the device)", registry=registry)  # fmt: skip


def _psi_name(key: Hashable) -> Hashable:
    assert isinstance(key, PsiKey)
    return key.name


def _call_work(request: pb.RankRequest) -> CallWork:
    """What a ranking call will compute, from its fields' sizes (before decoding; malformed sizes
    are refused later, by the decoder): its suffix against psi when it names its prefix by
    reference (sent when the psi is believed resident), else its prefix and suffix in full."""
    suffix = (len(request.recent.items_le) + len(request.candidates_le)) // 8  # int64 ids
    if request.HasField("prefix_ref"):
        return CallWork.of(request.prefix_ref.length, suffix, against_psi=True)
    prefix = (len(request.prefix.profile_le) + len(request.prefix.long_term.items_le)) // 8
    return CallWork.of(prefix, suffix, against_psi=False)


# Something queued on the engine this long is a stall: logged with the engine's state and the
# device thread's stack, at most once per STALL_REPORT_EVERY_S.
STALL_AFTER_S = 2.0
STALL_REPORT_EVERY_S = 5.0
ALLOCATOR_READ_EVERY_S = 1.0  # the caching allocator's counters (metrics, retries)
_MAX_SIGNAL_TRIP_MS = 60_000.0  # a longer trip (PreInferRequest.signal_time_unix_ms) is not measured
# The prefix length the warm-up calibrates pre-inference steps on (Engine.calibrate_steps).
CALIBRATION_TOKENS = 2048


class RankerService(pb_grpc.RankerServicer):
    """One ranker instance. `run()` is the process's life (see the module docstring); `start()` and
    `shutdown()` serve tests and benchmarks that embed an instance in their own event loop.

    `owns_process`: this instance is the process's only service, so once started, what start-up
    made moves out of the garbage collector's sight (shared.lifecycle.settle_heap)."""

    def __init__(self, config: RankerConfig, *, owns_process: bool = False) -> None:
        self.config = config
        self.lifecycle = Lifecycle("ranker", grace_s=5.0)
        self._owns_process = owns_process
        self._gc_pauses: GcPauses | None = None
        self._stalls: HostStalls | None = None
        self.accel: Accelerator = accelerator(config.device, config.device_index)
        spec = preset(config.preset)
        if config.checkpoint:
            self.model = HSTURanker.load(config.checkpoint, self.accel.device)
        else:
            self.model = HSTURanker.from_seed(spec, config.seed, self.accel.device)
        self.model.fuse_norms(config.layer_kernels is LayerKernels.FUSED)  # before any graph
        # psi blocks in size classes (off: 0): the model's new psi, reloads, and the HBM budget.
        self.psi_classes = PsiSizeClasses(config.psi_size_classes) if config.psi_size_classes else None
        self.model.psi_classes = self.psi_classes
        self.spec = self.model.spec
        # psi keys grouped by (user, prefix version, model): tells a content mismatch from a miss.
        self.cache = HbmCache(int(config.hbm_budget_mb * 2**20), time.monotonic, group_of=_psi_name)
        self.engine = Engine(
            self.model,
            self.accel,
            EngineConfig(
                max_batch=config.max_batch,
                max_batch_tokens=config.max_batch_tokens,
                max_wait_s=config.max_wait_ms / 1e3,
                preinfer_max_batch=config.preinfer_max_batch,
                preinfer_chunk_tokens=config.preinfer_chunk_tokens,
                max_rank_delay_s=config.max_rank_delay_ms / 1e3,
                first_chunk_absorbs=config.first_chunk_absorbs,
                budget_by_kind=config.step_budget_by_kind,
                cuda_graphs=config.cuda_graphs,
                graph_limits=GraphLimits(
                    max_tokens=config.graph_max_tokens,
                    max_full_tokens=config.graph_max_full_tokens,
                    full_batch_tokens=config.graph_full_batch_tokens,
                ),
                full_keeps_psi=config.ranking_psi_min_tokens > 0,
                graph_psi_chunks=config.graph_psi_chunks,
                batch_copies=config.batch_copies.value,
                launch_ahead=config.launch_ahead,
                chunks_ahead=config.chunks_ahead,
                takeover_pass=config.takeover_pass,
                latency_target_s=config.latency_target_ms / 1e3 if config.latency_target_ms else math.inf,
                slo_s=config.slo_ms / 1e3 if config.slo_ms else math.inf,
            ),
            on_fatal=self._engine_failed,
        )
        self._event_loop: asyncio.AbstractEventLoop | None = None  # set by start(): the engine reports there
        self.costs = CostModel(
            self.spec,
            assumed_tflops=200.0 if self.accel.backend == "cuda" else 0.05,
            h2d_gbps=20.0 if self.accel.backend == "cuda" else 5.0,
        )
        self.host: HostTier | None = None
        self.registry = CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self.registry.register(DeviceTimeCollector(self.engine.device_time))
        self.registry.register(LoopTimeCollector(self.engine.loop_time))
        self.registry.register(CopyStagesCollector(self.engine.copy_stages))
        self.registry.register(TakeoverPassCollector(self.engine.takeover))
        self.loop_lag = LoopLag(config.shed_lag_ms)  # how far behind the event loop runs (loop_lag.py)
        self.relay = RelayCache(
            self.cache,
            self.engine,
            self.costs,
            self.spec.psi_bytes,
            self._spawn,
            join_margin_ms=config.join_margin_ms,
            keep_demoted=config.keep_demoted,
            on_event=self._relay_event,
            ranking_psi_min_tokens=config.ranking_psi_min_tokens,
            demote_under_pressure=config.demotion in (Demotion.PRESSURE, Demotion.EARNED),
            demotion_gate=DemotionGate(config.demotion_sample_every)
            if config.demotion is Demotion.EARNED
            else None,
            demotion_reserve_bytes=int(config.demotion_reserve_fraction * self.cache.budget_bytes),
            keep_gate=KeepGate(config.ranking_psi_sample_every)
            if config.ranking_psi_keep is Keep.EARNED
            else None,
            host_pressed=self.loop_lag.pressed if config.shed_lag_ms > 0 else None,
            psi_footprint=self._psi_footprint,
        )
        self.registry.register(
            CopyStagesCollector(
                self.relay.reload_path,
                seconds_name="relaygr_ranker_reload_path_seconds",
                timed_name="relaygr_ranker_reload_paths_timed",
                what="ranking calls' reloads from host DRAM",
            )
        )
        self.registry.register(
            CpuMeterCollector(
                self.relay.demotion_cpu,
                seconds_name="relaygr_ranker_demotion_loop_cpu_seconds",
                runs_name="relaygr_ranker_demotions_metered",
                what="copies of psi to host DRAM (task_cpu.py)",
            )
        )
        self._background: set[asyncio.Task[None]] = set()
        self._rank_ms: collections.deque[float] = collections.deque(maxlen=2048)
        self._lead_ms: collections.deque[float] = collections.deque(maxlen=2048)
        self._signal_at: dict[PsiKey, float] = {}  # PreInfer arrival, for the lead time
        self._signal_trip_ms: collections.deque[float] = collections.deque(maxlen=512)
        # Requests handled (Rank and PreInfer) and the host's CPU per request (host_cost.py).
        self._requests = 0
        self._host_cost = HostCost()
        self.admission = AdmissionLimiter(config.admission, time.monotonic)
        self._overload_logged_at = float("-inf")
        self._preinfers_shed = 0
        # Read at scrape time: nothing to update on the Rank path.
        gates: list[tuple[str, YieldGate | None, Callable[[], float | None]]] = [
            ("keep", self.relay.keep_gate, self.relay.host_ms_per_keep),
            ("demotion", self.relay.demotion_gate, self.relay.host_ms_per_demotion),
        ]
        for name, gate, cost in gates:
            if gate is not None:
                returns = functools.partial(getattr, gate, "returns_per_action")
                self.metrics.gate_returns.labels(name).set_function(_or_nan(returns))
                self.metrics.gate_cost_ms.labels(name).set_function(_or_nan(cost))
        # ms per 1000 kept tokens is us per token (read through the engine: forget_batches replaces the fit).
        self.metrics.keep_device_us_per_token.set_function(
            _or_nan(lambda: self.engine.device_ms_per_keep(1000))
        )
        self.metrics.rank_inflight.set_function(lambda: self.admission.inflight)
        self.metrics.rank_admission_limit.set_function(lambda: self.admission.limit)
        self.metrics.rank_inflight_work.set_function(lambda: self.admission.inflight_work_s * 1e3)
        self.metrics.rank_drain_factor.set_function(lambda: self.admission.drain_factor)
        self.metrics.rank_throughput.set_function(lambda: self.admission.throughput or 0.0)
        graphs = self.engine.graph_stats()
        if graphs is not None:
            self.registry.register(GraphStatsCollector(graphs))
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._expiry: asyncio.Task[None] | None = None
        self._server_stopping: asyncio.Task[None] | None = None  # the gRPC server's graceful stop
        self._drain_grace_s = self.lifecycle.grace_s
        self._running = False  # under run()
        self._shutting_down = False  # shutdown() after a bare start()
        self._closed = asyncio.Event()
        self.port = 0
        self.metrics_port = 0
        self.instance_id = config.instance_id

    # ------------------------------------------------------------------ lifecycle

    def _engine_failed(self, exc: BaseException) -> None:
        """From the device thread: the engine's loop ended on an error, so no call can be served;
        the service stops (exit status 1) for its supervisor to restart it."""
        if self._event_loop is not None and not self._event_loop.is_closed():
            self._event_loop.call_soon_threadsafe(self.lifecycle.fail, f"engine loop failed: {exc!r}")

    async def start(self) -> None:
        """Warms the model up, starts the engine, binds gRPC, connects the host tier (optional)."""
        # The engine thread dispatches kernels in Python and gives the interpreter up in every
        # torch call; a short switch interval keeps it from waiting long to take it back from the
        # event loop, and the event loop (requests in, replies out) from waiting the default 5 ms.
        sys.setswitchinterval(self.config.gil_switch_ms / 1e3)
        if self.config.timer_slack_us > 0:  # before the engine's thread starts: it inherits it
            set_timer_slack(max(1, round(self.config.timer_slack_us * 1e3)))
        self._event_loop = asyncio.get_running_loop()
        self.engine.start()
        await self._warm_up()
        self._check_hbm_headroom()
        opts = [
            ("grpc.max_receive_message_length", int(self.config.max_message_mb * 2**20)),
            ("grpc.max_send_message_length", int(self.config.max_message_mb * 2**20)),
            ("grpc.so_reuseport", 0),
        ]
        self._server = grpc.aio.server(options=opts)
        pb_grpc.add_RankerServicer_to_server(self, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self._server)
        self.port = self.config.add_port(self._server, f"{self.config.host}:{self.config.port}")
        if not self.port:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        self.instance_id = self.config.instance_id or f"{socket.gethostname()}:{self.port}"
        await self._server.start()
        self.metrics_port = serve_metrics(self.registry, self.config.metrics_port, self.config.host)
        if self.config.expander_socket:
            from services.ranker.host_tier import HostTier

            self.host = HostTier(
                self.config.expander_socket,
                self.accel,
                on_change=self._host_changed,
                copy_piece_bytes=self.config.copy_piece_bytes,
                psi_format=self.config.host_psi_format.value,
                spec=self.spec,
                psi_classes=self.psi_classes,
            )
            await self.host.start()
            self.relay.host = self.host
        self._expiry = self.lifecycle.spawn(self._expire_loop(), "expire")
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("ranker_ready", port=self.port, metrics_port=self.metrics_port, instance=self.instance_id,
                 model_version=self.model.model_version, device=self.accel.name,
                 hbm_budget_mb=self.config.hbm_budget_mb)  # fmt: skip
        if self._owns_process:
            settle_heap()
            if self._gc_pauses is None:
                self._gc_pauses = GcPauses(self.registry)  # a collection stops the device thread too
                watchers = []
                # What the threads run while the device loop's host work is slow: on an accelerator,
                # whose work the loop only issues (on the CPU a launch computes: always "slow").
                if self.config.loop_slow_ms > 0 and self.accel.device.type != "cpu":
                    watchers.append(
                        LoopWatch(self.engine.loop_time, self.registry, self.config.loop_slow_ms).check
                    )
                self._stalls = HostStalls(self.registry, watchers=watchers)

    async def run(self, install_signals: bool = True) -> int:
        """Starts, serves until stopped (SIGTERM / SIGINT when `install_signals`, `shutdown()`, or
        the first failed background task), drains and closes; returns the exit status: 0 when
        asked to stop, 1 when the start or a background task failed."""
        if self._running or self._shutting_down:
            raise RuntimeError("RankerService.run() after run() or shutdown()")
        self._running = True
        return await self.lifecycle.run(self, install_signals=install_signals)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stops the instance and returns once it is closed; idempotent. Under `run()`, asks the
        lifecycle to stop (run then returns 0). After a bare `start()`, runs the same sequence
        itself: stop intake, drain the calls in flight (at most `grace_s`, default the lifecycle's
        grace period; calls still running then are cancelled), close."""
        self.lifecycle.request_stop("shutdown")  # from here on, a cancelled expiry loop is no failure
        if self._running or self._shutting_down:
            await self._closed.wait()
            return
        self._shutting_down = True
        if grace_s is not None:
            self._drain_grace_s = grace_s
        try:
            await self.stop_intake()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drain(), self._drain_grace_s)
        finally:
            await self.close()

    async def stop_intake(self) -> None:
        """Health NOT_SERVING, and the gRPC server stops taking calls (new ones fail UNAVAILABLE);
        the calls in flight go on (`drain`)."""
        await self._health.enter_graceful_shutdown()
        if self._server is not None and self._server_stopping is None:
            # stop() refuses new calls at once, then waits for those in flight (up to the grace
            # period; it cancels the rest). Its first step runs before this coroutine resumes.
            self._server_stopping = asyncio.ensure_future(self._server.stop(self._drain_grace_s))
            await asyncio.sleep(0)

    async def drain(self) -> None:
        """Waits for the calls in flight (cancelled by the lifecycle past its grace period; the
        gRPC server's own grace period, the same, ends them)."""
        if self._server_stopping is not None:
            await asyncio.shield(self._server_stopping)

    async def close(self) -> None:
        """Ends what start began, whatever part of it ran: aborts any call still in flight, cancels
        the lease-expiry loop and the productions and demotions in hand, stops the engine (its
        queued jobs fail) and closes the host tier. Never raises for a half-done start."""
        if self._gc_pauses is not None:
            self._gc_pauses.close()
        if self._stalls is not None:
            self._stalls.close()
        try:
            if self._server is not None:
                await self._server.stop(None)  # idempotent; aborts what a cut-short drain left
            if self._server_stopping is not None:
                await asyncio.gather(self._server_stopping, return_exceptions=True)
            tasks = [t for t in (self._expiry, *self._background) if t is not None and not t.done()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.to_thread(self.engine.stop)
            if self.host is not None:
                await self.host.close()
            log.info("ranker_stopped", instance=self.instance_id)
        finally:
            self._closed.set()

    def _check_hbm_headroom(self) -> None:
        """Refuses to serve with a psi budget over the device's free memory once warm, warns
        where it leaves too little of it to fragmentation (hbm_headroom.py); one log line either
        way. Per process: rankers that share a device must each be given a share of it."""
        free = self.accel.free_memory_bytes()
        if free is None:
            return
        headroom = judge(self.cache.budget_bytes, free, processes=self.config.device_processes)
        fields = {
            "budget_bytes": headroom.budget_bytes,
            "device_processes": headroom.processes,
            "free_bytes": free,
            "advised_bytes": headroom.advised_bytes,
        }
        if headroom.verdict is Verdict.EXCEEDS:
            raise ConfigError(headroom.message())
        if headroom.verdict is Verdict.TIGHT:
            log.warning("hbm_budget_tight", detail=headroom.message(), **fields)
        else:
            log.info("hbm_headroom", **fields)

    async def _warm_up(self) -> None:
        """Compiles every kernel variant before the first real request (a Triton JIT compile takes
        seconds): full ranking, pre-inference (a first chunk and one against built psi), a call
        completing half-built psi, and ranking against a prefix long enough for the split-prefix
        (float32 partial sums) variant; then, on CUDA, the ranking graphs of the
        configured suffix sizes (graph_warm_tokens) for every batch size."""
        ids = torch.arange(1024, dtype=torch.int64)
        prefix = UserPrefix(0, 0, ids[:2], Behaviors(ids, ids % 4, ids))
        suffix = RankingSuffix(Behaviors(ids[:64], ids[:64] % 4, ids[:64] + 1024), ids[:256], 2048)
        psi = await self.engine.preinfer(prefix)
        await self.engine.rank_cached(suffix, psi, psi.key)
        await self.engine.rank_full(prefix, suffix)

        # Chunks after the first attend to the psi built so far, and a call completing half-built
        # psi computes prefix tokens against it: the budget may have built the prefix in one chunk.
        # Batches of two as well: a kernel variant that only a batch of several needed would be
        # compiled mid-serving, on the device thread.
        def chunks() -> None:
            half, other = self.model.new_psi(prefix), self.model.new_psi(prefix)
            self.model.preinfer_chunks([PrefixChunk(prefix, half, 0, 256)])
            self.model.preinfer_chunks(
                [PrefixChunk(prefix, half, 256, 512), PrefixChunk(prefix, other, 0, 256)]
            )
            self.model.rank_partial([prefix, prefix], [suffix, suffix], [half, other], [512, 256])
            self.model.full([prefix, prefix], [suffix, suffix])

        await self.engine.call(chunks)
        short = RankingSuffix(Behaviors(ids[:4], ids[:4] % 4, ids[:4] + 1024), ids[:4], 2048)
        await self.engine.rank_cached(short, psi, psi.key)
        if self.engine.graphs is not None:
            started = time.perf_counter()
            captured = await self.engine.capture_graphs(list(self.config.graph_warm_tokens))
            log.info("rank_graphs_warm", captured=captured, tokens_per_user=list(self.config.graph_warm_tokens),
                     ms=round((time.perf_counter() - started) * 1e3, 1))  # fmt: skip
        self.engine.forget_batches()
        # A longer prefix than the rest of the warm-up: chunk sizes are judged up to thousands of
        # tokens, and a pair cost measured only on short ones extrapolates badly.
        long_ids = torch.arange(CALIBRATION_TOKENS, dtype=torch.int64)
        long_prefix = UserPrefix(1, 0, long_ids[:2], Behaviors(long_ids[2:], long_ids[2:] % 4, long_ids[2:]))
        prior = await self.engine.calibrate_steps(long_prefix)
        # Reload-or-recompute judges recompute by the same measured steps the scheduler plans by,
        # and reloads by a measured copy (the assumed 20 GB/s made a 4k-token reload on an H100
        # look dearer than its recompute, and reloads are what would have measured it).
        self.costs.step_s = lambda tokens: self.engine.scheduler.remaining_seconds(0, tokens)
        self.costs.h2d_gbps = await self.engine.measure_copy_gbps()
        log.info("reload_costs_measured", h2d_gbps=round(self.costs.h2d_gbps, 2),
                 recompute_4k_ms=round(self.costs.recompute_ms(4096), 3))  # fmt: skip
        log.info("preinfer_steps_calibrated", per_step_ms=round(prior.per_batch_s * 1e3, 3),
                 per_token_us=round(prior.per_token_s * 1e6, 4), per_pair_ns=round(prior.per_pair_s * 1e9, 5))  # fmt: skip
        # Measured, not assumed: one full ranking and one against psi, now warm, give admission
        # its first costs per batch, token and attention pair (services/ranker/call_cost.py).
        await self.engine.rank_full(prefix, suffix)
        await self.engine.rank_cached(short, psi, psi.key)
        self.admission.costs.observe_batches(self.engine.recent_batches())

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """A task of one call's (a production, a demotion), cancelled at close. Each handles its
        own errors; one that escapes is a bug that leaves the HBM cache's bookkeeping in doubt, so
        it stops the instance (exit status 1) instead of being dropped."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._call_task_done)
        return task

    def _call_task_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.lifecycle.fail(f"task {task.get_name()} failed: {task.exception()!r}")

    async def _expire_loop(self) -> None:
        reported = allocator_read = 0.0
        allocator = self.accel.allocator_stats()
        while True:
            asked = time.monotonic() + 0.05
            await asyncio.sleep(0.05)
            now = time.monotonic()
            self.loop_lag.observe(now, (now - asked) * 1e3)  # how late the loop came back to us
            self.metrics.event_loop_lag_ms.set(self.loop_lag.lag_ms)
            if now - allocator_read >= ALLOCATOR_READ_EVERY_S:
                allocator_read = now
                allocator = self._read_allocator(allocator)
            if now - reported >= STALL_REPORT_EVERY_S:
                stall = self.engine.stall_report(STALL_AFTER_S)
                if stall is not None:
                    log.warning("engine_stalled", **stall)
                    reported = now
            self.admission.costs.observe_batches(self.engine.recent_batches())
            self.relay.expire()
            self.metrics.hbm_bytes.labels("resident").set(self.cache.used_bytes)
            self.metrics.hbm_bytes.labels("leased").set(self.cache.leased_bytes)
            self.metrics.hbm_bytes.labels("budget").set(self.cache.budget_bytes)  # lowered on device refusals
            self.metrics.expander_up.set(1 if self.host is not None and self.host.connected else 0)

    def _read_allocator(self, before: dict[str, int]) -> dict[str, int]:
        """Exports the caching allocator's state (its counters as increments since `before`, the
        previous reading); says when allocations had to retry (each a stall of the device, which
        every queued call waits out). Returns this reading."""
        stats = self.accel.allocator_stats()
        if not stats:
            return before
        self.metrics.device_memory.labels("reserved").set(stats["reserved_bytes"])
        self.metrics.device_memory.labels("allocated").set(stats["allocated_bytes"])
        grown = {
            key: stats[key] - before.get(key, 0) for key in ("alloc_retries", "device_allocs", "device_frees")
        }
        self.metrics.device_mallocs.inc(max(0, grown["device_allocs"]))
        self.metrics.device_frees.inc(max(0, grown["device_frees"]))
        if grown["alloc_retries"] > 0:
            self.metrics.alloc_retries.inc(grown["alloc_retries"])
            log.warning("allocator_retried", retries=grown["alloc_retries"], reserved_bytes=stats["reserved_bytes"],
                        allocated_bytes=stats["allocated_bytes"], hbm_budget_bytes=self.cache.budget_bytes)  # fmt: skip
        return stats

    def _host_changed(self, connected: bool) -> None:
        log.info("host_tier", connected=connected)
        arena = self.host.arena_bytes if connected and self.host is not None else 0
        if arena and arena < self.cache.budget_bytes and self.config.demotion is Demotion.CONSUMED:
            # With every consumed psi copied at once, HBM evicts its least recently used psi,
            # which the arena, holding less, has already overwritten: returning users are
            # recomputed, not reloaded (GPU runs with a 24 GB arena beside a 40 GB HBM budget
            # served no reload at all). Demotion under pressure (the default) avoids this.
            log.warning("host_tier_smaller_than_hbm", arena_bytes=arena, hbm_budget_bytes=self.cache.budget_bytes,
                        effect="psi evicted from HBM is rarely still in DRAM: few reloads",
                        remedy="RELAYGR_RANKER_DEMOTION=earned (the default) or pressure")  # fmt: skip

    def _psi_footprint(self, prefix_len: int) -> int:
        """The HBM bytes of a psi of that many tokens: its size class's with --psi-size-classes."""
        nbytes = self.spec.psi_bytes(prefix_len)
        return self.psi_classes.footprint(nbytes) if self.psi_classes is not None else nbytes

    def _relay_event(self, kind: str, label: str) -> None:
        """Counts what the relay cache reports (services/ranker/relay_cache.py)."""
        m = self.metrics
        if kind == "reload_decision":
            m.reload_decisions.labels(label).inc()
        elif kind == "late_signal":
            m.late_signals.inc()
        elif kind == "preinfer_expired":
            m.preinfers_expired.inc()
        elif kind == "host_lookup":
            m.host_lookups.labels(label).inc()
        elif kind == "reload":
            m.reloads.labels(label).inc()
        elif kind == "fallback":
            m.fallbacks.labels(label).inc()
        elif kind == "demotion":
            m.demotions.labels(label).inc()
        elif kind == "content_mismatch":
            m.content_mismatch.inc()
        elif kind == "prefetch":
            m.prefetches.labels(label).inc()
        elif kind == "ranking_psi" and label == "declined":
            m.ranking_psi_declined.inc()
        elif kind == "ranking_psi" and label == "probed":
            m.ranking_psi_probed.inc()
        elif kind == "ranking_psi" and label == "shed":
            m.ranking_psi_shed.inc()
        elif kind == "ranking_psi":
            m.ranking_psi.inc()
        elif kind == "device_memory_short":
            m.device_memory_short.labels(label).inc()

    # ------------------------------------------------------------------ PreInfer

    async def PreInfer(
        self, request: pb.PreInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreInferReply:
        self._requests += 1
        try:
            if not request.request_id:
                raise WireError("request_id is required")
            prefix = preinfer_prefix(request, self.config.limits)
        except WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.signal_time_unix_ms > 0:
            # Wall clocks: a skewed trigger host can make it negative, which says nothing; a
            # trip past a minute is a bad clock or a made-up time, not the signal path (the
            # trigger would judge every pre-inference too late by it).
            trip_ms = max(0.0, time.time() * 1e3 - request.signal_time_unix_ms)
            if trip_ms <= _MAX_SIGNAL_TRIP_MS:
                self._signal_trip_ms.append(trip_ms)
                self.metrics.signal_trip_ms.observe(trip_ms)
        key = self.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
        if len(self._signal_at) > 100_000:
            self._signal_at.clear()  # a bound, not an LRU: lead times are a statistic
        self._signal_at.setdefault(key, time.monotonic())
        if self.admission.shedding():
            # Ranking calls are being refused: pre-inference would compete with the ones admitted.
            self.metrics.preinfers.labels("refused").inc()
            self._preinfers_shed += 1
            return pb.PreInferReply(
                outcome=pb.PreInferReply.REFUSED,
                reason="rank_overloaded",
                instance_id=self.instance_id,
                fingerprint=key.fingerprint,
            )
        lease = Lease(request.request_id, self._lease_deadline(request.lease_deadline_unix_ms))
        produced, reason = await self.relay.produce(
            key,
            prefix,
            lease,
            prefetch_only=request.prefetch_only,
            need_by=self._need_by(request.ranking_deadline_unix_ms),
        )
        outcome = _OUTCOME[produced]
        self.metrics.preinfers.labels(pb.PreInferReply.Outcome.Name(outcome).lower()).inc()
        return pb.PreInferReply(
            outcome=outcome, reason=reason, instance_id=self.instance_id, fingerprint=key.fingerprint
        )

    @staticmethod
    def _need_by(ranking_deadline_unix_ms: int) -> float:
        """When the signal's ranking call is due, on time.monotonic() (inf: not said). Only an
        order among pre-inferences (the engine builds the soonest needed first), so a skewed
        clock on the trigger's host shifts them all alike."""
        if ranking_deadline_unix_ms <= 0:
            return math.inf
        return time.monotonic() + (ranking_deadline_unix_ms - time.time() * 1e3) / 1e3

    def _lease_deadline(self, unix_ms: int) -> float:
        now_ms = time.time() * 1e3
        remaining = unix_ms - now_ms if unix_ms > 0 else self.config.default_lease_ms
        remaining = min(max(remaining, 0.0), self.config.max_lease_ms)
        return time.monotonic() + remaining / 1e3

    # ------------------------------------------------------------------ Rank

    async def Rank(self, request: pb.RankRequest, context: grpc.aio.ServicerContext) -> pb.RankReply:
        started = time.perf_counter()
        self._requests += 1
        remaining = context.time_remaining()
        # Admission first: O(1), before any decoding or engine work, so that a refusal is fast.
        admitted = self.admission.try_acquire(_call_work(request), remaining)
        if isinstance(admitted, Refusal):
            self._refuse(admitted)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"ranker {self.instance_id} {admitted.reason}"
            )
            raise AssertionError("unreachable: abort raises")  # pragma: no cover
        ranked: Ranked | None = None
        # Not started by then, the engine drops the call unrun (admission.py: a late refusal).
        budget_s = admitted.queue_budget_s
        start_by = started + budget_s if budget_s is not None else float("inf")
        try:
            prefix, suffix = rank_inputs(request, self.config.limits)
            deadline = time.monotonic() + (remaining if remaining is not None else 10.0)
            key = self.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.digest)
            signalled = self._signal_at.pop(key, None)
            if signalled is not None:
                self._lead_ms.append((time.monotonic() - signalled) * 1e3)
            ranked = await self.relay.rank(
                key, request.request_id, prefix, suffix, deadline, context.add_done_callback, start_by
            )
        except Overdue as exc:
            refusal = self.admission.late(admitted, exc.waited_s)
            self._refuse(refusal)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"ranker {self.instance_id} {refusal.reason}"
            )
        except WireError as exc:
            self.metrics.rank_errors.labels("invalid_argument").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except PrefixRequired as exc:
            self.metrics.rank_errors.labels("prefix_required").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except torch.OutOfMemoryError:
            # Refused twice by the device, psi freed in between (RelayCache._rank): a
            # load the caller may retry elsewhere, not a fault of its request.
            self.metrics.rank_errors.labels("device_memory").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"ranker {self.instance_id} device_memory: out of device memory",
            )
        except NonFiniteScores as exc:
            # Never answered as scores: a caller ranking by NaN would order its candidates
            # arbitrarily. A fault of ours (the pass's own log line says which batch).
            self.metrics.rank_errors.labels("nonfinite_scores").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"ranker {self.instance_id} {exc}")
        except Exception as exc:
            # A fault of ours: said as one (INTERNAL, with what failed), logged with its
            # traceback, and the service goes on.
            self.metrics.rank_errors.labels("internal").inc()
            log.exception("rank_failed", request_id=request.request_id)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"ranker {self.instance_id} internal error: {exc!r}"[:512]
            )
        except asyncio.CancelledError:
            # Admitted, and its caller gave up (deadline or cancel) before the answer: what
            # admission exists to avoid, so it is counted.
            self.metrics.rank_errors.labels("cancelled").inc()
            raise
        finally:
            self.admission.release(admitted, served=ranked is not None)
        total_ms = (time.perf_counter() - started) * 1e3
        self._rank_ms.append(total_ms)
        assert ranked is not None  # every other way out of the try block raises
        result = ranked.result
        self.metrics.rank_ms.labels(ranked.served.value).observe(total_ms)
        return pb.RankReply(
            scores=result.scores.tolist(),
            served_by=_SERVED[ranked.served],
            timings=pb.StageTimings(
                cache_ms=ranked.cache_ms,
                queue_ms=result.queue_ms,
                compute_ms=result.compute_ms,
                total_ms=total_ms,
                prefix_reused=ranked.prefix_reused,
                batch=result.batch_size,
                batch_tokens=result.batch_tokens,
                launch_ms=result.launch_ms,
                batch_seq=result.batch_seq,
                psi_kept=ranked.served is Served.FULL_RECOMPUTE and result.psi is not None,
            ),
            model_version=self.model.model_version,
            instance_id=self.instance_id,
        )

    def _refuse(self, refusal: Refusal) -> None:
        self.metrics.rank_errors.labels("resource_exhausted").inc()
        self.metrics.rank_refusals.labels(refusal.kind).inc()
        now = time.monotonic()
        if now - self._overload_logged_at >= 1.0:  # one line a second at most: refusals come in floods
            self._overload_logged_at = now
            log.warning("rank_overloaded", instance=self.instance_id, kind=refusal.kind,
                        inflight=self.admission.inflight, limit=self.admission.limit,
                        inflight_work_ms=round(self.admission.inflight_work_s * 1e3, 1),
                        drain_factor=round(self.admission.drain_factor, 2),
                        throughput_rps=self.admission.throughput, refused=dict(self.admission.refused))  # fmt: skip

    # ------------------------------------------------------------------ Stats

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        self._host_cost.observe(time.monotonic(), self._host_cpu_s(), self._requests)
        host_ms = self._host_cost.ms_per_request()
        self.metrics.host_ms_per_request.set(math.nan if host_ms is None else host_ms)
        window = list(self._rank_ms)
        rank_p50, rank_p99 = percentiles(window, (50, 99)) if window else (0.0, 0.0)  # one sort, polled often
        samples = [
            pb.LatencySample(
                prefix_len=s.prefix_len,
                tokens=s.tokens,
                batch=s.batch,
                compute_ms=s.compute_ms,
                full=s.full,
                seq=s.seq,
            )
            for s in self.engine.recent_batches()[-64:]
        ]
        return pb.StatsReply(
            instance_id=self.instance_id,
            model_version=self.model.model_version,
            hbm_budget_bytes=self.cache.budget_bytes,
            hbm_resident_bytes=self.cache.used_bytes,
            hbm_leased_bytes=self.cache.leased_bytes,
            # Every pre-inference the engine holds is a producing cache entry too (reloads are
            # producing entries only): added, each pre-inference counted twice.
            preinfer_backlog=max(self.engine.preinfer_backlog, self.cache.producing),
            preinfer_due_in_ms=[d * 1e3 for d in self.engine.preinfer_due_in_s(time.monotonic())],
            rank_queue_depth=self.engine.rank_queue_depth,
            preinfers_refused=self.cache.counters.refused + self._preinfers_shed,
            rank_p50_ms=rank_p50,
            rank_p99_ms=rank_p99,
            recent_batches=samples,
            recent_preinfers=[
                pb.PreinferSample(prefix_len=s.prefix_len, device_ms=s.device_ms, seq=s.seq)
                for s in self.engine.recent_preinfers()[-64:]
            ],
            expander_connected=self.host is not None and self.host.connected,
            psi_bytes_per_token=self.spec.psi_bytes(1),
            demotions=self.cache.counters.demoted,
            # Pre-inferences and reloads (the cache also counts psi kept by full rankings).
            psi_produced=self.cache.counters.produced - self.relay.psi_from_rankings,
            psi_expired=self.cache.counters.expired,
            lead_time_p50_ms=percentile(list(self._lead_ms), 50) if self._lead_ms else 0.0,
            hbm_hits=self.cache.counters.hits,
            hbm_misses=self.cache.counters.misses,
            prefix_content_mismatches=self.relay.content_mismatches,
            reloads=self.relay.reloads,
            hbm_evictable_bytes=self.cache.evictable_bytes,
            hbm_evictions=self.cache.counters.evicted,
            hbm_released=self.cache.counters.released,
            hbm_evicted_undemoted=self.cache.counters.evicted_undemoted,
            prefetches_issued=self.relay.prefetches.issued,
            prefetches_used=self.relay.prefetches.used,
            prefetches_wasted=self.relay.prefetches.wasted,
            prefetches_failed=self.relay.prefetches.failed,
            demotion_lag_p99_ms=percentile(list(self.relay.demotion_lag_ms), 99)
            if self.relay.demotion_lag_ms
            else 0.0,
            ranking_psi_min_tokens=self.relay.ranking_psi_min_tokens,
            psi_from_rankings=self.relay.psi_from_rankings,
            device_busy=self.engine.device_time.recent_busy_fraction(),
            signal_trip_p90_ms=percentile(list(self._signal_trip_ms), 90) if self._signal_trip_ms else 0.0,
            preinfer_plan=self._preinfer_plan(),
            host_ms_per_request=host_ms or 0.0,
        )

    def _host_cpu_s(self) -> float:
        """The process's CPU seconds so far, less the device loop's waits (they spin while the
        device works: not host work a request adds)."""
        loop = self.engine.loop_time.snapshot()
        waits = sum(loop[section][1] for section in ("settle_wait", "idle", "fill_wait"))
        return time.process_time() - waits

    def _preinfer_plan(self) -> list[pb.PreinferSample]:
        """The device time the scheduler plans for psi of each length of preinfer_plan_lengths
        (StatsReply.preinfer_plan); none before the steps were measured at start-up."""
        step_s = self.costs.step_s
        if step_s is None:
            return []
        return [
            pb.PreinferSample(prefix_len=n, device_ms=step_s(n) * 1e3)
            for n in preinfer_plan_lengths(self.config.max_prefix_tokens)
        ]


def preinfer_plan_lengths(max_prefix_tokens: int) -> list[int]:
    """The prefix lengths a ranker prices psi at in its Stats: powers of two from 256 tokens, and
    its longest prefix (a few samples: the trigger fits a + b n + c n^2 through them)."""
    lengths = [n for n in (256 << i for i in range(24)) if n < max_prefix_tokens]
    return [*lengths, max_prefix_tokens] if max_prefix_tokens > 0 else []


def serve(config: RankerConfig) -> int:
    """Runs one instance as this process's service; returns its exit status (shared.lifecycle)."""
    import uvloop

    if config.cpu_affinity:
        pin_process(config.cpu_affinity)

    async def main() -> int:
        return await RankerService(config, owns_process=True).run()

    return uvloop.run(main())
