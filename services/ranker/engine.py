"""The engine: its threads drive the accelerator; asyncio only submits work and awaits results.

The device thread runs, in priority order each time it looks for something to do:
  1. ranking batches: jobs of one kind (against psi, or in full) from different users, batched
     dynamically: up to `max_batch` jobs / `max_batch_tokens` tokens, waiting at most `max_wait_s`
     after the oldest job arrived for the batch to fill;
  2. host <-> device copies of psi (demotions and reloads): issued on a copy stream on CUDA, so the
     copy engine runs them beside the compute; completions are polled, never waited on;
  3. calls that must run on the device thread (e.g. capturing CUDA graphs at warm-up), and the
     capture of ranking graphs for batch shapes seen without one (services/ranker/graphs.py);
  4. with `preinfer_concurrent` off only: pre-inference, one layer at a time
     (`HSTURanker.preinfer_steps`), so a long prefix never holds a ranking batch back by more than
     one layer's compute.
With `preinfer_concurrent` on (the ranker's default, RankerConfig.preinfer_concurrent;
EngineConfig's own default is off), a second thread runs whole pre-inferences back to back instead, on CUDA on a
low-priority stream beside the ranking stream (the GPU schedules ranking kernels first; the two
threads share the GIL). Pre-inferences are batched up to `preinfer_max_batch` prefixes /
`preinfer_max_tokens` tokens either way. One lock guards the queues, with one condition per
thread, so a ranking call wakes only the device thread.
On CUDA, batches against psi replay a captured CUDA graph when one fits (GraphLimits), else run
eagerly; both give the same scores.
A job whose caller has gone (its future cancelled) is dropped before it runs.

Device time (services/ranker/device_time.py): every ranking batch, pre-inference and copy adds
its device time to `device_time` by kind (a copy under the kind its caller names: "copy",
"reload" or "demote"); the pre-inference cost of each psi is kept by key until a ranking batch
consumes it or the cache reports it expired unused (`device_time.expired_unused`).

Blocking: `rank_cached`, `rank_full`, `preinfer`, `copy` and `call` never block the event loop (a
lock held for microseconds); results arrive on the loop via call_soon_threadsafe. Errors in one
job fail that job's future only.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.device import Accelerator
from services.ranker.device_time import WORKS, DeviceTime, SectionTimer
from services.ranker.graphs import BucketKey, GraphLimits, GraphStats, RankGraphs, bucket_for
from services.ranker.model import HSTURanker
from services.ranker.psi import Psi, PsiKey
from services.ranker.sequences import RankingSuffix, UserPrefix
from shared.logging import get_logger

log = get_logger("ranker.engine")


class EngineStopped(RuntimeError):
    """The engine shut down before the job ran."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8
    max_batch_tokens: int = 65_536
    max_wait_s: float = 0.001
    preinfer_max_batch: int = 4
    preinfer_max_tokens: int = 65_536
    # Pre-inference in its own thread (on CUDA: on a low-priority stream beside the ranking
    # stream) instead of between ranking batches one layer at a time.
    preinfer_concurrent: bool = False
    # Replay captured CUDA graphs for batches against psi (CUDA only).
    cuda_graphs: bool = True
    graph_limits: GraphLimits = field(default_factory=GraphLimits)


@dataclass(frozen=True)
class RankResult:
    scores: torch.Tensor  # float32 on the host
    queue_ms: float  # submit -> batch start
    compute_ms: float  # the batch's compute (scores on the host)
    batch_size: int


@dataclass(frozen=True)
class BatchSample:
    """One measured ranking batch (feeds Stats and the trigger's latency model)."""

    full: bool
    batch: int
    tokens: int
    prefix_len: int  # longest prefix computed in full in this batch (0 against psi)
    compute_ms: float
    seq: int  # increasing per engine


@dataclass
class _Job:
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    submitted: float
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
class _RankJob(_Job):
    suffix: RankingSuffix = field(kw_only=True)
    prefix: UserPrefix | None = field(kw_only=True, default=None)  # full recompute
    psi: Psi | None = field(kw_only=True, default=None)  # against psi
    key: PsiKey | None = field(kw_only=True, default=None)

    @property
    def full(self) -> bool:
        return self.psi is None


@dataclass
class _CallJob(_Job):
    fn: Callable[[], Any] = field(kw_only=True)


@dataclass
class _PreInferJob(_Job):
    prefix: UserPrefix = field(kw_only=True)


@dataclass
class _CopyJob(_Job):
    issue: Callable[[], Any] = field(kw_only=True)  # issues the copy, returns the result value
    work: str = field(kw_only=True, default="copy")  # its kind in the device-time ledger
    event: Any = None
    value: Any = None
    timer: SectionTimer | None = None


class Engine:
    def __init__(self, model: HSTURanker, accel: Accelerator, config: EngineConfig) -> None:
        self.model = model
        self.accel = accel
        self.config = config
        # One lock, two conditions: a ranking call wakes only the ranking thread. With one shared
        # condition every ranking call also woke the pre-inference thread, which then competed
        # for the GIL with the thread about to run the call.
        lock = threading.RLock()
        self._cv = threading.Condition(lock)  # the ranking (device) thread waits on this one
        self._preinfer_cv = threading.Condition(lock)  # the pre-inference thread on this one
        self._ranks: collections.deque[_RankJob] = collections.deque()
        self._preinfers: collections.deque[_PreInferJob] = collections.deque()
        self._copies: collections.deque[_CopyJob] = collections.deque()
        self._copies_in_flight: list[_CopyJob] = []
        self._calls: collections.deque[_CallJob] = collections.deque()
        self._active: tuple[list[_PreInferJob], Generator[int, None, list[Psi]], SectionTimer] | None = None
        self._stopping = False
        self._threads: list[threading.Thread] = []
        cuda = accel.backend == "cuda"
        self._copy_stream = torch.cuda.Stream(accel.device) if cuda else None
        # Lower number, higher priority: ranking kernels are scheduled before pre-inference ones.
        self._rank_stream = torch.cuda.Stream(accel.device, priority=-1) if cuda else None
        self._preinfer_stream = torch.cuda.Stream(accel.device, priority=0) if cuda else None
        self._samples: collections.deque[BatchSample] = collections.deque(maxlen=256)
        self._batches_run = 0
        self.device_time = DeviceTime()
        self.graphs: RankGraphs | None = None
        if cuda and config.cuda_graphs:
            limits = GraphLimits(**{**config.graph_limits.__dict__, "max_batch": config.max_batch})
            self.graphs = RankGraphs(model, limits)
            torch.cuda.synchronize(accel.device)  # its buffers, zeroed on this thread's stream

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        targets = [("relaygr-engine", self._run)]
        if self.config.preinfer_concurrent:
            targets.append(("relaygr-preinfer", self._run_preinfers))
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops after the work in hand; queued jobs fail with CancelledError."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            self._preinfer_cv.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)

    # ------------------------------------------------------------------ submission (event loop)

    def _job_args(self, tokens: int) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        return {
            "future": loop.create_future(),
            "loop": loop,
            "submitted": time.perf_counter(),
            "tokens": tokens,
        }

    def _push(self, queue: collections.deque[Any], job: _Job) -> asyncio.Future[Any]:
        with self._cv:
            if self._stopping:
                raise EngineStopped("the engine is stopping")
            queue.append(job)
            if queue is not self._preinfers:
                self._cv.notify()
            elif self.config.preinfer_concurrent:
                self._preinfer_cv.notify()
            else:
                self._cv.notify()  # pre-inference steps run inline, between ranking batches
        return job.future

    async def rank_cached(self, suffix: RankingSuffix, psi: Psi, key: PsiKey) -> RankResult:
        job = _RankJob(**self._job_args(suffix.length), suffix=suffix, psi=psi, key=key)
        return await self._push(self._ranks, job)

    async def rank_full(self, prefix: UserPrefix, suffix: RankingSuffix) -> RankResult:
        job = _RankJob(**self._job_args(prefix.length + suffix.length), suffix=suffix, prefix=prefix)
        return await self._push(self._ranks, job)

    async def preinfer(self, prefix: UserPrefix) -> Psi:
        return await self._push(self._preinfers, _PreInferJob(**self._job_args(prefix.length), prefix=prefix))

    async def copy(self, issue: Callable[[], Any], work: str = "copy") -> Any:
        """Runs `issue` on the engine thread (on the copy stream on CUDA) and resolves once the
        copies it enqueued have completed. `issue` returns the value to resolve with. `work` names
        the copy in the device-time ledger ("copy", "reload" or "demote"; ValueError otherwise)."""
        if work not in WORKS or work in ("rank", "preinfer"):
            raise ValueError(f"a copy is 'copy', 'reload' or 'demote', not {work!r}")
        return await self._push(self._copies, _CopyJob(**self._job_args(0), issue=issue, work=work))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs fn on the device thread (on the ranking stream on CUDA); resolves with its result."""
        return await self._push(self._calls, _CallJob(**self._job_args(0), fn=fn))

    async def capture_graphs(self, tokens_per_user: list[int]) -> int:
        """Captures the ranking graphs of every batch size up to max_batch for users of these
        new-token counts (e.g. recent behaviors + candidates); returns how many were captured."""
        graphs = self.graphs
        if graphs is None:
            return 0
        keys: list[BucketKey] = []
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
        what a latency model should learn from)."""
        with self._cv:
            self._samples.clear()

    def recent_batches(self) -> list[BatchSample]:
        with self._cv:
            return list(self._samples)

    @property
    def rank_queue_depth(self) -> int:
        return len(self._ranks)

    @property
    def preinfer_backlog(self) -> int:
        active = len(self._active[0]) if self._active else 0
        return len(self._preinfers) + active

    # ------------------------------------------------------------------ the device thread

    def _run(self) -> None:
        if self._rank_stream is not None:
            torch.cuda.set_device(self.accel.device)
            torch.cuda.set_stream(self._rank_stream)
        inline_preinfers = not self.config.preinfer_concurrent
        while True:
            with self._cv:
                while not (
                    self._ranks
                    or self._copies
                    or self._copies_in_flight
                    or self._calls
                    or (self.graphs is not None and self.graphs.has_pending())
                    or (inline_preinfers and (self._preinfers or self._active))
                ):
                    if self._stopping:
                        self._fail_all()
                        return
                    self._cv.wait()
                if self._stopping:
                    self._fail_all()
                    return
            self._poll_copies()
            batch = self._take_rank_batch()
            if batch:
                self._run_rank_batch(batch)
                continue
            if self._issue_copy():
                continue
            if self._run_call():
                continue
            if self.graphs is not None and self.graphs.has_pending():
                self._capture_one()
                continue
            if inline_preinfers and self._step_preinfer():
                continue
            if self._copies_in_flight:
                time.sleep(50e-6)  # copies still running on the copy engine

    def _run_preinfers(self) -> None:
        """The pre-inference thread (preinfer_concurrent): whole pre-inferences, back to back."""
        if self._preinfer_stream is not None:
            torch.cuda.set_device(self.accel.device)
            torch.cuda.set_stream(self._preinfer_stream)
        while True:
            with self._cv:
                while not (self._preinfers or self._active or self._stopping):
                    self._preinfer_cv.wait()
                if self._stopping:
                    return  # the ranking thread fails what is left
            while self._step_preinfer():
                if self._active is None:
                    break

    def _take_rank_batch(self) -> list[_RankJob]:
        cfg = self.config
        with self._cv:
            while self._ranks and not self._ranks[0].alive():
                self._ranks.popleft()
            if not self._ranks:
                return []
            oldest = self._ranks[0]
            deadline = oldest.submitted + cfg.max_wait_s
            while len(self._ranks) < cfg.max_batch and time.perf_counter() < deadline and not self._stopping:
                self._cv.wait(max(0.0, deadline - time.perf_counter()))
            batch: list[_RankJob] = []
            keep: collections.deque[_RankJob] = collections.deque()
            tokens = 0
            while self._ranks:
                job = self._ranks.popleft()
                if not job.alive():
                    continue
                fits = len(batch) < cfg.max_batch and (
                    not batch or tokens + job.tokens <= cfg.max_batch_tokens
                )
                if fits and job.full == oldest.full:
                    batch.append(job)
                    tokens += job.tokens
                else:
                    keep.append(job)
            self._ranks.extendleft(reversed(keep))
        return batch

    def _run_rank_batch(self, batch: list[_RankJob]) -> None:
        self.device_time.begin()
        started = time.perf_counter()
        try:
            suffixes = [j.suffix for j in batch]
            host: list[torch.Tensor] | None = None
            if batch[0].full:
                prefixes = [j.prefix for j in batch]
                scores = self.model.full(prefixes, suffixes)  # type: ignore[arg-type]
                prefix_len = max(p.length for p in prefixes)  # type: ignore[union-attr]
            else:
                psis, keys = [j.psi for j in batch], [j.key for j in batch]
                if self.graphs is not None:
                    host = self.graphs.rank(suffixes, psis, keys)  # type: ignore[arg-type]
                if host is None:
                    scores = self.model.rank_cached(suffixes, psis, keys)  # type: ignore[arg-type]
                prefix_len = 0
            if host is None:
                # One copy for the batch; it waits for the device: the batch is done.
                host = list(torch.cat(scores).cpu().split([s.numel() for s in scores]))
        except Exception as exc:  # a bad batch fails its jobs, never the engine
            for j in batch:
                j.resolve(error=exc)
            return
        finally:
            # The scores are on the host (or the batch failed): its device work is over.
            self.device_time.end()
            self.device_time.add("rank", time.perf_counter() - started)
        done = time.perf_counter()
        compute_ms = (done - started) * 1e3
        for j in batch:
            if j.key is not None:
                self.device_time.consumed(j.key)
        with self._cv:
            self._batches_run += 1
            tokens = sum(j.tokens for j in batch)
            self._samples.append(
                BatchSample(batch[0].full, len(batch), tokens, prefix_len, compute_ms, self._batches_run)
            )
        for j, s in zip(batch, host, strict=True):
            j.resolve(RankResult(s, (started - j.submitted) * 1e3, compute_ms, len(batch)))

    def _issue_copy(self) -> bool:
        with self._cv:
            job = self._copies.popleft() if self._copies else None
        if job is None:
            return False
        if not job.alive():
            return True
        try:
            job.timer = SectionTimer(cuda=self._copy_stream is not None)
            if self._copy_stream is not None:
                # Copies read psi that compute just produced: order after it, on the copy stream.
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.accel.device))
                with torch.cuda.stream(self._copy_stream):
                    with job.timer.section():
                        job.value = job.issue()
                    job.event = torch.cuda.Event()
                    job.event.record(self._copy_stream)
                self._copies_in_flight.append(job)
            else:
                with job.timer.section():
                    value = job.issue()
                self.device_time.add(job.work, job.timer.total_s())
                job.resolve(value)
        except Exception as exc:
            job.resolve(error=exc)
        return True

    def _poll_copies(self) -> None:
        still = []
        for job in self._copies_in_flight:
            if job.event.query():
                if job.timer is not None:  # complete: reading its events does not block
                    self.device_time.add(job.work, job.timer.total_s())
                job.resolve(job.value)
            else:
                still.append(job)
        self._copies_in_flight = still

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

    def _step_preinfer(self) -> bool:
        if self._active is None:
            with self._cv:
                jobs: list[_PreInferJob] = []
                tokens = 0
                while self._preinfers and len(jobs) < self.config.preinfer_max_batch:
                    job = self._preinfers[0]
                    if jobs and tokens + job.tokens > self.config.preinfer_max_tokens:
                        break
                    self._preinfers.popleft()
                    if job.alive():
                        jobs.append(job)
                        tokens += job.tokens
            if not jobs:
                return False
            self.device_time.begin()
            timer = SectionTimer(cuda=self.accel.backend == "cuda")
            self._active = (jobs, self.model.preinfer_steps([j.prefix for j in jobs]), timer)
        jobs, steps, timer = self._active
        try:
            with timer.section():
                next(steps)
        except StopIteration as done:
            self._active = None
            if self.accel.backend == "cuda":
                torch.cuda.current_stream(self.accel.device).synchronize()  # psi complete before use
            else:
                self.accel.synchronize()
            self.device_time.end()
            self._account_preinfer(jobs, done.value, timer.total_s())
            for j, psi in zip(jobs, done.value, strict=True):
                j.resolve(psi)
        except Exception as exc:
            self._active = None
            self.device_time.end()
            for j in jobs:
                j.resolve(error=exc)
        return True

    def _account_preinfer(self, jobs: list[_PreInferJob], psis: list[Psi], seconds: float) -> None:
        """Books a finished pre-inference batch: its time, and each psi's share by tokens (the
        cost that is wasted if that psi expires unused)."""
        self.device_time.add("preinfer", seconds)
        tokens = sum(j.tokens for j in jobs) or 1
        for j, psi in zip(jobs, psis, strict=True):
            self.device_time.produced(psi.key, seconds * j.tokens / tokens)

    def _fail_all(self) -> None:
        pending: list[_Job] = [
            *self._ranks,
            *self._preinfers,
            *self._copies,
            *self._copies_in_flight,
            *self._calls,
        ]
        if self._active:
            pending.extend(self._active[0])
        for job in pending:
            job.resolve(error=EngineStopped("the engine stopped before this job ran"))
        self._ranks.clear()
        self._preinfers.clear()
        self._copies.clear()
        self._copies_in_flight.clear()
        self._calls.clear()
        self._active = None
