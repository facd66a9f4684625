"""The load generator measured alone: what the replayer itself adds to every latency.

    python -m bench.client                                  # L4096, 50 100 150 req/s, both loops
    python -m bench.client --rates 150 --loops uvloop --producer none

Replays the goodput benchmark's workload (every prefix `--prefix-len` tokens, sessions of mean 3)
against a stub ranker in its own process that answers every Rank at once with 256 scores, so the
latency the replayer reports is its own cost plus the loopback transport: serialising an 80 KB
request, the gRPC round trip, and how late its event loop wakes for the reply. It also publishes
every retrieval event to an embedded Tansu broker, as the benchmarks do (`--producer none`: not).
Per (loop, rate): latency P50 / P99, send lag P99 (how late calls left against their plan), and
the replayer's loop lag (P99, max), printed as a table and written to
bench/results/client-<machine>.json. `--processes 1 2 4` measures the same with the load from that
many processes (relaygr/load.py, users sharded; their loops are asyncio's; Kafka producer needed):
where one process falls behind and how far more of them carry it.

Why: on some GPU leases the goodput benchmark's load generator lagged 15-24 ms and the calls'
`network` P99 (client minus server time) reached 13-27 ms against 4-6 ms on others, which moved
the baseline's goodput 2x between leases. This says how much of that the replayer owns, and
whether uvloop (`--loops`) takes it away.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from bench.report import RESULTS_DIR, write_result
from relaygr.load import LoadGenerator
from relaygr.replay import replay
from relaygr.workload import Materializer, WorkloadConfig, generate
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc

LOOPS = ("asyncio", "uvloop")
_READY = "stub_ready port="


class _StubRanker(pb_grpc.RankerServicer):
    """Answers every Rank at once: one score per candidate, as a ranker's reply carries."""

    async def Rank(self, request: pb.RankRequest, context: grpc.aio.ServicerContext) -> pb.RankReply:
        n = len(request.candidates_le) // 8
        return pb.RankReply(scores=[0.0] * n, served_by=pb.FULL_RECOMPUTE, instance_id="stub")


async def _serve_stub() -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_RankerServicer_to_server(_StubRanker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"{_READY}{port}", flush=True)
    await server.wait_for_termination()


@contextlib.contextmanager
def stub_process() -> Iterator[int]:
    """The stub ranker in a child process (its own interpreter and loop); yields its port."""
    child = subprocess.Popen([sys.executable, "-m", "bench.client", "--serve-stub"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.startswith(_READY):
            raise RuntimeError(f"the stub ranker did not start: {line!r}")
        yield int(line[len(_READY) :])
    finally:
        child.terminate()
        child.wait(timeout=10)


class _NoProducer:
    """Publishing left out: only the Rank calls are measured."""

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[Any]:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def sharded_point(
    load: LoadGenerator, port: int, config: WorkloadConfig, bootstrap: str
) -> dict[str, Any]:
    """one_point from the load generator's worker processes."""
    workload = generate(config)
    result = await load.replay(workload, bootstrap=bootstrap, router_target=f"127.0.0.1:{port}",
                               retrieval_topic="bench.client.retrieval", slo_ms=50.0)  # fmt: skip
    return _row(result.summary(50.0))


def _row(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in ("ok", "failed", "publish_failed", "p50_ms", "p99_ms", "lag_ms_p99",
                              "client_loop_lag_ms_p99", "client_loop_lag_ms_max", "client_gc_pause_ms_max")}  # fmt: skip


async def one_point(port: int, config: WorkloadConfig, bootstrap: str | None) -> dict[str, Any]:
    workload = generate(config)
    materializer = Materializer.for_workload(workload)
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]
    )
    producer: Any = _NoProducer()
    if bootstrap is not None:
        from shared.kafka import KafkaSettings, make_producer

        producer = make_producer(KafkaSettings(bootstrap=bootstrap), max_request_size=64 << 20)
        await producer.start()
    try:
        result = await replay(workload, producer=producer, retrieval_topic="bench.client.retrieval",
                              router_stub=pb_grpc.RankerStub(channel), materializer=materializer,
                              slo_ms=50.0)  # fmt: skip
    finally:
        if bootstrap is not None:
            await producer.stop()
        await channel.close()
    return _row(result.summary(50.0))


def run_loop(loop_name: str, coro: Any) -> Any:
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[50.0, 100.0, 150.0])
    p.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--producer", choices=["none", "kafka"], default="kafka")
    p.add_argument("--processes", type=int, nargs="+", default=[1],
                   help="load generator processes (> 1: relaygr/load.py's workers, asyncio loops, Kafka producer)")  # fmt: skip
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_stub:
        import uvloop

        uvloop.run(_serve_stub())
        return
    if any(r <= 0 for r in args.rates) or args.duration_s <= 0 or args.prefix_len < 16:
        p.error("--rates and --duration-s must be positive, --prefix-len >= 16")
    if any(n < 1 for n in args.processes) or (max(args.processes) > 1 and args.producer != "kafka"):
        p.error("--processes must be >= 1; more than 1 needs --producer kafka (each worker publishes)")
    base = WorkloadConfig(fixed_prefix_len=args.prefix_len, duration_s=args.duration_s, lead_in_s=0.0)
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(stub_process())
        bootstrap = None
        if args.producer == "kafka":
            from shared.broker import EmbeddedBroker

            bootstrap = stack.enter_context(EmbeddedBroker.start()).bootstrap
        points = 0
        for processes in args.processes:
            load = stack.enter_context(LoadGenerator(processes)) if processes > 1 else None
            for loop_name in args.loops if load is None else ["asyncio"]:
                for rate in args.rates:
                    points += 1
                    config = dataclasses.replace(base, rate_rps=rate, version_base=1000 * points)
                    if load is None:
                        measured = run_loop(loop_name, one_point(port, config, bootstrap))
                    else:
                        assert bootstrap is not None
                        measured = asyncio.run(sharded_point(load, port, config, bootstrap))
                    row = {"loop": loop_name, "processes": processes, "rate_rps": rate, "producer": args.producer,
                           **measured}  # fmt: skip
                    results.append(row)
                    print(f"{loop_name:8s} x{processes} {rate:7g} req/s: p50 {row['p50_ms']:6.2f}  p99 {row['p99_ms']:6.2f} ms  "
                          f"send lag p99 {row['lag_ms_p99']:5.2f}  loop lag p99 {row['client_loop_lag_ms_p99']:5.2f} "
                          f"max {row['client_loop_lag_ms_max']:6.2f} ms  ok {row['ok']}", flush=True)  # fmt: skip
    if not args.no_write:
        config_doc = vars(args) | {"machine_cpus": os.cpu_count(), "python": platform.python_version(),
                                   "stub": "answers at once, 1 score per candidate; its own process"}  # fmt: skip
        config_doc.pop("serve_stub", None)
        columns = ["loop", "processes", "rate_rps", "producer", "ok", "p50_ms", "p99_ms", "lag_ms_p99",
                   "client_loop_lag_ms_p99", "client_loop_lag_ms_max"]  # fmt: skip
        out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
        print("wrote", *write_result("client", config_doc, results, columns, out_dir=out_dir, tag=args.tag))


if __name__ == "__main__":
    main()
