"""The load generator in several processes: each replays the requests of one shard of the users.

One Python process replaying the load reaches its own limit before the stack does once the stack
has several ranker processes: on an H200 (bench/results/goodput-nvidia-h200-h5c and -h5d, the
length mix) the one client process sent calls up to 4.7-9.7 s late (send lag p99) at 587.5 req/s,
its loop saturated, and both configurations "missed" there for the client's sake.

Worker k replays the requests of the users with user_id % processes == k, so that a user's
retrieval events and ranking calls stay in one process and in order (the Kafka key is the user),
through its own Kafka producer and gRPC channel, from one time zero shared by every worker
(time.monotonic is CLOCK_MONOTONIC, host-wide). Each request keeps its index in the whole
workload, and the shards' records are merged into one ReplayResult in workload order: what one
process's replay would have returned, had it kept up. Workers are spawned once and reused for
every point; each point's plan goes to them pickled (a few MB at most), never regenerated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import multiprocessing.connection
import signal
import time
import traceback
from collections.abc import Sequence
from typing import Any

from relaygr.replay import ReplayResult, replay
from relaygr.workload import Materializer, PlannedRequest, Workload, WorkloadConfig

__all__ = ["LoadGenerator", "ShardPlan", "merge_results", "shard_indices"]

SETUP_S = 2.0  # time zero this long after a point is handed out: every worker's producer is up by then
MAX_MESSAGE_BYTES = 64 << 20  # the largest Rank request or retrieval event a worker sends


def shard_indices(requests: Sequence[PlannedRequest], shard: int, shards: int) -> list[int]:
    """Indices (in `requests`) of the requests of shard `shard` of `shards`: by user, so that each
    user's requests, in their order, are in exactly one shard."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not in [0, {shards})")
    return [i for i, r in enumerate(requests) if r.user_id % shards == shard]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One worker's part of one point: its requests, their indices in the workload, and where to
    send them."""

    config: WorkloadConfig
    requests: list[PlannedRequest]
    indices: list[int]
    bootstrap: str
    router_target: str
    retrieval_topic: str
    slo_ms: float
    start_at: float  # time.monotonic() of the replay's time zero
    rank_timeout_s: float = 10.0
    score_sample_every: int = 50


def merge_results(workload: Workload, parts: Sequence[ReplayResult]) -> ReplayResult:
    """The shards' replays as one: every request's record, in workload order; the loop-lag probes
    and collector pauses of every worker; the latest end. Raises ValueError unless every request
    of `workload` has exactly one record."""
    records = sorted((r for part in parts for r in part.records), key=lambda r: r.index)
    if [r.index for r in records] != list(range(len(workload.requests))):
        raise ValueError(f"the shards hold {len(records)} records for {len(workload.requests)} requests")
    for record, planned in zip(records, workload.requests, strict=True):
        if record.planned.request_id != planned.request_id:
            raise ValueError(
                f"record {record.index} is {record.planned.request_id}, not {planned.request_id}"
            )
    return ReplayResult(
        records,
        planned_duration_s=workload.config.duration_s,
        wall_s=max((p.wall_s for p in parts), default=0.0),
        score_sample_every=parts[0].score_sample_every if parts else 0,
        materializer_hits=sum(p.materializer_hits for p in parts),
        materializer_misses=sum(p.materializer_misses for p in parts),
        loop_lag_ms=[x for p in parts for x in p.loop_lag_ms],
        gc_pause_ms=[x for p in parts for x in p.gc_pause_ms],
    )


async def _replay_plan(plan: ShardPlan) -> ReplayResult:
    # Imported here: the parent process needs neither.
    import grpc

    from shared.kafka import KafkaSettings, make_producer
    from shared.protos import ranker_pb2_grpc as pb_grpc

    part = Workload(plan.config, plan.requests, sessions=0)
    producer = make_producer(KafkaSettings(bootstrap=plan.bootstrap), max_request_size=MAX_MESSAGE_BYTES)
    await producer.start()
    channel = grpc.aio.insecure_channel(plan.router_target,
                                        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])  # fmt: skip
    try:
        return await replay(part, producer=producer, retrieval_topic=plan.retrieval_topic,
                            router_stub=pb_grpc.RankerStub(channel), materializer=Materializer.for_workload(part),
                            slo_ms=plan.slo_ms, rank_timeout_s=plan.rank_timeout_s,
                            score_sample_every=plan.score_sample_every, start_at=plan.start_at,
                            indices=plan.indices)  # fmt: skip
    finally:
        await channel.close()
        await producer.stop()


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """A worker: replays each plan it is sent and sends back ("ok", result) or ("error", text);
    ends when the pipe closes. Ctrl-C is the parent's to handle (it ends the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            plan = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, object] = ("ok", asyncio.run(_replay_plan(plan)))
        except Exception:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:  # the parent has gone (a time limit ended the run): nobody to tell
            return


class LoadGenerator:
    """`processes` worker processes that replay a workload's shards together (see the module).

    load = LoadGenerator(4)
    result = await load.replay(workload, bootstrap=..., router_target=..., retrieval_topic=..., slo_ms=50)
    load.close()
    """

    def __init__(self, processes: int, setup_s: float = SETUP_S) -> None:
        if processes < 2:
            raise ValueError(f"a load generator of {processes} processes: use the in-process replay for one")
        if setup_s <= 0:
            raise ValueError("setup_s must be > 0")
        self.processes = processes
        self.setup_s = setup_s
        self._workers: list[
            tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]
        ] = []

    @property
    def pids(self) -> dict[str, int]:
        """The workers by name (client_w0, ...), for CPU accounting; {} until started."""
        return {f"client_w{k}": proc.pid for k, (proc, _) in enumerate(self._workers) if proc.pid is not None}

    def start(self) -> None:
        """Spawns the workers (idempotent). A fresh interpreter each: no CUDA or event loop inherited."""
        if self._workers:
            return
        ctx = multiprocessing.get_context("spawn")
        for k in range(self.processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), name=f"relaygr-load-{k}", daemon=True)
            proc.start()
            child.close()
            self._workers.append((proc, parent))

    async def replay(self, workload: Workload, *, bootstrap: str, router_target: str, retrieval_topic: str,
                     slo_ms: float, rank_timeout_s: float = 10.0, score_sample_every: int = 50) -> ReplayResult:  # fmt: skip
        """Replays `workload` from every worker at once (one shard each); the merged result."""
        self.start()
        start_at = time.monotonic() + self.setup_s
        plans = []
        for k in range(self.processes):
            indices = shard_indices(workload.requests, k, self.processes)
            plans.append(ShardPlan(workload.config, [workload.requests[i] for i in indices], indices, bootstrap,
                                   router_target, retrieval_topic, slo_ms, start_at, rank_timeout_s,
                                   score_sample_every))  # fmt: skip
        for (_, conn), plan in zip(self._workers, plans, strict=True):
            conn.send(plan)
        receiving = [asyncio.ensure_future(self._receive(k)) for k in range(self.processes)]
        try:
            replies = await asyncio.gather(*receiving)
        except BaseException:
            # A worker failed or the run was cancelled: the others may still be replaying, and
            # their late replies must not be read as the next point's. Stop waiting on their
            # pipes, end them; fresh workers next time.
            for task in receiving:
                task.cancel()
            await asyncio.gather(*receiving, return_exceptions=True)
            self.close()
            raise
        return merge_results(workload, replies)

    async def _receive(self, k: int) -> ReplayResult:
        proc, conn = self._workers[k]
        # Waits on the pipe in the loop (no thread blocked in recv, which would hold up the
        # loop's shutdown after a Ctrl-C until the worker's replay ended).
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(conn.fileno(), on_readable)
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
        try:
            status, payload = conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"load worker {k} (pid {proc.pid}) died: exit code {proc.exitcode}") from exc
        if status != "ok":
            raise RuntimeError(f"load worker {k} failed:\n{payload}")
        result: ReplayResult = payload
        return result

    def close(self) -> None:
        """Ends the workers (a replay under way in one is abandoned). Idempotent."""
        for proc, conn in self._workers:
            conn.close()
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
        self._workers.clear()

    def __enter__(self) -> LoadGenerator:
        self.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()
