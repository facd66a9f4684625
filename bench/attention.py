"""Attention kernel benchmark: achieved TFLOP/s of the Triton HSTU attention, bias on.

    python -m bench.attention                 # on a CUDA device; writes bench/results/attention-<device>.json
    python -m bench.attention --sweep         # also times every tile configuration in SWEEP (printed only)

Two shapes of the bench preset (4 heads x 256, bf16, real random bias tables):

* full: causal attention over prefix_len + recent + candidates new tokens per user (the full
  ranking pass and, without the candidates, pre-inference), no cached prefix;
* cached: recent + candidates new tokens per user against a prefix_len cached prefix (psi).

FLOPs count visible (query, key) pairs: 4 * head_dim * heads per pair (QK^T and AV). Times are
medians of triton.testing.do_bench (CUDA events, L2 flushed before each call), on random data;
the bf16 matmul peak (8192^3) is measured in the same run, so `tflops / matmul_peak_tflops` is
comparable across machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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


def time_case(
    case: Case,
    plan: TritonPlan,
    params: AttentionParams,
    config: KernelConfig | None,
    splits: int | None = None,
) -> float:
    call = functools.partial(hstu_attention_triton, case.q, case.k, case.v, case.seq, case.prefix, plan, 3, params,
                             splits=splits, config=config)  # fmt: skip
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
    args = parser.parse_args(argv)
    params = AttentionParams(alpha=1 / 16, inv_norm=1 / 4096, pos_mantissa_bits=3, time_mantissa_bits=2)
    peak = matmul_peak_tflops()
    print(f"device {torch.cuda.get_device_name()}: bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    names = ["full", "cached"] if args.case == "both" else [args.case]
    results: list[dict[str, Any]] = []  # the default configuration, one record a shape
    variants: list[dict[str, Any]] = []  # everything else timed (--sweep, --splits)
    config_doc = vars(args) | {"timing": "triton.testing.do_bench median, L2 flushed", "dtype": "bfloat16"}
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
        configs = [default] + ([c for c in SWEEP if c != default] if args.sweep else [])
        for config in configs:
            described = (f"BM={config.block_m} BN={config.block_n} warps={config.num_warps} "
                         f"stages={config.num_stages}{'' if config.heads_fastest else ' heads-last'}"
                         f"{' two-pass' if config.two_pass else ''}")  # fmt: skip
            try:
                ms = time_case(case, plan, params, config)
            except Exception as exc:  # a config that does not fit (shared memory) is reported, not fatal
                print(f"{label} {described}: failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            record = timed(case, label, "default" if config == default else described, ms) | {
                "config": described
            }
            (results if config == default else variants).append(record)
        if args.sweep:  # the position bias bucketed on chip per pair (the fixed-grid path's way)
            ms = time_case(case, dataclasses.replace(plan, pos_by_distance=None), params, default)
            variants.append(timed(case, label, "position buckets on chip", ms))
        two_pass = dataclasses.replace(default, two_pass=True)
        for splits in args.splits:  # the splits' sums added atomically (the default) and in two passes
            variants.append(
                timed(case, label, f"splits={splits}", time_case(case, plan, params, default, splits))
            )
            if splits > 1:
                ms = time_case(case, plan, params, two_pass, splits)
                variants.append(timed(case, label, f"splits={splits} two-pass", ms))
        del case, plan
        torch.cuda.empty_cache()
        write()


if __name__ == "__main__":
    main()
