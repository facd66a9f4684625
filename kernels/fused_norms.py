"""The elementwise rest of an HSTU layer, fused on CUDA: two Triton kernels around the norms.

An HSTU layer is x' = x + W_o(LayerNorm_attn(attn) * u), and the next layer starts with
LayerNorm_in(x') (services/ranker/model.py, HSTULayer). Done by torch, that is four kernels and
ten passes over [T, d] around the output projection:

* `norm_gate`: LayerNorm(attn) * u. torch's norm reads attn and writes its output, which the
  multiply reads again beside u: two kernels, five passes. The fused kernel reads attn and u
  once and writes the gate: one kernel, three passes.
* `add_norm`: x + y (y = W_o's output) and the next layer's LayerNorm of the sum. torch's add
  reads both and writes the sum, which the norm reads again: two kernels, five passes. The fused
  kernel writes the sum (the residual stream) and its norm: one kernel, four passes.

So two graph nodes fewer per layer, and seven passes instead of ten. On an H200 the four kernels took ~0.6
ms a layer of a full ranking at 8192 tokens x 8 (4.8 of its 43 ms: profiles/
kernels-nvidia-h200-k9.txt), and ~30 us a layer of a call against psi.

Numerics: norms in float32 as torch's (mean, then the variance of the differences); the sum is
rounded to its dtype and normed as rounded, as torch does; the gate's product is rounded once,
where torch rounds the norm's output and then the product (on bfloat16 about one rounding step of
the gate apart). Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) truncates where CUDA
rounds to nearest.

The kernels themselves are in kernels/fused_norms_triton.py, imported only where they run.
A ranker chooses with --layer-kernels (services/ranker/config.py): `fused` (the default), these
kernels on CUDA and torch on other devices, or `torch`. Measured on an H100 (bench.core, one
sitting, k29a: bench/results/core-nvidia-h100-80gb-hbm3-k29a-*.md): every shape 4-16% faster,
e.g. full rankings of 4096 tokens x 8 17.65 ms against 20.01, calls against 8192-token psi x 8
4.13 ms against 4.33.
"""

from __future__ import annotations

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


def add_norm_reference(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, LayerNorm(x + y)) as torch computes them in the model."""
    total = x + y
    return total, F.layer_norm(total, (total.shape[-1],), weight, bias, eps)


def add_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, LayerNorm(x + y)) over rows of [T, d]: the fused kernel where asked for and the
    tensors are on CUDA (and Triton imports), else torch."""
    if fused and triton_usable(x):
        return add_norm_triton(x, y, weight, bias, eps)
    return add_norm_reference(x, y, weight, bias, eps)


def add_norm_triton(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_norm in one Triton kernel: rows of x and y (unit stride within a row) -> (x + y,
    LayerNorm(x + y)), two new [T, d] tensors in x's dtype."""
    _check(x, y, weight, bias, "add_norm")
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    normed = torch.empty_like(total)
    _launch("add_norm_fwd", (x, y, weight, bias), (total, normed), eps)
    return total, normed


def _check(attn: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, what: str) -> None:
    if attn.dim() != 2 or u.shape != attn.shape:
        raise ValueError(f"{what} takes two tensors of one shape [T, d], not {tuple(attn.shape)} "
                         f"and {tuple(u.shape)}")  # fmt: skip
    d = attn.shape[1]
    if weight.shape != (d,) or bias.shape != (d,):
        raise ValueError(
            f"{what}'s weight and bias are [{d}], not {tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    if (attn.shape[0] > 1 and d > 0) and (attn.stride(1) != 1 or u.stride(1) != 1):
        raise ValueError(f"{what} reads rows of unit stride (each may be a column slice of a wider tensor)")
    if u.dtype != attn.dtype or u.device != attn.device:
        raise ValueError(
            f"{what}'s second tensor is {u.dtype} on {u.device}, its first {attn.dtype} on {attn.device}"
        )


def norm_gate_triton(
    attn: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """norm_gate in one Triton kernel: rows of attn and u (each row of unit stride; u may be a
    column slice of the layer's UVQK tensor) -> a new [T, d] tensor in attn's dtype."""
    _check(attn, u, weight, bias, "norm_gate")
    out = torch.empty_like(attn, memory_format=torch.contiguous_format)
    _launch("norm_gate_fwd", (attn, u, weight, bias), (out,), eps)
    return out


def _launch(
    kernel: str, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...], eps: float
) -> None:
    """One of kernels/fused_norms_triton.py's kernels over the rows of inputs[0] (its first two
    inputs are [T, d] rows, then the norm's weight and bias) into `outputs` (new [T, d] tensors)."""
    rows, d = inputs[0].shape
    if rows == 0 or d == 0:
        return
    from kernels import fused_norms_triton  # triton is imported only where the kernels run

    config = _config(d)
    getattr(fused_norms_triton, kernel)[(-(-rows // config["ROWS"]),)](
        *inputs, *outputs, rows, d, inputs[0].stride(0), inputs[1].stride(0), outputs[0].stride(0), eps,
        BLOCK_D=config["BLOCK_D"], ROWS=config["ROWS"], num_warps=config["num_warps"],
    )  # fmt: skip


def _config(d: int) -> dict[str, int]:
    """A tile of ROWS rows x the row padded to a power of two: ~4096 elements a program (at
    d 1024, 4 rows and 8 warps: 16 bf16 values a thread, two 16-byte loads per tensor)."""
    block_d = 1 << max(0, (d - 1).bit_length())
    rows = max(1, min(16, 4096 // block_d))
    return {"BLOCK_D": block_d, "ROWS": rows, "num_warps": 8 if rows * block_d >= 4096 else 4}
