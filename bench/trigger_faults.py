"""Poison pills and size limits on the whole CPU stack (issue 12, findings 1 and 2); run from
bench/faults.py (`--trigger-scenarios`).

  oversized_malformed_event  malformed values of 0.9, 1 and 2 MB on every partition of the
                             retrieval topic, among valid events that are each followed by a
                             ranking call. Records calls / failed (those ranking calls),
                             lost_events (valid events never decided), dead-lettered bad records
                             (with their original bytes), and blocked_s: the longest time any
                             partition had records waiting and its committed offset did not move.
  max_size_valid_event       a valid event at the token limits (65,536 behaviours + 256 profile
                             tokens, ~1.3 MB), then small valid events on the same partition:
                             its signal must reach a ranker (router: forwarded; ranker: PreInfer
                             accepted), nothing lost or blocked.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import grpc
import numpy as np
import torch
from aiokafka import AIOKafkaConsumer, TopicPartition

from relaygr.launcher import DLQ_TOPIC, RETRIEVAL_TOPIC, Stack, StackConfig
from relaygr.synthetic import Shape, request
from services.ranker.wire import prefix_to_proto, rank_request
from shared.dlq import read_dead_letter
from shared.kafka import KafkaSettings, make_producer
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2_grpc as pb_grpc
from shared.wire import RequestLimits

TRIGGER_GROUP = "relaygr-trigger"  # the trigger's default consumer group (the stack does not set one)
BAD_SIZES = (900_000, 1_000_000, 2_000_000)
_POLL_S = 0.05


def _stack(args: argparse.Namespace) -> Stack:
    # A low risk bar: most valid events are admitted, so signals flow through the same partitions.
    # Four partitions, as in the committed results: the run puts 3.9 MB of garbage on each.
    return Stack(StackConfig(rankers=2, slo_ms=args.slo_ms, arena_bytes=256 << 20, partitions=4,
                             trigger_args=("--suffix-tokens-estimate", "48", "--risk-fraction", "0.05")))  # fmt: skip


def _event(prefix: Any, request_id: str) -> bytes:
    now = int(time.time() * 1e3)
    return ev.RetrievalEvent(schema_version=1, request_id=request_id, event_time_unix_ms=now, user_id=prefix.user_id,
                             prefix_version=prefix.prefix_version, prefix_len=prefix.length,
                             prefix=prefix_to_proto(prefix), ranking_deadline_unix_ms=now + 60_000).SerializeToString()  # fmt: skip


class Progress:
    """Per partition of the retrieval topic: what was produced (from the acks) and what the
    trigger's group committed, polled; the longest stretch with records waiting and no commit."""

    def __init__(self, bootstrap: str, partitions: int) -> None:
        self.bootstrap = bootstrap
        self.tps = [TopicPartition(RETRIEVAL_TOPIC, p) for p in range(partitions)]
        self.produced: dict[TopicPartition, int] = dict.fromkeys(self.tps, 0)
        self.blocked_s = 0.0
        self._stop = asyncio.Event()

    def acked(self, partition: int, offset: int) -> None:
        tp = TopicPartition(RETRIEVAL_TOPIC, partition)
        self.produced[tp] = max(self.produced[tp], offset + 1)

    async def watch(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=TRIGGER_GROUP, enable_auto_commit=False
        )
        await consumer.start()
        committed = dict.fromkeys(self.tps, 0)
        since = {tp: time.monotonic() for tp in self.tps}  # last progress, or last time nothing waited
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                for tp in self.tps:
                    offset = await consumer.committed(tp) or 0
                    if offset > committed[tp] or offset >= self.produced[tp]:
                        since[tp] = now
                    committed[tp] = max(committed[tp], offset)
                    self.blocked_s = max(self.blocked_s, now - since[tp])
                await asyncio.sleep(_POLL_S)
        finally:
            await consumer.stop()

    async def drained(self, timeout_s: float) -> bool:
        """Waits until the group committed everything produced."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=TRIGGER_GROUP, enable_auto_commit=False
        )
        await consumer.start()
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                offsets = {tp: await consumer.committed(tp) or 0 for tp in self.produced}
                if all(offsets[tp] >= end for tp, end in self.produced.items()):
                    return True
                await asyncio.sleep(0.2)
            return False
        finally:
            await consumer.stop()

    def stop(self) -> None:
        self._stop.set()


async def _dead_letters(bootstrap: str, expect: int, timeout_s: float) -> list[Any]:
    consumer = AIOKafkaConsumer(DLQ_TOPIC, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=8 << 20)  # fmt: skip
    await consumer.start()
    letters: list[Any] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(letters) < expect and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                letters += [read_dead_letter(r) for r in records]
    finally:
        await consumer.stop()
    return letters


def _trigger_counts(stack: Stack) -> dict[str, float]:
    assert stack.trigger is not None
    port = int(stack.trigger.wait_event("trigger_ready")["metrics_port"])
    names = {"decided": "relaygr_trigger_decisions_total", "dead_lettered": "relaygr_trigger_dead_letters_total",
             "redelivered": "relaygr_trigger_redelivered_total",
             "undeliverable": "relaygr_trigger_undeliverable_total",
             "signals_dead_lettered": "relaygr_trigger_signals_dead_lettered_total",
             "delivery_retries": "relaygr_trigger_delivery_retries_total"}  # fmt: skip
    return {k: stack.trigger.metric(port, n) for k, n in names.items()}


def run_oversized_malformed_event(args: argparse.Namespace) -> dict[str, Any]:
    n_valid, gap_s = args.poison_valid_events, 0.3
    gen = torch.Generator().manual_seed(args.seed)
    users = [request(gen, 10_000 + i, Shape(4, 100 + 20 * (i % 10), 8, 16)) for i in range(n_valid)]
    rng = np.random.default_rng(args.seed)
    outcomes: list[str] = []

    async def drive(stack: Stack) -> tuple[Progress, list[Any], bool]:
        progress = Progress(stack.bootstrap, stack.config.partitions)
        watcher = asyncio.ensure_future(progress.watch())
        producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap), max_request_size=8 << 20)
        await producer.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.router_port}")
        stub = pb_grpc.RankerStub(channel)

        async def one(i: int) -> None:
            prefix, suffix = users[i]
            meta = await producer.send_and_wait(RETRIEVAL_TOPIC, _event(prefix, f"v{i}"),
                                                key=str(prefix.user_id).encode())  # fmt: skip
            progress.acked(meta.partition, meta.offset)
            await asyncio.sleep(gap_s)
            try:
                await stub.Rank(rank_request(prefix, suffix, f"v{i}"), timeout=10)
                outcomes.append("OK")
            except grpc.aio.AioRpcError as exc:
                outcomes.append(exc.code().name)

        async def poison() -> None:
            for size in BAD_SIZES:  # one of each size on every partition, among the valid events
                await asyncio.sleep(n_valid * 0.1 / (len(BAD_SIZES) + 1))
                for p in range(stack.config.partitions):
                    garbage = b"\xff" + rng.integers(0, 256, size - 1, dtype=np.uint8).tobytes()
                    meta = await producer.send_and_wait(RETRIEVAL_TOPIC, garbage, key=b"poison", partition=p)
                    progress.acked(meta.partition, meta.offset)

        calls = []
        try:
            poisoner = asyncio.ensure_future(poison())
            for i in range(n_valid):
                calls.append(asyncio.ensure_future(one(i)))
                await asyncio.sleep(0.1)
            await asyncio.gather(poisoner, *calls)
            drained = await progress.drained(60.0)
        finally:
            progress.stop()
            await watcher
            await channel.close()
            await producer.stop()
        letters = await _dead_letters(stack.bootstrap, len(BAD_SIZES) * stack.config.partitions, 30.0)
        return progress, letters, drained

    with _stack(args) as stack:
        progress, letters, drained = asyncio.run(drive(stack))
        counts = _trigger_counts(stack)
    bad_sent = len(BAD_SIZES) * stack.config.partitions
    intact = sum(
        1 for d in letters if d.value is not None and len(d.value) in BAD_SIZES and d.value[:1] == b"\xff"
    )
    record = {
        "scenario": "oversized_malformed_event",
        "calls": len(outcomes),
        "failed": sum(1 for o in outcomes if o != "OK"),
        "lost_events": max(0, n_valid - int(counts["decided"])),
        "blocked_s": round(progress.blocked_s, 2),
        "valid_events": n_valid,
        "malformed_events": bad_sent,
        "malformed_sizes": list(BAD_SIZES),
        "dead_lettered_intact": intact,  # in the DLQ with their original bytes
        "offsets_committed": drained,
        **{k: int(v) for k, v in counts.items()},
    }
    print(f"oversized_malformed_event {record}", flush=True)
    return record


def _router_signals(stack: Stack) -> dict[str, int]:
    assert stack.router is not None
    port = int(stack.router.wait_event("router_ready")["metrics_port"])
    return {o: int(stack.router.metric(port, f'relaygr_router_signals_total{{outcome="{o}"}}'))
            for o in ("forwarded", "refused", "dlq", "lost", "stale")}  # fmt: skip


def run_max_size_valid_event(args: argparse.Namespace) -> dict[str, Any]:
    """The max-size event first, alone: its signal's fate at the router (forwarded: the ranker
    accepted the PreInfer) is then unambiguous; small events follow on its partition."""
    limits = RequestLimits()
    gen = torch.Generator().manual_seed(args.seed)
    big, _ = request(gen, 77, Shape(limits.max_profile_tokens, limits.max_prefix_tokens, 0, 1))
    small = [request(gen, 20_000 + i, Shape(4, 60, 8, 16))[0] for i in range(args.poison_valid_events)]
    big_event = _event(big, "max-size")
    sent = 0

    async def drive(stack: Stack) -> tuple[Progress, bool, dict[str, int]]:
        nonlocal sent
        progress = Progress(stack.bootstrap, stack.config.partitions)
        watcher = asyncio.ensure_future(progress.watch())
        producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap), max_request_size=8 << 20)
        await producer.start()
        try:
            meta = await producer.send_and_wait(RETRIEVAL_TOPIC, big_event, key=b"77")
            progress.acked(meta.partition, meta.offset)
            sent += 1
            deadline, big_signal = time.monotonic() + 60.0, {}
            while time.monotonic() < deadline:
                big_signal = await asyncio.to_thread(_router_signals, stack)
                if sum(big_signal.values()):
                    break
                await asyncio.sleep(0.1)
            for prefix in small:  # after it, on its partition (keys are not checked against partitions)
                m = await producer.send_and_wait(RETRIEVAL_TOPIC, _event(prefix, f"s{prefix.user_id}"),
                                                 key=str(prefix.user_id).encode(), partition=meta.partition)  # fmt: skip
                progress.acked(m.partition, m.offset)
                sent += 1
                await asyncio.sleep(0.05)
            drained = await progress.drained(60.0)
        finally:
            progress.stop()
            await watcher
            await producer.stop()
        return progress, drained, big_signal

    with _stack(args) as stack:
        progress, drained, big_signal = asyncio.run(drive(stack))
        counts = _trigger_counts(stack)
    record = {
        "scenario": "max_size_valid_event",
        "calls": 0,  # no ranking call: a full ranking of 65k tokens on the CPU would take minutes
        "failed": 0,
        "lost_events": max(0, sent - int(counts["decided"])),
        "blocked_s": round(progress.blocked_s, 2),
        "event_bytes": len(big_event),
        "event_tokens": big.length,
        # the router's outcome for the max-size event's signal (forwarded: a ranker accepted it)
        "max_size_signal": {k: v for k, v in big_signal.items() if v},
        "offsets_committed": drained,
        **{k: int(v) for k, v in counts.items()},
    }
    print(f"max_size_valid_event {record}", flush=True)
    return record
