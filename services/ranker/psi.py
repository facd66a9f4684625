"""psi: one user's cached prefix state, the baton handed from pre-inference to the ranking call.

Layout: `kv` is one contiguous tensor [L, 2, P, H*D] (per layer: K then V of every prefix token,
heads interleaved in the feature dimension), plus the prefix tokens' int64 timestamps [P] (the
suffix's time bias needs them). A cache owns and moves it as one block; a layer's K or V is a
contiguous [P, H*D] slab, so reloads can proceed layer by layer.

Every psi is stamped with its PsiKey (user, prefix version, model version, content fingerprint:
shared/psi_key.py). Using psi for any other key would silently produce wrong scores, so
`require_match` refuses it loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.psi_key import PsiKey

__all__ = ["Psi", "PsiKey", "PsiMismatchError"]


class PsiMismatchError(ValueError):
    """A psi was offered for a user, prefix version, model version or prefix content it was not
    computed for."""


@dataclass(frozen=True)
class Psi:
    key: PsiKey
    kv: torch.Tensor  # [L, 2, P, H*D]
    timestamps: torch.Tensor  # [P] int64

    def __post_init__(self) -> None:
        if self.kv.dim() != 4 or self.kv.shape[1] != 2:
            raise ValueError(f"psi kv must be [L, 2, P, H*D], got {tuple(self.kv.shape)}")
        if self.timestamps.numel() != self.kv.shape[2]:
            raise ValueError("psi needs one timestamp per prefix token")

    @property
    def prefix_len(self) -> int:
        return int(self.kv.shape[2])

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.timestamps.numel() * 8

    def require_match(self, expected: PsiKey) -> None:
        if self.key != expected:
            fields = [
                f"{name} {getattr(self.key, name)!r} != expected {getattr(expected, name)!r}"
                for name in ("user_id", "prefix_version", "model_version", "fingerprint")
                if getattr(self.key, name) != getattr(expected, name)
            ]
            raise PsiMismatchError("psi refused: " + "; ".join(fields))
