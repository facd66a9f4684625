"""Model dimensions shared by every service.

The ranker builds its network from a ModelSpec; the trigger and router only need its arithmetic
(psi bytes per token, FLOPs per token) to size admission bounds, so this module has no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

DType = Literal["float32", "bfloat16", "float16"]
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


class ModelSpecError(ValueError):
    """A model specification is inconsistent (raised at start-up, never per request)."""


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of the HSTU ranking model.

    The token sequence of one ranking call is [U | S_l | eS_l | I]: user-profile tokens, long-term
    behaviours (the cacheable prefix is [U, S_l]), recent behaviours, candidates.
    """

    name: str
    num_layers: int
    num_heads: int
    head_dim: int
    num_items: int  # item embedding rows; ids are taken modulo (num_items - 1), row 0 is padding
    num_actions: int  # behaviour action types (click, like, ...)
    num_profile_features: int  # user-profile feature ids are taken modulo this
    dtype: DType
    # Attention: SiLU(q.k * head_dim**-0.5 + rab) / attn_norm. attn_norm is a constant, not the
    # sequence length, so a prefix's K/V and outputs never depend on what follows it.
    attn_norm: float
    # Relative attention bias buckets: log-spaced via the float32 exponent and the top mantissa bits.
    pos_mantissa_bits: int = 3
    time_mantissa_bits: int = 2
    num_pos_buckets: int = 160
    num_time_buckets: int = 96
    head_hidden: int = 256
    layer_norm_eps: float = 1e-6
    max_sequence_len: int = 65_536

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def psi_bytes(self, prefix_len: int) -> int:
        """Bytes of one user's psi: per layer K and V of every prefix token, plus int64 timestamps."""
        return 2 * self.num_layers * prefix_len * self.hidden * self.dtype_bytes + 8 * prefix_len

    def linear_flops_per_token(self) -> int:
        """Matmul FLOPs per token through all layers (UVQK and output projections)."""
        d = self.hidden
        return self.num_layers * (2 * d * 4 * d + 2 * d * d)

    def validate(self) -> ModelSpec:
        problems = []
        for field in ("num_layers", "num_heads", "head_dim", "num_actions", "num_profile_features"):
            if getattr(self, field) < 1:
                problems.append(f"{field} must be >= 1")
        if self.num_items < 2:
            problems.append("num_items must be >= 2 (row 0 is padding)")
        if self.dtype not in _DTYPE_BYTES:
            problems.append(f"dtype must be one of {sorted(_DTYPE_BYTES)}")
        if self.attn_norm <= 0:
            problems.append("attn_norm must be > 0")
        if not 0 <= self.pos_mantissa_bits <= 8 or not 0 <= self.time_mantissa_bits <= 8:
            problems.append("bucket mantissa bits must be within 0..8")
        if self.num_pos_buckets < 1 or self.num_time_buckets < 1:
            problems.append("bucket counts must be >= 1")
        if self.num_pos_buckets * self.num_time_buckets > 32_767:
            problems.append("num_pos_buckets * num_time_buckets must be <= 32767 (int16 bias index)")
        if problems:
            raise ModelSpecError(f"invalid model spec {self.name!r}: " + "; ".join(problems))
        return self

    def with_overrides(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes).validate()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ModelSpec:
        return ModelSpec(**json.loads(text)).validate()


PRESETS: dict[str, ModelSpec] = {
    # CPU: tests and the demo. Power-of-two head_dim so the GPU kernels accept it too.
    "tiny": ModelSpec(
        name="tiny",
        num_layers=2,
        num_heads=2,
        head_dim=16,
        num_items=4096,
        num_actions=8,
        num_profile_features=512,
        dtype="float32",
        attn_norm=256.0,
        head_hidden=32,
    ),
    # GPU: the configuration of NVIDIA's public HSTU inference benchmark (recsys-examples).
    "bench": ModelSpec(
        name="bench",
        num_layers=8,
        num_heads=4,
        head_dim=256,
        num_items=500_000,
        num_actions=16,
        num_profile_features=65_536,
        dtype="bfloat16",
        attn_norm=4096.0,
        head_hidden=512,
    ),
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelSpecError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
