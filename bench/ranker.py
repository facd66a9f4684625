"""Ranker benchmark: psi demote / reload through the expander's shared-memory arena, recompute,
and Rank through gRPC on an HBM hit at a light steady load.

    python -m bench.ranker                          # bench preset on the GPU, prefixes 1k..16k
    python -m bench.ranker --preset tiny --device cpu --prefix-lens 512 1024 --samples 10   # CPU smoke run

Phase 1: a real expander daemon (subprocess) and one ranker in this process. Per prefix length:
recompute_ms (pre-inference), demote_ms (HBM -> arena, reserve to commit), reload_ms and
reload_gbps (arena -> HBM, acquire to release).
Phase 2: one ranker in its own process, this process as its gRPC client on loopback. Per prefix
length: rank_p50/p99_ms, the client-side latency of Rank calls that hit psi in HBM, one at a time
(each preceded by its PreInfer and polling until psi is resident). 64 recent tokens, 256 candidates.
Writes bench/results/ranker-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.report import RESULTS_DIR, median, percentile, write_result
from relaygr.processes import ServiceProcess
from relaygr.synthetic import Shape
from relaygr.synthetic import request as synthetic_request
from services.ranker.config import RankerConfig
from services.ranker.service import RankerService
from services.ranker.transfer import host_meta, host_nbytes
from services.ranker.wire import by_reference, preinfer_request, rank_request
from shared.config import load_config
from shared.fingerprint import CHUNK_TOKENS
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc


def start_expander(socket_path: str, arena_bytes: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.expander",
            "--socket-path",
            socket_path,
            "--arena-bytes",
            str(arena_bytes),
        ],
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        if b"expander_ready" in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the expander did not start")


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="relaygr-bench-")
    socket_path = os.path.join(tmp, "expander.sock")
    expander = start_expander(socket_path, args.arena_gb * 2**30)
    flags = ["--preset", args.preset, "--device", args.device, "--host-tier", "true", "--expander-socket-path", socket_path,
             "--hbm-budget-mb", str(args.hbm_budget_mb), "--max-wait-ms", "0", "--log-level", "warning"]  # fmt: skip
    service = RankerService(load_config(RankerConfig, flags))
    await service.start()
    engine, host = service.engine, service.host
    if host is None or not host.connected:
        raise RuntimeError("the ranker could not reach the expander")
    results = []
    try:
        for prefix_len in args.prefix_lens:
            # One user per length: (user, prefix version) must name one prefix, or psi would be reused.
            gen = torch.Generator().manual_seed(prefix_len)
            prefix, _ = synthetic_request(
                gen, prefix_len, Shape(16, prefix_len - 16, args.recent, args.candidates)
            )
            recompute, demote, reload = [], [], []
            psi = None
            for _ in range(args.reps):
                t0 = time.perf_counter()
                psi = await engine.preinfer(prefix)
                recompute.append((time.perf_counter() - t0) * 1e3)
            assert psi is not None
            nbytes = host_nbytes(host_meta(psi))
            for i in range(args.reps):
                probe = dataclasses.replace(
                    psi.key, prefix_version=10_000 + i
                )  # a fresh arena entry each rep
                t0 = time.perf_counter()
                ok = await host.demote(probe, psi, engine)
                demote.append((time.perf_counter() - t0) * 1e3)
                if not ok:
                    raise RuntimeError("demotion refused: is the arena large enough?")
                t0 = time.perf_counter()
                back = await host.reload(probe, engine)
                reload.append((time.perf_counter() - t0) * 1e3)
                if back is None or back.kv.shape != psi.kv.shape:
                    raise RuntimeError("the reload did not return the demoted psi")
            row = {
                "prefix_len": prefix_len,
                "psi_bytes": nbytes,
                "reload_ms": median(reload),
                "reload_gbps": nbytes / (median(reload) * 1e-3) / 1e9,
                "recompute_ms": median(recompute),
                "demote_ms": median(demote),
                "demote_gbps": nbytes / (median(demote) * 1e-3) / 1e9,
            }
            results.append(row)
            print(
                f"P={prefix_len:6d}  psi {nbytes / 2**20:7.1f} MiB  recompute {row['recompute_ms']:8.2f} ms  "
                f"demote {row['demote_ms']:7.2f} ms  reload {row['reload_ms']:7.2f} ms "
                f"({row['reload_gbps']:5.1f} GB/s)",
                flush=True,
            )
    finally:
        await service.shutdown(grace_s=1.0)
        expander.terminate()
        expander.wait(10)
    del service, engine, host
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the ranker process of the next phase shares the device
    return results


async def wait_resident_remote(stub: Any, prefix: Any, request_id: str, timeout_s: float = 30.0) -> None:
    """Polls PreInfer (idempotent; it takes no new work for a psi already there) until resident."""
    request = preinfer_request(prefix, request_id)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        reply = await stub.PreInfer(request, timeout=10)
        if reply.outcome == pb.PreInferReply.ALREADY_RESIDENT:
            return
        if reply.outcome == pb.PreInferReply.REFUSED:
            raise RuntimeError(f"pre-inference refused: {reply.reason}")
        await asyncio.sleep(0.001)
    raise TimeoutError(f"psi of user {prefix.user_id} never became resident")


async def rank_latency(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Rank through gRPC on HBM hits, one call at a time, against a ranker in its own process
    (as deployed: the caller's serialisation and the server never share an interpreter)."""
    # info: ranker_ready, which this waits for, is an info line.
    flags = ["--preset", args.preset, "--device", args.device, "--hbm-budget-mb", str(args.hbm_budget_mb),
             "--max-wait-ms", "0", "--log-level", "info"]  # fmt: skip
    if args.ranker_cpus:
        flags += ["--cpu-affinity", args.ranker_cpus]
    ranker = ServiceProcess("services.ranker", *flags)
    out: dict[int, dict[str, Any]] = {}
    try:
        port = ranker.wait_event("ranker_ready", 600)["port"]
        if args.client_cpus:  # only now: the ranker was started with this process's full CPU set
            os.sched_setaffinity(0, parse_cpus(args.client_cpus))
        options = [("grpc.max_send_message_length", 64 << 20)]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        stub = pb_grpc.RankerStub(channel)
        # Three clients take turns, call by call: a blocking stub sending the call as the router
        # forwards it to the instance holding psi (the prefix by reference: rank_p50/p99_ms),
        # the same stub sending the prefix itself (rank_*_with_prefix), and an asyncio stub
        # by reference (rank_*_aio_client).
        sync_channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        sync_stub = pb_grpc.RankerStub(sync_channel)
        for prefix_len in args.prefix_lens:
            gen = torch.Generator().manual_seed(prefix_len)
            prefix, suffix = synthetic_request(
                gen, prefix_len, Shape(16, prefix_len - 16, args.recent, args.candidates)
            )
            request = rank_request(prefix, suffix, "bench")
            slim = by_reference(request)
            await stub.Rank(request, timeout=60)  # full: warms the path
            timed: dict[str, list[float]] = {"ref": [], "prefix": [], "aio": []}
            server: dict[str, list[float]] = {"total": [], "compute": [], "queue": [], "cache": []}
            served: dict[int, int] = {}
            # The client's own collector must not land inside a timed call: automatic collection
            # is off while sampling, and a young-generation pass runs in every pause instead.
            gc.collect()
            gc.freeze()
            gc.disable()
            steal_before = cpu_steal_ticks()
            for i in range(3 * args.samples + 3):
                await wait_resident_remote(stub, prefix, f"p{prefix_len}-{i}")
                mode = ("ref", "prefix", "aio")[i % 3]
                t0 = time.perf_counter()
                if mode == "aio":
                    reply = await stub.Rank(slim, timeout=60)
                else:
                    reply = sync_stub.Rank(slim if mode == "ref" else request, timeout=60)
                ms = (time.perf_counter() - t0) * 1e3
                served[reply.served_by] = served.get(reply.served_by, 0) + 1
                if i >= 3 and reply.served_by == pb.HBM_HIT:
                    timed[mode].append(ms)
                    if mode == "ref":
                        t = reply.timings
                        for name, value in (("total", t.total_ms), ("compute", t.compute_ms), ("queue", t.queue_ms),
                                            ("cache", t.cache_ms)):  # fmt: skip
                            server[name].append(value)
                gc.collect(0)
                await asyncio.sleep(args.gap_ms / 1e3)
            gc.enable()
            steal = cpu_steal_ticks()
            rank_ms, aio_ms, with_prefix_ms = timed["ref"], timed["aio"], timed["prefix"]
            out[prefix_len] = {
                "rank_p50_ms": percentile(rank_ms, 50),
                "rank_p99_ms": percentile(rank_ms, 99),
                "rank_p999_ms": percentile(rank_ms, 99.9),
                "rank_samples": len(rank_ms),
                "rank_p50_ms_with_prefix": percentile(with_prefix_ms, 50),
                "rank_p99_ms_with_prefix": percentile(with_prefix_ms, 99),
                "rank_p999_ms_with_prefix": percentile(with_prefix_ms, 99.9),
                # Time the hypervisor gave this VM's CPUs to others while sampling (all CPUs): a
                # noisy host shows here first.
                "cpu_steal_pct": 100.0 * (steal[0] - steal_before[0]) / max(1, steal[1] - steal_before[1]),
                "rank_p50_ms_aio_client": percentile(aio_ms, 50),
                "rank_p99_ms_aio_client": percentile(aio_ms, 99),
                # Where a hit's time goes, server side (p50): handler total, the batch's compute,
                # waiting for the engine; the rest of rank_p50_ms is gRPC and the client.
                "server_total_p50_ms": percentile(server["total"], 50),
                "server_compute_p50_ms": percentile(server["compute"], 50),
                "server_queue_p50_ms": percentile(server["queue"], 50),
                "served_by": {pb.ServedBy.Name(k): v for k, v in served.items()},
            }
            r = out[prefix_len]
            print(
                f"P={prefix_len:6d}  rank p50 {r['rank_p50_ms']:6.2f} / p99 {r['rank_p99_ms']:6.2f} ms "
                f"(with prefix {r['rank_p50_ms_with_prefix']:.2f} / {r['rank_p99_ms_with_prefix']:.2f}) "
                f"(aio client {r['rank_p50_ms_aio_client']:.2f} / {r['rank_p99_ms_aio_client']:.2f}) "
                f"(server {r['server_total_p50_ms']:.2f}, compute {r['server_compute_p50_ms']:.2f}, "
                f"queue {r['server_queue_p50_ms']:.2f})  served {r['served_by']}",
                flush=True,
            )
        await channel.close()
        sync_channel.close()
    finally:
        ranker.stop()
    return out


def cpu_steal_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far, from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def parse_cpus(text: str) -> set[int]:
    """ "0-3,8" -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def fingerprint_cost(prefix_len: int, reps: int = 200) -> dict[str, float]:
    """CPU microseconds per call (median of `reps`) of what names psi by content on the Rank hit
    path, for a prefix of prefix_len tokens (16 of them profile): `fingerprint_us`, the chained
    hash of the prefix's wire bytes that the ranker computes for a call carrying its prefix
    (shared/fingerprint.py); `by_reference_us`, the router's rewrite of such a call into one by
    reference (scan, hash, check against the resident fingerprint, splice)."""
    import numpy as np

    from services.router.passthrough import rank_by_reference
    from shared.fingerprint import prefix_fingerprint
    from shared.wire import behaviors_message, encode, prefix_message

    rng = np.random.default_rng(prefix_len)
    n = prefix_len - 16
    items, actions, stamps = (
        rng.integers(0, 1 << 20, n),
        rng.integers(0, 4, n),
        np.sort(rng.integers(0, 1 << 31, n)),
    )
    prefix = prefix_message(1, 1, np.arange(16), items, actions, stamps)
    lt = prefix.long_term
    request = pb.RankRequest(
        request_id="r", user_id=1, prefix_version=1, prefix=prefix,
        recent=behaviors_message(items[:64], actions[:64], stamps[:64]), candidates_le=encode(items[:256]),
    ).SerializeToString()  # fmt: skip
    resident = prefix_fingerprint(prefix.profile_le, lt.items_le, lt.actions_le, lt.timestamps_le).digest

    def per_call_us(fn: Any) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return round(median(times), 1)

    return {
        "fingerprint_us": per_call_us(
            lambda: prefix_fingerprint(prefix.profile_le, lt.items_le, lt.actions_le, lt.timestamps_le)
        ),
        "by_reference_us": per_call_us(lambda: rank_by_reference(request, resident)),
    }


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = await run(args)
    latency = await rank_latency(args)
    return [row | latency.get(row["prefix_len"], {}) | fingerprint_cost(row["prefix_len"]) for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5, help="demote / reload / recompute repetitions")
    parser.add_argument("--samples", type=int, default=50, help="Rank calls per prefix length")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="pause between Rank calls (light load)")
    parser.add_argument("--arena-gb", type=int, default=8)
    parser.add_argument("--hbm-budget-mb", type=float, default=16384)
    parser.add_argument(
        "--ranker-cpus", default="", help="CPUs of the ranker process (e.g. 0-3; default all)"
    )
    parser.add_argument("--client-cpus", default="", help="CPUs of this client (e.g. 4-5; default all)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    if args.ranker_cpus:
        args.ranker_cpus = ",".join(map(str, sorted(parse_cpus(args.ranker_cpus))))
    results = asyncio.run(run_all(args))
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    config["rank_timing"] = (
        "client-side Rank latency over gRPC loopback on HBM hits, one call at a time, ranker in its "
        "own process; blocking stub, the call as the router forwards it to the instance holding psi "
        "(prefix by reference); rank_*_with_prefix: the same call carrying its prefix; "
        "rank_*_aio_client: asyncio stub, by reference; the client's garbage collector runs between "
        "calls, never inside one"
    )
    config["fingerprint_timing"] = (
        "fingerprint_us / by_reference_us: CPU of this client process, median per call (see "
        "fingerprint_cost); chunk of " + str(CHUNK_TOKENS) + " tokens"
    )
    columns = ["prefix_len", "psi_bytes", "recompute_ms", "demote_ms", "reload_ms", "reload_gbps",
               "rank_p50_ms", "rank_p99_ms", "rank_p999_ms", "rank_p99_ms_with_prefix", "rank_samples", "cpu_steal_pct",
               "fingerprint_us", "by_reference_us"]  # fmt: skip
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    print("wrote", *write_result("ranker", config, results, columns, out_dir=out_dir))


if __name__ == "__main__":
    main()
