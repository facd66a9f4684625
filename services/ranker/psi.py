"""psi: one user's cached prefix state, the baton handed from pre-inference to the ranking call.

Layout: `kv` is one contiguous tensor [L, 2, P, H*D] (per layer: K then V of every prefix token,
heads interleaved in the feature dimension), plus the prefix tokens' int64 timestamps [P] (the
suffix's time bias needs them). A cache owns and moves it as one block; a layer's K or V is a
contiguous [P, H*D] slab, so reloads can proceed layer by layer. psi the ranker allocates
(`psi_memory`) lives in one allocation, [K/V bytes | timestamps], the host tier's layout too
(services/ranker/transfer.py): it moves between the tiers in one copy, where two copies and two
allocations each gave up the Python interpreter (bench.host_costs). On CUDA the caching allocator
rounds a large block up to 2 MiB: 4096 tokens of the bench preset ask 128 MiB + 32 KiB, and the
~2 MiB left over is split off for other large allocations.

Every psi is stamped with its PsiKey (user, prefix version, model version, content fingerprint:
shared/psi_key.py). Using psi for any other key would silently produce wrong scores, so
`require_match` refuses it loudly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shared.psi_key import PsiKey

__all__ = ["Psi", "PsiKey", "PsiMismatchError", "PsiSizeClasses", "psi_memory"]

_MIB = 1 << 20


class PsiMismatchError(ValueError):
    """A psi was offered for a user, prefix version, model version or prefix content it was not
    computed for."""


@dataclass(frozen=True)
class PsiSizeClasses:
    """psi blocks allocated in size classes: floor x ratio^k, rounded up to 2 MiB (the device's
    caching allocator rounds a large block so). Why: psi of many lengths, freed in LRU order
    while their neighbours live, fragment the caching allocator until a new block fits no free
    one and no new segment; it then frees its whole cache and retries, a device-wide stall (an
    H100's mix, k29b: 37 ms, 184 blocks freed, in the launch of a full ranking keeping psi).
    With classes a freed block fits every later psi of its class, at most ratio - 1 of each
    block unused (counted in the HBM budget: `footprint`)."""

    ratio: float
    floor_bytes: int = 2 * _MIB

    def __post_init__(self) -> None:
        if not 1.0 < self.ratio <= 2.0 or self.floor_bytes < 1:
            raise ValueError(f"psi size classes need a ratio in (1, 2] and a floor >= 1 byte, not {self}")

    def _bound(self, k: int) -> int:
        return -(-math.ceil(self.floor_bytes * self.ratio**k) // (2 * _MIB)) * (2 * _MIB)

    def footprint(self, nbytes: int) -> int:
        """The bytes a psi block of nbytes takes: the smallest class that holds it."""
        k = max(0, math.ceil(math.log(max(nbytes, 1) / self.floor_bytes, self.ratio)))
        while k > 0 and self._bound(k - 1) >= nbytes:  # the float log may land one class high
            k -= 1
        while self._bound(k) < nbytes:
            k += 1
        return self._bound(k)


def psi_memory(
    layers: int,
    prefix_len: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device | str,
    classes: PsiSizeClasses | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Uninitialised memory for one psi: (kv [L, 2, P, H], timestamps [P] int64, block), kv and
    timestamps views of one uint8 block [K/V bytes | timestamps] (psi's host layout). block is None,
    and the two are allocated apart, where the K/V bytes are not a multiple of 8 (the timestamps'
    int64 view needs that alignment). With `classes` the block is the front of an allocation of
    its class's size (PsiSizeClasses): every reader still sees exact, contiguous psi."""
    kv_bytes = layers * 2 * prefix_len * hidden * dtype.itemsize
    if kv_bytes % 8:
        kv = torch.empty(layers, 2, prefix_len, hidden, dtype=dtype, device=device)
        return kv, torch.empty(prefix_len, dtype=torch.int64, device=device), None
    nbytes = kv_bytes + prefix_len * 8
    size = classes.footprint(nbytes) if classes is not None else nbytes
    block = torch.empty(size, dtype=torch.uint8, device=device)
    if size != nbytes:
        block = block[:nbytes]  # the view keeps the whole allocation alive, freed with it
    kv = block[:kv_bytes].view(dtype).view(layers, 2, prefix_len, hidden)
    return kv, block[kv_bytes:].view(torch.int64), block


@dataclass(frozen=True)
class Psi:
    key: PsiKey
    kv: torch.Tensor  # [L, 2, P, H*D]
    timestamps: torch.Tensor  # [P] int64
    # Both of them as one uint8 block [K/V bytes | timestamps] (psi_memory), or None where they
    # were allocated apart: copied to and from the host tier in one copy when there is one.
    block: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kv.dim() != 4 or self.kv.shape[1] != 2:
            raise ValueError(f"psi kv must be [L, 2, P, H*D], got {tuple(self.kv.shape)}")
        if self.timestamps.numel() != self.kv.shape[2]:
            raise ValueError("psi needs one timestamp per prefix token")
        block = self.block
        if block is not None:
            kv_bytes = self.kv.numel() * self.kv.element_size()
            if (
                block.dtype != torch.uint8
                or block.numel() != self.nbytes
                or self.kv.data_ptr() != block.data_ptr()
                or self.timestamps.data_ptr() != block.data_ptr() + kv_bytes
            ):
                raise ValueError("psi block must hold its kv then its timestamps, nothing else")

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
