"""The ranker's host CPU per Rank call, by thread, under an open-loop load: what a host-bound
ranker spends where (the event loop, the device loop, gRPC's own threads).

    python -m bench.ranker_cpu --device cuda --preset bench --prefix-len 1024 --rate 200   # GPU
    python -m bench.ranker_cpu --device cpu --preset tiny --prefix-len 64 --rate 50 --calls 300   # CPU

On the mix a ranker at its limit runs ~0.9 of a core in one interpreter while the device is half
busy (k18, k26, k27): every millisecond of host per call is throughput. This starts one ranker
process per variant and repeat (variants alternate, so a drifting host touches them alike), sends
`--calls` Rank calls at `--rate` (each carries its prefix; a `--returning` share are users seen
before, which a relay ranker answers from the psi its full ranking kept), and reads every thread's
CPU time from /proc before and after: ms of CPU per call for the process, its main thread (the
event loop), the device loop (relaygr-engine) and the rest (gRPC's threads, the stall watch).

Variants (VARIANTS): the baseline's ranker and the relay's, each also with gRPC's older I/O
manager (`GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener`, what the router runs:
on the 2-core build machine it saved ~0.1 ms a routed call; for the ranker it is measured here).
Writes bench/results/ranker-cpu-<device>[-tag].json and .md. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.report import RESULTS_DIR, median, percentile, write_result
from relaygr.cpu_usage import threads_cpu_s
from relaygr.processes import ServiceProcess
from relaygr.synthetic import Shape
from relaygr.synthetic import request as synthetic_request
from services.ranker.wire import rank_request
from shared.protos import ranker_pb2 as pb
from shared.protos import ranker_pb2_grpc as pb_grpc

OLD_IO = "-event_engine_client,-event_engine_listener"
# name -> (ranker flags, environment added)
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "baseline": (("--ranking-psi-min-tokens", "0"), {}),
    "relay": ((), {}),
    "baseline-old-io": (("--ranking-psi-min-tokens", "0"), {"GRPC_EXPERIMENTS": OLD_IO}),
    "relay-old-io": ((), {"GRPC_EXPERIMENTS": OLD_IO}),
}
MAIN, ENGINE, OTHER = "main", "engine", "other"


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of the process's threads (relaygr.cpu_usage), grouped: its main thread,
    the device loop, and every other thread (gRPC's, the stall watch's, ...). Threads gone since
    are not counted: the ranker's live for its lifetime."""
    out = {MAIN: 0.0, ENGINE: 0.0, OTHER: 0.0}
    for key, seconds in threads_cpu_s(pid).items():
        name, tid = key.rsplit("/", 1)
        out[MAIN if int(tid) == pid else ENGINE if name == "relaygr-engine" else OTHER] += seconds
    return out


def requests(args: argparse.Namespace) -> list[pb.RankRequest]:
    """`args.calls` Rank calls, each with its prefix; a `--returning` share repeat an earlier
    user's prefix (same user, version and tokens: psi a relay kept answers it)."""
    gen = torch.Generator().manual_seed(args.seed)
    pick = torch.Generator().manual_seed(args.seed + 1)
    shape = Shape(16, max(args.prefix_len - 16, 0), args.recent, args.candidates)
    made: list[tuple[Any, Any]] = []
    out = []
    for i in range(args.calls):
        if made and float(torch.rand(1, generator=pick)) < args.returning:
            prefix, _ = made[int(torch.randint(0, len(made), (1,), generator=pick))]
            _, suffix = synthetic_request(gen, prefix.user_id, shape)
        else:
            prefix, suffix = synthetic_request(gen, 1 + len(made), shape)
            made.append((prefix, suffix))
        out.append(rank_request(prefix, suffix, f"c{i}"))
    return out


async def drive(port: int, calls: list[pb.RankRequest], rate: float, pid: int) -> dict[str, Any]:
    """Sends `calls` open-loop at `rate`; returns the CPU per call by thread group and the
    client's latencies."""
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = pb_grpc.RankerStub(channel)
        latencies: list[float] = []
        served: dict[str, int] = {}
        failed = 0

        async def one(request: pb.RankRequest) -> None:
            nonlocal failed
            t0 = time.perf_counter()
            try:
                reply = await stub.Rank(request, timeout=30)
            except grpc.aio.AioRpcError:
                failed += 1
                return
            latencies.append((time.perf_counter() - t0) * 1e3)
            label = pb.ServedBy.Name(reply.served_by).lower()
            served[label] = served.get(label, 0) + 1

        before, wall0 = thread_cpu_s(pid), time.monotonic()
        tasks = []
        for i, request in enumerate(calls):
            delay = wall0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        await asyncio.gather(*tasks)
        after, wall = thread_cpu_s(pid), time.monotonic() - wall0
    n = len(calls)
    per_call = {g: (after[g] - before[g]) / n * 1e3 for g in before}
    return {
        "calls": n,
        "failed": failed,
        "wall_s": wall,
        "cpu_ms_per_call": sum(per_call.values()),
        **{f"{g}_cpu_ms_per_call": v for g, v in per_call.items()},
        "cores": sum(after[g] - before[g] for g in before) / wall,
        "p50_ms": percentile(latencies, 50) if latencies else None,
        "p99_ms": percentile(latencies, 99) if latencies else None,
        "served_by": served,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    calls = requests(args)
    warm = requests(argparse.Namespace(**{**vars(args), "seed": args.seed + 7, "calls": args.warmup}))
    rows = []
    for repeat in range(args.repeats):
        for name in args.variants:
            flags, env = VARIANTS[name]
            ranker = ServiceProcess(
                "services.ranker",
                "--preset", args.preset, "--device", args.device, "--hbm-budget-mb", str(args.hbm_budget_mb),
                "--log-level", "info", *flags,
                env={**os.environ, **env},
            )  # fmt: skip
            try:
                port = int(ranker.wait_event("ranker_ready", 600)["port"])
                await drive(port, warm, args.rate, ranker.proc.pid)  # graphs, costs, caches
                row = {
                    "variant": name,
                    "repeat": repeat,
                    **await drive(port, calls, args.rate, ranker.proc.pid),
                }
            finally:
                ranker.stop()
            rows.append(row)
            print(f"{name:16s} r{repeat}  cpu {row['cpu_ms_per_call']:6.3f} ms/call  (main "
                  f"{row['main_cpu_ms_per_call']:.3f}, engine {row['engine_cpu_ms_per_call']:.3f}, other "
                  f"{row['other_cpu_ms_per_call']:.3f})  cores {row['cores']:.2f}  p50 {row['p50_ms']}  "
                  f"p99 {row['p99_ms']}  failed {row['failed']}  {row['served_by']}", flush=True)  # fmt: skip
    for name in args.variants:
        mine = [r for r in rows if r["variant"] == name]
        print(f"{name:16s} median of {len(mine)}: cpu {median([r['cpu_ms_per_call'] for r in mine]):.3f} ms/call, "
              f"main {median([r['main_cpu_ms_per_call'] for r in mine]):.3f}")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="the ranker's --device")
    p.add_argument("--preset", default="bench")
    p.add_argument("--hbm-budget-mb", type=float, default=8000.0)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--recent", type=int, default=64)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--rate", type=float, default=200.0, help="calls a second, open loop")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="calls sent first to each ranker, not counted")
    p.add_argument("--returning", type=float, default=0.3, help="share of calls for users seen before")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    for name, value in (("--rate", args.rate), ("--calls", args.calls), ("--repeats", args.repeats)):
        if not value > 0:
            p.error(f"{name} must be > 0")
    if not 0 <= args.returning < 1:
        p.error("--returning is a share in [0, 1)")
    rows = asyncio.run(run(args))
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["what"] = "ranker process CPU per Rank call by thread group (/proc), open loop, prefixes inline"
    columns = ["variant", "repeat", "cpu_ms_per_call", "main_cpu_ms_per_call", "engine_cpu_ms_per_call",
               "other_cpu_ms_per_call", "cores", "p50_ms", "p99_ms", "failed"]  # fmt: skip
    paths = write_result("ranker-cpu", config, rows, columns, out_dir=args.out_dir, tag=args.tag)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
