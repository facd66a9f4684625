"""Router and trigger benchmark (CPU is fine): what the router adds to a ranking call, and how many
retrieval events per second the trigger decides on one core.

    python -m bench.router [--calls 4000] [--runs 3] [--events 50000] [--layout pinned|shared]

Router: one ranker and two routers as real processes on loopback (`python -m services.router`,
so with the router's own process settings, health checks aside: TOLERANT_CHECKS), one per front door: the hand-written HTTP/2 frame
relay (`--front-door relay`, services/router/frontdoor/relay.py) and the router's gRPC server
(`--front-door grpc`). (A third door, the same relay on the h2 library, lost on CPU per call in
all nine runs of bench/results/router-cpu.json and was removed.)
The same Rank request (a short prefix, so the ranker's own time is small) is sent from this
process directly and through each, one call at a time, alternating in chunks of 50 so all paths
see the same machine state; `--calls` per path. Reported: p50/p99 of each and
router_added_p99_ms = p99(routed) - p99(direct) (every call counts) for the hand-written relay,
grpc_front_door_added_* for the other; a fourth path through the smallest
grpc.aio proxy (bench/bare_proxy.py, same core) gives bare_proxy_added_*, the cost of a Python
gRPC hop on the machine, in the same run. *_cpu_ms_per_call: CPU time of each proxy process (all
threads, from /proc) while its own chunks ran, per call.
`--runs`: the whole comparison that many times, fresh processes each time, one record per run
(with the 1-minute load average before it); the JSON's "decision" applies issue 17's rule: the
hand-written relay stays the default only if it beats the gRPC front door by more than the
run-to-run spread (router_added_p99_ms; CPU per call breaks a tie), else the gRPC front door.
Layout (recorded in the JSON's config):
  pinned  (default) what the router adds on one core: the router on the last core (no other
          process of the benchmark there); this client and the ranker on the first core (the
          ranker, started there, computes with one thread), for direct and routed calls alike.
          Measure on a quiet machine: anything else busy on the router's core shows up in its tail.
  shared  the scheduler places every process on any core.
Trigger: the retrieval topic is filled first (events with the workload's length mix), then a
trigger runs in this process (uvloop, one thread) against the embedded broker and one ranker;
events/s = events / time to decide all, decision p99 from per-event timings.
--tls: every hop (client, proxies, ranker) over mutual TLS with certificates made for the run;
writes router-tls-<machine>.json instead.
Writes bench/results/router-<machine>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.report import percentile, write_result
from relaygr.processes import ServiceProcess
from relaygr.synthetic import Shape, request
from relaygr.workload import SHAPE_PATH
from services.ranker.wire import prefix_to_proto, rank_request
from services.trigger.config import TriggerConfig
from services.trigger.service import TriggerService
from shared.broker import EmbeddedBroker, free_port
from shared.config import load_config
from shared.kafka import KafkaSettings, ensure_topics, make_producer
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2_grpc as pb_grpc
from shared.tls import PLAINTEXT, TlsSettings


async def time_calls(stub: Any, req: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await stub.Rank(req, timeout=30)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def layout_cpus(layout: str) -> dict[str, list[int]]:
    """{"client_and_ranker": [...], "router": [...]} for `layout` ({} for "shared")."""
    if layout == "shared":
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--layout pinned needs two cores, this process may use {cpus}: use --layout shared")
    return {"client_and_ranker": cpus[:1], "router": cpus[-1:]}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by every thread of process `pid` (Linux /proc)."""
    ticks = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread has just exited
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def pin_threads(pid: int, cpus: set[int] | list[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit the mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread has just exited
            continue


@contextmanager
def pinned_here(cpus: list[int] | None) -> Iterator[None]:
    """This process on `cpus` while the block runs (children started in it inherit them), every
    thread back where it was afterwards (the trigger benchmark that follows runs unpinned)."""
    if not cpus:
        yield
        return
    saved = os.sched_getaffinity(0)
    pin_threads(os.getpid(), cpus)
    try:
        yield
    finally:
        pin_threads(os.getpid(), saved)


def pem_files(tls: TlsSettings) -> tuple[str, ...]:
    return (tls.tls_ca, tls.tls_cert, tls.tls_key) if tls.tls_enabled else ()


def tls_flags(tls: TlsSettings) -> list[str]:
    return (
        ["--tls-ca", tls.tls_ca, "--tls-cert", tls.tls_cert, "--tls-key", tls.tls_key]
        if tls.tls_enabled
        else []
    )


# Health checks that a busy machine does not fail: on the shared 2-core build machine a ranker
# starved for 2 x 250 ms (the defaults) was dropped from every router's fleet mid-run.
TOLERANT_CHECKS = ("--check-timeout-ms", "2000", "--fail-after", "5")


async def router_overhead(
    calls: int, broker: EmbeddedBroker, cpus: dict[str, list[int]], tls_dir: Path | None = None
) -> dict[str, float]:
    """What each front door (and the bare proxy) adds; every hop over mutual TLS with `tls_dir`
    (certificates for the ranker, the proxies and this client are made there)."""
    ranker_tls = proxy_tls = client_tls = PLAINTEXT
    if tls_dir is not None:
        from tests.certs import issue, make_ca  # cryptography: a dev dependency, as the benchmarks

        ca = make_ca("relaygr-bench-ca")
        ranker_tls, proxy_tls, client_tls = (
            issue(ca, name, tls_dir / name) for name in ("ranker", "proxy", "client")
        )
    with pinned_here(cpus.get("client_and_ranker")):
        ranker = ServiceProcess("services.ranker", "--device", "cpu", *tls_flags(ranker_tls))
        target = f"127.0.0.1:{ranker.wait_event('ranker_ready', 120)['port']}"
        routers = {
            door: ServiceProcess("services.router", "--rankers", target, "--bootstrap", broker.bootstrap,
                                 "--consume-signals", "false", "--front-door", door,
                                 *TOLERANT_CHECKS, *tls_flags(proxy_tls))
            for door in ("relay", "grpc")
        }  # fmt: skip
        bare_port = free_port()
        bare = ServiceProcess("bench.bare_proxy", str(bare_port), target, *pem_files(proxy_tls))
        try:
            ports = {door: router.wait_event("router_ready", 120)["port"] for door, router in routers.items()}
            bare.wait_event("bare_proxy_ready", 60)
            if "router" in cpus:  # the router's core, for every proxy (they never run at once)
                for proc in (*routers.values(), bare):
                    pin_threads(proc.proc.pid, cpus["router"])
            channels = {name: client_tls.channel(address) for name, address in
                        (("direct", target), ("routed", f"127.0.0.1:{ports['relay']}"),
                         ("routed_grpc", f"127.0.0.1:{ports['grpc']}"), ("bare", f"127.0.0.1:{bare_port}"))}  # fmt: skip
            prefix, suffix = request(torch.Generator().manual_seed(0), 1, Shape(4, 60, 8, 32))
            req = rank_request(prefix, suffix, "bench")
            stubs = {name: pb_grpc.RankerStub(channel) for name, channel in channels.items()}
            for stub in stubs.values():
                await time_calls(stub, req, 50)
            ms: dict[str, list[float]] = {name: [] for name in stubs}
            # The CPU each proxy process spends while its own chunks run (health checks and other
            # background work included): what one routed call costs the router's core.
            pids = {"routed": routers["relay"].proc.pid, "routed_grpc": routers["grpc"].proc.pid,
                    "bare": bare.proc.pid}  # fmt: skip
            cpu_s = dict.fromkeys(pids, 0.0)
            # This client's collector runs between chunks, never inside a timed call (it would
            # land on either path at random and only add noise to the difference).
            gc.collect()
            gc.freeze()
            gc.disable()
            try:
                for _ in range(calls // 50):  # alternate in chunks: all see the same machine state
                    for name, stub in stubs.items():
                        before = process_cpu_s(pids[name]) if name in pids else 0.0
                        ms[name] += await time_calls(stub, req, 50)
                        if name in pids:
                            cpu_s[name] += process_cpu_s(pids[name]) - before
                    gc.collect(1)
            finally:
                gc.enable()
            for channel in channels.values():
                await channel.close()
        finally:
            bare.stop()
            for router in routers.values():
                router.stop()
            ranker.stop()
    d_ms, r_ms, g_ms, b_ms = ms["direct"], ms["routed"], ms["routed_grpc"], ms["bare"]
    return {
        "rank_p50_ms_direct": percentile(d_ms, 50),
        "rank_p99_ms_direct": percentile(d_ms, 99),
        "rank_p50_ms_routed": percentile(r_ms, 50),
        "rank_p99_ms_routed": percentile(r_ms, 99),
        "router_added_p50_ms": percentile(r_ms, 50) - percentile(d_ms, 50),
        "router_added_p99_ms": percentile(r_ms, 99) - percentile(d_ms, 99),
        # The same router with its gRPC server as the front door (RELAYGR_ROUTER_FRONT_DOOR=grpc),
        # same run, same core.
        "grpc_front_door_added_p50_ms": percentile(g_ms, 50) - percentile(d_ms, 50),
        "grpc_front_door_added_p99_ms": percentile(g_ms, 99) - percentile(d_ms, 99),
        # The same hop through the smallest grpc.aio proxy (bench/bare_proxy.py), same run, same
        # core: the floor a Python gRPC router starts from on this machine.
        "bare_proxy_added_p50_ms": percentile(b_ms, 50) - percentile(d_ms, 50),
        "bare_proxy_added_p99_ms": percentile(b_ms, 99) - percentile(d_ms, 99),
        "router_cpu_ms_per_call": cpu_s["routed"] * 1e3 / len(r_ms),
        "grpc_front_door_cpu_ms_per_call": cpu_s["routed_grpc"] * 1e3 / len(g_ms),
        "bare_proxy_cpu_ms_per_call": cpu_s["bare"] * 1e3 / len(b_ms),
        "rank_calls_each": len(d_ms),
    }


def workload_lengths(n: int, seed: int) -> np.ndarray:
    """Prefix lengths with the ML-100K shape scaled x4 (the trigger sees only the length)."""
    shape = json.loads(SHAPE_PATH.read_text())
    rng = np.random.default_rng(seed)
    return rng.choice(np.array(shape["history_lengths"]) * 4, size=n)


async def trigger_throughput(events: int, broker: EmbeddedBroker) -> dict[str, float]:
    settings = KafkaSettings(bootstrap=broker.bootstrap)
    topic = "bench.retrieval"
    await ensure_topics(settings, {topic: 8})
    producer = make_producer(settings, max_batch_size=1 << 20, linger_ms=5)
    await producer.start()
    template_cache: dict[int, bytes] = {}
    now = int(time.time() * 1e3)
    for i, length in enumerate(workload_lengths(events, 1)):
        length = int(length)
        if length not in template_cache:
            prefix, _ = request(torch.Generator().manual_seed(length), 0, Shape(8, length - 8, 0, 1))
            template_cache[length] = prefix_to_proto(prefix).SerializeToString()
        event = ev.RetrievalEvent(schema_version=1, request_id=f"b{i}", event_time_unix_ms=now, user_id=i,
                                  prefix_version=1, prefix_len=length, ranking_deadline_unix_ms=now + 60_000)  # fmt: skip
        prefix_msg = event.prefix
        prefix_msg.ParseFromString(template_cache[length])
        prefix_msg.user_id = i
        await producer.send(topic, event.SerializeToString(), key=str(i).encode())
    await producer.flush()
    await producer.stop()
    ranker = ServiceProcess("services.ranker", "--device", "cpu")
    target = f"127.0.0.1:{ranker.wait_event('ranker_ready', 120)['port']}"
    try:
        config = load_config(TriggerConfig, ["--bootstrap", broker.bootstrap, "--rankers", target,
                                             "--retrieval-topic", topic, "--log-level", "warning",
                                             "--slo-ms", "50", "--suffix-tokens-estimate", "320"])  # fmt: skip
        trigger = TriggerService(config)
        await trigger.start()
        start = None
        while True:
            decided = sum(trigger.counts.values())
            if start is None and decided:
                start = time.perf_counter()
            if decided >= events:
                break
            await asyncio.sleep(0.01)
        assert start is not None
        elapsed = time.perf_counter() - start
        await trigger.shutdown()
    finally:
        ranker.stop()
    ns = trigger.decision_ns
    return {
        "trigger_events": events,
        "trigger_events_per_s": events / elapsed,
        "trigger_decision_p50_ms": percentile(ns, 50) / 1e6,
        "trigger_decision_p99_ms": percentile(ns, 99) / 1e6,
        "trigger_admitted": trigger.counts["admitted"],
        "trigger_not_at_risk": trigger.counts["not_at_risk"],
    }


# Each front door's fields in a run's record: (added p99, CPU per call).
DOORS = {
    "relay": ("router_added_p99_ms", "router_cpu_ms_per_call"),
    "grpc": ("grpc_front_door_added_p99_ms", "grpc_front_door_cpu_ms_per_call"),
    "bare_proxy": ("bare_proxy_added_p99_ms", "bare_proxy_cpu_ms_per_call"),
}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per front door over the runs: mean, min, max and spread (max - min) of added p99 and CPU per
    call; and issue 17's decision. The hand-written relay beats another door when its mean added
    p99 is lower by more than the larger spread of the two; when the p99 difference is within
    that spread, CPU per call decides the same way. It stays the default only if it beats the gRPC
    front door, else the gRPC front door becomes the default."""
    stats: dict[str, Any] = {}
    for door, fields in DOORS.items():
        stats[door] = {}
        for field in fields:
            values = [float(row[field]) for row in rows]
            stats[door][field] = {"mean": float(np.mean(values)), "min": min(values), "max": max(values),
                                  "spread": max(values) - min(values)}  # fmt: skip
    verdicts = {}
    for other in ("grpc",):
        verdict = "tie"
        for i in range(2):  # p99 first; CPU per call breaks a tie
            mine, theirs = stats["relay"][DOORS["relay"][i]], stats[other][DOORS[other][i]]
            margin, spread = theirs["mean"] - mine["mean"], max(mine["spread"], theirs["spread"])
            if abs(margin) > spread:
                verdict = "relay_wins" if margin > 0 else f"{other}_wins"
                break
        verdicts[other] = verdict
    keep = all(v == "relay_wins" for v in verdicts.values())
    return {
        "runs": len(rows),
        "doors": stats,
        "relay_vs": verdicts,
        "default": "relay" if keep else "grpc",
        "rule": "relay stays default only if it beats grpc by more than the run-to-run spread "
        "(max - min over runs, the larger of the two doors) on mean router_added_p99_ms, CPU per call "
        "as the tie-breaker; otherwise grpc",
    }


def load_average() -> float:
    """The 1-minute load average (other work on this machine shows up in the tails)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


async def run(args: argparse.Namespace, cpus: dict[str, list[int]]) -> list[dict[str, Any]]:
    rows = []
    with EmbeddedBroker.start() as broker, tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            row: dict[str, Any] = {"run": i + 1, "loadavg_1m_before": load_average()}
            print(f"run {row['run']}/{args.runs}: load average {row['loadavg_1m_before']}", flush=True)
            row |= await router_overhead(
                args.calls, broker, cpus, Path(tmp) / f"run{i}" if args.tls else None
            )
            if args.events:
                row |= await trigger_throughput(args.events, broker)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=4000, help="Rank calls per path (direct, routed)")
    parser.add_argument(
        "--runs", type=int, default=3, help="repeats of the whole comparison (fresh processes)"
    )
    parser.add_argument("--layout", choices=("pinned", "shared"), default="pinned",
                        help="where the processes run (see above)")  # fmt: skip
    parser.add_argument("--events", type=int, default=50_000, help="trigger events (0: no trigger run)")
    parser.add_argument("--tls", action="store_true",
                        help="every hop over mutual TLS (test certificates); writes router-tls-<machine>")  # fmt: skip
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    import uvloop

    cpus = layout_cpus(args.layout)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    rows = uvloop.run(run(args, cpus))
    for row in rows:
        for k, v in row.items():
            print(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")
    summary = summarize(rows)
    config = vars(args) | {"machine_cores": os.cpu_count(), "host": socket.gethostname(), "cpus": cpus}
    columns = ["run", "loadavg_1m_before", "rank_p50_ms_direct", "rank_p99_ms_direct", "router_added_p99_ms",
               "grpc_front_door_added_p99_ms", "bare_proxy_added_p99_ms",
               "router_cpu_ms_per_call", "grpc_front_door_cpu_ms_per_call",
               "bare_proxy_cpu_ms_per_call"]  # fmt: skip
    if args.events:
        columns += ["trigger_events_per_s", "trigger_decision_p99_ms"]
    footer = "\n" + summary_table(summary)
    kwargs: dict[str, Any] = {"out_dir": Path(args.out_dir)} if args.out_dir else {}
    paths = write_result(
        "router-tls" if args.tls else "router", config, rows, columns, footer=footer, **kwargs
    )
    record = json.loads(paths[0].read_text())
    paths[0].write_text(json.dumps(record | {"summary": summary}, indent=2) + "\n")
    print(footer)
    print("wrote", *paths)


def summary_table(summary: dict[str, Any]) -> str:
    """The summary as markdown: each door's mean (min-max) over the runs, then the decision."""
    lines = [f"Over {summary['runs']} runs, mean (min-max):", "",
             "| front door | added p99 ms | CPU ms per call |", "|---|---|---|"]  # fmt: skip
    for door, fields in DOORS.items():
        cells = [summary["doors"][door][field] for field in fields]
        lines.append(
            f"| {door} | "
            + " | ".join(f"{c['mean']:.3f} ({c['min']:.3f}-{c['max']:.3f})" for c in cells)
            + " |"
        )
    verdicts = ", ".join(f"vs {door}: {verdict}" for door, verdict in summary["relay_vs"].items())
    lines += [
        "",
        f"Hand-written relay {verdicts}. Default: **{summary['default']}** ({summary['rule']}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
