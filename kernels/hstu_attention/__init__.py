"""HSTU pointwise attention over jagged batches with an optional cached prefix.

`hstu_attention` dispatches to the Triton kernel on CUDA and to the PyTorch reference elsewhere
(CPU, Ascend NPU). Both share one contract: see layout.py and reference.py.
"""

from __future__ import annotations

import enum

import torch

from kernels.device import triton_usable
from kernels.hstu_attention.layout import AttentionParams, PrefixKV, SeqLayout
from kernels.hstu_attention.reference import hstu_attention_reference, log_bucket

__all__ = [
    "AttentionImpl",
    "AttentionParams",
    "PrefixKV",
    "SeqLayout",
    "hstu_attention",
    "hstu_attention_reference",
    "log_bucket",
]


class AttentionImpl(enum.Enum):
    AUTO = "auto"  # Triton on CUDA, reference elsewhere
    REFERENCE = "reference"
    TRITON = "triton"


def _triton_supports(q: torch.Tensor) -> bool:
    head_dim = q.shape[2]
    return triton_usable(q) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqLayout,
    prefix: PrefixKV | None,
    layer: int,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    params: AttentionParams,
    impl: AttentionImpl = AttentionImpl.AUTO,
) -> torch.Tensor:
    """Attention of the new tokens q/k/v [T, H, D]; returns [T, H, D] in q's dtype.

    Raises ValueError when impl=TRITON is asked for a tensor or shape the kernel cannot take.
    """
    use_triton = impl is AttentionImpl.TRITON or (impl is AttentionImpl.AUTO and _triton_supports(q))
    if use_triton:
        if not _triton_supports(q):
            raise ValueError("the Triton attention needs CUDA tensors and a power-of-two head_dim >= 16")
        from kernels.hstu_attention.triton_impl import hstu_attention_triton

        return hstu_attention_triton(q, k, v, seq, prefix, layer, pos_bias, time_bias, params)
    return hstu_attention_reference(q, k, v, seq, prefix, layer, pos_bias, time_bias, params)
