"""HSTU pointwise attention over jagged batches with an optional cached prefix.

Use: `batch = prepare_attention(...)` once per forward pass (it resolves the implementation and
builds what all layers share), then `hstu_attention(q, k, v, batch, layer)` per layer. The Triton
kernel runs on CUDA; the PyTorch reference everywhere else (CPU, Ascend NPU). Both share one
contract: see layout.py and reference.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.device import triton_usable
from kernels.hstu_attention.bias import BiasTables
from kernels.hstu_attention.layout import AttentionParams, PrefixKV, SeqLayout
from kernels.hstu_attention.reference import (
    ReferencePlan,
    hstu_attention_reference,
    log_bucket,
    plan_reference,
)

if TYPE_CHECKING:
    from kernels.hstu_attention.triton_impl import TritonPlan

__all__ = [
    "AttentionBatch",
    "AttentionImpl",
    "AttentionParams",
    "BiasTables",
    "PrefixKV",
    "SeqLayout",
    "hstu_attention",
    "hstu_attention_reference",
    "log_bucket",
    "plan_reference",
    "prepare_attention",
]


class AttentionImpl(enum.Enum):
    AUTO = "auto"  # Triton on CUDA, reference elsewhere
    REFERENCE = "reference"
    TRITON = "triton"


def triton_supports(device_tensor: torch.Tensor, head_dim: int) -> bool:
    return triton_usable(device_tensor) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


@dataclass(frozen=True)
class AttentionBatch:
    """Everything about one forward pass's attention that is the same for every layer."""

    seq: SeqLayout
    prefix: PrefixKV | None
    pos_tables: torch.Tensor  # [L, H, NB_POS] float32
    time_tables: torch.Tensor  # [L, H, NB_TIME] float32
    params: AttentionParams
    triton_plan: TritonPlan | None  # set when the Triton kernel runs this batch
    reference_plan: ReferencePlan | None  # set otherwise


def prepare_attention(
    seq: SeqLayout,
    prefix: PrefixKV | None,
    pos_tables: torch.Tensor,
    time_tables: torch.Tensor,
    params: AttentionParams,
    head_dim: int,
    impl: AttentionImpl = AttentionImpl.AUTO,
    bias: BiasTables | None = None,
) -> AttentionBatch:
    """Resolves the implementation for this device. Raises ValueError for TRITON where it cannot
    run. `bias`: pos/time tables with their kernel forms derived once (a model's, across passes)."""
    supported = triton_supports(seq.timestamps, head_dim)
    if impl is AttentionImpl.TRITON and not supported:
        raise ValueError("the Triton attention needs CUDA tensors and a power-of-two head_dim >= 16")
    if impl is AttentionImpl.TRITON or (impl is AttentionImpl.AUTO and supported):
        from kernels.hstu_attention.triton_impl import plan_triton

        plan = plan_triton(seq, prefix, pos_tables, time_tables, params, bias)
        return AttentionBatch(seq, prefix, pos_tables, time_tables, params, plan, None)
    reference = plan_reference(seq, prefix, pos_tables, time_tables, params)
    return AttentionBatch(seq, prefix, pos_tables, time_tables, params, None, reference)


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, layer: int
) -> torch.Tensor:
    """Attention of the new tokens q/k/v [T, H, D] at `layer`; returns [T, H, D] in q's dtype."""
    if batch.triton_plan is not None:
        from kernels.hstu_attention.triton_impl import hstu_attention_triton

        return hstu_attention_triton(q, k, v, batch.seq, batch.prefix, batch.triton_plan, layer, batch.params)
    assert batch.reference_plan is not None
    return hstu_attention_reference(
        q, k, v, batch.seq, batch.prefix, layer, batch.reference_plan, batch.params
    )
