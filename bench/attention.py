"""Attention kernel benchmark: achieved TFLOP/s of the Triton HSTU attention, bias on.

    python -m bench.attention                 # on a CUDA device; writes bench/results/attention-<device>.json
    python -m bench.attention --sweep         # also times every tile configuration in SWEEP (printed only)

Two shapes of the bench preset (4 heads x 256, bf16, real random bias tables):

* full: causal attention over prefix_len + recent + candidates new tokens per user (the full
  ranking pass and, without the candidates, pre-inference), no cached prefix;
* cached: recent + candidates new tokens per user against a prefix_len cached prefix (psi).

FLOPs count visible (query, key) pairs: 4 * head_dim * heads per pair (QK^T and AV). Times are
device times (`graph_ms`): calls captured in one CUDA graph, each after an L2 flush, replayed, less
a graph of the flushes alone; on random data. triton.testing.do_bench (CUDA events around each
call) timed the host's launch of small shapes instead of the kernel: on an H200 (2026-11-29, k9s)
every cached shape from batch 1 x 4096 to batch 4 x 8192 took 0.13-0.22 ms, and a batch-1 call
that profiled at 0.127 ms a layer inside a graph timed 0.08 in one session and 0.15 in the next.
`--timing do_bench` keeps the old way for comparison. The bf16 matmul peak (8192^3) is measured
in the same run, so `tflops / matmul_peak_tflops` is comparable across machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton.testing

from bench.report import RESULTS_DIR, write_result
from kernels.hstu_attention import AttentionParams, PrefixKV, SeqLayout
from kernels.hstu_attention.triton_impl import (
    NO_PREFIX_CONFIG,
    PREFIX_CONFIG,
    KernelConfig,
    TritonPlan,
    hstu_attention_triton,
    plan_triton,
)

SWEEP = [
    KernelConfig(128, 64, 8, 2),
    KernelConfig(128, 32, 8, 3),
    KernelConfig(128, 64, 8, 2, heads_fastest=False),  # the program order before 2026-11-29
    KernelConfig(128, 64, 8, 2, two_pass=True),  # splits' sums in slots of their own
]
# Tried on the cached case only (a ranking batch: 320 rows a user, so 128-row blocks leave a
# third of the last block empty; 64-row blocks waste none and double the programs).
CACHED_SWEEP = [
    KernelConfig(64, 64, 4, 2),
    KernelConfig(64, 64, 4, 3),
    KernelConfig(64, 32, 4, 4),
    KernelConfig(128, 32, 8, 4),
]


@dataclass
class Case:
    name: str
    batch: int
    prefix_len: int
    recent: int
    candidates: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq: SeqLayout
    prefix: PrefixKV | None
    pos: torch.Tensor
    tim: torch.Tensor
    flops: int


def visible_pairs(n_new: int, n_hist: int, prefix_len: int) -> int:
    """Visible (query, key) pairs of one sequence (layout.py's masking rule)."""
    hist = n_hist * (n_hist + 1) // 2  # history token i sees history keys 0..i
    cands = (n_new - n_hist) * (n_hist + 1)  # each candidate: every history key and itself
    return hist + cands + n_new * prefix_len


def make_case(name: str, batch: int, prefix_len: int, recent: int, candidates: int,
              heads: int = 4, dim: int = 256, layers: int = 8) -> Case:  # fmt: skip
    dev = "cuda"
    cached = name == "cached"
    new_len = recent + candidates + (0 if cached else prefix_len)
    n_hist = new_len - candidates
    total = batch * new_len
    uvqk = torch.randn(total, 4, heads, dim, device=dev, dtype=torch.bfloat16)
    q, k, v = uvqk[:, 0], uvqk[:, 1], uvqk[:, 2]
    # One user's timeline: prefix, recent, then candidates at the query time.
    ts = torch.sort(torch.randint(0, 10**9, (batch, prefix_len + recent + candidates))).values
    ts[:, prefix_len + recent :] = ts[:, -1:]
    new_ts = ts[:, prefix_len:] if cached else ts
    seq = SeqLayout.build([new_len] * batch, [n_hist] * batch, new_ts.flatten().to(dev))
    prefix = None
    if cached:
        kv = [
            torch.randn(layers, 2, prefix_len, heads * dim, device=dev, dtype=torch.bfloat16)
            for _ in range(batch)
        ]
        prefix = PrefixKV.build(kv, [ts[b, :prefix_len].to(dev) for b in range(batch)])
    pos = torch.randn(layers, heads, 160, device=dev)
    tim = torch.randn(layers, heads, 96, device=dev)
    plen = prefix_len if cached else 0
    flops = 4 * dim * heads * batch * visible_pairs(new_len, n_hist, plen)
    return Case(name, batch, prefix_len, recent, candidates, q, k, v, seq, prefix, pos, tim, flops)


def matmul_peak_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * n**3 / ms / 1e9


def graph_ms(fn: Callable[[], Any], calls: int = 20, replays: int = 15) -> float:
    """Device time of one call of fn: `calls` calls captured in one CUDA graph, each after an L2
    flush, replayed `replays` times (median), less the same graph of flushes alone. No host work
    is timed (module docstring)."""
    flush_buffer = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

    def flushed_calls() -> None:
        for _ in range(calls):
            flush_buffer.zero_()
            fn()

    def flushes() -> None:
        for _ in range(calls):
            flush_buffer.zero_()

    def capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles and warms up outside the capture
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph

    def median_ms(graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    with_calls, alone = capture(flushed_calls), capture(flushes)
    ms = (median_ms(with_calls) - median_ms(alone)) / calls
    del with_calls, alone
    return ms


def time_case(
    case: Case,
    plan: TritonPlan,
    params: AttentionParams,
    config: KernelConfig | None,
    splits: int | None = None,
    timing: str = "graph",
) -> float:
    """Milliseconds per call: device time (graph_ms), or with timing "do_bench" CUDA events around
    each call (the host's launch included)."""
    call = functools.partial(hstu_attention_triton, case.q, case.k, case.v, case.seq, case.prefix, plan, 3, params,
                             splits=splits, config=config)  # fmt: skip
    if timing == "graph":
        return graph_ms(call)
    return float(triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix", type=int, nargs="+", default=[8192], help="prefix lengths (each a shape)")
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="batch sizes (each a shape)")
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--case", choices=["cached", "full", "both"], default="both")
    parser.add_argument("--sweep", action="store_true", help="also time every configuration in SWEEP")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--splits", type=int, nargs="*", default=[], help="also time these split counts of the keys"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where the result files go")
    parser.add_argument("--tag", default="", help="attention-<device>-<tag>.json")
    parser.add_argument(
        "--timing",
        choices=["graph", "do_bench"],
        default="graph",
        help="graph: device time from CUDA graph replays (default); do_bench: CUDA events around each call",
    )
    args = parser.parse_args(argv)
    time_case_ms = functools.partial(time_case, timing=args.timing)
    params = AttentionParams(alpha=1 / 16, inv_norm=1 / 4096, pos_mantissa_bits=3, time_mantissa_bits=2)
    peak = matmul_peak_tflops()
    print(f"device {torch.cuda.get_device_name()}: bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    names = ["full", "cached"] if args.case == "both" else [args.case]
    results: list[dict[str, Any]] = []  # the default configuration, one record a shape
    variants: list[dict[str, Any]] = []  # everything else timed (--sweep, --splits)
    timing = {
        "graph": "device time: 20 calls in one CUDA graph, each after an L2 flush, less the flushes; median of 15 replays",
        "do_bench": "triton.testing.do_bench median, L2 flushed (host launch included)",
    }[args.timing]
    config_doc = vars(args) | {"timing": timing, "dtype": "bfloat16"}
    config_doc["out_dir"] = str(args.out_dir)

    def timed(case: Case, label: str, variant: str, ms: float) -> dict[str, Any]:
        tflops = case.flops / ms / 1e9
        print(
            f"{label} {variant}: {ms:8.3f} ms  {tflops:6.1f} TFLOP/s  {tflops / peak:.3f} of peak", flush=True
        )
        return {
            "case": case.name, "heads": 4, "head_dim": 256, "batch": case.batch, "prefix_len": case.prefix_len,
            "recent": case.recent, "candidates": case.candidates, "bias": True, "ms": ms, "tflops": tflops,
            "matmul_peak_tflops": peak, "fraction_of_peak": tflops / peak, "flops": case.flops, "variant": variant,
        }  # fmt: skip

    def write() -> None:  # after every shape: a run cut short keeps what it measured
        if args.no_write:
            return
        columns = ["case", "batch", "prefix_len", "recent", "candidates", "bias", "ms", "tflops",
                   "matmul_peak_tflops", "fraction_of_peak", "config"]  # fmt: skip
        paths = [
            *write_result("attention", config_doc, results, columns, out_dir=args.out_dir, tag=args.tag),
            *write_result("attention-variants", config_doc, variants, ["variant", *columns],
                          out_dir=args.out_dir, tag=args.tag),
        ]  # fmt: skip
        print("wrote", *paths, flush=True)

    shapes = [(name, b, p) for b in args.batch for p in args.prefix for name in names]
    for name, batch, prefix_len in shapes:
        case = make_case(name, batch, prefix_len, args.recent, args.candidates)
        label = f"{name:6s} B={batch} P={prefix_len}"
        plan = plan_triton(case.seq, case.prefix, case.pos, case.tim, params)
        default = PREFIX_CONFIG if case.prefix is not None else NO_PREFIX_CONFIG
        sweep = SWEEP + (CACHED_SWEEP if case.prefix is not None else [])
        configs = [default] + ([c for c in sweep if c != default] if args.sweep else [])
        for config in configs:
            described = (f"BM={config.block_m} BN={config.block_n} warps={config.num_warps} "
                         f"stages={config.num_stages}{'' if config.heads_fastest else ' heads-last'}"
                         f"{' two-pass' if config.two_pass else ''}")  # fmt: skip
            try:
                ms = time_case_ms(case, plan, params, config)
            except Exception as exc:  # a config that does not fit (shared memory) is reported, not fatal
                print(f"{label} {described}: failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            record = timed(case, label, "default" if config == default else described, ms) | {
                "config": described
            }
            (results if config == default else variants).append(record)
        if args.sweep:  # the position bias bucketed on chip per pair (the fixed-grid path's way)
            ms = time_case_ms(case, dataclasses.replace(plan, pos_by_distance=None), params, default)
            variants.append(timed(case, label, "position buckets on chip", ms))
        two_pass = dataclasses.replace(default, two_pass=True)
        for splits in args.splits:  # the splits' sums added atomically (the default) and in two passes
            variants.append(
                timed(case, label, f"splits={splits}", time_case_ms(case, plan, params, default, splits))
            )
            if splits > 1:
                ms = time_case_ms(case, plan, params, two_pass, splits)
                variants.append(timed(case, label, f"splits={splits} two-pass", ms))
        del case, plan
        torch.cuda.empty_cache()
        write()


if __name__ == "__main__":
    main()
