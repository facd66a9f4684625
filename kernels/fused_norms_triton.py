"""The Triton kernels of kernels/fused_norms.py, which imports this module only where they run
(CUDA, or Triton's interpreter): triton is not installed on every machine the ranker runs on.

Each program takes ROWS rows of [T, d], each padded to BLOCK_D columns (fused_norms._config),
and computes in float32."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(rows, d, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows (int64, as a column), its columns, which columns are in the row,
    and which elements are in the tensor."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK_D)
    col_ok = col < d
    mask = (row < rows)[:, None] & col_ok[None, :]
    return row.to(tl.int64)[:, None], col, col_ok, mask


@triton.jit
def _affine_norm(t, mask, col, col_ok, d, W, B, eps):
    """LayerNorm of the float32 rows of t (elements outside the tensor read as 0), times W plus B:
    the mean, then the variance of the differences, as torch computes it."""
    mean = tl.sum(t, axis=1) / d
    diff = tl.where(mask, t - mean[:, None], 0.0)
    var = tl.sum(diff * diff, axis=1) / d
    rstd = tl.rsqrt(var + eps)
    w = tl.load(W + col, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + col, mask=col_ok, other=0.0).to(tl.float32)
    return diff * rstd[:, None] * w[None, :] + b[None, :]


@triton.jit
def norm_gate_fwd(
    A, U, W, B, OUT, rows, d, stride_a, stride_u, stride_o, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """OUT = LayerNorm(A) * U, rounded once."""
    r64, col, col_ok, mask = _tile(rows, d, ROWS, BLOCK_D)
    a = tl.load(A + r64 * stride_a + col[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * stride_u + col[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = _affine_norm(a, mask, col, col_ok, d, W, B, eps) * u
    tl.store(OUT + r64 * stride_o + col[None, :], gate.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def add_norm_fwd(
    X, Y, W, B, TOTAL, NORMED, rows, d, stride_x, stride_y, stride_o, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """TOTAL = X + Y; NORMED = LayerNorm(TOTAL) of the sum as stored."""
    r64, col, col_ok, mask = _tile(rows, d, ROWS, BLOCK_D)
    x = tl.load(X + r64 * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + r64 * stride_y + col[None, :], mask=mask, other=0.0).to(tl.float32)
    # Rounded to nearest, then normed as rounded: as torch does (the sum bit for bit).
    total = (x + y).to(TOTAL.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(TOTAL + r64 * stride_o + col[None, :], total, mask=mask)
    normed = _affine_norm(total.to(tl.float32), mask, col, col_ok, d, W, B, eps)
    tl.store(NORMED + r64 * stride_o + col[None, :], normed.to(NORMED.dtype.element_ty), mask=mask)
