"""Jagged layouts shared by the reference and the Triton attention.

A batch holds B sequences of *new* tokens (concatenated, no padding) and, optionally, one cached
prefix per sequence. Within sequence b, new token i has position P_b + min(i, n_hist_b): the
history tokens (everything that is not a candidate) count up from the end of the prefix, and all
candidates share the position right after the history (M-FALCON style), so a candidate's score
does not depend on how many other candidates the request holds. All candidates of a sequence also
carry one timestamp (the query time), so they share their relative-bias row; build() checks it.

Masking rule for new token i against new token j:  j <= i  and  (j < n_hist  or  j == i).
Every new token sees every prefix token.

psi layout (what the cache owns and moves): one contiguous tensor per user, [L, 2, P, H*D]
(layer-major, then K/V, then token, then head-interleaved features). A layer's K or V is one
contiguous [P, H*D] slab, so a reload can be done layer by layer with large copies. A sequence
may read only the first `lens[b]` tokens of its block (psi built in part: pre-inference chunks,
a take-over's partial pass): the block's own length P is then the layer stride (`strides[b]`),
and the kernels read the built part in place instead of a contiguous copy of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Kernels read psi with 16-byte vector loads: each block must start 16-byte aligned (the caching
# allocators of torch align every allocation to 512 bytes).
PSI_ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class AttentionParams:
    """Scalar parameters of the HSTU pointwise attention, identical in every implementation."""

    alpha: float  # q.k scale (head_dim ** -0.5): length-independent
    inv_norm: float  # 1 / attn_norm: a constant, never the sequence length
    pos_mantissa_bits: int
    time_mantissa_bits: int


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _sections_to_device(sections: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 vectors, copied to the device in one transfer, each starting 16-byte aligned.

    Why aligned: Triton specialises a kernel on whether each pointer argument is 16-byte aligned.
    Sections packed back to back start aligned or not with the batch size's parity, and every
    new pattern is a JIT compile of seconds on the device thread mid-serving (seen on an H100:
    a partial batch of 4 stalled the ranker for over 7 s)."""
    flat: list[int] = []
    starts = []
    for section in sections:
        starts.append(len(flat))
        flat.extend(section)
        flat.extend([0] * (len(flat) % 2))  # pad to a whole 16 bytes
    packed = _to_device(flat, device)
    return [packed[start : start + len(section)] for start, section in zip(starts, sections, strict=True)]


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

    @functools.cached_property
    def max_len(self) -> int:
        """Longest sequence's new tokens (computed once: every layer's launch asks)."""
        o = self.offsets_host
        return max((o[i + 1] - o[i] for i in range(len(o) - 1)), default=0)

    def length(self, b: int) -> int:
        return self.offsets_host[b + 1] - self.offsets_host[b]

    @staticmethod
    def build(
        lengths: list[int],
        n_hist: list[int],
        timestamps: torch.Tensor,
        host_timestamps: torch.Tensor | None = None,
    ) -> SeqLayout:
        """timestamps: [T] on the compute device. host_timestamps (a CPU copy, when the caller has
        one) lets the candidate-timestamp contract be checked without a device round trip."""
        if len(lengths) != len(n_hist):
            raise ValueError("lengths and n_hist must have one entry per sequence")
        offsets = [0]
        for n, h in zip(lengths, n_hist, strict=True):
            if n < 0 or not 0 <= h <= n:
                raise ValueError(f"bad sequence: length {n}, n_hist {h}")
            offsets.append(offsets[-1] + n)
        if timestamps.numel() != offsets[-1]:
            raise ValueError(f"timestamps hold {timestamps.numel()} tokens, the layout {offsets[-1]}")
        check = host_timestamps if host_timestamps is not None else timestamps.cpu()
        for b, h in enumerate(n_hist):
            candidates = check[offsets[b] + h : offsets[b + 1]]
            if candidates.numel() > 1 and bool((candidates != candidates[0]).any()):
                raise ValueError(f"sequence {b}: all candidates must carry one timestamp (the query time)")
        device_offsets, device_n_hist = _sections_to_device([offsets, list(n_hist)], timestamps.device)
        return SeqLayout(
            offsets=device_offsets,
            n_hist=device_n_hist,
            timestamps=timestamps,
            offsets_host=tuple(offsets),
            n_hist_host=tuple(n_hist),
        )


@dataclass(frozen=True)
class PrefixKV:
    """The cached prefixes (psi) of a batch, one per sequence, in the layout documented above.

    Kernels read the blocks in place: `kv_base` is one of them and `kv_offsets[b]` is block b's
    start relative to it, in elements (blocks live in separate allocations of one address space).
    """

    kv: tuple[torch.Tensor, ...]  # per sequence [L, 2, P_b, H*D]
    lens: torch.Tensor  # [B] int64: the tokens read of each block (its first ones)
    timestamps: torch.Tensor  # [sum lens] int64
    ts_offsets: torch.Tensor  # [B + 1] int64
    kv_offsets: torch.Tensor  # [B] int64
    kv_base: torch.Tensor
    lens_host: tuple[int, ...]
    # [B] int64: each block's own length P_b, its layer stride (the same tensor as `lens` where
    # every block is read whole).
    strides: torch.Tensor | None = None

    @property
    def layer_strides(self) -> torch.Tensor:
        return self.strides if self.strides is not None else self.lens

    def read(self, b: int, layer: int, kv: int) -> torch.Tensor:
        """Sequence b's prefix K (kv 0) or V (1) of `layer` as the kernels read it:
        [lens[b], H*D], a view of its block."""
        return self.kv[b][layer, kv, : self.lens_host[b]]

    @staticmethod
    def build(
        kv: list[torch.Tensor], timestamps: list[torch.Tensor], lens: list[int] | None = None
    ) -> PrefixKV:
        """`lens[b]`: read only block b's first that many tokens (default: all of it); its
        timestamps are those tokens' (timestamps[b] holds lens[b])."""
        if not kv or len(kv) != len(timestamps) or (lens is not None and len(lens) != len(kv)):
            raise ValueError("one psi block, one timestamp vector (and one length) per sequence are required")
        base = kv[0]
        reads, strides, offsets = [], [], []
        for b, (block, ts) in enumerate(zip(kv, timestamps, strict=True)):
            if block.dim() != 4 or block.shape[1] != 2:
                raise ValueError(f"psi block must be [L, 2, P, H*D], got {tuple(block.shape)}")
            if not block.is_contiguous() or block.dtype != base.dtype or block.device != base.device:
                raise ValueError("psi blocks must be contiguous, of one dtype and on one device")
            n = int(block.shape[2]) if lens is None else int(lens[b])
            if not 0 <= n <= block.shape[2]:
                raise ValueError(f"reading {n} tokens of a psi block of {block.shape[2]}")
            if ts.numel() != n:
                raise ValueError(f"psi read for {n} tokens but {ts.numel()} timestamps")
            delta = block.data_ptr() - base.data_ptr()
            if block.numel() and (block.data_ptr() % PSI_ALIGNMENT_BYTES or delta % block.element_size()):
                raise ValueError(f"psi blocks must start {PSI_ALIGNMENT_BYTES}-byte aligned")
            reads.append(n)
            strides.append(int(block.shape[2]))
            offsets.append(delta // block.element_size() if block.numel() else 0)
        ts_offsets = [0]
        for n in reads:
            ts_offsets.append(ts_offsets[-1] + n)
        dev = base.device
        whole = reads == strides
        sections = [reads, ts_offsets, offsets] if whole else [reads, ts_offsets, offsets, strides]
        device_lens, device_ts_offsets, device_offsets, *device_strides = _sections_to_device(sections, dev)
        return PrefixKV(
            kv=tuple(kv),
            lens=device_lens,
            timestamps=torch.cat([t.to(dev, torch.int64) for t in timestamps]),
            ts_offsets=device_ts_offsets,
            kv_offsets=device_offsets,
            kv_base=base,
            lens_host=tuple(reads),
            strides=device_strides[0] if device_strides else None,
        )
