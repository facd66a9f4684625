"""What a psi is valid for: one type for the ranker's HBM cache, the expander's host-DRAM tier and
their protocol (no torch here: the expander and the router import it).

A psi is the K/V of one prefix computed by one model, so its key names the user, the prefix
version the client gave, the model version, and the prefix's content (`fingerprint`: the last
digest of its chunk chain, shared/fingerprint.py). Two calls that agree on (user, prefix version,
model) but not on the fingerprint name different psi: the second one misses, and is ranked in
full, whatever the first one left in any tier.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PsiKey", "PsiName"]

_U64 = (1 << 64) - 1


@dataclass(frozen=True, order=True)
class PsiName:
    """(user, prefix version, model): what a client names. Under one name there should be one
    content; a PsiKey whose name matches and whose fingerprint does not is a content mismatch."""

    user_id: int
    prefix_version: int
    model_version: str


@dataclass(frozen=True, order=True)
class PsiKey:
    user_id: int
    prefix_version: int
    model_version: str
    fingerprint: int  # uint64: PrefixFingerprint.digest of the prefix's tokens

    def __post_init__(self) -> None:
        if not 0 <= self.fingerprint <= _U64:
            raise ValueError(f"fingerprint must be a uint64, got {self.fingerprint}")

    @property
    def name(self) -> PsiName:
        return PsiName(self.user_id, self.prefix_version, self.model_version)

    def __str__(self) -> str:
        return (
            f"user={self.user_id} prefix_version={self.prefix_version} model={self.model_version} "
            f"fingerprint={self.fingerprint:016x}"
        )
