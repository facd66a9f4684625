"""The engine: one device thread drives the accelerator; asyncio only submits work and awaits results.

One device loop per accelerator, planned step by step by the iteration scheduler
(services/ranker/scheduler.py, a pure policy). Each time round, the loop:
  1. issues the host <-> device copies of psi that are queued (demotions and reloads: on CUDA on a
     copy stream, so the copy engine runs them beside the compute; completions are polled, never
     waited on) and resolves those that completed;
  2. runs what the scheduler planned for the step: a ranking batch (earliest deadline first, one
     kind per batch: against complete psi, in full, or partial) or, when no ranking call waits,
     pre-inference chunks sized so the step lasts about its fixed cost plus `max_rank_delay_s`;
     or waits for a ranking batch to fill (at most `max_wait_s`);
  3. between steps, calls that must run on the device thread (e.g. CUDA graph captures at
     warm-up); when nothing else is planned, the capture of ranking graphs for batch shapes seen
     without one.
On CUDA, batches against complete psi, full batches and pre-inference steps whose chunks start at
their prefix's first token replay a captured CUDA graph when one fits (GraphLimits), else run
eagerly; both give the same scores. Partial batches and later chunks run eagerly.

Launch-ahead (EngineConfig.launch_ahead, on by default): a ranking batch's scores are collected
only after the next step is planned and, if it is a ranking batch too, launched behind it on the
ranking stream. The host's work between two batches (answering the first batch's calls, planning,
packing and staging the next) then runs while the device computes, instead of leaving it idle: in
service on an H100 a call against 4096 tokens of psi spent ~1.9 ms a step for ~0.85 ms of kernels.
Anything else the loop does (a pre-inference chunk, a copy's completion, a capture, a wait for a
batch to fill) first collects the batch in flight. With `chunks_ahead` (off by default: not yet
measured on a GPU) pre-inference steps are launched the same way: behind the step on the device,
settled once the next step is launched; their chunks' progress moves at the launch, and whatever
reads their psi next runs behind them on the stream. A batch's compute_ms is its own device time:
on CUDA between events recorded around its device work (Engine._complete_rank_batch), on the CPU
its launch's wall time.

Pre-inference builds psi in chunks of at most `preinfer_chunk_tokens` prefix tokens (a multiple of
256, the fingerprint's chunk), each a causal forward against the psi built so far whose K/V are
written in place into the user's psi block (HSTURanker.preinfer_chunks). A ranking call whose
psi is being pre-inferred here goes through `relay()`, which asks the scheduler:
  * JOIN: wait for the remaining chunks (they then run with the call's deadline), rank against psi;
  * TAKE_OVER: no more chunks run; the call's own step reads the chunks built (none, if it had not
    started: the pre-inference is in effect cancelled) and computes the rest of the prefix and
    its suffix (HSTURanker.rank_partial), writing the rest of psi, which is then complete and is
    handed to the pre-inference's waiter as if it had built it. No token is computed twice.

The step-cost models are `services.ranker.call_cost.CostFit`s (the fit admission uses), fitted
here on the device thread: one to the measured pre-inference steps (tokens, attention pairs,
seconds), what the scheduler sizes chunks and judges joins by; one to the steps that a CUDA graph
ran from a prefix's first token (first chunks, costed apart: see IterationScheduler.chunk_seconds);
one to the ranking batches, what it composes batches by (one fit of pre-inference steps and
ranking batches ran chunk steps ~1.5x over the budget on the CPU).

Device time (services/ranker/device_time.py): every ranking batch, pre-inference chunk and copy
adds its device time to `device_time` by kind (a copy under the kind its caller names: "copy",
"reload" or "demote"). The chunks' cost of each psi is kept by key as they run
(`device_time.produced` with the running total) until a ranking call consumes that psi (served
from it, joined, or taken over) or it is lost: expired unused (reported by the cache), or
abandoned half-built (its waiter gone, or the engine stopped) which is counted as unused here.

Blocking: the submission methods never block the event loop (a lock held for microseconds);
results arrive on the loop via call_soon_threadsafe. Errors in one job fail that job's future only.
A job whose caller has gone (its future cancelled) is dropped before it runs.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kernels.device import Accelerator
from kernels.host_view import HostStaging
from services.ranker.call_cost import CostFit, CostPrior
from services.ranker.config import BatchCopies
from services.ranker.copy_stages import CopyStages
from services.ranker.copy_watch import CopyWatcher
from services.ranker.device_time import WORKS, DeviceTime, SectionTimer, starved_seconds
from services.ranker.events import EventPool, timing_event_pool, wait_until_done
from services.ranker.graphs import (
    BucketKey,
    GraphLimits,
    GraphStats,
    PendingScores,
    RankGraphs,
    bucket_for,
    warm_full_keys,
)
from services.ranker.keep_gate import KeepDeviceCost
from services.ranker.loop_time import LoopTime
from services.ranker.model import HSTURanker, PrefixChunk
from services.ranker.psi import Psi, PsiKey
from services.ranker.rank_queue import RankQueue
from services.ranker.scheduler import (
    Chunk,
    IterationScheduler,
    Plan,
    PreinferItem,
    RankItem,
    RankKind,
    Relay,
    SchedulerConfig,
    chunk_work,
)
from services.ranker.sequences import RankingSuffix, UserPrefix
from services.ranker.takeover import TakeoverPass, TakeoverPolicy
from shared.fingerprint import CHUNK_TOKENS
from shared.lifecycle import name_os_thread
from shared.logging import get_logger
from shared.wire import MAX_PREINFER_DUES

log = get_logger("ranker.engine")

# A ranking call submitted without a deadline is ordered as if it had this long.
DEFAULT_DEADLINE_S = 1.0


# How often the device loop looks at copies in flight when it has nothing else to do.
_COPY_POLL_S = 0.00025
# Demotions issued after a ranking batch's launch while more calls wait: each costs the loop
# ~0.6 ms of CPU (H200); the rest wait for the next launch or for a pass with no call queued.
_DEMOTIONS_PER_LAUNCH = 2
# Queued copies past which every demotion is issued at once, calls waiting or not.
_DEMOTION_BACKLOG = 16


class EngineStopped(RuntimeError):
    """The engine shut down before the job ran."""


class PreinferExpired(RuntimeError):
    """A pre-inference whose lease ended before any of it was built: dropped unrun (its ranking
    call is over; building it then only delays the pre-inferences behind it)."""


class NonFiniteScores(RuntimeError):
    """A call's scores came back with NaN or infinity: never answered as scores. The batch's
    psi for that call (kept, or completed for a pre-inference it took over) is not kept either."""


def nonfinite_calls(scores: list[torch.Tensor]) -> list[int]:
    """The positions of the calls whose scores are not all finite (host float32 tensors; ~2 us
    a call: numpy over the tensor's own memory)."""
    return [i for i, s in enumerate(scores) if not np.isfinite(s.numpy()).all()]


class Overdue(RuntimeError):
    """A ranking call was not started by its `start_by` time (its admission's queue budget,
    services/ranker/admission.py): dropped unrun. `waited_s`: how long it waited."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"not started within {waited_s * 1e3:.0f} ms")
        self.waited_s = waited_s


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8
    max_batch_tokens: int = 65_536
    max_wait_s: float = 0.001
    preinfer_max_batch: int = 4
    # Pre-inference chunks: at most this many prefix tokens (a multiple of 256) ...
    preinfer_chunk_tokens: int = 4096
    # ... and sized so that a step is predicted to last at most its fixed cost plus this long:
    # about the longest a ranking call waits behind pre-inference (scheduler.step_budget_s).
    max_rank_delay_s: float = 0.005
    # A first chunk a graph holds may pass that budget where that saves a step
    # (IterationScheduler.chunk_size).
    first_chunk_absorbs: bool = False
    # A step's budget counts the fixed cost of the kind of step that runs (SchedulerConfig).
    budget_by_kind: bool = False
    # The step-cost model before any step is measured.
    step_prior: CostPrior = field(default_factory=CostPrior)
    # Replay captured CUDA graphs for batches against psi (CUDA only).
    cuda_graphs: bool = True
    graph_limits: GraphLimits = field(default_factory=GraphLimits)
    # Full rankings may leave their prefix's psi (rank_full(keep_psi=True)): those that do
    # replay graphs that also write K/V (RankGraphs full_keeps_kv: the full_keep family).
    full_keeps_psi: bool = False
    # CUDA: pre-inference chunks that read psi replay graphs of their own family (RankGraphs).
    graph_psi_chunks: bool = True
    # CUDA: how a batch's inputs and scores cross between host and device (RankGraphs'
    # batch_copies: "engine", "scores_aside" or "kernel"; the ranker's default here too).
    batch_copies: str = BatchCopies.KERNEL.value
    # Launch the next ranking batch before collecting the scores of the one on the device
    # (Engine._loop): at most two batches in flight.
    launch_ahead: bool = True
    # Pre-inference steps too: a step is launched behind the batch or step on the device and
    # settled after the next one is launched (off until measured on a GPU).
    chunks_ahead: bool = False
    # A take-over of a started pre-inference: the eager partial pass or the full graph (takeover.py).
    takeover_pass: TakeoverPolicy = TakeoverPolicy.MEASURED
    # The latency a ranking call is scheduled to finish within (from its submission): the
    # scheduler orders calls, and lets short work go ahead of long, by min(the call's own
    # deadline, submitted + this). A gRPC deadline says when a caller gives up, not when it
    # needs its answer: with a client's 10 s deadline every hit "fitted" before a full ranking,
    # and full rankings waited 50-110 ms behind hits (relay-nospare, L4096, H200, h2a) while
    # the device was 64% busy. Off by default (config.py says why).
    latency_target_s: float = math.inf
    # The ranking SLO, from a call's submission: work predicted to finish past it (or past the
    # call's own deadline) waits behind work that can still meet its own (the scheduler's
    # `doomed`). inf: no SLO known, only a call's own deadline dooms it.
    slo_s: float = math.inf

    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch=self.max_batch,
            max_batch_tokens=self.max_batch_tokens,
            max_wait_s=self.max_wait_s,
            preinfer_max_batch=self.preinfer_max_batch,
            chunk_tokens=self.preinfer_chunk_tokens,
            max_rank_delay_s=self.max_rank_delay_s,
            first_chunk_absorbs=self.first_chunk_absorbs,
            budget_by_kind=self.budget_by_kind,
        )


@dataclass(frozen=True)
class RankResult:
    scores: torch.Tensor  # float32 on the host
    queue_ms: float  # submit -> batch start
    compute_ms: float  # the batch's compute (scores on the host)
    batch_size: int
    reused_tokens: int = 0  # prefix tokens read from psi (the whole prefix against complete psi)
    batch_tokens: int = 0  # tokens the batch computed (all its calls)
    launch_ms: float = 0.0  # host time issuing the batch's device work, up to the wait for scores
    psi: Psi | None = None  # a full ranking's prefix psi, complete (rank_full(keep_psi=True))
    batch_seq: int = 0  # the batch's number on this engine (from 1; its calls share it)
    psi_out_of_memory: bool = False  # keep_psi asked, and the device had no room for the psi


@dataclass(frozen=True)
class RelayResult:
    """How `relay()` served a ranking call whose psi was being pre-inferred here."""

    result: RankResult
    joined: bool  # waited for the pre-inference and ranked against complete psi
    reused_tokens: int  # prefix tokens built by the pre-inference that the call used
    prefix_tokens: int

    @property
    def reused_fraction(self) -> float:
        return self.reused_tokens / self.prefix_tokens if self.prefix_tokens else 0.0


@dataclass(frozen=True)
class BatchSample:
    """One measured ranking batch (feeds Stats and the trigger's latency model). A partial batch
    counts as full: it computes prefix tokens (`tokens` are those it computed)."""

    full: bool
    batch: int
    tokens: int
    prefix_len: int  # longest prefix computed in full in this batch (0 against psi)
    compute_ms: float
    seq: int  # increasing per engine


@dataclass(frozen=True)
class PreinferSample:
    """One pre-inference built whole by its chunks: prefix tokens and the device time of its
    share of their steps (feeds Stats: the trigger's cost of a pre-inference)."""

    prefix_len: int
    device_ms: float
    seq: int  # increasing per engine


@dataclass
class _Job:
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    submitted: float  # time.monotonic()
    tokens: int

    def alive(self) -> bool:
        return not self.future.cancelled()

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        self.loop.call_soon_threadsafe(settle)


@dataclass
class _PreInferJob(_Job):
    prefix: UserPrefix = field(kw_only=True)
    key: PsiKey = field(kw_only=True)
    id: int = field(kw_only=True)
    psi: Psi | None = None  # allocated at the first chunk (or by the call that takes it over)
    done: int = 0  # prefix tokens built
    taken: bool = False  # a ranking call computes the rest: no more chunks
    joined_deadline: float | None = None
    # The latest due_by of the calls that joined it (-inf: none): it is worth running while any
    # of them can still be served in time (scheduler.doomed).
    joined_due_by: float = -math.inf
    cost_s: float = 0.0  # device time of its chunks so far
    expires_at: float = math.inf  # time.monotonic(): not started by then, it is dropped
    need_by: float = math.inf  # time.monotonic(): when its ranking call is due (the build order)
    started_at: float | None = None  # time.monotonic() of its first step's launch
    abandoned: bool = False  # left the queue unfinished (Engine._abandon)

    def item(self) -> PreinferItem:
        return PreinferItem(
            self.id,
            self.prefix.length,
            self.done,
            self.submitted,
            self.joined_deadline,
            self.taken,
            need_by=self.need_by,
            joined_due_by=self.joined_due_by,
        )


@dataclass
class _RankJob(_Job):
    suffix: RankingSuffix = field(kw_only=True)
    kind: RankKind = field(kw_only=True)
    deadline: float = field(kw_only=True)
    id: int = field(kw_only=True)
    prefix: UserPrefix | None = field(kw_only=True, default=None)  # full and partial
    psi: Psi | None = field(kw_only=True, default=None)  # against complete psi
    key: PsiKey | None = field(kw_only=True, default=None)
    takes: _PreInferJob | None = field(kw_only=True, default=None)  # partial: the job it takes over
    keep_psi: bool = field(kw_only=True, default=False)  # full: leave the prefix's psi (RankResult.psi)
    start_by: float = field(kw_only=True, default=float("inf"))  # time.perf_counter(); else Overdue
    due_by: float = field(kw_only=True, default=math.inf)  # RankItem.due_by (time.monotonic())

    def item(self) -> RankItem:
        # The scheduler's clock is time.monotonic(); start_by is on time.perf_counter().
        start_by = self.start_by + (time.monotonic() - time.perf_counter())
        if self.kind is RankKind.CACHED:
            return RankItem(
                self.id,
                self.kind,
                self.deadline,
                self.submitted,
                self.tokens,
                start_by=start_by,
                due_by=self.due_by,
            )
        assert self.prefix is not None
        built = self.takes.done if self.takes is not None else 0
        tokens = self.prefix.length - built + self.suffix.length
        return RankItem(
            self.id,
            self.kind,
            self.deadline,
            self.submitted,
            tokens,
            self.prefix.length * tokens,
            start_by,
            due_by=self.due_by,
        )


@dataclass
class _CallJob(_Job):
    fn: Callable[[], Any] = field(kw_only=True)


# Ranking batches measured before the full-vs-cached saving is read from their fit.
_MIN_SAVING_BATCHES = 16
_MIN_COPIES_TIMED = 32  # copies issued before their host time per copy is reported
_MIN_KEPT_TIMED = 32  # psi kept by full rankings before their host time per psi is reported


@dataclass
class _CopyJob(_Job):
    issue: Callable[[], Any] = field(kw_only=True)  # issues the copy, returns the result value
    work: str = field(kw_only=True, default="copy")  # its kind in the device-time ledger
    event: Any = None
    value: Any = None
    timer: SectionTimer | None = None
    on_timed: Callable[[float], None] | None = None  # called with the copy's device seconds
    issued_at: float = 0.0  # time.monotonic() when the loop issued it
    waited_from: Any = None  # a reload's event before its stream's wait for compute (CUDA)
    told_at: float = 0.0  # time.monotonic() when the copy watcher told its caller (0: not)


@dataclass
class _InFlight:
    """A ranking batch launched on the device, its scores not yet collected."""

    batch: list[_RankJob]
    pending: PendingScores
    started: float  # time.perf_counter() at its launch
    started_at: float  # time.monotonic() at its launch
    issued: float  # time.perf_counter() once its device work was issued
    built: list[int]  # per call: prefix tokens read from psi
    kept: list[Psi | None]  # per call: the psi a full ranking leaves (keep_psi)
    prefix_len: int  # longest prefix computed in full
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: around its device work
    kept_out_of_memory: bool = False  # its psi blocks were refused by the device: none kept


@dataclass
class _ChunksInFlight:
    """A pre-inference step launched on the device, not yet settled."""

    work: list[tuple[Chunk, _PreInferJob]]
    timer: SectionTimer
    graphed: bool  # replayed a graph (first chunks), else eager
    began: float = 0.0  # time.monotonic() at its launch: the ranking calls' waits behind it count from here


class Engine:
    def __init__(
        self,
        model: HSTURanker,
        accel: Accelerator,
        config: EngineConfig,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`on_fatal` is told, from the device thread, of an error that ended the device loop
        (a bug: per-job errors fail only their jobs); every queued and later job then fails with
        EngineStopped instead of waiting for a loop that is gone."""
        self.model = model
        self.accel = accel
        self.config = config
        self._on_fatal = on_fatal
        self._cv = threading.Condition(threading.RLock())
        self._ranks: dict[int, _RankJob] = {}
        # The same calls as the scheduler reads them, kept in deadline order across steps
        # (rank_queue.py: planning a step may not grow with the backlog).
        self._rank_queue = RankQueue()
        self._preinfers: dict[int, _PreInferJob] = {}
        self.preinfers_expired = 0  # dropped unstarted at the end of their lease
        self._producing: dict[PsiKey, _PreInferJob] = {}
        self._copies: collections.deque[_CopyJob] = collections.deque()
        self._copies_in_flight: list[_CopyJob] = []
        self._calls: collections.deque[_CallJob] = collections.deque()
        self._ids = itertools.count()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        cuda = accel.backend == "cuda"
        self._copy_stream = torch.cuda.Stream(accel.device) if cuda else None
        # Reloads (host -> device) on their own stream: on the copy stream they queued behind
        # demotions (device -> host), which another copy engine runs, and waited for them.
        self._reload_stream = torch.cuda.Stream(accel.device) if cuda else None
        self._stream = torch.cuda.Stream(accel.device) if cuda else None
        # Timing events reused (services/ranker/events.py): a batch's start and end, a copy's
        # start and end; and one event re-recorded to order the copy streams after compute.
        self._events = timing_event_pool() if cuda else None
        self._order_event = torch.cuda.Event() if cuda else None
        # Tells a reload's caller once its copy is done, not once the loop next polls
        # (copy_watch.py); off CUDA a copy is done when issued.
        self._copy_watcher = CopyWatcher() if cuda else None
        self._samples: collections.deque[BatchSample] = collections.deque(maxlen=256)
        self._batches_run = 0
        # The end of the last ranking batch on the device (its CUDA event; on the CPU the wall
        # time it was collected), for the gap before the next (DeviceTime.idle_between); None
        # after a pre-inference step.
        self._last_batch_end: torch.cuda.Event | float | None = None
        self.loop_time = LoopTime()
        self._copies_issued = 0  # host <-> device copies the loop issued (host_ms_per_copy)
        self._psis_kept = 0  # psi blocks allocated for full rankings that keep psi (host_ms_per_keep)
        self.nonfinite_scores = 0  # calls failed because their scores were NaN or infinite
        self._keep_alloc_cpu_s = 0.0  # the device loop's CPU allocating them
        self.copy_stages = CopyStages()  # where each psi copy's time goes (copy_stages.py)
        self._preinfer_samples: collections.deque[PreinferSample] = collections.deque(maxlen=256)
        self._preinfers_built = 0
        self.device_time = DeviceTime()
        # Fitted on the device thread only (CostFit is not thread-safe); relay() reads its
        # coefficients from the event loop: an immutable value that observe() replaces whole.
        self._step_prior = config.step_prior  # until calibrate_steps() measures one
        self.step_costs = CostFit(config.step_prior)
        # Steps that build prefixes from their first token by a graph replay: their own fit, from
        # calibrate_steps() on (None until then, and without graphs for them).
        self._first_prior: CostPrior | None = None
        self.first_costs: CostFit | None = None
        self.rank_costs = CostFit(config.step_prior)
        # Device time a full ranking spends on the psi it keeps (keep_gate.py; settling only).
        self.keep_device = KeepDeviceCost()
        # Which pass completes a take-over of a started pre-inference (device thread only).
        self.takeover = TakeoverPass(config.takeover_pass)
        self.graphs: RankGraphs | None = None
        if cuda and config.cuda_graphs:
            limits = GraphLimits(**{**config.graph_limits.__dict__, "max_batch": config.max_batch})
            self.graphs = RankGraphs(
                model,
                limits,
                full_keeps_kv=config.full_keeps_psi,
                chunks_reading_psi=config.graph_psi_chunks,
                batch_copies=config.batch_copies,
            )
            # A new psi's timestamps go the way of the batches' copies (model.new_psi).
            staging = HostStaging(model.device) if self.graphs.batch_copies == "kernel" else None
            model.host_staging = staging if staging is not None and staging.available else None
            torch.cuda.synchronize(accel.device)  # its buffers, zeroed on this thread's stream
        self.scheduler = IterationScheduler(
            config.scheduler(),
            self.step_costs,
            self.rank_costs,
            full_replays=None if self.graphs is None else self.graphs.holds_full,
        )

    @property
    def event_pool(self) -> EventPool[torch.cuda.Event] | None:
        """The timing events the loop reuses (CUDA; None elsewhere)."""
        return self._events

    @property
    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream the device loop computes on (CUDA; None elsewhere): psi blocks are
        allocated from its memory pool."""
        return self._stream

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._copy_watcher is not None:
            self._copy_watcher.start()
        thread = threading.Thread(target=self._run, name="relaygr-engine", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops after the step in hand; queued jobs fail with EngineStopped."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)
        if self._copy_watcher is not None:
            self._copy_watcher.stop(timeout_s)

    # ------------------------------------------------------------------ submission (event loop)

    def _job_args(self, tokens: int) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        return {
            "future": loop.create_future(),
            "loop": loop,
            "submitted": time.monotonic(),
            "tokens": tokens,
        }

    def _check_running(self) -> None:
        if self._stopping:
            raise EngineStopped("the engine is stopping")

    def _push_rank(self, job: _RankJob) -> asyncio.Future[Any]:
        with self._cv:
            self._check_running()
            self._enqueue_rank(job)
            self._cv.notify()
        return job.future

    def _enqueue_rank(self, job: _RankJob) -> None:
        """Under the lock, on the event loop: queues a ranking call. A call whose caller leaves
        (its future cancelled) leaves the queue at once rather than when a step is planned. A
        partial call is planned by the prefix built when it took over: a chunk that was under way
        then and lands later only makes it cheaper than planned."""
        self._ranks[job.id] = job
        self._rank_queue.add(job.item())
        job.future.add_done_callback(functools.partial(self._rank_left, job))

    def _rank_left(self, job: _RankJob, future: asyncio.Future[Any]) -> None:
        """On the event loop, once a call's future is done: a cancelled one still queued is
        dropped (the pre-inference it took over goes back to its chunks)."""
        if not future.cancelled():
            return
        with self._cv:
            if self._ranks.pop(job.id, None) is None:
                return  # already in a step, or dropped
            self._rank_queue.remove(job.id)
            if job.takes is not None:
                self._hand_back(job.takes)

    def _rank_job(
        self,
        kind: RankKind,
        suffix: RankingSuffix,
        tokens: int,
        deadline: float | None,
        due_by: float | None = None,
        **fields: Any,
    ) -> _RankJob:
        """`deadline`: the caller's own; the job is ordered by it or its latency target, whichever
        is sooner, and doomed past it or the SLO (`due_by` given: past that)."""
        args = self._job_args(tokens)
        if deadline is None:
            deadline = args["submitted"] + DEFAULT_DEADLINE_S
        if due_by is None:
            due_by = min(deadline, args["submitted"] + self.config.slo_s)
        deadline = min(deadline, args["submitted"] + self.config.latency_target_s)
        return _RankJob(
            **args, suffix=suffix, kind=kind, deadline=deadline, due_by=due_by, id=next(self._ids), **fields
        )

    async def rank_cached(
        self,
        suffix: RankingSuffix,
        psi: Psi,
        key: PsiKey,
        start_by: float = float("inf"),
        *,
        deadline: float | None = None,
        due_by: float | None = None,
    ) -> RankResult:
        """Scores of the suffix against complete psi. `deadline` (time.monotonic()) orders the
        call among others (earliest first); a call not started by `start_by`
        (time.perf_counter()) is dropped and fails with Overdue. `due_by` (time.monotonic()):
        when the call is doomed (scheduler.doomed; default: its deadline or the SLO)."""
        job = self._rank_job(
            RankKind.CACHED, suffix, suffix.length, deadline, due_by, psi=psi, key=key, start_by=start_by
        )
        return await self._push_rank(job)

    async def rank_full(
        self,
        prefix: UserPrefix,
        suffix: RankingSuffix,
        start_by: float = float("inf"),
        *,
        deadline: float | None = None,
        keep_psi: bool = False,
    ) -> RankResult:
        """Scores of the whole sequence; `start_by` and `deadline` as for rank_cached. With
        `keep_psi`, the result also carries the prefix's psi, written by the same pass (one
        fresh block; its K/V are those a pre-inference of the prefix computes)."""
        job = self._rank_job(
            RankKind.FULL, suffix, prefix.length + suffix.length, deadline, prefix=prefix, start_by=start_by,
            keep_psi=keep_psi,
        )  # fmt: skip
        return await self._push_rank(job)

    async def preinfer(
        self, prefix: UserPrefix, expires_at: float = math.inf, need_by: float = math.inf
    ) -> Psi:
        """psi of the prefix, built in chunks between ranking steps (or completed by the ranking
        call that takes it over: `relay`). Not started by `expires_at` (time.monotonic(): its
        lease's end), it fails with PreinferExpired and costs nothing. `need_by`
        (time.monotonic()): when its ranking call is due; pre-inferences are built earliest
        first (scheduler.plan)."""
        key = self.model.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
        job = _PreInferJob(
            **self._job_args(prefix.length),
            prefix=prefix,
            key=key,
            id=next(self._ids),
            expires_at=expires_at,
            need_by=need_by,
        )
        with self._cv:
            self._check_running()
            self._preinfers[job.id] = job
            self._producing[key] = job
            self._cv.notify()
        return await job.future

    def producing(self, key: PsiKey) -> bool:
        """Whether a pre-inference of this psi is queued or under way here."""
        with self._cv:
            job = self._producing.get(key)
            return job is not None and job.alive() and not job.future.done()

    async def relay(
        self,
        prefix: UserPrefix | None,
        suffix: RankingSuffix,
        key: PsiKey,
        deadline: float,
        start_by: float = float("inf"),
    ) -> RelayResult | None:
        """Ranks a call whose psi is being pre-inferred here, joining the pre-inference or taking
        it over (module docstring). None when no pre-inference of `key` is in hand (finished or
        never started here): the caller claims psi or ranks otherwise. Errors propagate (the
        caller falls back to a full ranking). `prefix` None: the call named its prefix by
        reference (same key, so same tokens): a take-over computes from the pre-inference's own."""
        with self._cv:
            self._check_running()
            job = self._producing.get(key)
            if job is None or not job.alive() or job.future.done():
                return None
            if prefix is None:
                prefix = job.prefix
            now = time.monotonic()
            call_deadline = deadline  # the caller's own: _rank_job applies the target and SLO
            due_by = min(deadline, now + self.config.slo_s)  # as _rank_job's
            deadline = min(deadline, now + self.config.latency_target_s)
            decision = self.scheduler.relay(job.item(), now, deadline)
            if decision is Relay.JOIN:
                # Also while taken: if the taker leaves before its step, the rest runs by this
                # call's deadline rather than as background work.
                job.joined_deadline = min(deadline, job.joined_deadline or deadline)
                job.joined_due_by = max(due_by, job.joined_due_by)
                self._cv.notify()
            else:
                job.taken = True
                tokens = prefix.length - job.done + suffix.length
                rank = self._rank_job(
                    RankKind.PARTIAL,
                    suffix,
                    tokens,
                    call_deadline,
                    prefix=prefix,
                    key=key,
                    takes=job,
                    start_by=start_by,
                )
                self._enqueue_rank(rank)
                self._cv.notify()
        if decision is Relay.JOIN:
            psi: Psi = await asyncio.shield(job.future)
            result = await self.rank_cached(suffix, psi, key, start_by, deadline=deadline, due_by=due_by)
            return RelayResult(result, True, prefix.length, prefix.length)
        result = await rank.future
        return RelayResult(result, False, result.reused_tokens, prefix.length)

    async def copy(
        self, issue: Callable[[], Any], work: str = "copy", on_timed: Callable[[float], None] | None = None
    ) -> Any:
        """Runs `issue` on the engine thread (on a copy stream on CUDA: reloads have their own)
        and resolves once the copies it enqueued have completed. `issue` returns the value to
        resolve with. `work` names the copy in the device-time ledger ("copy", "reload" or
        "demote"; ValueError otherwise). `on_timed` gets the copies' own device seconds, without
        the waits before them (on the engine's loop, behind other copies): a rate to learn from. It
        may run after this returns: the copy watcher tells the caller as soon as the copy is done,
        the loop settles the timing when it next polls."""
        if work not in WORKS or work in ("rank", "preinfer"):
            raise ValueError(f"a copy is 'copy', 'reload' or 'demote', not {work!r}")
        job = _CopyJob(**self._job_args(0), issue=issue, work=work, on_timed=on_timed)
        with self._cv:
            self._check_running()
            self._copies.append(job)
            self._cv.notify()
        return await job.future

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs fn on the device thread (on its compute stream on CUDA); resolves with its result."""
        job = _CallJob(**self._job_args(0), fn=fn)
        with self._cv:
            self._check_running()
            self._calls.append(job)
            self._cv.notify()
        return await job.future

    async def capture_graphs(self, tokens_per_user: list[int]) -> int:
        """Captures the ranking graphs of every batch size up to max_batch for users of these
        new-token counts (e.g. recent behaviors + candidates), and the full-ranking and
        pre-inference graphs of one sequence at every size of their ladder (warm_full_keys: a
        prefix length seen first mid-serving would otherwise stall the device thread for its
        capture); returns how many were captured."""
        graphs = self.graphs
        if graphs is None:
            return 0
        keys: list[BucketKey] = warm_full_keys(graphs.limits, graphs.chunks_reading_psi, graphs.full_keeps_kv)
        for n in tokens_per_user:
            for b in range(1, self.config.max_batch + 1):
                key = bucket_for(b, b * n, n, graphs.limits)
                if key is not None:
                    keys.append(key)

        def capture() -> int:
            graphs.request(keys)
            return graphs.capture_pending(limit=len(keys))

        result: int = await self.call(capture)
        return result

    def graph_stats(self) -> GraphStats | None:
        return self.graphs.stats if self.graphs is not None else None

    def forget_batches(self) -> None:
        """Drops the measurements so far (the warm-up's: compiles and first allocations are not
        what a latency model should learn from), the step-cost fit's too."""
        with self._cv:
            self._samples.clear()
            self._preinfer_samples.clear()
            self.step_costs = CostFit(self._step_prior)
            self.rank_costs = CostFit(self.config.step_prior)
            self.keep_device = KeepDeviceCost()
            self.scheduler.costs = self.step_costs
            self.scheduler.rank_costs = self.rank_costs
            if self._first_prior is not None:
                self.first_costs = CostFit(self._first_prior)
                self.scheduler.first_costs = self.first_costs

    async def calibrate_steps(self, prefix: UserPrefix, repeats: int = 3) -> CostPrior:
        """Measures pre-inference steps of this (warm) prefix on the device thread: a first
        256-token chunk, a last one (against all the rest built) and the whole prefix in one;
        their fixed, per-token and per-pair costs become the step-cost fit's prior. Why: chunk
        steps of one size cannot tell a fixed cost from a cost per token or per pair, so a fit
        that starts far from the device (the default prior's 10 us a token, a CPU's) and sees
        only small chunks keeps sizing them small (on an H100: 16 steps of ~4.5 ms for a
        4096-token psi that one 4.3 ms step builds)."""
        length = prefix.length
        if length <= CHUNK_TOKENS:
            raise ValueError(f"calibration needs a prefix over {CHUNK_TOKENS} tokens, got {length}")
        last = length - CHUNK_TOKENS
        steps = ((0, CHUNK_TOKENS), (last, length), (0, length))

        def measure() -> list[float]:
            psi = self.model.new_psi(prefix)

            def step(start: int, end: int) -> Callable[[], None]:
                return lambda: self.model.preinfer_chunks([PrefixChunk(prefix, psi, start, end)])  # eager

            whole = self._median_s(step(0, length), repeats)  # first: the last chunk reads it
            return [self._median_s(step(*s), repeats) for s in steps[:2]] + [whole]

        seconds = await self.call(measure)
        prior = self._fitted_prior([(end - start, end) for start, end in steps], seconds)
        if prior is None:
            return self._step_prior  # nothing measurable (a clock too coarse): keep it
        with self._cv:
            self._step_prior = prior
            self.step_costs = CostFit(prior)
            self.scheduler.costs = self.step_costs
        try:
            await self._calibrate_graph_steps(prefix, repeats)
        except Exception as exc:  # best effort: without it first chunks are costed as eager ones
            log.warning("preinfer_graph_steps_not_calibrated", error=repr(exc))
        return prior

    async def _calibrate_graph_steps(self, prefix: UserPrefix, repeats: int) -> None:
        """Where pre-inference steps from a prefix's first token replay graphs: measures such
        steps of 256 tokens, half the prefix and all of it, whose fit becomes the scheduler's
        cost of first chunks (IterationScheduler.chunk_seconds). Nothing when no graph holds
        them (CPU, RELAYGR_RANKER_GRAPH_MAX_FULL_TOKENS 0, or a prefix too long)."""
        graphs = self.graphs
        length = prefix.length
        if graphs is None or graphs.limits.max_full_tokens < length:
            return
        ends = (CHUNK_TOKENS, max(CHUNK_TOKENS, length // 2), length)

        def measure() -> list[float] | None:
            psi = self.model.new_psi(prefix)

            def step(end: int) -> Callable[[], bool]:
                return lambda: graphs.preinfer([PrefixChunk(prefix, psi, 0, end)])

            for end in ends:  # remembers each bucket without a graph; capture them
                step(end)()
            graphs.capture_pending(limit=len(ends))
            if not all(step(end)() for end in ends):
                return None  # a graph limit or a failed capture: no graph steps to fit
            return [self._median_s(step(end), repeats) for end in ends]

        seconds = await self.call(measure)
        if seconds is None:
            return
        prior = self._fitted_prior([(end, end) for end in ends], seconds)
        if prior is None:
            return
        with self._cv:
            self._first_prior = prior
            self.first_costs = CostFit(prior)
            self.scheduler.first_costs = self.first_costs
            self.scheduler.graph_tokens = graphs.limits.max_full_tokens
            self.scheduler.graph_batch = graphs.limits.max_full_batch
            self.scheduler.graph_reads_psi = graphs.chunks_reading_psi
        log.info("preinfer_graph_steps_calibrated", per_step_ms=round(prior.per_batch_s * 1e3, 3),
                 per_token_us=round(prior.per_token_s * 1e6, 4), per_pair_ns=round(prior.per_pair_s * 1e9, 5),
                 step_ms=[round(t * 1e3, 3) for t in seconds], graph_tokens=graphs.limits.max_full_tokens,
                 graph_batch=graphs.limits.max_full_batch, graph_reads_psi=graphs.chunks_reading_psi,
                 full_batch_tokens=graphs.limits.full_batch_tokens,
                 batch_copies=graphs.batch_copies)  # fmt: skip

    def _fitted_prior(self, steps: list[tuple[int, int]], seconds: list[float]) -> CostPrior | None:
        """A step-cost prior fitted to measured steps of (tokens, end) (pairs: tokens x end);
        None when nothing is measurable."""
        fit = CostFit(dataclasses.replace(self.config.step_prior, batches=0.0))
        for (tokens, end), t in zip(steps, seconds, strict=True):
            fit.observe(tokens, tokens * end, t)
        c = fit.coefficients
        if c.per_batch_s + c.per_token_s <= 0:
            return None
        return dataclasses.replace(
            self.config.step_prior,
            per_batch_s=c.per_batch_s,
            per_token_s=c.per_token_s,
            per_pair_s=c.per_pair_s,
            pairs_measured=True,
        )

    async def measure_copy_gbps(self, nbytes: int = 64 << 20, repeats: int = 3) -> float:
        """Host -> device copy bandwidth (GB/s), measured on the device thread: what a reload of
        psi from the host tier moves at (page-locked host memory on CUDA, like the tier's arena;
        a plain memory copy on the CPU). The reload-or-recompute model's starting point."""
        cuda = self._stream is not None

        def measure() -> float:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            device = torch.empty(nbytes, dtype=torch.uint8, device=self.accel.device)
            return nbytes / self._median_s(lambda: device.copy_(host, non_blocking=cuda), repeats) / 1e9

        result: float = await self.call(measure)
        return result

    def _median_s(self, work: Callable[[], Any], repeats: int) -> float:
        """On the device thread: the median wall time of `work` run to completion on the device."""
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            work()
            self._sync()
            times.append(time.perf_counter() - started)
        return sorted(times)[repeats // 2]

    def recent_batches(self) -> list[BatchSample]:
        with self._cv:
            return list(self._samples)

    def recent_preinfers(self) -> list[PreinferSample]:
        """Pre-inferences built whole by their chunks, most recent last (one a ranking call took
        over is not: part of its cost was the call's)."""
        with self._cv:
            return list(self._preinfer_samples)

    def stall_report(self, older_than_s: float) -> dict[str, Any] | None:
        """What the device loop holds and where its thread is, when a queued ranking call, a
        waited-for pre-inference or a copy has been waiting longer than `older_than_s` (None
        otherwise): the service logs it, so a stalled or spinning loop explains itself."""
        now = time.monotonic()
        with self._cv:
            waits = [now - j.submitted for j in self._ranks.values()]
            waits += [now - j.submitted for j in self._preinfers.values() if j.joined_deadline is not None]
            waits += [now - j.submitted for j in (*self._copies, *self._copies_in_flight, *self._calls)]
            if not waits or max(waits) < older_than_s:
                return None
            report: dict[str, Any] = {
                "oldest_wait_s": round(max(waits), 3),
                "ranks": [
                    {"id": j.id, "kind": j.kind.value, "age_s": round(now - j.submitted, 3),
                     "deadline_in_s": round(j.deadline - now, 3), "alive": j.alive(),
                     "takes": j.takes.id if j.takes is not None else None}
                    for j in self._ranks.values()
                ],
                "preinfers": [
                    {"id": j.id, "done": j.done, "length": j.prefix.length, "taken": j.taken,
                     "joined": j.joined_deadline is not None, "alive": j.alive(),
                     "resolved": j.future.done(), "age_s": round(now - j.submitted, 3)}
                    for j in self._preinfers.values()
                ],
                "copies_queued": len(self._copies),
                "copies_in_flight": len(self._copies_in_flight),
                "calls": len(self._calls),
                "graphs_pending": self.graphs.has_pending() if self.graphs is not None else False,
                "stopping": self._stopping,
            }  # fmt: skip
        frames = sys._current_frames()
        report["threads"] = [
            "".join(traceback.format_stack(frames[t.ident])[-8:]) if t.ident in frames else "gone"
            for t in self._threads
        ]
        return report

    def host_ms_per_copy(self) -> float | None:
        """The device loop's host time per host <-> device copy it issued: its `copies` section
        (polling and issuing, loop_time.py) over the copies issued, in ms; None before
        _MIN_COPIES_TIMED were. What one demotion costs the loop (the event loop's share, the
        expander's reserve and commit, is not in it)."""
        issued = self._copies_issued
        if issued < _MIN_COPIES_TIMED:
            return None
        wall, _cpu = self.loop_time.snapshot()["copies"]
        return wall / issued * 1e3

    def host_ms_per_keep(self) -> float | None:
        """The device loop's CPU time per psi a full ranking kept: allocating its block (with its
        timestamps' copy) and issuing the copy of its K/V, in ms; None before _MIN_KEPT_TIMED
        were. Read on the event loop while the device loop adds to it: a torn read is off by
        one psi at most."""
        kept = self._psis_kept
        if kept < _MIN_KEPT_TIMED:
            return None
        copies = self.graphs.stats.keep_copy_cpu_s if self.graphs is not None else 0.0
        return (self._keep_alloc_cpu_s + copies) / kept * 1e3

    def device_ms_per_keep(self, prefix_len: int) -> float | None:
        """Device time a full ranking spends keeping psi of `prefix_len` tokens, in ms, as the
        ranking batches measure it (keep_gate.KeepDeviceCost); None while they cannot tell."""
        return self.keep_device.ms_per_keep(prefix_len)

    @property
    def keep_needs_plain(self) -> bool:
        """Whether the keep cost's fit wants full rankings that keep nothing (keep_gate.py)."""
        return self.keep_device.needs_plain

    def reload_saving_s(self, prefix_len: int, suffix_len: int) -> float | None:
        """The device time a call against psi saves over a full ranking of the same call, from
        the ranking batches measured so far (rank_costs, the same pair and token counts its
        batches are observed with); None before enough were measured to tell."""
        fit = self.rank_costs
        if fit.measured < _MIN_SAVING_BATCHES:
            return None
        c = fit.coefficients
        tokens = prefix_len + suffix_len
        return max(0.0, c.seconds(tokens, prefix_len * tokens) - c.seconds(suffix_len, 0))

    @property
    def rank_queue_depth(self) -> int:
        return len(self._ranks)

    @property
    def preinfer_backlog(self) -> int:
        return len(self._preinfers)

    def preinfer_due_in_s(self, now: float, limit: int = MAX_PREINFER_DUES) -> list[float]:
        """When the queued and running pre-inferences are due (PreinferItem.due: a joined call's
        deadline, else the signal's), in seconds from `now` (time.monotonic()), earliest first,
        at most `limit`; those due at no known time are left out. What the trigger needs to count
        the backlog ahead of a new one: the scheduler builds them earliest due first."""
        with self._cv:
            dues = [j.item().due for j in self._preinfers.values() if not j.taken and not j.abandoned]
        return sorted(d - now for d in dues if math.isfinite(d))[:limit]

    # ------------------------------------------------------------------ the device thread

    def _has_work(self) -> bool:
        return bool(
            self._ranks
            or self._copies
            or self._copies_in_flight
            or self._calls
            or (self.graphs is not None and self.graphs.has_pending())
            or any(not j.taken for j in self._preinfers.values())
        )

    def _run(self) -> None:
        name_os_thread("relaygr-engine")
        try:
            self._loop()
        except BaseException as exc:
            log.error("engine_loop_failed", error=repr(exc))
            with self._cv:
                self._stopping = True
                self._fail_all()
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _loop(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.accel.device)
            torch.cuda.set_stream(self._stream)
        # A ranking batch launched whose scores are not collected yet (launch-ahead): the next
        # batch is staged and launched behind it on the stream before it is collected, so the
        # host's work between batches (collecting, answering, planning, packing, staging)
        # overlaps the device's instead of leaving the device idle.
        flight: _InFlight | _ChunksInFlight | None = None
        # Where the loop's own time goes (loop_time.py): a section is timed only when it has
        # something to do (two clock reads of each kind per section, on every pass of the loop).
        section = self.loop_time.section
        while True:
            with self._cv:
                while flight is None and not self._has_work() and not self._stopping:
                    with section("idle"):
                        self._cv.wait()
                stopping = self._stopping
            if stopping:
                if flight is not None:
                    self._complete(flight)  # the step in hand
                with self._cv:
                    self._fail_all()
                return
            # Copies: completions first (cheap queries). Reloads are issued at once (a ranking
            # call waits for each); demotions only while no ranking call waits, otherwise once
            # the next batch is launched (below): issuing a 128 MiB psi's copy costs the loop
            # ~0.6 ms of CPU and ~1.2 ms of wall time (H200, L4096, h2c), and issued ahead of a
            # launch behind a 1.3 ms batch it left the device idle with calls waiting.
            if self._copies or self._copies_in_flight:  # one added meanwhile: the next pass
                with section("copies"):
                    self._poll_copies()
                    self._issue_copies(demotions=0 if self._ranks else None)
            if flight is not None and self._ready(flight):
                # Done on the device: settle it before planning (its calls are answered now,
                # not after the next step's launch; what it settles may change the plan).
                self._complete(flight)
                flight = None
            with section("plan"), self._cv:
                plan = self._plan()
                batch = [self._ranks.pop(i) for i in plan.rank]
                for i in plan.rank:
                    self._rank_queue.remove(i)
            launched: _InFlight | _ChunksInFlight | None = None
            if batch:
                with section("launch"):
                    launched = self._launch_rank_batch(batch)
            elif plan.chunks and self.config.chunks_ahead and not self._calls:
                with section("launch"):
                    launched = self._launch_chunks(plan)
            if batch or launched is not None:
                if self._copies and launched is not None:
                    # The device has this step queued (and maybe the one in flight): issuing
                    # copies now overlaps it. While calls still wait, as many demotions as the
                    # batch had calls (each call may leave a psi to demote), at least a few, and
                    # all of them once a backlog builds (HBM frees only what DRAM holds).
                    calls_wait = self._ranks and len(self._copies) <= _DEMOTION_BACKLOG
                    with section("copies"):
                        self._issue_copies(
                            demotions=max(_DEMOTIONS_PER_LAUNCH, len(batch)) if calls_wait else None
                        )
                if flight is not None:
                    self._complete(flight)
                    flight = None
                if launched is not None:
                    # Held in flight only while its device work is queued (never on the CPU, where
                    # a launch computes: holding it would only delay its answer).
                    ahead = self.config.launch_ahead if batch else self.config.chunks_ahead
                    if ahead and not self._ready(launched):
                        flight = launched
                    else:
                        self._complete(launched)
                continue
            if flight is not None and plan.wait_s > 0 and not self._calls and not self._ready(flight):
                # A ranking batch is filling while the device still computes the one in flight:
                # it fills now and is launched behind that one (settling it first left the
                # device idle for the rest of the fill wait and the next launch). Short waits,
                # so that the flight is settled soon after it is done.
                with section("fill_wait"), self._cv:
                    self._cv.wait(min(plan.wait_s, _COPY_POLL_S))
                continue
            if flight is not None:
                # Anything else waits for the step in flight: calls on the device thread and
                # captures run between steps.
                self._complete(flight)
                flight = None
                continue
            if self._copies:
                with section("copies"):  # nothing launched this pass: every queued copy now
                    self._issue_copies()
            ran_call = False
            if self._calls:
                with section("other"):
                    ran_call = self._run_call()
            if ran_call:
                continue
            elif plan.chunks:
                with section("other"):
                    self._run_chunks(plan)
            elif plan.wait_s > 0:
                waited_from = time.perf_counter()
                with section("fill_wait"), self._cv:
                    self._cv.wait(plan.wait_s)  # a ranking batch is filling
                # Nothing is on the device meanwhile: part of the starved time, by design.
                self.device_time.fill_wait(time.perf_counter() - waited_from)
            elif self.graphs is not None and self.graphs.has_pending():
                # Only when nothing else is planned: a capture takes tens to hundreds of ms, and
                # one run ahead of a waited-for chunk or a filling batch delayed both.
                with section("other"):
                    self._capture_one()
            elif self._copies_in_flight:
                # Copies still running on the copy engine: look again shortly, or at once when
                # work is submitted (notify). A 50 us sleep here spun the loop (and took the GIL
                # from the event loop) ~20 times a millisecond through every 2-3 ms demotion.
                with section("idle"), self._cv:
                    self._cv.wait(_COPY_POLL_S)

    @staticmethod
    def _ready(flight: _InFlight | _ChunksInFlight) -> bool:
        """Whether a launched step's device work is done (settling it would not wait)."""
        if isinstance(flight, _InFlight):
            return flight.pending.ready() and (flight.events is None or bool(flight.events[1].query()))
        return flight.timer.done()

    def _complete(self, flight: _InFlight | _ChunksInFlight) -> None:
        if isinstance(flight, _InFlight):
            self._complete_rank_batch(flight)
        else:
            with self.loop_time.section("settle"):
                self._complete_chunks(flight)

    def _plan(self) -> Plan:
        """Under the lock: drops the ranking calls not started by their start_by (those whose
        callers left are gone already: _rank_left), the pre-inferences whose callers left or
        whose lease ran out unstarted; asks the scheduler."""
        mono = time.monotonic()
        for item in self._rank_queue.overdue(mono):  # calls that left are gone already (_rank_left)
            rank = self._ranks.pop(item.id)
            if rank.alive():
                rank.resolve(error=Overdue(mono - rank.submitted))
            if rank.takes is not None:
                self._hand_back(rank.takes)
        for job in [j for j in self._preinfers.values() if not j.alive()]:
            self._abandon(job)
        # Pre-inferences are built first come, first served between ranking steps: under load
        # some wait past their lease. Built then, their psi came after their call and delayed
        # every pre-inference behind them, which then came late too (H100, L4096, after an
        # overload: 53-75% of the psi produced never read, at rates the relay had served).
        expired = [j for j in self._preinfers.values()
                   if j.expires_at < mono and not j.done and not j.taken and j.joined_deadline is None]  # fmt: skip
        for job in expired:
            self._abandon(job)
            self.preinfers_expired += 1
            job.resolve(
                error=PreinferExpired(f"not started within its lease ({mono - job.expires_at:.3f} s late)")
            )
        return self.scheduler.plan(mono, self._rank_queue, [j.item() for j in self._preinfers.values()])

    def _hand_back(self, job: _PreInferJob) -> None:
        """Under the lock: the call that took this pre-inference over left before its step. Its
        chunks go on, nobody else computes the rest; or, when the chunk that was under way at the
        take-over built the last of psi, it is complete: finished and handed to its waiter here,
        as no chunk of it will run again (left queued, it was never resolved, its joiners waited
        for ever and the device loop spun on it)."""
        job.taken = False
        if job.done == job.prefix.length:
            self._finish(job)
            job.resolve(job.psi)

    def _abandon(self, job: _PreInferJob) -> None:
        """Under the lock: a pre-inference leaves the queue unfinished; its chunks were for nothing."""
        job.abandoned = True
        self._preinfers.pop(job.id, None)
        if self._producing.get(job.key) is job:
            del self._producing[job.key]
        if job.cost_s > 0:
            self.device_time.expired_unused(job.key)

    def _finish(self, job: _PreInferJob) -> None:
        """Under the lock: a pre-inference is complete (built, or completed by its taker)."""
        self._preinfers.pop(job.id, None)
        if self._producing.get(job.key) is job:
            del self._producing[job.key]

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        else:
            self.accel.synchronize()

    def _launch_rank_batch(self, batch: list[_RankJob]) -> _InFlight | None:
        """Issues a ranking batch's device work; its scores are collected by _complete_rank_batch
        (a replayed graph's are still on their way then: PendingScores; an eager batch's are
        complete). None: the batch failed, its jobs have their error."""
        kind = batch[0].kind
        self.device_time.begin()
        started, started_at = time.perf_counter(), time.monotonic()
        # On CUDA the batch's time is its events' (queued behind any batch still in flight, the
        # start runs when the device reaches it): a wall clock read when the batch is collected
        # cannot tell its time from the time of the batch ahead of it.
        start_event: torch.cuda.Event | None = None
        if self._events is not None:
            start_event = self._events.take()
            start_event.record()
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        built = [0] * len(batch)
        kept: list[Psi | None] = [None] * len(batch)
        refused = False  # the device had no room for the psi blocks to keep
        prefix_len = 0
        try:
            suffixes = [j.suffix for j in batch]
            pending: PendingScores | None = None
            if kind is RankKind.FULL:
                prefixes = [j.prefix for j in batch]
                keeps = any(j.keep_psi for j in batch)

                def new_psis(timestamps: bool = True) -> list[Psi | None]:
                    nonlocal refused
                    # Once: a graph that falls back to the eager pass has not called it. A
                    # graph copies the timestamps itself (RankGraphs.launch_full).
                    if not any(p is not None for p in kept) and not refused:
                        allocating_from = time.thread_time()
                        new = self.model.new_psi
                        try:
                            kept[:] = [new(j.prefix, timestamps) if j.keep_psi else None for j in batch]  # type: ignore[arg-type]
                        except torch.OutOfMemoryError:
                            # Keeping is optional: the batch ranks without it (its scores are
                            # the same), and the callers hear why (RankResult.psi_out_of_memory).
                            kept[:] = [None] * len(batch)
                            refused = True
                        self._keep_alloc_cpu_s += time.thread_time() - allocating_from
                        self._psis_kept += sum(1 for p in kept if p is not None)
                    return kept

                if self.graphs is not None:
                    # psi blocks are allocated once the replay is issued (RankGraphs.full).
                    pending = self.graphs.launch_full(prefixes, suffixes, new_psis if keeps else None)  # type: ignore[arg-type]
                if pending is None:
                    scores = self.model.full(prefixes, suffixes, new_psis() if keeps else None)  # type: ignore[arg-type]
                prefix_len = max(p.length for p in prefixes)  # type: ignore[union-attr]
            elif kind is RankKind.PARTIAL:
                pending = self._launch_takeover_full(batch)
                if pending is None:
                    scores = self._rank_partial(batch, built)
                prefix_len = max(j.prefix.length for j in batch)  # type: ignore[union-attr]
            else:
                psis, keys = [j.psi for j in batch], [j.key for j in batch]
                built = [p.prefix_len for p in psis]  # type: ignore[union-attr]
                if self.graphs is not None:
                    pending = self.graphs.launch_rank(suffixes, psis, keys)  # type: ignore[arg-type]
                if pending is None:
                    scores = self.model.rank_cached(suffixes, psis, keys)  # type: ignore[arg-type]
            issued = time.perf_counter()
            if pending is None:
                # One copy for the batch; it waits for the device: the batch is done.
                pending = PendingScores.done(list(torch.cat(scores).cpu().split([s.numel() for s in scores])))
            if start_event is not None and self._events is not None:
                # After the scores' copy (a replay's is queued behind it): the batch's end.
                end_event = self._events.take()
                end_event.record()
                events = (start_event, end_event)
        except Exception as exc:  # a bad batch fails its jobs, never the engine
            self.device_time.end()
            self.device_time.add("rank", time.perf_counter() - started)
            for j in batch:
                j.resolve(error=exc)
            if kind is RankKind.PARTIAL:
                self._takeovers_failed(batch, exc)
            return None
        return _InFlight(
            batch, pending, started, started_at, issued, built, kept, prefix_len, events, refused
        )

    def _complete_rank_batch(self, flight: _InFlight) -> None:
        """Waits for a launched batch's scores and answers its calls. Its time is its own share
        of the device: on CUDA the time between events recorded before its first and after its
        last device work (behind a batch still in flight the first runs when that one is done,
        so the wait behind it is not counted; on an idle device it runs at once, so the host's
        launch is); elsewhere its launch's wall time (the CPU computes it in the launch). That
        is what the cost fits learn and the calls' compute_ms report; the rest of their time
        on the device loop is in queue_ms."""
        batch = flight.batch
        try:
            with self.loop_time.section("settle_wait"):
                host = flight.pending.wait()
                seconds = flight.issued - flight.started
                if flight.events is not None:
                    wait_until_done(flight.events[1])
                    seconds = flight.events[0].elapsed_time(flight.events[1]) / 1e3
        except Exception as exc:
            for j in batch:
                j.resolve(error=exc)
            return
        finally:
            # The scores are on the host (or the batch failed): its device work is over.
            done = time.perf_counter()
            self.device_time.end()
        with self.loop_time.section("settle"):
            self._settle_rank_batch(flight, host, seconds, done)

    def _settle_rank_batch(
        self, flight: _InFlight, host: list[torch.Tensor], seconds: float, done: float
    ) -> None:
        """Books a completed batch's time and answers its calls (_complete_rank_batch)."""
        batch, kind = flight.batch, flight.batch[0].kind
        self.device_time.add("rank", seconds)
        compute_ms = seconds * 1e3
        # Host time up to the launch's last call (before any wait for the scores): on a slow
        # batch, close to compute_ms means the host stalled while issuing; far below it, the
        # device was the slower side.
        launch_ms = (flight.issued - flight.started) * 1e3
        built = flight.built
        # Tokens computed: a partial call computes its prefix from what was built on.
        tokens = sum(j.tokens if j.prefix is None else j.prefix.length - c + j.suffix.length
                     for j, c in zip(batch, built, strict=True))  # fmt: skip
        # Pairs as the scheduler's RankItems count them: prefix x computed tokens, 0 against psi.
        pairs = sum(j.prefix.length * (j.prefix.length - c + j.suffix.length)
                    for j, c in zip(batch, built, strict=True) if j.prefix is not None)  # fmt: skip
        if kind is RankKind.PARTIAL and any(built) and self.rank_costs.measured >= _MIN_SAVING_BATCHES:
            # An eager partial pass (a graph's take-over builds on nothing): against what full
            # rankings of the same calls are predicted to take (takeover.py).
            full_tokens = sum(j.prefix.length + j.suffix.length for j in batch if j.prefix is not None)
            full_pairs = sum(j.prefix.length * (j.prefix.length + j.suffix.length) for j in batch if j.prefix is not None)  # fmt: skip
            self.takeover.observe(seconds, self.rank_costs.coefficients.seconds(full_tokens, full_pairs))
        if kind is RankKind.FULL and self.rank_costs.measured >= _MIN_SAVING_BATCHES:
            # Before the fit learns from it: the batch against what it predicts (keep_gate.py).
            kept_tokens = sum(j.prefix.length for j, p in zip(batch, flight.kept, strict=True)
                              if p is not None and j.prefix is not None)  # fmt: skip
            self.keep_device.observe(
                self.rank_costs.coefficients.seconds(tokens, pairs), seconds, kept_tokens
            )
        self.rank_costs.observe(tokens, pairs, seconds)
        for j in batch:
            if j.key is not None:
                self.device_time.consumed(j.key)
        with self._cv:
            self._batches_run += 1
            batch_seq = self._batches_run
            self._samples.append(
                BatchSample(
                    kind is not RankKind.CACHED, len(batch), tokens, flight.prefix_len, compute_ms,
                    self._batches_run,
                )
            )  # fmt: skip
            for j in batch:
                if j.takes is not None:
                    self._finish(j.takes)
        # Its own time ended when its scores were collected (or shortly before).
        began = flight.started_at + max(0.0, done - flight.started - seconds)
        bad = [] if flight.pending.all_finite else nonfinite_calls(host)
        if bad:
            self._fail_nonfinite(flight, bad)
        for i, (j, s, c, psi) in enumerate(zip(batch, host, built, flight.kept, strict=True)):
            if i in bad:
                continue
            if j.takes is not None:
                j.takes.resolve(j.takes.psi)  # complete: the pre-inference's waiter gets it
            queue_ms = max(0.0, (began - j.submitted) * 1e3)
            j.resolve(RankResult(s, queue_ms, compute_ms, len(batch), c, tokens, launch_ms, psi, batch_seq,
                                 psi_out_of_memory=flight.kept_out_of_memory and j.keep_psi))  # fmt: skip
        self._account_gap(flight, done)  # bookkeeping, after the calls have their answers

    def _fail_nonfinite(self, flight: _InFlight, bad: list[int]) -> None:
        """Fails the calls of a batch whose scores are not finite, and the pre-inferences they
        took over (their psi came from the same pass), with what ran; logged and counted."""
        batch = flight.batch
        graph = flight.pending.event is not None
        self.nonfinite_scores += len(bad)
        log.error("nonfinite_scores", kind=batch[0].kind.value, batch=len(batch), calls=len(bad),
                  graph=graph, tokens=[batch[i].tokens for i in bad])  # fmt: skip
        for i in bad:
            j = batch[i]
            error = NonFiniteScores(
                f"scores not finite ({batch[0].kind.value} batch of {len(batch)}, "
                f"{'graph replay' if graph else 'eager'}): not answered"
            )
            if j.takes is not None:
                j.takes.resolve(error=error)
            j.resolve(error=error)

    def _account_gap(self, flight: _InFlight, done: float) -> None:
        """The device's idle time between the last ranking batch and this one, and how much of
        it a call of this batch spent waiting (services/ranker/device_time.py: gap, starved)."""
        last = self._last_batch_end
        gap_s: float | None = None
        if flight.events is not None:
            if isinstance(last, torch.cuda.Event):
                try:
                    gap_s = last.elapsed_time(flight.events[0]) / 1e3
                except RuntimeError as exc:  # a bookkeeping failure must not fail the loop
                    log.warning("device_gap_not_measured", error=repr(exc))
            self._last_batch_end = flight.events[1]
            # Read for the last time: the start now, the end before (it was the last batch's).
            if self._events is not None:
                self._events.give(flight.events[0])
                if isinstance(last, torch.cuda.Event):
                    self._events.give(last)
        else:
            if isinstance(last, float):
                gap_s = flight.started - last
            self._last_batch_end = done
        if gap_s is not None:
            oldest = min(j.submitted for j in flight.batch)
            self.device_time.idle_between(gap_s, starved_seconds(gap_s, flight.started_at, oldest))

    def _launch_takeover_full(self, batch: list[_RankJob]) -> PendingScores | None:
        """A partial batch whose pre-inferences had built nothing is a full ranking that leaves
        its psi in the pre-inferences' own blocks: the full family's CUDA graph, where one holds
        it, instead of the eager pass (at L8192 on an H200 such take-overs took 8.3 ms of host
        launch at p50 for 9.5 ms on the device, the device idle meanwhile: h6c). One whose
        pre-inferences had built chunks too, while partial passes measure dearer than full
        rankings (takeover.py): the graph rewrites the chunks with the same K/V. None: run it
        eagerly (the partial pass chosen, full rankings keep no psi here, or no graph fits)."""
        graphs = self.graphs
        takes = [j.takes for j in batch]
        if graphs is None or not graphs.full_keeps_kv or any(t is None for t in takes):
            return None
        jobs = [t for t in takes if t is not None]
        # Something built: the graph recomputes it, so only while partial passes measure dearer.
        started = any(job.done for job in jobs)
        if started and not self.takeover.wants_full():
            self.takeover.ran(full=False)
            return None

        def psis(timestamps: bool = True) -> list[Psi | None]:
            for job in jobs:  # once the replay is issued, as a full ranking's kept psi
                if job.psi is None:
                    job.psi = self.model.new_psi(job.prefix, timestamps)
            return [job.psi for job in jobs]

        pending = graphs.launch_full([job.prefix for job in jobs], [j.suffix for j in batch], psis)
        if started:
            self.takeover.ran(full=pending is not None)  # no graph for the shape: partial after all
            if pending is not None:
                for job in jobs:  # the chunks built are computed again: their time went for nothing
                    self.device_time.expired_unused(job.key, count=False)
        if pending is not None:
            for job in jobs:
                job.done = job.prefix.length
        return pending

    def _rank_partial(self, batch: list[_RankJob], built: list[int]) -> list[torch.Tensor]:
        """Partial batch: each call reads what its pre-inference built and completes psi."""
        psis: list[Psi] = []
        for b, j in enumerate(batch):
            job = j.takes
            assert job is not None
            assert j.prefix is not None
            if job.psi is None:
                job.psi = self.model.new_psi(job.prefix)
            built[b] = job.done
            psis.append(job.psi)
        prefixes = [j.prefix for j in batch]
        suffixes = [j.suffix for j in batch]
        scores = self.model.rank_partial(prefixes, suffixes, psis, built)  # type: ignore[arg-type]
        for j in batch:
            assert j.takes is not None
            j.takes.done = j.takes.prefix.length
        return scores

    def _takeovers_failed(self, batch: list[_RankJob], exc: Exception) -> None:
        """A failed partial batch leaves its psi half-written: their pre-inferences fail too."""
        with self._cv:
            for j in batch:
                if j.takes is not None:
                    self._abandon(j.takes)
                    j.takes.resolve(error=exc)

    def _run_chunks(self, plan: Plan) -> None:
        flight = self._launch_chunks(plan)
        if flight is not None:
            self._complete_chunks(flight)

    def _launch_chunks(self, plan: Plan) -> _ChunksInFlight | None:
        """Issues a pre-inference step; _complete_chunks waits for it and settles its jobs. Their
        progress (`done`) moves at the launch: the next plan must not schedule the same chunks
        again, and whatever reads their psi next (a later chunk, a take-over's partial batch)
        runs behind them on the same stream. None: nothing to run, or the step failed (its jobs
        have their error)."""
        last, self._last_batch_end = self._last_batch_end, None  # the gap would include this step
        if self._events is not None and isinstance(last, torch.cuda.Event):
            self._events.give(last)
        with self._cv:
            jobs = [self._preinfers.get(c.id) for c in plan.chunks]
        work = [(c, j) for c, j in zip(plan.chunks, jobs, strict=True) if j is not None and j.done == c.start]
        if not work:
            return None
        timer = SectionTimer(cuda=self._stream is not None)
        launched_at = time.monotonic()
        for c, job in work:
            if c.start == 0:  # its first step: how long it queued, and whether a call waits already
                job.started_at = launched_at
                self.device_time.preinfer_started(
                    launched_at - job.submitted, job.joined_deadline is not None
                )
        self.device_time.begin()
        try:
            for _, job in work:
                if job.psi is None:
                    job.psi = self.model.new_psi(job.prefix)
            chunks = [PrefixChunk(j.prefix, j.psi, c.start, c.end) for c, j in work]  # type: ignore[arg-type]
            with timer.section():
                graphed = self._preinfer_chunks(chunks)
        except Exception as exc:
            self.device_time.end()
            with self._cv:
                for _, job in work:
                    self._abandon(job)
                    job.resolve(error=exc)
            return None
        with self._cv:
            for c, job in work:
                job.done = c.end
        return _ChunksInFlight(work, timer, graphed, launched_at)

    def _complete_chunks(self, flight: _ChunksInFlight) -> None:
        work = flight.work
        try:
            flight.timer.synchronize()  # not the stream: a batch launched behind may run
            seconds = flight.timer.total_s()
        except Exception as exc:
            with self._cv:
                for _, job in work:
                    self._abandon(job)
                    job.resolve(error=exc)
            return
        finally:
            self.device_time.end()
        tokens, pairs = chunk_work(c for c, _ in work)
        ended = time.monotonic()
        with self._cv:  # the calls that came while the step held the device loop, and how long
            held = [
                ended - max(j.submitted, flight.began) for j in self._ranks.values() if j.submitted < ended
            ]
        self.device_time.add("preinfer", seconds)
        self.device_time.preinfer_step(flight.graphed, len(work), seconds, len(held), sum(held))
        # Graph steps and eager steps cost differently (IterationScheduler.chunk_seconds): each fit
        # learns from its own kind.
        fit = self.first_costs if flight.graphed and self.first_costs is not None else self.step_costs
        fit.observe(tokens, pairs, seconds)
        with self._cv:
            for c, job in work:
                share = seconds * (c.end - c.start) / tokens
                counted = job.cost_s > 0  # by _abandon, if it was abandoned
                job.cost_s += share
                if job.abandoned:
                    # Abandoned while this step was on the device (its caller left, or the step
                    # ahead failed): built for nothing, counted as unused with what came before.
                    self.device_time.produced(job.key, share)
                    self.device_time.expired_unused(job.key, count=not counted)
                    continue
                self.device_time.produced(job.key, job.cost_s)
                if self._preinfers.get(job.id) is not job:
                    continue  # finished meanwhile (a take-over's caller left: _hand_back)
                # The chunk that ends the prefix (`done` moves at each launch: with a later
                # chunk launched, an earlier one's settling must not finish the pre-inference).
                if c.end == job.prefix.length and job.done == job.prefix.length and not job.taken:
                    done_at = time.monotonic()
                    call_at = job.need_by - self.config.slo_s  # its call's planned time (nan/-inf: unknown)
                    self.device_time.preinfer_done(
                        done_at - (job.started_at if job.started_at is not None else job.submitted),
                        done_at - job.submitted,
                        math.isfinite(call_at) and done_at > call_at,
                    )
                    self._finish(job)
                    self._preinfers_built += 1
                    self._preinfer_samples.append(
                        PreinferSample(job.prefix.length, job.cost_s * 1e3, self._preinfers_built)
                    )
                    job.resolve(job.psi)

    def _preinfer_chunks(self, chunks: list[PrefixChunk]) -> bool:
        """On the device thread: one pre-inference step, by a graph replay where one is captured
        for its shape (chunks from a prefix's first token), else eagerly. True: by a graph."""
        if self.graphs is not None and self.graphs.preinfer(chunks):
            return True
        self.model.preinfer_chunks(chunks)
        return False

    def _issue_copies(self, demotions: int | None = None) -> bool:
        """Issues the queued copies: every reload (a ranking call waits for each) and, of the
        other copies (demotions), the first `demotions` (None: all), in order. Returns whether
        any was issued."""
        jobs: list[_CopyJob] = []
        with self._cv:
            if demotions is None:
                jobs.extend(self._copies)
                self._copies.clear()
            else:
                kept: collections.deque[_CopyJob] = collections.deque()
                for job in self._copies:
                    if job.work == "reload" or demotions > 0:
                        jobs.append(job)
                        demotions -= job.work != "reload"
                    else:
                        kept.append(job)
                self._copies = kept
        for job in jobs:
            if job.alive():
                self._issue_copy(job)
        return bool(jobs)

    def _issue_copy(self, job: _CopyJob) -> None:
        self._copies_issued += 1
        try:
            job.timer = SectionTimer(cuda=self._copy_stream is not None, pool=self._events)
            stream = self._reload_stream if job.work == "reload" else self._copy_stream
            job.issued_at = time.monotonic()
            if stream is not None and self._order_event is not None and self._events is not None:
                if job.work == "reload":  # how long its stream waits for compute (copy_stages.py)
                    job.waited_from = self._events.take()
                    job.waited_from.record(stream)
                # Copies read psi that compute just produced: order after it, on the copy stream
                # (the wait is for the record made before it: the event may be recorded again).
                self._order_event.record(torch.cuda.current_stream(self.accel.device))
                stream.wait_event(self._order_event)
                with torch.cuda.stream(stream), job.timer.section():
                    job.value = job.issue()
                job.event = job.timer.last_event  # after the copy: its completion
                self._copies_in_flight.append(job)
                if job.work == "reload" and self._copy_watcher is not None:  # a ranking call waits
                    self._copy_watcher.watch(job.event, functools.partial(self._tell_copied, job))
            else:
                with job.timer.section():
                    value = job.issue()
                self._copied(job)
                job.resolve(value)
        except Exception as exc:
            job.resolve(error=exc)

    @staticmethod
    def _tell_copied(job: _CopyJob) -> None:
        """From the copy watcher: the copy is done; its caller is told now, the loop settles its
        bookkeeping when it next polls (resolving again then is a no-op)."""
        job.told_at = time.monotonic()
        job.resolve(job.value)

    def _poll_copies(self) -> None:
        still = []
        for job in self._copies_in_flight:
            if job.event.query():
                self._copied(job)  # complete: reading its timer's events does not block
                job.resolve(job.value)
            else:
                still.append(job)
        self._copies_in_flight = still

    def _copied(self, job: _CopyJob) -> None:
        if job.timer is None:
            return
        seconds = job.timer.total_s()
        waited_s = 0.0
        started = job.timer.first_event
        if job.waited_from is not None and started is not None:
            waited_s = job.waited_from.elapsed_time(started) / 1e3
            if self._events is not None:
                self._events.give(job.waited_from)
            job.waited_from = None
        job.timer.release()  # its events are read: back to the pool
        # Until its caller was told: by the copy watcher where it watched the copy.
        done_s = (job.told_at or time.monotonic()) - job.issued_at
        self.copy_stages.add(
            job.work, job.issued_at - job.submitted, waited_s, seconds, done_s - waited_s - seconds
        )
        self.device_time.add(job.work, seconds)
        if job.on_timed is not None:
            try:
                job.on_timed(seconds)
            except Exception as exc:  # a caller's bookkeeping never fails the copy
                log.warning("copy_timing_callback_failed", error=repr(exc))

    def _run_call(self) -> bool:
        with self._cv:
            job = self._calls.popleft() if self._calls else None
        if job is None:
            return False
        if job.alive():
            try:
                job.resolve(job.fn())
            except Exception as exc:
                job.resolve(error=exc)
        return True

    def _capture_one(self) -> None:
        assert self.graphs is not None
        try:
            self.graphs.capture_pending(limit=1)
        except Exception as exc:  # a failed capture leaves that shape on the eager path
            log.error("rank_graph_capture_failed", error=repr(exc))

    def _fail_all(self) -> None:
        pending: list[_Job] = [*self._ranks.values(), *self._copies, *self._copies_in_flight, *self._calls]
        for preinfer in list(self._preinfers.values()):
            self._abandon(preinfer)
            pending.append(preinfer)
        for job in pending:
            job.resolve(error=EngineStopped("the engine stopped before this job ran"))
        self._ranks.clear()
        self._rank_queue.clear()
        self._preinfers.clear()
        self._producing.clear()
        self._copies.clear()
        self._copies_in_flight.clear()
        self._calls.clear()
