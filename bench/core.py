"""Microbenchmark of the relay-race core: full vs preinfer vs rank_cached, with a roofline floor.

    python -m bench.core                      # bench preset on the GPU (the issue's grid)
    python -m bench.core --preset tiny --prefix-lens 256 512 --batches 1 --reps 3   # CPU smoke run

Times are wall-clock per call as the caller sees it (host-side assembly and the input copy
included), medians over --reps after --warmup calls, with the device synchronised around each.
The floor for rank_cached is max(FLOPs / measured matmul peak, bytes / measured copy bandwidth),
both peaks measured in the same run; its FLOP/byte model is `cached_rank_cost` below.
On CUDA, cached_rank_ms is the serving path (a replayed CUDA graph, scores copied to the host,
services/ranker/graphs.py) and cached_eager_ms the same call issued kernel by kernel.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.report import median, write_result
from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker, PrefixChunk
from shared.modelspec import ModelSpec, preset

PROFILE_TOKENS = 16


def cached_rank_cost(
    spec: ModelSpec, prefix_len: int, batch_size: int, recent: int, candidates: int
) -> tuple[int, int]:
    """(FLOPs, bytes) of one rank_cached call: the work that cannot be avoided.

    FLOPs: UVQK and output projections of every suffix token, the scoring head on candidates, and
    attention (QK^T and AV, 4*D per visible key per head per layer).
    Bytes: the weights read once, psi (K and V of every layer) read once, and each layer's
    hidden state read and written once per suffix token. Embedding rows and biases are negligible.
    """
    d, layers, heads, dim = spec.hidden, spec.num_layers, spec.num_heads, spec.head_dim
    el = spec.dtype_bytes
    tokens = batch_size * (recent + candidates)
    linear = tokens * spec.linear_flops_per_token()
    head = batch_size * candidates * 2 * (d * spec.head_hidden + spec.head_hidden)
    keys_recent = sum(prefix_len + i + 1 for i in range(recent))
    keys_cands = candidates * (prefix_len + recent + 1)
    attention = batch_size * layers * heads * 4 * dim * (keys_recent + keys_cands)
    weights = layers * (d * 4 * d + d * d) * el + (d * spec.head_hidden + spec.head_hidden) * el
    psi = batch_size * spec.psi_bytes(prefix_len)
    activations = layers * tokens * 2 * d * el
    return linear + head + attention, weights + psi + activations


def full_cost(spec: ModelSpec, prefix_len: int, batch_size: int, recent: int, candidates: int) -> int:
    """FLOPs of one full pass (every token recomputed): projections of every token, the scoring
    head on candidates, and attention over the visible pairs of prefix + recent (causal) and
    candidates (every history key and themselves)."""
    d, layers, heads, dim = spec.hidden, spec.num_layers, spec.num_heads, spec.head_dim
    n_hist = prefix_len + recent
    tokens = batch_size * (n_hist + candidates)
    linear = tokens * spec.linear_flops_per_token()
    head = batch_size * candidates * 2 * (d * spec.head_hidden + spec.head_hidden)
    pairs = n_hist * (n_hist + 1) // 2 + candidates * (n_hist + 1)
    return linear + head + batch_size * layers * heads * 4 * dim * pairs


def time_call(fn: Callable[[], Any], sync: Callable[[], None], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return median(samples)


def measure_peaks(device: torch.device, sync: Callable[[], None]) -> tuple[float, float]:
    """(bf16 matmul TFLOP/s, copy GB/s counting bytes read and written), measured now."""
    if device.type == "cpu":
        n, dtype = 1024, torch.float32
    else:
        n, dtype = 8192, torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = time_call(lambda: a @ b, sync, reps=10, warmup=3)
    tflops = 2 * n**3 / (mm_ms * 1e-3) / 1e12
    numel = (1 << 28) if device.type != "cpu" else (1 << 24)
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    cp_ms = time_call(lambda: dst.copy_(src), sync, reps=10, warmup=3)
    gbps = 2 * src.numel() * 4 / (cp_ms * 1e-3) / 1e9
    return tflops, gbps


def profile_cached(
    model: HSTURanker,
    graphs: Any,
    prefix_len: int,
    batch_size: int,
    args: argparse.Namespace,
    sync: Callable[[], None],
) -> list[dict[str, Any]]:
    """Prints where one call's device time goes: the top kernels by device time (torch.profiler,
    averaged over the calls) beside the wall-clock time per call and the device's timeline
    (kernel_timeline), for cached ranking (the replayed graph and the eager path) and, with
    args.profile_full, the full pass. Returns one row per call kind (the results file's
    `profile`)."""
    from torch.profiler import ProfilerActivity, profile

    shape = Shape(PROFILE_TOKENS, prefix_len - PROFILE_TOKENS, args.recent, args.candidates)
    prefixes, suffixes = batch(prefix_len * 31 + batch_size, [shape] * batch_size)
    keys = [model.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest) for p in prefixes]
    psis = model.preinfer(prefixes)
    calls: dict[str, Callable[[], Any]] = {"eager": lambda: model.rank_cached(suffixes, psis, keys)}
    if graphs is not None:
        calls["graph"] = lambda: graphs.rank(suffixes, psis, keys)
    if args.profile_full:
        calls["full"] = lambda: model.full(prefixes, suffixes)
    reps = 5
    rows: list[dict[str, Any]] = []
    on_cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    for label, fn in calls.items():
        for _ in range(3):
            fn()
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            wall_ms = (time.perf_counter() - t0) * 1e3 / reps
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        device_ms = sum(e.self_device_time_total for e in events) / 1e3 / reps
        intervals = [(e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
        row: dict[str, Any] = {"call": label, "prefix_len": prefix_len, "batch": batch_size,
                               "wall_ms": wall_ms, "kernel_ms": device_ms}  # fmt: skip
        timeline = ""
        if intervals:  # none on the CPU, which has no device timeline apart from the host's
            try:
                row.update(kernel_timeline(intervals, reps))
                timeline = (f"; per call: device span {row['span_ms']:.3f} ms, busy {row['busy_ms']:.3f}, "
                            f"idle within the span {row['idle_in_span_ms']:.3f}, "
                            f"device idle between calls {row['between_calls_ms']:.3f}")  # fmt: skip
            except ValueError as exc:  # calls that did not issue alike (a one-off copy): no split
                row["timeline_error"] = str(exc)
                timeline = f"; no timeline: {exc}"
        rows.append(row)
        print(f"profile {label} P={prefix_len} B={batch_size}: wall {wall_ms:.3f} ms/call, "
              f"device kernels {device_ms:.3f} ms/call{timeline}")  # fmt: skip
        for e in events[:14]:
            print(f"  {e.self_device_time_total / 1e3 / reps:8.3f} ms  x{e.count // reps:4d}  {e.key[:90]}")
    return rows


def kernel_timeline(intervals: Sequence[tuple[float, float]], calls: int) -> dict[str, float]:
    """Where a call's wall time goes on the device, from the (start, end) times in us of every
    device operation of `calls` identical calls issued one after another: medians per call of
    the span from its first operation's start to its last's end, the time within it some
    operation ran (`busy_ms`, overlaps counted once), the span's idle rest (gaps between a CUDA
    graph's kernels, or kernels waiting for the host), and the device's idle time from one
    call's last operation to the next call's first (the host's time between them: staging,
    launch, scores back). The operations are split into calls in time order, the same count
    each; `calls` that do not divide them raise ValueError."""
    if calls < 1 or not intervals or len(intervals) % calls:
        raise ValueError(f"{len(intervals)} device operations do not split into {calls} calls")
    ordered = sorted(intervals)
    each = len(ordered) // calls
    spans, busy, between = [], [], []
    for i in range(calls):
        ops = ordered[i * each : (i + 1) * each]
        first, last = ops[0][0], max(end for _, end in ops)
        spans.append(last - first)
        covered, reach = 0.0, first
        for start, end in ops:
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        busy.append(covered)
        if i + 1 < calls:
            between.append(max(0.0, ordered[(i + 1) * each][0] - last))
    span_ms, busy_ms = median(spans) / 1e3, median(busy) / 1e3
    return {
        "span_ms": span_ms,
        "busy_ms": busy_ms,
        "idle_in_span_ms": span_ms - busy_ms,
        "between_calls_ms": median(between) / 1e3 if between else 0.0,
    }


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per prefix length x batch, the --profile rows: none without it)."""
    acc = accelerator(args.device)
    spec = preset(args.preset)
    model = HSTURanker.from_seed(spec, seed=0, device=acc.device)
    model.fuse_norms(args.layer_kernels == "fused")  # before any graph is captured
    peak_tflops, peak_gbps = measure_peaks(acc.device, acc.synchronize)
    print(f"device {acc.name}: matmul {peak_tflops:.0f} TFLOP/s, copy {peak_gbps:.0f} GB/s")
    graphs = None
    if acc.backend == "cuda":  # the serving path: ranking against psi replays CUDA graphs
        from services.ranker.graphs import GraphLimits, RankGraphs

        tokens = max(args.batches) * (args.recent + args.candidates)
        graphs = RankGraphs(model, GraphLimits(max_batch=max(args.batches), max_tokens=max(tokens, 64),
                                               max_prefix_tokens=max(args.prefix_lens)))  # fmt: skip
    if args.profile:
        if graphs is not None:  # the bucket this batch needs, captured before profiling
            shape = Shape(PROFILE_TOKENS, args.profile_prefix - PROFILE_TOKENS, args.recent, args.candidates)
            prefixes, suffixes = batch(1, [shape] * args.profile_batch)
            keys = [model.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest) for p in prefixes]
            psis = model.preinfer(prefixes)
            if graphs.rank(suffixes, psis, keys) is None:
                graphs.capture_pending(limit=4)
            del psis
        profiled = profile_cached(
            model, graphs, args.profile_prefix, args.profile_batch, args, acc.synchronize
        )
    else:
        profiled = []
    results = []
    for prefix_len in args.prefix_lens:
        for batch_size in args.batches:
            shape = Shape(PROFILE_TOKENS, prefix_len - PROFILE_TOKENS, args.recent, args.candidates)
            prefixes, suffixes = batch(prefix_len * 31 + batch_size, [shape] * batch_size)
            keys = [model.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest) for p in prefixes]
            sync, reps, warm = acc.synchronize, args.reps, args.warmup
            full_ms = time_call(functools.partial(model.full, prefixes, suffixes), sync, reps, warm)
            preinfer_ms = time_call(functools.partial(model.preinfer, prefixes), sync, reps, warm)
            psis = model.preinfer(prefixes)
            eager_ms = time_call(functools.partial(model.rank_cached, suffixes, psis, keys), sync, reps, warm)
            full = model.full(prefixes, suffixes)
            cached = model.rank_cached(suffixes, psis, keys)
            cached_ms = eager_ms
            if graphs is not None:
                if graphs.rank(suffixes, psis, keys) is None:
                    graphs.capture_pending(limit=4)
                graphed = graphs.rank(suffixes, psis, keys)
                if graphed is None:
                    raise RuntimeError(f"no CUDA graph for batch {batch_size} x {prefix_len}: {graphs.stats}")
                cached = [g.to(acc.device) for g in graphed]
                cached_ms = time_call(functools.partial(graphs.rank, suffixes, psis, keys), sync, reps, warm)
            full_graph_ms = full_keep_graph_ms = preinfer_graph_ms = None
            if graphs is not None:
                full_graph_ms, full_keep_graph_ms, preinfer_graph_ms = time_graph_passes(
                    model, prefixes, suffixes, sync, reps, warm
                )
            eps = max(float((f - c).abs().max()) for f, c in zip(full, cached, strict=True))
            flops, nbytes = cached_rank_cost(spec, prefix_len, batch_size, args.recent, args.candidates)
            floor_ms = max(flops / (peak_tflops * 1e12), nbytes / (peak_gbps * 1e9)) * 1e3
            full_flops = full_cost(spec, prefix_len, batch_size, args.recent, args.candidates)
            full_floor_ms = full_flops / (peak_tflops * 1e12) * 1e3
            row = {
                "prefix_len": prefix_len,
                "batch": batch_size,
                "candidates": args.candidates,
                "suffix_len": args.recent,
                "full_ms": full_ms,
                "preinfer_ms": preinfer_ms,
                "cached_rank_ms": cached_ms,
                "cached_eager_ms": eager_ms,
                "cuda_graphs": graphs is not None,
                "psi_bytes_per_user": spec.psi_bytes(prefix_len),
                "cached_rank_flops": flops,
                "cached_rank_bytes": nbytes,
                "cached_floor_ms": floor_ms,
                "full_flops": full_flops,
                "full_floor_ms": full_floor_ms,
                "full_over_floor": full_ms / full_floor_ms,
                # The same passes replayed as CUDA graphs (how the ranker serves them; None on the CPU).
                "full_graph_ms": full_graph_ms,
                "full_keep_graph_ms": full_keep_graph_ms,
                "preinfer_graph_ms": preinfer_graph_ms,
                "full_graph_over_floor": full_graph_ms / full_floor_ms if full_graph_ms else None,
                "peak_tflops_measured": peak_tflops,
                "peak_gbps_measured": peak_gbps,
                "full_over_cached": full_ms / cached_ms,
                "cached_over_floor": cached_ms / floor_ms,
                "eps_max": eps,
            }
            results.append(row)
            print(
                f"P={prefix_len:6d} B={batch_size}: full {full_ms:8.2f} ms  preinfer {preinfer_ms:8.2f} ms  "
                f"cached {cached_ms:7.3f} ms (eager {eager_ms:7.3f})  floor {floor_ms:6.3f} ms  full/cached {full_ms / cached_ms:5.1f}x  "
                f"cached/floor {cached_ms / floor_ms:4.2f}  full/floor {full_ms / full_floor_ms:4.2f}  eps {eps:.2e}",
                flush=True,
            )
            del psis, full, cached
            if acc.backend == "cuda":
                torch.cuda.empty_cache()
    return results, profiled


def time_graph_passes(
    model: HSTURanker, prefixes: list[Any], suffixes: list[Any], sync: Any, reps: int, warm: int
) -> tuple[float, float, float]:
    """ms of a full ranking, of one that keeps its prefix's psi, and of a whole pre-inference of this batch replayed as CUDA graphs
    (graph families full / full_keep / preinfer, how the ranker serves them), captured first. Graphs sized
    for this batch alone, as the ranker's are for the shapes it serves (their staging copy
    grows with their capacity)."""
    from services.ranker.graphs import GraphLimits, RankGraphs

    tokens = sum(
        p.length + s.recent.items.numel() + s.candidates.numel()
        for p, s in zip(prefixes, suffixes, strict=True)
    )
    limits = GraphLimits(max_batch=1, max_tokens=64, max_prefix_tokens=1, max_full_tokens=tokens,
                         max_full_batch=len(prefixes))  # fmt: skip
    graphs = RankGraphs(model, limits, full_keeps_kv=True)
    chunks = [PrefixChunk(p, model.new_psi(p), 0, p.length) for p in prefixes]

    def passes() -> tuple[Any, Any, bool]:
        kept = graphs.full(prefixes, suffixes, [model.new_psi(p) for p in prefixes])
        return graphs.full(prefixes, suffixes), kept, graphs.preinfer(chunks)

    # All three first (each remembers its bucket: the plain and the keeping full families, the
    # preinfer one), then capture: one replay may not wait on another.
    full, kept, built = passes()
    if full is None or kept is None or not built:
        graphs.capture_pending(limit=6)
    full, kept, built = passes()
    if full is None or kept is None or not built:
        raise RuntimeError(
            f"no full / full_keep / preinfer CUDA graph for {len(prefixes)} x {prefixes[0].length}: {graphs.stats}"
        )
    full_ms = time_call(functools.partial(graphs.full, prefixes, suffixes), sync, reps, warm)
    # What a full ranking that keeps its prefix's psi costs (the relay's full recompute):
    # a fresh psi block per call, as the engine allocates it, and the K/V copied into it.
    keep_ms = time_call(
        lambda: graphs.full(prefixes, suffixes, [model.new_psi(p) for p in prefixes]), sync, reps, warm
    )
    preinfer_ms = time_call(functools.partial(graphs.preinfer, chunks), sync, reps, warm)
    return full_ms, keep_ms, preinfer_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | npu")
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument(
        "--layer-kernels",
        choices=("torch", "fused"),
        default="fused",
        help="each layer's norms and what is around them as torch's four kernels or two fused ones "
        "(kernels/fused_norms.py; the ranker's --layer-kernels, fused by default)",
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--out-dir", default=None, help="where to write core-<device>.json (default bench/results)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="first print the top kernels of one cached ranking call (torch.profiler)",
    )
    parser.add_argument("--profile-full", action="store_true", help="--profile also profiles the full pass")
    parser.add_argument("--profile-prefix", type=int, default=8192)
    parser.add_argument("--profile-batch", type=int, default=8)
    args = parser.parse_args(argv)
    results, profiled = run(args)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    if profiled:
        # Per profiled call kind: wall and kernel time per call, and the device's timeline
        # (kernel_timeline): what of the wall is device work, gaps inside it, and host between.
        config["profile_calls"] = profiled
    config["profile_tokens"] = PROFILE_TOKENS
    config["spec"] = preset(args.preset).to_json()
    config["timing"] = "wall-clock per call, device synchronised, median of reps"
    config["floor"] = "max(flops / peak_tflops_measured, bytes / peak_gbps_measured); see bench/core.py"
    config["full_floor"] = "full pass FLOPs (projections + visible attention pairs) / peak_tflops_measured"
    columns = ["prefix_len", "batch", "full_ms", "full_floor_ms", "full_over_floor", "preinfer_ms",
               "cached_rank_ms", "cached_floor_ms", "full_over_cached", "cached_over_floor", "psi_bytes_per_user",
               "eps_max"]  # fmt: skip
    kwargs = {"out_dir": __import__("pathlib").Path(args.out_dir)} if args.out_dir else {}
    paths = write_result("core", config, results, columns, **kwargs)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
