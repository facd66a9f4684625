"""An HSTU layer's gate, LayerNorm(attn) * u, as one kernel on CUDA.

Each layer ends with x + W_o (LayerNorm(attn) * u) (services/ranker/model.py, HSTULayer.finish).
Done by torch, the norm and the multiply are two kernels and four passes over [T, d]: the norm
reads attn and writes its output, which the multiply reads again beside u before writing the
gate. `norm_gate_triton` does both in one kernel and three passes (attn and u read once, the gate
written once), and leaves one node fewer per layer in a CUDA graph. On an H200 the two kernels
took ~0.34 ms a layer of a full ranking at 8192 tokens x 8 (2.7 of its 43 ms: profiles/
kernels-nvidia-h200-k9.txt), and ~17 us a layer of a call against psi.

Numerics: the norm is computed in float32 as torch's is (mean, then the variance of the
differences), and the product is rounded once to the output's dtype, where torch rounds the norm's
output and then the product: on bfloat16 the two differ by about one rounding step of the gate.

A ranker chooses with --layer-kernels (services/ranker/config.py): `torch` (the default until
measured on a GPU) or `fused`, which is this kernel on CUDA and the torch path on other devices.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from kernels.device import triton_usable


def norm_gate_reference(
    attn: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm(attn) * u as torch computes it in the model (two roundings in attn's dtype)."""
    return F.layer_norm(attn, (attn.shape[-1],), weight, bias, eps) * u


def norm_gate(
    attn: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    fused: bool = False,
) -> torch.Tensor:
    """LayerNorm(attn) * u over rows of [T, d]: the fused kernel where asked for and the tensors
    are on CUDA (and Triton imports), else torch."""
    if fused and triton_usable(attn):
        return norm_gate_triton(attn, u, weight, bias, eps)
    return norm_gate_reference(attn, u, weight, bias, eps)


def _check(attn: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if attn.dim() != 2 or u.shape != attn.shape:
        raise ValueError(f"norm_gate takes attn and u of one shape [T, d], not {tuple(attn.shape)} "
                         f"and {tuple(u.shape)}")  # fmt: skip
    d = attn.shape[1]
    if weight.shape != (d,) or bias.shape != (d,):
        raise ValueError(
            f"norm_gate's weight and bias are [{d}], not {tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    if (attn.shape[0] > 1 and d > 0) and (attn.stride(1) != 1 or u.stride(1) != 1):
        raise ValueError("norm_gate reads rows of unit stride (u may be a column slice of a wider tensor)")
    if u.dtype != attn.dtype or u.device != attn.device:
        raise ValueError(f"norm_gate's u is {u.dtype} on {u.device}, attn {attn.dtype} on {attn.device}")


def norm_gate_triton(
    attn: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """norm_gate in one Triton kernel: rows of attn and u (each row of unit stride; u may be a
    column slice of the layer's UVQK tensor) -> a new [T, d] tensor in attn's dtype."""
    _check(attn, u, weight, bias)
    rows, d = attn.shape
    out = torch.empty(rows, d, dtype=attn.dtype, device=attn.device)
    if rows == 0 or d == 0:
        return out
    kernel, config = _kernel(), _config(d)
    grid = (-(-rows // config["ROWS"]),)
    kernel[grid](
        attn, u, weight, bias, out, rows, d, attn.stride(0), u.stride(0), out.stride(0), eps,
        BLOCK_D=config["BLOCK_D"], ROWS=config["ROWS"], num_warps=config["num_warps"],
    )  # fmt: skip
    return out


def _config(d: int) -> dict[str, int]:
    """A tile of ROWS rows x the row padded to a power of two: ~4096 elements a program (at
    d 1024, 4 rows and 8 warps: 16 bf16 values a thread, two 16-byte loads per tensor)."""
    block_d = 1 << max(0, (d - 1).bit_length())
    rows = max(1, min(16, 4096 // block_d))
    return {"BLOCK_D": block_d, "ROWS": rows, "num_warps": 8 if rows * block_d >= 4096 else 4}


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use (triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_gate_fwd(
        A, U, W, B, OUT, rows, d, stride_a, stride_u, stride_o, eps,
        BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_D)
        row_ok = row < rows
        col_ok = col < d
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = row.to(tl.int64)[:, None]
        a = tl.load(A + r64 * stride_a + col[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(a, axis=1) / d
        diff = tl.where(mask, a - mean[:, None], 0.0)
        var = tl.sum(diff * diff, axis=1) / d
        rstd = tl.rsqrt(var + eps)
        w = tl.load(W + col, mask=col_ok, other=0.0).to(tl.float32)
        b = tl.load(B + col, mask=col_ok, other=0.0).to(tl.float32)
        u = tl.load(U + r64 * stride_u + col[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = (diff * rstd[:, None] * w[None, :] + b[None, :]) * u
        tl.store(OUT + r64 * stride_o + col[None, :], gate.to(OUT.dtype.element_ty), mask=mask)

    return _norm_gate_fwd
