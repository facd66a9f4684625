"""psi's allocation churn against the device's caching allocator: does it stall, and which setting ends it.

    python -m bench.psi_alloc --device cuda                        # the mix, 60000 MiB of psi
    python -m bench.psi_alloc --device cuda --prefix-len 4096      # one length
    python -m bench.psi_alloc --device cpu --duration-s 5 --budget-mb 64   # smoke run (no allocator stats)

Why: on an H100's length mix (k29b, relay at 312.5 req/s) a full ranking that kept a 7889-token
psi took 37.1 ms to launch where the baseline's took 0.8, and the point's P99 went from 22.4 to
32.0 ms: the ranker logged one `allocator_retried` (reserved 73.0 GB for 65.9 allocated; 184
cached blocks freed). psi blocks of many sizes, freed in LRU order while their neighbours live,
fragment PyTorch's caching allocator until a new psi's block fits no free block and no new
segment: it then frees its whole cache, a synchronising stall, and retries.

This replays the relay's psi traffic without the rest of the ranker: the workload's requests
(relaygr.workload, the goodput runs' plan) in ranking order; a returning user whose psi is held
reads it (a hit), any other's full ranking keeps its prefix's psi (`--keep-fraction` of them, a
deterministic draw: the ranker's keep gate kept about half on the mix) in a block of the preset's
psi bytes (psi.psi_memory: K/V of every layer, then the timestamps), evicting the least recently
used psi until the budget holds it (HBMCache's order for consumed psi). Beside the budget the
device keeps `--headroom-mb` free (a ballast tensor takes the rest: the ranker's graphs,
activations and hbm_headroom's margin), so the allocator meets the device's end as the ranker's
does.

Each variant runs in a process of its own (the allocator reads PYTORCH_CUDA_ALLOC_CONF once):
`default`; `expandable` (expandable_segments:True: one segment per stream that grows, so free
neighbours always merge); `gc` (garbage_collection_threshold:0.9: old cached blocks freed before
the device is full); `nosplit` (max_split_size_mb:64: large blocks never split); and each with
`+classes`: psi blocks rounded up to size classes
(--class-ratio apart: services/ranker/psi.py, PsiSizeClasses, what the ranker's
--psi-size-classes allocates) so that a freed block fits later psi of its class. Reported per variant:
the allocator's retries (`num_alloc_retries`) and cudaMalloc / cudaFree calls, peak reserved and
allocated bytes, allocation wall times (p50, p99, max: a retry is the max), hits and evictions.
On the CPU the replay runs (the eviction counts are the same) and allocator figures are None.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import RESULTS_DIR, percentile, write_result
from relaygr.harness import ALLOCATOR_CONFS
from relaygr.workload import WorkloadConfig, generate
from services.ranker.psi import PsiSizeClasses
from shared.modelspec import preset

# The harness's -expandable, -alloc-gc and -alloc-nosplit configurations run the ranker with these.
ALLOC_CONFS = {
    "default": "",
    "expandable": ALLOCATOR_CONFS["expandable"],
    "gc": ALLOCATOR_CONFS["alloc-gc"],
    "nosplit": ALLOCATOR_CONFS["alloc-nosplit"],
}
VARIANTS = (*ALLOC_CONFS, *(f"{name}+classes" for name in ALLOC_CONFS))
MIB = 1 << 20
COLUMNS = ("variant", "alloc_conf", "allocs", "hits", "evictions", "alloc_retries", "ooms", "device_mallocs",
           "device_frees", "reserved_peak_gb", "allocated_peak_gb", "alloc_ms_p50", "alloc_ms_p99",
           "alloc_ms_max", "class_waste", "error")  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One step of the replay: `alloc` a block of nbytes for psi `ident`, or `free` it."""

    kind: str  # "alloc" | "free"
    ident: int
    nbytes: int = 0


@dataclass(frozen=True)
class Churn:
    ops: list[Op]
    hits: int
    allocs: int
    evictions: int
    too_large: int  # psi over the whole budget: never kept


def psi_bytes(prefix_len: int, preset_name: str) -> int:
    """A psi's block for a prefix of this many tokens (ModelSpec.psi_bytes, psi.psi_memory's
    layout: K and V of every layer, then the timestamps)."""
    return preset(preset_name).psi_bytes(prefix_len)


def churn(
    requests: Iterable[tuple[tuple[int, int], int]],
    budget_bytes: int,
    keep_fraction: float = 1.0,
    seed: int = 0,
    footprint: Callable[[int], int] | None = None,
) -> Churn:
    """The psi allocations and frees of a relay that keeps psi from full rankings under an LRU
    byte budget. `requests`: (psi key, block bytes) in ranking order. A held key is a hit (and
    becomes the most recently used); any other keeps its block with probability keep_fraction,
    first freeing the least recently used blocks until it fits. `footprint`: the bytes the
    budget counts for a block (size classes: its class's, as the ranker's cache admits them,
    RelayCache psi_footprint); the ops keep the block's own bytes."""
    counted = footprint if footprint is not None else (lambda n: n)
    draw = random.Random(seed)
    held: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()  # key -> (ident, nbytes)
    used = hits = allocs = evictions = too_large = 0
    ops: list[Op] = []
    for key, nbytes in requests:
        if key in held:
            held.move_to_end(key)
            hits += 1
            continue
        if draw.random() >= keep_fraction:
            continue
        size = counted(nbytes)
        if size > budget_bytes:
            too_large += 1
            continue
        while used + size > budget_bytes:
            _, (ident, evicted) = held.popitem(last=False)
            ops.append(Op("free", ident))
            used -= evicted
            evictions += 1
        ident = allocs
        allocs += 1
        held[key] = (ident, size)
        used += size
        ops.append(Op("alloc", ident, nbytes))
    return Churn(ops, hits, allocs, evictions, too_large)


def plan_requests(args: argparse.Namespace) -> list[tuple[tuple[int, int], int]]:
    """(psi key, psi bytes) of every planned request, in ranking order."""
    config = WorkloadConfig(
        seed=args.seed,
        duration_s=args.duration_s,
        rate_rps=args.rate,
        fixed_prefix_len=args.prefix_len,
        session_mean_requests=args.session_mean_requests,
    )
    reqs = sorted(generate(config).requests, key=lambda r: r.t_rank_s)
    return [((r.user_id, r.prefix_version), psi_bytes(r.prefix_len, args.preset)) for r in reqs]


def replay(
    ops: Sequence[Op], device: str, class_ratio: float, headroom_bytes: int, budget_bytes: int
) -> dict[str, Any]:
    """Runs the ops against the device's allocator (a uint8 block each, classes applied), and
    reports the allocator's figures (None on the CPU) and the allocations' wall times."""
    import torch

    cuda = device == "cuda"
    ballast = None
    if cuda:
        torch.cuda.init()
        free, _total = torch.cuda.mem_get_info()
        spare = free - budget_bytes - headroom_bytes
        if spare > 0:
            ballast = torch.empty(spare, dtype=torch.uint8, device=device)
        torch.cuda.reset_peak_memory_stats()
    classes = PsiSizeClasses(class_ratio) if class_ratio > 1.0 else None
    blocks: dict[int, Any] = {}
    times: list[float] = []
    asked = given = ooms = 0
    for op in ops:
        if op.kind == "free":
            blocks.pop(op.ident, None)
            continue
        size = classes.footprint(op.nbytes) if classes is not None else op.nbytes
        t0 = time.perf_counter()
        try:
            blocks[op.ident] = torch.empty(size, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            ooms += 1
            continue
        finally:
            times.append((time.perf_counter() - t0) * 1e3)
        asked += op.nbytes
        given += size
    row: dict[str, Any] = {
        "ooms": ooms,
        "alloc_ms_p50": round(percentile(times, 50), 4) if times else None,
        "alloc_ms_p99": round(percentile(times, 99), 4) if times else None,
        "alloc_ms_max": round(max(times), 3) if times else None,
        "class_waste": round(given / asked - 1.0, 4) if asked else 0.0,
        "alloc_retries": None,
        "device_mallocs": None,
        "device_frees": None,
        "reserved_peak_gb": None,
        "allocated_peak_gb": None,
        "ballast_gb": round(ballast.numel() / 1e9, 2) if ballast is not None else 0.0,
    }
    if cuda:
        stats = torch.cuda.memory_stats()
        ballast_bytes = ballast.numel() if ballast is not None else 0
        row.update(
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            device_mallocs=int(stats.get("num_device_alloc", 0)),
            device_frees=int(stats.get("num_device_free", 0)),
            reserved_peak_gb=round((stats.get("reserved_bytes.all.peak", 0) - ballast_bytes) / 1e9, 2),
            allocated_peak_gb=round((stats.get("allocated_bytes.all.peak", 0) - ballast_bytes) / 1e9, 2),
        )
    return row


def class_ratio(variant: str, args: argparse.Namespace) -> float:
    """The variant's size classes' ratio (1.0: none)."""
    return args.class_ratio if variant.partition("+")[2] == "classes" else 1.0


def variant_plan(
    variant: str, args: argparse.Namespace, requests: Sequence[tuple[tuple[int, int], int]]
) -> Churn:
    """The variant's churn: with size classes the budget counts class bytes (more evictions)."""
    ratio = class_ratio(variant, args)
    footprint = PsiSizeClasses(ratio).footprint if ratio > 1.0 else None
    return churn(requests, int(args.budget_mb * MIB), args.keep_fraction, args.seed, footprint)


def run_variant(variant: str, args: argparse.Namespace, ops: Sequence[Op]) -> dict[str, Any]:
    name = variant.partition("+")[0]
    budget, headroom = int(args.budget_mb * MIB), int(args.headroom_mb * MIB)
    return replay(ops, args.device, class_ratio(variant, args), headroom, budget) | {
        "variant": variant,
        "alloc_conf": ALLOC_CONFS[name],
    }


def _child(variant: str, argv: Sequence[str]) -> dict[str, Any]:
    """The variant in a process of its own, its allocator configured from the start."""
    name = variant.partition("+")[0]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if ALLOC_CONFS[name]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONFS[name]
    out = subprocess.run(
        [sys.executable, "-m", "bench.psi_alloc", *argv, "--only", variant],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        return {"variant": variant, "alloc_conf": ALLOC_CONFS[name], "error": out.stderr.strip()[-500:]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def parse(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--preset", default="bench")
    p.add_argument(
        "--prefix-len", type=int, default=None, help="every prefix this long (default: the length mix)"
    )
    p.add_argument("--rate", type=float, default=312.5, help="requests per second planned (the order only)")
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--session-mean-requests", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--budget-mb", type=float, default=60000.0, help="psi's budget (the ranker's --hbm-budget-mb)"
    )
    p.add_argument("--headroom-mb", type=float, default=6000.0,
                   help="kept free on the device beside the budget (a ballast takes the rest)")  # fmt: skip
    p.add_argument("--keep-fraction", type=float, default=0.5, help="full rankings whose psi is kept")
    p.add_argument(
        "--class-ratio", type=float, default=1.125, help="size classes' ratio (the +classes variants)"
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--only", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.prefix_len is not None and args.prefix_len < 10:
        p.error("--prefix-len must be >= 10 (the profile's tokens and a behaviour)")
    if args.rate <= 0 or args.duration_s <= 0 or args.budget_mb <= 0 or args.headroom_mb < 0:
        p.error("--rate, --duration-s and --budget-mb must be positive, --headroom-mb >= 0")
    if not 0.0 < args.keep_fraction <= 1.0:
        p.error("--keep-fraction must be in (0, 1]")
    if not 1.0 < args.class_ratio <= 2.0:
        p.error("--class-ratio must be in (1, 2]")
    try:
        preset(args.preset)
    except ValueError as exc:
        p.error(f"--preset: {exc}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device here (--device cpu replays without allocator figures)")
    return p, args


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _, args = parse(argv)
    requests = plan_requests(args)
    if args.only is not None:  # a child: one variant, its row as the last line
        print(json.dumps(run_variant(args.only, args, variant_plan(args.only, args, requests).ops)))
        return
    rows = []
    plans: dict[float, Churn] = {}  # by class ratio: the variants without classes share one plan
    for variant in args.variants:
        ratio = class_ratio(variant, args)
        if ratio not in plans:
            plans[ratio] = variant_plan(variant, args, requests)
        plan = plans[ratio]
        counts = {"allocs": plan.allocs, "hits": plan.hits, "evictions": plan.evictions}
        # CUDA: each in its own process (the allocator's settings are read once); CPU: here.
        row = _child(variant, argv) if args.device == "cuda" else run_variant(variant, args, plan.ops)
        rows.append(row | counts)
        print({k: row.get(k) for k in COLUMNS if k in row} | counts, flush=True)
    plan = plans.get(1.0) or variant_plan("default", args, requests)
    too_large = max(p.too_large for p in plans.values())
    config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "only")} | {"too_large": too_large}
    paths = write_result("psi-alloc", config, rows, COLUMNS, out_dir=args.out_dir, tag=args.tag,
                         header=f"psi's allocation churn (bench/psi_alloc.py): {plan.allocs} blocks kept, "
                         f"{plan.evictions} evicted, {plan.hits} hits without size classes (with them: each "
                         f"row's); budget {args.budget_mb:g} MiB, "
                         f"{args.headroom_mb:g} MiB free beside it; "
                         f"{'L' + str(args.prefix_len) if args.prefix_len else 'the length mix'}.\n\n")  # fmt: skip
    print("wrote", *paths)


if __name__ == "__main__":
    main()
