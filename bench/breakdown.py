"""Where the time of ranking calls goes, per served-by path, at one offered rate.

    python -m bench.breakdown --device cuda --preset bench --configs baseline,relay --rate 25 \\
        --workload L4096 --hbm-budget-mb 40000 --arena-gb 24

For each configuration (relaygr/harness.py's CONFIGS; `--ranker-args` adds ranker flags to every
configuration but the baseline), brings the stack up once, replays a short warm-up, then one
open-loop point at `--rate` for `--duration-s`, and prints, per served-by path (hbm_hit,
inflight_join, partial_prefix, dram_reload, full_recompute), P50 / P90 / P99 of the client
latency and of the server's stages (cache wait, engine queue, compute, the rest of the server's
time, the network), the failures by status code, and the slowest calls whole. The goodput search
(bench/goodput.py) says whether a configuration meets the SLO; this says why it does not.

Writes bench/results/breakdown-<device>[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
from pathlib import Path
from typing import Any

import grpc

from bench import goodput, relay
from bench.report import RESULTS_DIR, percentile, write_result
from relaygr.harness import CONFIGS, markdown_table
from relaygr.launcher import RETRIEVAL_TOPIC, Stack
from relaygr.replay import ReplayResult, replay
from relaygr.workload import Materializer, WorkloadConfig, generate
from shared.kafka import KafkaSettings, make_producer
from shared.protos import ranker_pb2_grpc as pb_grpc

STAGES = ("latency_ms", "cache_ms", "queue_ms", "compute_ms", "server_other_ms", "network_ms")


def paths(result: ReplayResult) -> list[dict[str, Any]]:
    """One row per (served-by path, stage): count and P50 / P90 / P99 of the OK calls."""
    by_path: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for record in result.records:
        if record.ok:
            by_path[record.served_by].append(record.breakdown())
    rows = []
    for path, calls in sorted(by_path.items()):
        for stage in STAGES:
            values = [c[stage] for c in calls]
            rows.append({"served_by": path, "calls": len(calls), "stage": stage,
                         **{f"p{q}": round(percentile(values, q), 2) for q in (50, 90, 99)}})  # fmt: skip
    return rows


async def measure(stack: Stack, name: str, args: argparse.Namespace) -> dict[str, Any]:
    base = WorkloadConfig(
        seed=args.seed, users=args.users, recent_tokens=args.recent, candidates=args.candidates
    )
    workload = goodput.workload_config(args.workload, base)
    record: dict[str, Any] = {"config": name, "workload": args.workload, "rate_rps": args.rate}
    for index, (rate, duration) in enumerate(
        ((args.warmup_rate, args.warmup_s), (args.rate, args.duration_s))
    ):
        # Each replay names fresh prefix versions: the warm-up leaves no psi the point could hit.
        cfg = dataclasses.replace(workload, version_base=(index + 1) * 1_000_000, rate_rps=rate,
                                  duration_s=duration)  # fmt: skip
        planned = generate(cfg)
        producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap), max_request_size=64 << 20)
        await producer.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.router_port}",
                                            options=[("grpc.max_send_message_length", 64 << 20)])  # fmt: skip
        try:
            result = await replay(planned, producer=producer, retrieval_topic=RETRIEVAL_TOPIC,
                                  router_stub=pb_grpc.RankerStub(channel),
                                  materializer=Materializer.for_workload(planned), slo_ms=args.slo_ms)  # fmt: skip
        finally:
            await producer.stop()
            await channel.close()
        summary = result.summary(args.slo_ms)
        print(f"[{name}] {'warm-up' if index == 0 else 'point'} {rate:g} req/s: p50 {summary['p50_ms']:.1f} "
              f"p99 {summary['p99_ms']:.1f} ms, ok {summary['ok']}/{summary['sent']}, "
              f"served {summary['served_by_counts']}, failed {summary['failed_by_code']}", flush=True)  # fmt: skip
    record |= {
        "summary": {k: v for k, v in summary.items() if not isinstance(v, list)},
        "paths": paths(result),
        "slowest": [r.breakdown() for r in result.slowest_ok(args.slowest_fraction)],
    }
    print(markdown_table(record["paths"], ["served_by", "calls", "stage", "p50", "p90", "p99"]), flush=True)
    return record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="baseline,relay", help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--workload", default="L4096", help="L<prefix tokens> or mix")
    p.add_argument("--rate", type=float, default=25.0, help="offered ranking calls per second")
    p.add_argument("--duration-s", type=float, default=16.0)
    p.add_argument("--warmup-rate", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument(
        "--ranker-args", default="", help="extra ranker flags for every configuration but the baseline"
    )
    p.add_argument("--slowest-fraction", type=float, default=0.03)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rankers", type=int, default=1)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--slo-ms", type=float, default=300.0)
    p.add_argument("--risk-fraction", type=float, default=0.5)
    p.add_argument("--users", type=int, default=100_000)
    p.add_argument("--recent", type=int, default=64)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--hbm-budget-mb", type=float, default=512.0)
    p.add_argument("--arena-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")
    p.add_argument("--logs-dir", default=None, help="write every service's log records here (JSON lines)")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}")
    if args.rate <= 0 or args.duration_s <= 0 or args.warmup_rate <= 0 or args.warmup_s <= 0:
        p.error("rates and durations must be > 0")
    goodput.workload_config(args.workload, WorkloadConfig())  # raises for an unknown workload
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    extra = tuple(args.ranker_args.split())
    records = []
    for name in args.configs:
        config = relay.stack_config(name, args)
        if extra and name != "baseline":
            config = dataclasses.replace(config, ranker_args=(*config.ranker_args, *extra))
        with Stack(config) as stack:  # from the main thread: children live as long
            records.append(asyncio.run(measure(stack, name, args)))
            if args.logs_dir:
                relay.save_logs(stack, Path(args.logs_dir), name)
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    for r in records:  # flat columns for the summary table
        r.update({k: r["summary"].get(k) for k in ("ok", "sent", "p50_ms", "p99_ms", "slo_attainment")})
    footer = "".join(
        f"\n\n## {r['config']}: stages per served-by path (ms)\n\n"
        + markdown_table(r["paths"], ["served_by", "calls", "stage", "p50", "p90", "p99"])
        for r in records
    )
    write_result("breakdown", settings, records, ["config", "workload", "rate_rps", "ok", "sent", "p50_ms", "p99_ms",
                 "slo_attainment"], out_dir=Path(args.out_dir) if args.out_dir else RESULTS_DIR, tag=args.tag,
                 footer=footer)  # fmt: skip


if __name__ == "__main__":
    main()
