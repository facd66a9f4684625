"""psi's K/V in 8-bit floats: half the bytes of bf16, one scale per group of tokens of one head.

psi is 32 KiB a token in the bench preset (8 layers x K and V x 1024 features x bf16): 512 MiB a
user at 16384 tokens, where a 110000 MiB HBM budget holds ~214 users and each copy to or from
host DRAM takes ~10 ms (k22-k24 on an H200). Stored as float8 e4m3 (3 mantissa bits, largest
finite 448) with a float32 scale per (layer, K or V, group of `group_tokens` tokens, head), it
takes half the bytes and a little more for the scales (4 bytes per group_tokens x head_dim
values: 1/64 more at 1 token x 256 dims, 1/1024 at 16 tokens).

A group's scale maps its largest magnitude to 448, so each value keeps ~2^-4 of relative
precision and no group overflows. A group that is all zeros gets scale 1 (its values stay 0).
Non-finite values are not hidden: a NaN or an infinity makes its group's scale and values NaN,
so scores computed from it are non-finite and the ranker's guard (no such score is answered)
still holds.

Whether the relay may store psi this way is decided by what it does to scores: bench.psi_fp8
measures the scores' error and the top-k agreement of candidate rankings against bf16 psi.
These functions are plain torch, the same on CPU and GPU. The ranker's host tier uses them when
its host_psi_format is fp8 (services/ranker/transfer.py); HBM keeps psi as computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Scales are amax times this, not amax / 448: CUDA divides a tensor by a Python number as a
# multiplication by its float32 reciprocal and the CPU divides, which differ in the last bit
# for some amax (k25, on an H200: the GPU's bytes were not the CPU's). A multiplication by one
# float32 constant is the same on both.
_FP8_MAX_RECIPROCAL = 1.0 / FP8_MAX


@dataclass(frozen=True)
class QuantizedKV:
    """psi's K/V [L, 2, P, H*D] as float8 values and per-group float32 scales."""

    values: torch.Tensor  # [L, 2, P, H*D] float8_e4m3fn
    scales: torch.Tensor  # [L, 2, ceil(P / group_tokens), heads] float32
    group_tokens: int
    heads: int
    dtype: torch.dtype  # what dequantize_kv gives back

    @property
    def nbytes(self) -> int:
        return (
            self.values.numel() * self.values.element_size()
            + self.scales.numel() * self.scales.element_size()
        )


# The float32 working set of one pass: slabs (one layer's K or V) are taken as many at a time as
# fit, so that a psi takes few passes (each a handful of kernels issued by the device loop) and
# never a float32 copy of all of it (1 GiB at 16384 tokens of the bench preset).
_PASS_BYTES = 256 << 20


def _grouped(slabs: torch.Tensor, heads: int, group_tokens: int) -> torch.Tensor:
    """Slabs [n, P, H*D] as [n, groups, group_tokens, heads, D], zero-padded to whole groups."""
    n, tokens, hidden = slabs.shape
    pad = -tokens % group_tokens
    if pad:
        slabs = torch.nn.functional.pad(slabs, (0, 0, 0, pad))
    return slabs.reshape(n, -1, group_tokens, heads, hidden // heads)


def _passes(slabs: int, tokens: int, hidden: int) -> range:
    """Starts of the passes over `slabs` slabs of [tokens, hidden] (step: slabs a pass)."""
    return range(0, slabs, max(1, _PASS_BYTES // max(1, tokens * hidden * 4)))


def quantize_kv(kv: torch.Tensor, heads: int, group_tokens: int = 1) -> QuantizedKV:
    """kv [L, 2, P, H*D] (any float dtype) as float8 e4m3 with one scale per (layer, K or V,
    group of `group_tokens` tokens, head). ValueError on a shape that does not split so."""
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"psi kv must be [L, 2, P, H*D], got {tuple(kv.shape)}")
    if heads < 1 or kv.shape[3] % heads:
        raise ValueError(f"{kv.shape[3]} features do not split into {heads} heads")
    if group_tokens < 1:
        raise ValueError("group_tokens must be >= 1")
    layers, _two, tokens, hidden = kv.shape
    slabs = kv.reshape(layers * 2, tokens, hidden)
    values = torch.empty(kv.shape, dtype=FP8, device=kv.device)
    scales = torch.empty(layers, 2, -(-tokens // group_tokens), heads, dtype=torch.float32, device=kv.device)
    flat_values, flat_scales = values.view(layers * 2, tokens, hidden), scales.view(layers * 2, -1, heads)
    step = _passes(layers * 2, tokens, hidden).step
    for at in range(0, layers * 2, step):
        grouped = _grouped(slabs[at : at + step].float(), heads, group_tokens)
        amax = grouped.abs().amax(dim=(2, 4))  # [n, groups, heads]; NaN where a NaN is
        # An all-zero group keeps scale 1; a NaN keeps its group's scale NaN (NaN > 0 is false,
        # so testing for > 0 would give a NaN's group scale 1 and let its values through).
        scale = torch.where(amax == 0, torch.ones_like(amax), amax * _FP8_MAX_RECIPROCAL)
        flat_scales[at : at + step] = scale
        scaled = (grouped / scale[:, :, None, :, None]).reshape(grouped.shape[0], -1, hidden)
        flat_values[at : at + step] = scaled[:, :tokens].to(FP8)
    return QuantizedKV(values, scales, group_tokens, heads, kv.dtype)


def dequantize_kv(q: QuantizedKV, out: torch.Tensor | None = None) -> torch.Tensor:
    """The K/V [L, 2, P, H*D] in q.dtype (into `out` when given, of that shape and dtype)."""
    layers, _two, tokens, hidden = q.values.shape
    if out is None:
        out = torch.empty(q.values.shape, dtype=q.dtype, device=q.values.device)
    elif out.shape != q.values.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.values.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    slabs, flat_out = q.values.view(layers * 2, tokens, hidden), out.view(layers * 2, tokens, hidden)
    flat_scales = q.scales.view(layers * 2, -1, q.heads)
    step = _passes(layers * 2, tokens, hidden).step
    for at in range(0, layers * 2, step):
        grouped = _grouped(slabs[at : at + step].to(torch.float32), q.heads, q.group_tokens)
        full = (grouped * flat_scales[at : at + step][:, :, None, :, None]).reshape(
            grouped.shape[0], -1, hidden
        )
        flat_out[at : at + step] = full[:, :tokens]
    return out
