"""Attention kernel microbenchmark: achieved TFLOP/s of the Triton HSTU attention per config.

    python -m bench.attention            # on a CUDA device

Two shapes of the bench preset (4 heads x 256): the cached ranking call (320 suffix tokens per user
against an 8k prefix) and the full sequence (8k causal). Prints one row per kernel configuration
and bias setting; used to choose the defaults in kernels/hstu_attention/triton_impl.py.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton.testing

from kernels.hstu_attention import AttentionParams, PrefixKV, SeqLayout
from kernels.hstu_attention.triton_impl import KernelConfig, hstu_attention_triton, plan_triton


def make_case(batch: int, new_len: int, n_hist: int, prefix_len: int, heads: int = 4, dim: int = 256):
    dev = "cuda"
    total = batch * new_len
    uvqk = torch.randn(total, 4, heads, dim, device=dev, dtype=torch.bfloat16)
    q, k, v = uvqk[:, 0], uvqk[:, 1], uvqk[:, 2]
    ts = torch.sort(torch.randint(0, 10**7, (batch, new_len))).values
    ts[:, n_hist:] = ts[:, -1:]  # candidates share the query time
    ts = ts.flatten().to(dev)
    seq = SeqLayout.build([new_len] * batch, [n_hist] * batch, ts)
    prefix = None
    if prefix_len:
        kv = [
            torch.randn(8, 2, prefix_len, heads * dim, device=dev, dtype=torch.bfloat16) for _ in range(batch)
        ]
        pts = [torch.sort(torch.randint(0, 10**7, (prefix_len,), device=dev)).values for _ in range(batch)]
        prefix = PrefixKV.build(kv, pts)
    pos = torch.randn(8, heads, 160, device=dev)
    tim = torch.randn(8, heads, 96, device=dev)
    flops = 0
    for i in range(new_len):
        keys = prefix_len + (min(i, n_hist - 1) + 1 if i < n_hist else n_hist + 1)
        flops += keys
    flops *= 4 * dim * heads * batch
    return q, k, v, seq, prefix, pos, tim, flops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--case", choices=["cached", "full", "both"], default="both")
    parser.add_argument(
        "--config",
        type=int,
        nargs=4,
        metavar=("BM", "BN", "WARPS", "STAGES"),
        default=None,
        help="time this one configuration only (e.g. under a profiler)",
    )
    parser.add_argument("--splits", type=int, nargs="+", default=None,
                        help="time the default cached configuration at these prefix split counts")  # fmt: skip
    args = parser.parse_args()
    params = AttentionParams(alpha=1 / 16, inv_norm=1 / 4096, pos_mantissa_bits=3, time_mantissa_bits=2)
    cases = {}
    if args.case in ("cached", "both"):
        cases["cached"] = make_case(args.batch, 320, 64, args.prefix)
    if args.case in ("full", "both"):
        cases["full"] = make_case(max(1, args.batch // 4), args.prefix + 320, args.prefix + 64, 0)
    shapes = [
        (64, 64, 8, 2),
        (64, 64, 4, 2),
        (64, 64, 8, 3),
        (64, 32, 4, 3),
        (128, 64, 8, 2),
        (128, 32, 8, 2),
    ]
    configs = [
        KernelConfig(bm, bn, w, st, fast)
        for (bm, bn, w, st), fast in itertools.product(shapes, [True, False])
    ]
    if args.config:
        configs = [KernelConfig(*args.config)]
    for name, (q, k, v, seq, prefix, pos, tim, flops) in cases.items():
        plan_ms = triton.testing.do_bench(functools.partial(plan_triton, seq, prefix, pos, tim, params))
        plan = plan_triton(seq, prefix, pos, tim, params)
        print(f"{name:6s} plan (bias indices, once per forward): {plan_ms:.3f} ms")
        if args.splits and prefix is not None:
            for splits in args.splits:
                call = functools.partial(
                    hstu_attention_triton, q, k, v, seq, prefix, plan, 3, params, splits=splits
                )
                ms = triton.testing.do_bench(call, warmup=5, rep=30)
                print(
                    f"{name:6s} splits={splits:3d}: {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True
                )
            continue
        for cfg in configs:
            try:
                call = functools.partial(
                    hstu_attention_triton, q, k, v, seq, prefix, plan, 3, params, config=cfg
                )
                ms = triton.testing.do_bench(call, warmup=5, rep=30)
            except Exception as exc:  # a config that does not fit (shared memory) is reported, not fatal
                print(f"{name:6s} {cfg}: failed {type(exc).__name__}: {str(exc)[:80]}")
                continue
            print(f"{name:6s} {cfg}: {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
