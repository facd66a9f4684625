"""What psi stored in 8-bit floats (kernels.psi_fp8) does to the scores.

    python -m bench.psi_fp8                                   # bench preset, on the GPU if there is one
    python -m bench.psi_fp8 --device cpu --prefix-lens 1024 --batch 2 --tag cpu   # CPU, minutes

For each prefix length: a batch of synthetic users is pre-inferred, and every user's candidates
are scored against that psi as it is (`ref`) and against the same psi quantized to float8 e4m3 and
back, with one scale per group of `--group-tokens` tokens of one head. Reported per group size:
the scores' largest absolute error against `ref` (`eps_fp8`), beside the error the serving path
already has (full inference against psi, `eps_full`: bf16 rounding on the GPU); the same as a share
of the scores' spread (`eps_fp8_over_std`); how many of ref's top-k candidates stay in the top k
(`top{k}_overlap_min` / `_mean`, over users), beside the same for full inference
(`top{k}_full_overlap_min`); and the bytes of psi against psi as computed (`bytes_ratio`).
Also in float32 (`--dtype float32`), where only the quantization differs.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch

from bench.report import RESULTS_DIR, write_result
from kernels.device import Accelerator, DeviceUnavailableError, accelerator
from kernels.psi_fp8 import dequantize_kv, quantize_kv
from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from services.ranker.psi import Psi
from shared.modelspec import preset

PROFILE_TOKENS = 16
TOP_K = (10, 50)
COLUMNS = ["dtype", "prefix_len", "batch", "group_tokens", "bytes_ratio", "eps_full", "eps_fp8",
           "eps_fp8_over_std", "top10_overlap_min", "top10_overlap_mean", "top50_overlap_min",
           "top50_overlap_mean", "top10_full_overlap_min", "top50_full_overlap_min"]  # fmt: skip


def overlap(ref: torch.Tensor, other: torch.Tensor, k: int) -> float:
    """Share of ref's k best candidates also among other's k best."""
    k = min(k, ref.numel())
    best = set(torch.topk(ref.float(), k).indices.tolist())
    return len(best & set(torch.topk(other.float(), k).indices.tolist())) / k


def min_overlap(ref: list[torch.Tensor], other: list[torch.Tensor], k: int) -> float:
    """The smallest top-k overlap over users."""
    return min(overlap(r, o, k) for r, o in zip(ref, other, strict=True))


def score_errors(ref: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, float]:
    """eps (largest absolute difference), eps over the scores' spread, and top-k overlaps."""
    eps = max(float((r.float() - o.float()).abs().max()) for r, o in zip(ref, other, strict=True))
    spread = float(torch.cat([r.float() for r in ref]).std())
    row: dict[str, float] = {"eps_fp8": eps, "eps_fp8_over_std": eps / spread if spread > 0 else 0.0}
    for k in TOP_K:
        shares = [overlap(r, o, k) for r, o in zip(ref, other, strict=True)]
        row[f"top{k}_overlap_min"] = min(shares)
        row[f"top{k}_overlap_mean"] = sum(shares) / len(shares)
    return row


def run(args: argparse.Namespace, acc: Accelerator) -> list[dict[str, Any]]:
    spec = preset(args.preset)
    if args.dtype:
        spec = dataclasses.replace(spec, dtype=args.dtype)
    model = HSTURanker.from_seed(spec, seed=0, device=acc.device)
    rows = []
    for prefix_len in args.prefix_lens:
        shape = Shape(PROFILE_TOKENS, prefix_len - PROFILE_TOKENS, args.recent, args.candidates)
        prefixes, suffixes = batch(prefix_len * 7 + args.batch, [shape] * args.batch)
        keys = [model.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest) for p in prefixes]
        with torch.inference_mode():
            psis = model.preinfer(prefixes)
            ref = model.rank_cached(suffixes, psis, keys)
            full = model.full(prefixes, suffixes)
            # The serving path's own disagreement (full inference against psi), to set fp8's beside.
            served = {
                "eps_full": max(
                    float((f.float() - r.float()).abs().max()) for f, r in zip(full, ref, strict=True)
                )
            }
            served.update({f"top{k}_full_overlap_min": min_overlap(ref, full, k) for k in TOP_K})
            for group in args.group_tokens:
                quantized = [quantize_kv(p.kv, spec.num_heads, group) for p in psis]
                back = [
                    Psi(p.key, dequantize_kv(q), p.timestamps) for p, q in zip(psis, quantized, strict=True)
                ]
                scores = model.rank_cached(suffixes, back, keys)
                nbytes = sum(q.nbytes for q in quantized)
                plain = sum(p.kv.numel() * p.kv.element_size() for p in psis)
                row = {"dtype": spec.dtype, "prefix_len": prefix_len, "batch": args.batch, "group_tokens": group,
                       "bytes_ratio": nbytes / plain, **served, **score_errors(ref, scores)}  # fmt: skip
                rows.append(row)
                print("  ".join(f"{c} {row[c]:.4g}" if isinstance(row[c], float) else f"{c} {row[c]}"
                                for c in COLUMNS), flush=True)  # fmt: skip
        del psis
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or npu")
    p.add_argument("--preset", default="bench")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default=None, help="the preset's, unless given"
    )
    p.add_argument("--prefix-lens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--recent", type=int, default=64)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--group-tokens", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if min(args.prefix_lens) <= PROFILE_TOKENS:
        p.error(f"--prefix-lens must be > {PROFILE_TOKENS} (the profile's tokens)")
    if args.batch < 1 or args.recent < 1 or args.candidates < 1 or min(args.group_tokens) < 1:
        p.error("--batch, --recent, --candidates and --group-tokens must be >= 1")
    try:
        preset(args.preset)
    except ValueError as exc:
        p.error(f"--preset: {exc}")
    try:
        acc = accelerator(args.device)
    except (ValueError, DeviceUnavailableError) as exc:
        p.error(f"--device: {exc}")
    rows = run(args, acc)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    paths = write_result("psi-fp8", config, rows, COLUMNS, out_dir=args.out_dir, tag=args.tag,
                         header=f"Scores against psi stored as float8 e4m3 (kernels.psi_fp8) vs psi as computed; "
                         f"model {args.preset} ({rows[0]['dtype'] if rows else ''}), weights from seed 0, "
                         f"{args.recent} recent + {args.candidates} candidates.\n\n")  # fmt: skip
    print("wrote", *paths)


if __name__ == "__main__":
    main()
