"""Fault scenarios on the CPU stack: what each does to ranking calls and pre-inferences.

    python -m bench.faults                  # every scenario, writes bench/results/faults-<machine>.json
    python -m bench.faults --scenarios ranker_kill --duration-s 8
    python -m bench.faults --scenarios --fuzz 0 --out-dir /tmp/ov   # the overload run alone

Each scenario brings up the whole stack (embedded broker, expander, two rankers, router, trigger),
replays a steady open-loop workload through it (relaygr/workload.py, relaygr/replay.py), injects one
fault at `fault_at_s`, and records:
  calls, failed             ranking calls sent / not answered with scores
  p99_ms_before/during/after  before the fault / from the fault to 1 s after it ended / the rest
  recovery_s                from the fault to the end of the last call slower than
                            max(2 x p99_before, p99_before + 20 ms)
  preinfers_lost            pre-infer signals the trigger admitted that no ranker received
                            (admitted - forwarded - refused - stale, from their metrics)
Scenarios:
  ranker_kill       kill -9 of one ranker (it stays down)
  expander_restart  kill -9 of the expander, a new one 1 s later on the same socket
  broker_restart    the (memory-only) broker stopped, a new one on the same port 1 s later
  ranker_stall      one ranker frozen (SIGSTOP) for 1.5 s: a slow instance
  ranker_cut_off    one ranker frozen until the end: the router only sees timeouts
poison pills and size limits through the trigger (bench/trigger_faults.py: oversized_malformed_event,
max_size_valid_event; `--trigger-scenarios` with none skips them),
an overload run (run_overload; `--overload-rate 0` skips it), and a fuzz run (bench/fuzz.py):
inputs (malformed events), crashes, dlq_events, lost_events.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shlex
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.report import RESULTS_DIR, write_result
from bench.trigger_faults import run_max_size_valid_event, run_oversized_malformed_event
from relaygr.launcher import RETRIEVAL_TOPIC, Stack, StackConfig
from relaygr.replay import ReplayResult, replay
from relaygr.workload import Materializer, WorkloadConfig, generate
from shared.kafka import KafkaSettings, make_producer
from shared.protos import ranker_pb2_grpc as pb_grpc
from shared.stats import percentile

SCENARIOS = ("ranker_kill", "expander_restart", "broker_restart", "ranker_stall", "ranker_cut_off")


def _inject(stack: Stack, name: str) -> tuple[Callable[[], None], float]:
    """The fault as a blocking function (run in a worker thread), and how long it lasts (s)."""
    victim = stack.rankers[0].proc.pid

    def ranker_kill() -> None:
        stack.rankers[0].kill()

    def expander_restart() -> None:
        assert stack.expander is not None
        stack.expander.kill()
        time.sleep(1.0)
        stack.start_expander()

    def broker_restart() -> None:
        stack.restart_broker(down_s=1.0)

    def ranker_stall() -> None:
        os.kill(victim, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(victim, signal.SIGCONT)

    def ranker_cut_off() -> None:
        os.kill(victim, signal.SIGSTOP)

    faults: dict[str, tuple[Callable[[], None], float]] = {
        "ranker_kill": (ranker_kill, 0.0),
        "expander_restart": (expander_restart, 1.0),
        "broker_restart": (broker_restart, 1.0),
        "ranker_stall": (ranker_stall, 1.5),
        "ranker_cut_off": (ranker_cut_off, float("inf")),
    }
    return faults[name]


def windows(result: ReplayResult, fault_at_s: float, fault_s: float) -> dict[str, Any]:
    """Latency percentiles before (answered before the fault), during (in flight at any time
    from the fault to 1 s after it ended) and after it, and the time to recover."""
    ok = [(r.sent_at_s, r.sent_at_s + r.latency_ms / 1e3, r.latency_ms) for r in result.records
          if r.ok and r.sent_at_s is not None]  # fmt: skip
    end_of_fault = fault_at_s + (fault_s if fault_s != float("inf") else 1e9) + 1.0
    before = [ms for _, done, ms in ok if done < fault_at_s]
    during = [ms for sent, done, ms in ok if done >= fault_at_s and sent < end_of_fault]
    after = [ms for sent, _, ms in ok if sent >= end_of_fault]
    p99_before = percentile(before, 99) if before else float("nan")
    threshold = max(2 * p99_before, p99_before + 20.0)
    recovery_s = 0.0
    for _sent, done, ms in ok:
        if done >= fault_at_s and ms > threshold:
            recovery_s = max(recovery_s, done - fault_at_s)
    return {
        "p99_ms_before": p99_before,
        "p99_ms_during": percentile(during, 99) if during else float("nan"),
        "p99_ms_after": percentile(after, 99) if after else float("nan"),
        "recovery_s": recovery_s,
    }


async def _drive(stack: Stack, workload_config: WorkloadConfig, fault: Callable[[], None], fault_at_s: float,
                 slo_ms: float) -> ReplayResult:  # fmt: skip
    workload = generate(workload_config)
    materializer = Materializer.for_workload(workload)
    producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap), max_request_size=64 << 20)
    await producer.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.router_port}")

    async def injector() -> None:
        await asyncio.sleep(fault_at_s)
        await asyncio.to_thread(fault)

    task = asyncio.ensure_future(injector())
    try:
        result = await replay(workload, producer=producer, retrieval_topic=RETRIEVAL_TOPIC,
                              router_stub=pb_grpc.RankerStub(channel), materializer=materializer, slo_ms=slo_ms,
                              rank_timeout_s=10.0)  # fmt: skip
    finally:
        await task
        await channel.close()
        with contextlib.suppress(Exception):
            await producer.stop()
    return result


def run_scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    config = StackConfig(rankers=2, slo_ms=args.slo_ms, arena_bytes=256 << 20,
                         # a low risk bar: most requests are pre-inferred, so faults hit that path too
                         trigger_args=("--suffix-tokens-estimate", "48", "--risk-fraction", "0.05"),
                         # a frozen instance: the router gives an attempt this long before retrying elsewhere
                         router_args=("--rank-attempt-timeout-ms", str(args.attempt_timeout_ms)))  # fmt: skip
    workload = WorkloadConfig(seed=args.seed, duration_s=args.duration_s, rate_rps=args.rate, users=300,
                              length_scale=2.0, recent_tokens=16, candidates=32)  # fmt: skip
    with Stack(config) as stack:
        fault, fault_s = _inject(stack, name)
        victim = stack.rankers[0].proc.pid
        try:
            result = asyncio.run(_drive(stack, workload, fault, args.fault_at_s, args.slo_ms))
        finally:
            if name in ("ranker_stall", "ranker_cut_off"):
                with contextlib.suppress(Exception):
                    os.kill(victim, signal.SIGCONT)  # let it shut down
        assert stack.trigger is not None
        assert stack.router is not None
        trigger_port = int(stack.trigger.wait_event("trigger_ready")["metrics_port"])
        router_port = int(stack.router.wait_event("router_ready")["metrics_port"])
        admitted = stack.trigger.metric(trigger_port, 'relaygr_trigger_decisions_total{reason="admitted"}')
        received = sum(
            stack.router.metric(router_port, f'relaygr_router_signals_total{{outcome="{o}"}}')
            for o in ("forwarded", "refused", "stale")
        )
    summary = result.summary(args.slo_ms)
    record = {
        "scenario": name,
        "calls": summary["sent"],
        "failed": summary["failed"],
        **windows(result, args.fault_at_s, fault_s),
        "preinfers_lost": max(0, int(admitted - received)),
        "preinfers_admitted": int(admitted),
        # retrieval events the broker refused while it was down: their pre-inference never happened
        "events_lost": summary["publish_failed"],
        "failed_by_code": summary["failed_by_code"],
    }
    print(f"{name:18s} calls {record['calls']:4d} failed {record['failed']:3d}  p99 before/during/after "
          f"{record['p99_ms_before']:.0f}/{record['p99_ms_during']:.0f}/{record['p99_ms_after']:.0f} ms  "
          f"recovery {record['recovery_s']:.1f} s  pre-infers lost {record['preinfers_lost']}", flush=True)  # fmt: skip
    return record


def _rss_mb(pid: int) -> float:
    """Resident set size of a process (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _histogram_quantile(text: str, name: str, labels: str, q: float) -> float:
    """The q-quantile (0..1) of a Prometheus histogram in exposition text, as Prometheus's
    histogram_quantile estimates it (linear within the bucket)."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{") and labels in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = upper, count
    return lower


def run_overload(args: argparse.Namespace) -> dict[str, Any]:
    """Offers far more than the stack serves: ranking calls beyond capacity must be refused fast
    (RESOURCE_EXHAUSTED, with a reason) rather than time out, pre-inference must be shed first,
    and queues and memory must stay bounded. Sampled every 0.2 s over the run: the rankers' Stats
    (engine queue, pre-inference backlog, resident psi bytes), their in-flight ranking calls and
    admission limit (Prometheus), and the resident memory of every service process. The record
    ends with `slowest_ok`: the slowest 2% of served calls, each with where its time went
    (RequestRecord.breakdown: served_by, instance, cache/queue/compute/server/network ms, lag)."""
    config = StackConfig(rankers=2, slo_ms=args.slo_ms, arena_bytes=256 << 20,
                         trigger_args=("--suffix-tokens-estimate", "48", "--risk-fraction", "0.05"),
                         ranker_args=tuple(args.overload_ranker_args))  # fmt: skip
    workload = WorkloadConfig(seed=args.seed, duration_s=args.duration_s, rate_rps=args.overload_rate, users=300,
                              length_scale=8.0, recent_tokens=16, candidates=32)  # fmt: skip
    peaks = {"rank_queue_depth": 0, "preinfer_backlog": 0, "hbm_resident_bytes": 0}
    gauges = {"rank_inflight": 0.0, "rank_inflight_work_ms": 0.0}  # predicted engine time held
    rss: dict[str, list[float]] = {}  # service -> samples (MiB)

    async def drive(stack: Stack) -> ReplayResult:
        stop = asyncio.Event()
        services = {p.name: p.proc.pid for p in stack.processes}

        def poll_processes() -> None:
            for name, pid in services.items():
                rss.setdefault(name, []).append(_rss_mb(pid))
            for ranker, port in zip(stack.rankers, stack.ranker_metrics_ports, strict=True):
                for key in gauges:
                    with contextlib.suppress(OSError):
                        gauges[key] = max(gauges[key], ranker.metric(port, f"relaygr_ranker_{key}"))

        async def sample() -> None:
            from shared.protos import ranker_pb2 as pb

            channels = [grpc.aio.insecure_channel(t) for t in stack.ranker_targets]
            while not stop.is_set():
                for channel in channels:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        st = await pb_grpc.RankerStub(channel).Stats(pb.StatsRequest(), timeout=1)
                        for key in peaks:
                            peaks[key] = max(peaks[key], int(getattr(st, key)))
                await asyncio.to_thread(poll_processes)
                await asyncio.sleep(0.2)
            for channel in channels:
                await channel.close()

        sampler = asyncio.ensure_future(sample())
        generated = generate(workload)
        materializer = Materializer.for_workload(generated)
        producer = make_producer(KafkaSettings(bootstrap=stack.bootstrap), max_request_size=64 << 20)
        await producer.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{stack.router_port}")
        try:
            return await replay(generated, producer=producer, retrieval_topic=RETRIEVAL_TOPIC,
                                router_stub=pb_grpc.RankerStub(channel), materializer=materializer,
                                slo_ms=args.slo_ms, rank_timeout_s=args.overload_deadline_s)  # fmt: skip
        finally:
            stop.set()
            await sampler
            await channel.close()
            with contextlib.suppress(Exception):
                await producer.stop()

    with Stack(config) as stack:
        result = asyncio.run(drive(stack))
        assert stack.trigger is not None
        assert stack.router is not None
        port = int(stack.trigger.wait_event("trigger_ready")["metrics_port"])
        decisions = {r: stack.trigger.metric(port, f'relaygr_trigger_decisions_total{{reason="{r}"}}')
                     for r in ("admitted", "load_bound", "footprint_bound", "too_late", "not_at_risk",
                               "adds_work")}  # fmt: skip
        router_port = int(stack.router.wait_event("router_ready")["metrics_port"])
        router_retries = stack.router.metric(router_port, 'relaygr_router_retries_total{method="rank"}')
        # The router's own view (entry to reply): without the load generator's event-loop lag,
        # which on a 2-core machine is a large part of what the client measures.
        router_text = (
            urllib.request.urlopen(f"http://127.0.0.1:{router_port}/metrics", timeout=5).read().decode()
        )
        router_ms = {f"router_{result}_p{q}_ms": _histogram_quantile(router_text, "relaygr_router_latency_ms",
                                                                     f'method="rank",result="{result}"', q / 100)
                     for result in ("ok", "resource_exhausted") for q in (50, 99)}  # fmt: skip
        rankers = list(zip(stack.rankers, stack.ranker_metrics_ports, strict=True))
        ranker_refusals = sum(
            r.metric(p, 'relaygr_ranker_rank_errors_total{code="resource_exhausted"}') for r, p in rankers
        )
        ranker_cancelled = sum(
            r.metric(p, 'relaygr_ranker_rank_errors_total{code="cancelled"}') for r, p in rankers
        )
        ranker_late = sum(
            r.metric(p, 'relaygr_ranker_rank_refusals_total{reason="late"}') for r, p in rankers
        )
        preinfer = {o: sum(r.metric(p, f'relaygr_ranker_preinfer_total{{outcome="{o}"}}') for r, p in rankers)
                    for o in ("accepted", "reload_scheduled", "refused")}  # fmt: skip
    refused = [r.latency_ms for r in result.records if r.status == "RESOURCE_EXHAUSTED"]
    timed_out = sum(1 for r in result.records if r.status == "DEADLINE_EXCEEDED")
    summary = result.summary(args.slo_ms)
    nan = float("nan")
    record = {
        "scenario": "overload",
        "offered_rps": summary["offered_rps"],
        "calls": summary["sent"],
        "ok": summary["ok"],
        "refused": len(refused),
        "refused_p50_ms": percentile(refused, 50) if refused else nan,
        "refused_p99_ms": percentile(refused, 99) if refused else nan,
        "timed_out": timed_out,
        "other_failures": summary["failed"] - len(refused) - timed_out,
        "ok_p50_ms": summary["p50_ms"],
        "ok_p99_ms": summary["p99_ms"],
        **router_ms,
        "ok_within_slo": sum(1 for r in result.records if r.ok and r.latency_ms <= args.slo_ms),
        "client_lag_ms_p99": summary["lag_ms_p99"],  # the load generator itself behind schedule
        "preinfers_shed": int(decisions["load_bound"] + decisions["footprint_bound"] + decisions["too_late"]),
        "preinfers_admitted": int(decisions["admitted"]),
        # what the rankers did with the admitted ones (they refuse pre-inference while overloaded)
        "preinfers_started": int(preinfer["accepted"] + preinfer["reload_scheduled"]),
        "preinfers_refused_by_rankers": int(preinfer["refused"]),
        "ranker_refusals": int(ranker_refusals),  # per attempt: a call the router retried counts twice
        "ranker_admitted_then_cancelled": int(ranker_cancelled),  # admitted, caller gave up first
        "ranker_late_refusals": int(ranker_late),  # admitted, not started within its queue budget
        "router_rank_retries": int(router_retries),
        **{f"max_{k}": v for k, v in peaks.items()},
        **{f"max_{k}": int(v) for k, v in gauges.items()},
        # memory: the most of any one process of each kind, and its growth from the first sample
        **{f"max_rss_mb_{name}": round(max(v), 1) for name, v in sorted(rss.items()) if v},
        **{f"rss_growth_mb_{name}": round(v[-1] - v[0], 1) for name, v in sorted(rss.items()) if v},
        # bounded memory: no growth over the second half of the run
        **{
            f"rss_growth_2nd_half_mb_{name}": round(v[-1] - v[len(v) // 2], 1)
            for name, v in sorted(rss.items())
            if v
        },
    }
    # Per-call evidence for the tail: the slowest 2% of served calls, each with its breakdown.
    slowest = [r.breakdown() for r in result.slowest_ok(0.02)]
    print(f"overload           {record}", flush=True)
    record["slowest_ok"] = slowest
    print(f"overload: slowest {len(slowest)} of {summary['ok']} OK calls", flush=True)
    for row in slowest:
        print("   ", " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return record


# ---------------------------------------------------------------------- front-door abuse (issue 12)


def _router_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _front_door_stack(args: argparse.Namespace) -> Stack:
    """Two rankers behind the router (its default front door, the HTTP/2 relay); no trigger."""
    return Stack(StackConfig(rankers=2, slo_ms=args.slo_ms, arena_bytes=256 << 20, trigger_policy="off"))


def _rank_requests(n: int) -> list[bytes]:
    """Small, valid ranking calls (64-token prefixes) for the tiny model."""
    from relaygr.synthetic import Shape, batch
    from services.ranker.wire import rank_request

    prefixes, suffixes = batch(7, [Shape(3, 64, 8, 16)] * n)
    return [rank_request(p, s, f"fd{i}").SerializeToString()
            for i, (p, s) in enumerate(zip(prefixes, suffixes, strict=True))]  # fmt: skip


class _Outcomes(list[str]):
    """Ranking call outcomes ("OK" or a status name), with a way to wait for the n-th."""

    def __init__(self) -> None:
        super().__init__()
        self._tick = asyncio.Event()

    def note(self, outcome: str) -> None:
        self.append(outcome)
        self._tick.set()

    async def reach(self, n: int) -> None:
        while len(self) < n:
            self._tick.clear()
            await self._tick.wait()


async def _rank_loop(channel: grpc.aio.Channel, requests: list[bytes], stop: asyncio.Event,
                     outcomes: _Outcomes) -> None:  # fmt: skip
    """Ranking calls one after another until `stop`, each outcome noted."""
    rank = channel.unary_unary("/relaygr.v1.Ranker/Rank")
    i = 0
    while not stop.is_set():
        try:
            await rank(requests[i % len(requests)], timeout=10)
            outcomes.note("OK")
        except grpc.aio.AioRpcError as exc:
            outcomes.note(exc.code().name)
        i += 1


def run_router_oversized_header(args: argparse.Namespace) -> dict[str, Any]:
    """Finding 4 of issue 12: on one channel, ranking calls run (8 at a time) while calls with a
    100 KB metadata header are sent now and then. `failed` counts the OTHER calls that failed (the
    ones sharing the connection); `oversized_status` is what the oversized calls got."""
    requests = _rank_requests(32)
    outcomes = _Outcomes()
    oversized: list[str] = []

    async def drive(port: int) -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stop = asyncio.Event()
        loops = [asyncio.ensure_future(_rank_loop(channel, requests, stop, outcomes)) for _ in range(8)]
        rank = channel.unary_unary("/relaygr.v1.Ranker/Rank")
        try:
            for i in range(args.oversized_calls):
                await outcomes.reach(20 * (i + 1))  # calls in flight, and between oversized ones
                try:
                    await rank(requests[i % len(requests)], timeout=10, metadata=(("x-big", "v" * 100_000),))
                    oversized.append("OK")
                except grpc.aio.AioRpcError as exc:
                    oversized.append(exc.code().name)
        finally:
            stop.set()
            await asyncio.gather(*loops)
            await channel.close()

    with _front_door_stack(args) as stack:
        asyncio.run(drive(stack.router_port))
    record = {
        "scenario": "router_oversized_header",
        "calls": len(outcomes),
        "failed": sum(1 for o in outcomes if o != "OK"),
        "oversized_calls": len(oversized),
        "oversized_status": sorted(set(oversized)),
        "front_door": "relay",
    }
    print(f"router_oversized_header {record}", flush=True)
    return record


def run_rapid_reset(args: argparse.Namespace) -> dict[str, Any]:
    """CVE-2023-44487 against the router: for `attack_s` seconds an attacker opens ranking streams
    (HEADERS + the message) and resets each at once, as fast as it can write, reconnecting when
    cut off; meanwhile a normal client's calls run (8 at a time) on their own connection.
    Records the normal calls and failures, the attack streams sent, whether (and how often) the
    attacker was cut off, the router's RSS growth and CPU over the attack."""
    from services.router.frontdoor import h2wire
    from services.router.frontdoor.h2wire import frame

    requests = _rank_requests(32)
    outcomes = _Outcomes()
    attack = {"streams": 0, "connections": 0, "cut_off": 0}
    block = h2wire.literal_block([(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/relaygr.v1.Ranker/Rank"),
                           (b":authority", b"router"), (b"content-type", b"application/grpc"),
                           (b"te", b"trailers")])  # fmt: skip
    message = b"\x00" + len(requests[0]).to_bytes(4, "big") + requests[0]

    async def one_connection(port: int, until: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        attack["connections"] += 1
        closed = asyncio.Event()

        async def drain() -> None:
            with contextlib.suppress(ConnectionError):
                while await reader.read(65_536):
                    pass
            closed.set()

        drainer = asyncio.ensure_future(drain())
        writer.write(h2wire.CONNECTION_PREFACE + h2wire.settings_frame([]))
        stream_id = 1
        try:
            while not closed.is_set() and time.monotonic() < until and stream_id < (1 << 31) - 200:
                chunk = bytearray()
                for _ in range(100):
                    chunk += frame(h2wire.HEADERS, h2wire.END_HEADERS, stream_id, block)
                    chunk += frame(h2wire.DATA, h2wire.END_STREAM, stream_id, message)
                    chunk += frame(h2wire.RST_STREAM, 0, stream_id, h2wire.CANCEL.to_bytes(4, "big"))
                    stream_id += 2
                writer.write(bytes(chunk))
                attack["streams"] += 100
                try:
                    await writer.drain()
                except ConnectionError:
                    break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closed.wait(), 2.0)
            attack["cut_off"] += closed.is_set() and time.monotonic() < until
        finally:
            writer.close()
            drainer.cancel()

    async def drive(port: int, pid: int) -> dict[str, float]:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stop = asyncio.Event()
        loops = [asyncio.ensure_future(_rank_loop(channel, requests, stop, outcomes)) for _ in range(8)]
        await outcomes.reach(20)  # the normal client is up and running
        rss0, cpu0, t0 = _rss_mb(pid), _router_cpu_s(pid), time.monotonic()
        until = t0 + args.attack_s
        while time.monotonic() < until:
            await one_connection(port, until)
        measured = {"router_rss_growth_mb": round(_rss_mb(pid) - rss0, 1),
                    "router_cpu_s": round(_router_cpu_s(pid) - cpu0, 2),
                    "attack_s": round(time.monotonic() - t0, 2)}  # fmt: skip
        stop.set()
        await asyncio.gather(*loops)
        await channel.close()
        return measured

    with _front_door_stack(args) as stack:
        assert stack.router is not None
        measured = asyncio.run(drive(stack.router_port, stack.router.proc.pid))
    record = {
        "scenario": "rapid_reset",
        "calls": len(outcomes),
        "failed": sum(1 for o in outcomes if o != "OK"),
        "attack_streams_sent": attack["streams"],
        "attack_connections": attack["connections"],
        "attacker_cut_off": attack["cut_off"] > 0,
        "attacker_cut_offs": attack["cut_off"],
        **measured,
        "router_cpu_fraction": round(measured["router_cpu_s"] / max(measured["attack_s"], 1e-9), 2),
    }
    print(f"rapid_reset {record}", flush=True)
    return record


def _other_tokens(prefix: Any, at: int) -> Any:
    """The same user, prefix version and length, the long-term item at `at` changed."""
    from services.ranker.sequences import Behaviors, UserPrefix

    items = prefix.long_term.items.clone()
    items[at] = (items[at] + 1) % 1000
    lt = prefix.long_term
    return UserPrefix(
        prefix.user_id, prefix.prefix_version, prefix.profile, Behaviors(items, lt.actions, lt.timestamps)
    )


def run_prefix_content_mismatch(args: argparse.Namespace) -> dict[str, Any]:
    """Finding 3 of issue 12: through the router, each user's prefix A is pre-inferred; then
    ranking calls arrive under the same (user, prefix version) with other tokens of the same
    length (one item changed: the first, the middle or the last), then with A itself, then with
    the other tokens again. `wrong_scores` counts calls whose scores differ from a full ranking
    of their own tokens (the tiny model, float32 on the CPU) by more than 1e-5; `lost_events`
    the PreInfers not accepted; `prefix_content_mismatches` the rankers' own count."""
    import torch

    from relaygr.synthetic import Shape, batch
    from services.ranker.model import HSTURanker
    from services.ranker.wire import preinfer_request, rank_request
    from shared.modelspec import preset
    from shared.protos import ranker_pb2 as pb

    n = args.mismatch_users
    prefixes, suffixes = batch(args.seed + 12, [Shape(3, args.mismatch_prefix_len, 8, 16)] * n)
    others = [_other_tokens(p, (0, len(p.long_term) // 2, -1)[i % 3]) for i, p in enumerate(prefixes)]
    reference = HSTURanker.from_seed(preset("tiny"), seed=0)  # the rankers' weights
    calls: list[tuple[Any, Any, bool]] = []  # (prefix, suffix, other tokens?) in send order
    for wave in (others, prefixes, others):
        calls += [(p, s, wave is others) for p, s in zip(wave, suffixes, strict=True)]
    want = [reference.full([p], [s])[0] for p, s, _ in calls]
    replies: list[Any] = []
    lost = 0

    async def drive(port: int, ranker_targets: list[str]) -> int:
        nonlocal lost
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.RankerStub(channel)
        rankers = [grpc.aio.insecure_channel(t) for t in ranker_targets]
        try:
            lease = int(time.time() * 1e3) + 30_000
            for i, p in enumerate(prefixes):
                try:
                    pre = await stub.PreInfer(preinfer_request(p, f"pa{i}", lease), timeout=10)
                    lost += pre.outcome not in (pb.PreInferReply.ACCEPTED, pb.PreInferReply.RELOAD_SCHEDULED)
                except grpc.aio.AioRpcError:
                    lost += 1

            async def stats() -> list[Any]:
                return [await pb_grpc.RankerStub(c).Stats(pb.StatsRequest(), timeout=5) for c in rankers]

            for _ in range(600):  # psi produced, or a minute passed
                if sum(s.psi_produced for s in await stats()) >= n - lost:
                    break
                await asyncio.sleep(0.1)
            for i, (p, s, _) in enumerate(calls):
                try:
                    replies.append(await stub.Rank(rank_request(p, s, f"r{i}"), timeout=30))
                except grpc.aio.AioRpcError as exc:
                    replies.append(exc.code().name)
            return sum(s.prefix_content_mismatches for s in await stats())
        finally:
            for c in rankers:
                await c.close()
            await channel.close()

    with _front_door_stack(args) as stack:
        mismatches = asyncio.run(drive(stack.router_port, stack.ranker_targets))
    answered = [
        (r, w, other)
        for r, w, (_, _, other) in zip(replies, want, calls, strict=True)
        if not isinstance(r, str)
    ]
    wrong = sum(1 for r, w, _ in answered if float((torch.tensor(list(r.scores)) - w).abs().max()) > 1e-5)
    served = [(pb.ServedBy.Name(r.served_by).lower(), other) for r, _, other in answered]
    record = {
        "scenario": "prefix_content_mismatch",
        "calls": len(calls),
        "failed": len(calls) - len(answered),
        "lost_events": lost,
        "wrong_scores": wrong,
        "mismatch_calls": sum(1 for _, _, other in calls if other),
        "prefix_content_mismatches": mismatches,
        "served_other_tokens": dict(collections.Counter(name for name, other in served if other)),
        "served_own_tokens": dict(collections.Counter(name for name, other in served if not other)),
        "prefix_len": args.mismatch_prefix_len + 3,
    }
    print(f"prefix_content_mismatch {record}", flush=True)
    return record


FRONT_DOOR_SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "router_oversized_header": run_router_oversized_header,
    "rapid_reset": run_rapid_reset,
    "prefix_content_mismatch": run_prefix_content_mismatch,
}


TRIGGER_SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "oversized_malformed_event": run_oversized_malformed_event,
    "max_size_valid_event": run_max_size_valid_event,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios",
        nargs="*",
        default=list(SCENARIOS),
        choices=SCENARIOS,
        help="fault scenarios to run (none given: only the overload and fuzz runs)",
    )
    parser.add_argument("--duration-s", type=float, default=12.0)
    parser.add_argument("--fault-at-s", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--slo-ms", type=float, default=300.0)
    parser.add_argument("--attempt-timeout-ms", type=float, default=1000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuzz", type=int, default=10_000, help="malformed retrieval events (0: skip)")
    parser.add_argument(
        "--overload-rate", type=float, default=120.0, help="offered rate of the overload run (0: skip)"
    )
    parser.add_argument(
        "--overload-deadline-s", type=float, default=1.0, help="callers' deadline under overload"
    )
    parser.add_argument("--overload-ranker-args", type=shlex.split, default=[],
                        help="extra ranker flags for the overload run, one string (e.g. an admission setting)")  # fmt: skip
    parser.add_argument("--front-door-scenarios", nargs="*", default=list(FRONT_DOOR_SCENARIOS),
                        choices=list(FRONT_DOOR_SCENARIOS), help="front-door abuse scenarios (none given: skip)")  # fmt: skip
    parser.add_argument("--oversized-calls", type=int, default=5, help="router_oversized_header: 100 KB calls")  # fmt: skip
    parser.add_argument("--attack-s", type=float, default=5.0, help="rapid_reset: how long the attack runs")
    parser.add_argument("--mismatch-users", type=int, default=12, help="prefix_content_mismatch: users")
    parser.add_argument("--mismatch-prefix-len", type=int, default=1000,
                        help="prefix_content_mismatch: long-term tokens per prefix")  # fmt: skip
    parser.add_argument("--trigger-scenarios", nargs="*", default=list(TRIGGER_SCENARIOS),
                        choices=list(TRIGGER_SCENARIOS), help="poison pills and size limits (bench/trigger_faults.py)")  # fmt: skip
    parser.add_argument("--poison-valid-events", type=int, default=40,
                        help="trigger scenarios: valid events among the poison pills")  # fmt: skip
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    records = [run_scenario(name, args) for name in args.scenarios]
    records += [FRONT_DOOR_SCENARIOS[name](args) for name in args.front_door_scenarios]
    records += [TRIGGER_SCENARIOS[name](args) for name in args.trigger_scenarios]
    if args.overload_rate:
        records.append(run_overload(args))
    if args.fuzz:
        from bench.fuzz import run_fuzz

        fuzz = run_fuzz(malformed_count=args.fuzz, good_count=500, seed=args.seed)
        print(f"fuzz: {fuzz}", flush=True)
        records.append(fuzz)
    columns = ["scenario", "calls", "failed", "p99_ms_before", "p99_ms_during", "p99_ms_after", "recovery_s",
               "preinfers_lost"]  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    print("wrote", *write_result("faults", config, records, columns, out_dir=out_dir))


if __name__ == "__main__":
    main()
