"""Jagged layouts shared by the reference and the Triton attention.

A batch holds B sequences of *new* tokens (concatenated, no padding) and, optionally, one cached
prefix per sequence. Within sequence b, new token i has position P_b + min(i, n_hist_b): the
history tokens (everything that is not a candidate) count up from the end of the prefix, and all
candidates share the position right after the history (M-FALCON style), so a candidate's score
does not depend on how many other candidates the request holds.

Masking rule for new token i against new token j:  j <= i  and  (j < n_hist  or  j == i).
Every new token sees every prefix token.

psi layout (what the cache owns and moves): one contiguous tensor per user, [L, 2, P, H*D]
(layer-major, then K/V, then token, then head-interleaved features). A layer's K or V is one
contiguous [P, H*D] slab, so a reload can be done layer by layer with large copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionParams:
    """Scalar parameters of the HSTU pointwise attention, identical in every implementation."""

    alpha: float  # q.k scale (head_dim ** -0.5): length-independent
    inv_norm: float  # 1 / attn_norm: a constant, never the sequence length
    pos_mantissa_bits: int
    time_mantissa_bits: int


@dataclass(frozen=True)
class SeqLayout:
    """Offsets and per-sequence metadata of the new tokens of a jagged batch."""

    offsets: torch.Tensor  # [B + 1] int64, on the compute device
    n_hist: torch.Tensor  # [B] int64: non-candidate tokens among each sequence's new tokens
    timestamps: torch.Tensor  # [T] int64
    offsets_host: tuple[int, ...]
    n_hist_host: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.n_hist_host)

    @property
    def total_tokens(self) -> int:
        return self.offsets_host[-1]

    @property
    def max_len(self) -> int:
        o = self.offsets_host
        return max((o[i + 1] - o[i] for i in range(len(o) - 1)), default=0)

    def length(self, b: int) -> int:
        return self.offsets_host[b + 1] - self.offsets_host[b]

    @staticmethod
    def build(lengths: list[int], n_hist: list[int], timestamps: torch.Tensor) -> SeqLayout:
        if len(lengths) != len(n_hist):
            raise ValueError("lengths and n_hist must have one entry per sequence")
        offsets = [0]
        for n, h in zip(lengths, n_hist, strict=True):
            if n < 0 or not 0 <= h <= n:
                raise ValueError(f"bad sequence: length {n}, n_hist {h}")
            offsets.append(offsets[-1] + n)
        if timestamps.numel() != offsets[-1]:
            raise ValueError(f"timestamps hold {timestamps.numel()} tokens, the layout {offsets[-1]}")
        dev = timestamps.device
        return SeqLayout(
            offsets=torch.tensor(offsets, dtype=torch.int64, device=dev),
            n_hist=torch.tensor(n_hist, dtype=torch.int64, device=dev),
            timestamps=timestamps,
            offsets_host=tuple(offsets),
            n_hist_host=tuple(n_hist),
        )


@dataclass(frozen=True)
class PrefixKV:
    """The cached prefixes (psi) of a batch, one per sequence, in the layout documented above."""

    kv: tuple[torch.Tensor, ...]  # per sequence [L, 2, P_b, H*D]
    lens: torch.Tensor  # [B] int64
    timestamps: torch.Tensor  # [sum P_b] int64
    ts_offsets: torch.Tensor  # [B + 1] int64
    lens_host: tuple[int, ...]
    # Base address of each block, for kernels that read the blocks in place (accelerators only).
    pointers: torch.Tensor | None

    @staticmethod
    def build(kv: list[torch.Tensor], timestamps: list[torch.Tensor]) -> PrefixKV:
        if len(kv) != len(timestamps):
            raise ValueError("one timestamp vector per prefix is required")
        lens = []
        for block, ts in zip(kv, timestamps, strict=True):
            if block.dim() != 4 or block.shape[1] != 2:
                raise ValueError(f"psi block must be [L, 2, P, H*D], got {tuple(block.shape)}")
            if not block.is_contiguous():
                raise ValueError("psi block must be contiguous")
            if ts.numel() != block.shape[2]:
                raise ValueError(f"psi holds {block.shape[2]} tokens but {ts.numel()} timestamps")
            lens.append(int(block.shape[2]))
        dev = kv[0].device if kv else torch.device("cpu")
        ts_offsets = [0]
        for n in lens:
            ts_offsets.append(ts_offsets[-1] + n)
        all_ts = torch.cat([t.to(dev, torch.int64) for t in timestamps]) if timestamps else torch.empty(0)
        return PrefixKV(
            kv=tuple(kv),
            lens=torch.tensor(lens, dtype=torch.int64, device=dev),
            timestamps=all_ts.to(torch.int64),
            ts_offsets=torch.tensor(ts_offsets, dtype=torch.int64, device=dev),
            lens_host=tuple(lens),
            pointers=None
            if dev.type == "cpu"
            else torch.tensor([b.data_ptr() for b in kv], dtype=torch.int64, device=dev),
        )
