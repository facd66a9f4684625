"""Triton HSTU attention for CUDA: jagged new tokens against an optional cached prefix read in place.

Two kernels:

* `_rab_index_fwd` runs once per forward pass. The relative-bias bucket of a (query, key) pair
  depends on positions and timestamps only, not on the layer or the head, so it is computed once
  (int16: pos_bucket * NB_TIME + time_bucket) instead of 2 x layers x heads times inside the
  attention loop. Sequence b gets a row-major [r_b, stride_b] matrix, r_b = min(n_b, n_hist_b + 1)
  (all candidates share one row): prefix keys in columns [0, P_b), history key j in column
  round_up(P_b, 8) + j, the rest padded with index 0.
* `_hstu_attention_fwd` computes BLOCK_M query rows of one (sequence, head): it streams the cached
  prefix K/V straight from each user's psi block, then the sequence's own history keys (causal),
  then adds each candidate's attention to itself (a row-wise dot). The bias is one gather from the
  layer's combined table pos_bias[h, p] + time_bias[h, t]. Pointwise SiLU attention has no softmax,
  so the prefix can be split across programs and the partial sums added (atomically, in a float32
  buffer): that keeps the SMs busy when a batch has few query blocks but long prefixes.

Q/K/V tiles are loaded through TMA tensor descriptors made on the device (psi blocks live at
per-user addresses): with head_dim 256, per-element pointer tensors would not fit in registers.

Semantics are those of reference.py; bucket arithmetic is the same integer bit manipulation.

Two ways to launch: `plan_triton` + `hstu_attention_triton` size the grids from the batch (host
values), and `plan_triton_static` + `hstu_attention_static` take every per-batch value from device
tensors and launch fixed grids (`StaticGrid`), so the whole forward pass can be captured once in a
CUDA graph and replayed for any batch that fits: programs beyond a batch's sizes exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.hstu_attention.layout import AttentionParams, PrefixKV, SeqLayout


@triton.jit
def _log_bucket(x, MANT_BITS: tl.constexpr, NUM_BUCKETS: tl.constexpr):
    f = (tl.maximum(x, 0) + 1).to(tl.float32)
    bits = f.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    mantissa = (bits >> (23 - MANT_BITS)) & ((1 << MANT_BITS) - 1)
    return tl.minimum(exponent * (1 << MANT_BITS) + mantissa, NUM_BUCKETS - 1)


@triton.jit
def _rab_index_fwd(
    Idx, idx_offsets, idx_strides,
    seq_offsets, n_hist_ptr, ts_ptr,
    prefix_lens, prefix_ts, prefix_ts_offsets,
    HAS_PREFIX: tl.constexpr,
    POS_BITS: tl.constexpr, NB_POS: tl.constexpr, TIME_BITS: tl.constexpr, NB_TIME: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2)
    seq_start = tl.load(seq_offsets + b)
    n = (tl.load(seq_offsets + b + 1) - seq_start).to(tl.int32)
    n_hist = tl.load(n_hist_ptr + b).to(tl.int32)
    plen = 0
    if HAS_PREFIX:
        plen = tl.load(prefix_lens + b).to(tl.int32)
    plen_pad = tl.cdiv(plen, ALIGN) * ALIGN
    stride = tl.load(idx_strides + b).to(tl.int32)
    # Candidates share row n_hist (one position, one timestamp): rows past it are never read.
    rows = tl.minimum(n, n_hist + 1)
    r0 = pid_r * BLOCK_R
    if r0 >= rows:
        return
    r = r0 + tl.arange(0, BLOCK_R)
    r_valid = r < rows
    q_ts = tl.load(ts_ptr + seq_start + r, mask=r_valid, other=0)
    q_pos = plen + tl.minimum(r, n_hist)
    out_rows = Idx + tl.load(idx_offsets + b) + r.to(tl.int64)[:, None] * stride
    if HAS_PREFIX:
        pts = prefix_ts + tl.load(prefix_ts_offsets + b)
    # Column blocks grid-strided: a fixed grid (CUDA graphs) covers any row length.
    for c0 in range(pid_c * BLOCK_C, stride, tl.num_programs(1) * BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        in_prefix = c < plen
        j = c - plen_pad  # history key index for columns past the (padded) prefix
        in_hist = (j >= 0) & (j < n_hist)
        k_ts = tl.load(ts_ptr + seq_start + j, mask=in_hist, other=0)
        if HAS_PREFIX:
            k_ts = tl.where(in_prefix, tl.load(pts + c, mask=in_prefix, other=0), k_ts)
        # Prefix key c sits at position c, history key j at plen + j.
        k_pos = tl.where(in_prefix, c, plen + j)
        dpos = q_pos[:, None] - k_pos[None, :]
        dts = q_ts[:, None] - k_ts[None, :]
        idx = _log_bucket(dpos, POS_BITS, NB_POS) * NB_TIME + _log_bucket(dts, TIME_BITS, NB_TIME)
        # Every entry of the padded row is written (padding with index 0): the attention kernel
        # loads whole tiles without masks and gathers with them, so each must be a valid index.
        idx = tl.where((in_prefix | in_hist)[None, :], idx, 0)
        tl.store(out_rows + c[None, :], idx.to(tl.int16), mask=r_valid[:, None] & (c < stride)[None, :])


@triton.jit
def _silu(x, FAST_SILU: tl.constexpr):
    if FAST_SILU:
        # x * sigmoid(x) = h + h * tanh(h), h = x / 2: one MUFU op (tanh.approx) instead of exp + rcp.
        h = 0.5 * x
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=tl.float32, is_pure=True, pack=1
        )
        return h + h * t
    else:
        return x * tl.sigmoid(x)


@triton.jit(do_not_specialize=["layer", "splits", "total"])
def _hstu_attention_fwd(
    Q, K, V, Out,
    total, stride_t, stride_ot, stride_oh,
    seq_offsets, n_hist_ptr,
    KVBase, prefix_kv_offsets, prefix_lens,
    RabIdx, rab_offsets, rab_strides, rab_table,
    layer, splits, alpha, inv_norm,
    H: tl.constexpr, NB_COMBINED: tl.constexpr, HAS_PREFIX: tl.constexpr, FAST_SILU: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SPLIT_BLOCKS: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    hd: tl.constexpr = H * BLOCK_D
    seq_start = tl.load(seq_offsets + b).to(tl.int32)
    n = tl.load(seq_offsets + b + 1).to(tl.int32) - seq_start
    start_m = pid_m * BLOCK_M
    if start_m >= n:
        return
    plen = 0
    if HAS_PREFIX:
        plen = tl.load(prefix_lens + b).to(tl.int32)
    n_blocks = tl.cdiv(plen, BLOCK_N)
    # This sequence's own split count: at most `splits`, at least MIN_SPLIT_BLOCKS key blocks
    # each, so a fixed grid (CUDA graphs) does no extra work for short prefixes.
    active = splits
    if SPLIT:
        active = tl.minimum(splits, tl.maximum(n_blocks // MIN_SPLIT_BLOCKS, 1))
        if pid_s >= active:
            return
    n_hist = tl.load(n_hist_ptr + b).to(tl.int32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < n
    # q, k, v are [T, H*D] views with row stride stride_t (columns of one UVQK tensor).
    q_desc = tl.make_tensor_descriptor(
        Q, shape=[total, hd], strides=[stride_t, 1], block_shape=[BLOCK_M, BLOCK_D]
    )
    q = q_desc.load([seq_start + start_m, h * BLOCK_D])
    table = rab_table + (layer * H + h).to(tl.int64) * NB_COMBINED
    # Bias index rows of this block: unmasked, vectorised loads (see plan_triton for the slack).
    # A block of candidates only shares one row (same position and timestamp): 1-D bias per key.
    rab_base = RabIdx + tl.multiple_of(tl.load(rab_offsets + b), ALIGN)
    rab_stride = tl.multiple_of(tl.load(rab_strides + b), ALIGN)
    shared_row = start_m >= n_hist
    rab_ptrs = rab_base + tl.minimum(offs_m, n_hist).to(tl.int64)[:, None] * rab_stride
    hist_col0 = tl.cdiv(plen, ALIGN) * ALIGN
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if HAS_PREFIX:
        per_split = tl.cdiv(n_blocks, active)
        lo = pid_s * per_split * BLOCK_N
        hi = tl.minimum((pid_s + 1) * per_split * BLOCK_N, plen)
        k_base = KVBase + tl.load(prefix_kv_offsets + b) + (layer * 2).to(tl.int64) * plen * hd
        rows_p = tl.maximum(plen, 1)  # a descriptor needs a non-empty shape; empty prefixes load nothing
        pk_desc = tl.make_tensor_descriptor(
            k_base, shape=[rows_p, hd], strides=[hd, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        pv_desc = tl.make_tensor_descriptor(
            k_base + plen.to(tl.int64) * hd, shape=[rows_p, hd], strides=[hd, 1], block_shape=[BLOCK_N, BLOCK_D]
        )  # fmt: skip
        if shared_row:
            row = rab_base + n_hist.to(tl.int64) * rab_stride
            for start_n in range(lo, hi, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                k = pk_desc.load([start_n, h * BLOCK_D])
                s = tl.dot(q, tl.trans(k)) * alpha
                s += tl.load(table + tl.load(row + offs_n).to(tl.int32))[None, :]
                w = tl.where(m_valid[:, None] & (offs_n < hi)[None, :], _silu(s, FAST_SILU) * inv_norm, 0.0)
                v = pv_desc.load([start_n, h * BLOCK_D])
                acc += tl.dot(w.to(v.dtype), v)
        else:
            for start_n in range(lo, hi, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                k = pk_desc.load([start_n, h * BLOCK_D])
                s = tl.dot(q, tl.trans(k)) * alpha
                s += tl.load(table + tl.load(rab_ptrs + offs_n[None, :]).to(tl.int32))
                w = tl.where(m_valid[:, None] & (offs_n < hi)[None, :], _silu(s, FAST_SILU) * inv_norm, 0.0)
                v = pv_desc.load([start_n, h * BLOCK_D])
                acc += tl.dot(w.to(v.dtype), v)

    if pid_s == 0:
        # The sequence's own history keys: causal, up to the end of this row block.
        hi_new = tl.minimum(start_m + BLOCK_M, n_hist)
        k_desc = tl.make_tensor_descriptor(
            K, shape=[total, hd], strides=[stride_t, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        v_desc = tl.make_tensor_descriptor(
            V, shape=[total, hd], strides=[stride_t, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        if shared_row:  # candidates see every history key
            row = rab_base + n_hist.to(tl.int64) * rab_stride + hist_col0
            for start_n in range(0, hi_new, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                k = k_desc.load([seq_start + start_n, h * BLOCK_D])
                s = tl.dot(q, tl.trans(k)) * alpha
                s += tl.load(table + tl.load(row + offs_n).to(tl.int32))[None, :]
                w = tl.where(
                    m_valid[:, None] & (offs_n < hi_new)[None, :], _silu(s, FAST_SILU) * inv_norm, 0.0
                )
                v = v_desc.load([seq_start + start_n, h * BLOCK_D])
                acc += tl.dot(w.to(v.dtype), v)
        else:
            for start_n in range(0, hi_new, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                k = k_desc.load([seq_start + start_n, h * BLOCK_D])
                s = tl.dot(q, tl.trans(k)) * alpha
                s += tl.load(table + tl.load(rab_ptrs + (hist_col0 + offs_n)[None, :]).to(tl.int32))
                visible = m_valid[:, None] & (offs_n[None, :] < hi_new) & (offs_n[None, :] <= offs_m[:, None])
                w = tl.where(visible, _silu(s, FAST_SILU) * inv_norm, 0.0)
                v = v_desc.load([seq_start + start_n, h * BLOCK_D])
                acc += tl.dot(w.to(v.dtype), v)
        # Each candidate also sees itself (distance 0, same timestamp: bias index 0), no other.
        if start_m + BLOCK_M > n_hist:
            is_cand = m_valid & (offs_m >= n_hist)
            rows = (seq_start + offs_m).to(tl.int64)
            self_off = rows[:, None] * stride_t + h * BLOCK_D + offs_d[None, :]
            k_self = tl.load(K + self_off, mask=is_cand[:, None], other=0.0)
            v_self = tl.load(V + self_off, mask=is_cand[:, None], other=0.0)
            s_self = tl.sum(q.to(tl.float32) * k_self.to(tl.float32), axis=1) * alpha + tl.load(table)
            w_self = tl.where(is_cand, _silu(s_self, FAST_SILU) * inv_norm, 0.0)
            acc += w_self[:, None] * v_self.to(tl.float32)

    out_rows = (seq_start + offs_m).to(tl.int64)
    out_ptrs = Out + out_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    if SPLIT:  # partial sums over prefix splits meet in one float32 buffer (zeroed by the host)
        tl.atomic_add(out_ptrs, acc, mask=m_valid[:, None], sem="relaxed")
    else:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=m_valid[:, None])


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    fast_silu: bool = True


# Measured on H200, bench preset (python -m bench.attention): against a cached prefix, narrower key
# tiles with a deeper pipeline win; without one (full / preinfer), 64-wide key tiles.
PREFIX_CONFIG = KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)
NO_PREFIX_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
_RAB_BLOCK = 64
# A prefix split covers at least this many key blocks (fewer: the per-program set-up dominates).
MIN_SPLIT_BLOCKS = 4
_ALIGN = 8  # int16 elements: bias-index rows and the history columns start 16-byte aligned
# Unmasked tile loads may run past a sequence's matrix (rows past its end, columns past a row):
# the buffer ends with this much zeroed slack, so they read valid indices.
_MAX_BLOCK = 128


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for the tensor descriptors that programs create on the device."""
    return torch.empty(size, device=torch.device("cuda", torch.cuda.current_device()), dtype=torch.int8)


def _install_scratch_allocator() -> None:
    # Triton keeps its allocator in a context variable: per thread (the engine runs ranking and
    # pre-inference in different threads), so it is set on every plan. It only hands out device
    # scratch, so it cannot disturb other Triton users.
    triton.set_allocator(_scratch)


@dataclass(frozen=True)
class TritonPlan:
    """What every layer of one forward pass shares: bias indices and combined bias tables."""

    rab_index: torch.Tensor  # int16, per sequence [r, stride] (layout above), concatenated, + slack
    rab_offsets: torch.Tensor  # [B] int64, element offset of each sequence's matrix
    rab_strides: torch.Tensor  # [B] int64, row stride of each sequence's matrix
    rab_table: torch.Tensor  # [L, H, NB_POS * NB_TIME] float32: pos_bias[p] + time_bias[t]


def combined_bias_table(pos_tables: torch.Tensor, time_tables: torch.Tensor) -> torch.Tensor:
    """[L, H, NB_POS * NB_TIME] float32 table of pos_bias[p] + time_bias[t] (index p * NB_TIME + t)."""
    nb_pos, nb_time = pos_tables.shape[2], time_tables.shape[2]
    if nb_pos * nb_time > torch.iinfo(torch.int16).max:
        raise ValueError("num_pos_buckets * num_time_buckets must fit in int16")
    return (pos_tables.float()[:, :, :, None] + time_tables.float()[:, :, None, :]).flatten(2).contiguous()


def rab_layout(
    lengths: list[int], n_hist: list[int], prefix_lens: list[int] | tuple[int, ...]
) -> tuple[list[int], list[int], int]:
    """(offset, row stride) of every sequence's bias-index matrix, and their total size in elements."""
    offsets, strides, size = [], [], 0
    for n, h, p in zip(lengths, n_hist, prefix_lens, strict=True):
        stride = _round_up(_round_up(p, _ALIGN) + h, _ALIGN)
        offsets.append(size)
        strides.append(stride)
        size += min(n, h + 1) * stride
    return offsets, strides, size


def rab_slack(max_cols: int) -> int:
    """Zeroed elements after the last matrix, for unmasked tile loads past it."""
    return _MAX_BLOCK * (max_cols + 1) + _MAX_BLOCK


def _launch_rab_index(
    rab_index: torch.Tensor,
    rab_offsets: torch.Tensor,
    rab_strides: torch.Tensor,
    seq_offsets: torch.Tensor,
    n_hist: torch.Tensor,
    timestamps: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    grid: tuple[int, int, int],
    params: AttentionParams,
    nb_pos: int,
    nb_time: int,
) -> None:
    if prefix is not None:
        plens_d, pts, pts_off = prefix
    else:
        plens_d, pts, pts_off = seq_offsets, timestamps, seq_offsets  # never read
    _rab_index_fwd[grid](
        rab_index, rab_offsets, rab_strides,
        seq_offsets, n_hist, timestamps,
        plens_d, pts, pts_off,
        HAS_PREFIX=prefix is not None,
        POS_BITS=params.pos_mantissa_bits, NB_POS=nb_pos, TIME_BITS=params.time_mantissa_bits, NB_TIME=nb_time,
        ALIGN=_ALIGN, BLOCK_R=_RAB_BLOCK, BLOCK_C=_RAB_BLOCK,
    )  # fmt: skip


def plan_triton(
    seq: SeqLayout,
    prefix: PrefixKV | None,
    pos_tables: torch.Tensor,
    time_tables: torch.Tensor,
    params: AttentionParams,
) -> TritonPlan:
    """pos_tables [L, H, NB_POS], time_tables [L, H, NB_TIME] (float32, on the device)."""
    _install_scratch_allocator()
    table = combined_bias_table(pos_tables, time_tables)
    dev = seq.timestamps.device
    plens = prefix.lens_host if prefix is not None else (0,) * seq.batch_size
    lengths = [seq.length(b) for b in range(seq.batch_size)]
    offsets, strides, size = rab_layout(lengths, list(seq.n_hist_host), plens)
    max_rows = max((min(n, h + 1) for n, h in zip(lengths, seq.n_hist_host, strict=True)), default=0)
    max_cols = max(strides, default=0)
    meta = torch.tensor(offsets + strides, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
    rab_index = torch.empty(size + rab_slack(max_cols), dtype=torch.int16, device=dev)
    rab_index[size:].zero_()
    rab_offsets, rab_strides = meta[: seq.batch_size], meta[seq.batch_size :]
    if max_rows and max_cols:
        grid = (triton.cdiv(max_rows, _RAB_BLOCK), triton.cdiv(max_cols, _RAB_BLOCK), seq.batch_size)
        prefix_d = (prefix.lens, prefix.timestamps, prefix.ts_offsets) if prefix is not None else None
        _launch_rab_index(rab_index, rab_offsets, rab_strides, seq.offsets, seq.n_hist, seq.timestamps,
                          prefix_d, grid, params, pos_tables.shape[2], time_tables.shape[2])  # fmt: skip
    return TritonPlan(rab_index, rab_offsets, rab_strides, table)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """The row stride q, k and v share; raises if the kernels cannot read them as they are."""
    head_dim = q.shape[2]
    stride_t = q.stride(0)
    for t in (q, k, v):
        if t.stride(0) != stride_t or t.stride(1) != head_dim or t.stride(2) != 1:
            raise ValueError("q, k, v must be [T, H, D] rows of one stride, contiguous within a row")
        if t.data_ptr() % 16 or (stride_t * t.element_size()) % 16:
            raise ValueError("q, k, v rows must be 16-byte aligned")
    return stride_t


def _launch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stride_t: int,
    seq_offsets: torch.Tensor,
    n_hist: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    plan: TritonPlan,
    layer: int,
    params: AttentionParams,
    grid: tuple[int, int, int],
    config: KernelConfig,
) -> torch.Tensor:
    """One attention launch over `grid` = (row blocks, sequences x heads, splits); prefix is
    (kv_base, kv_offsets, lens) or None. Returns [T, H, D] in q's dtype."""
    total, num_heads, head_dim = q.shape
    splits = grid[2]
    if splits > 1:
        target = torch.zeros(total, num_heads, head_dim, dtype=torch.float32, device=q.device)
    else:
        target = torch.empty(total, num_heads, head_dim, dtype=q.dtype, device=q.device)
    kv_base, kv_offsets, lens = prefix if prefix is not None else (q, seq_offsets, seq_offsets)  # never read
    _hstu_attention_fwd[grid](
        q, k, v, target,
        total, stride_t, target.stride(0), target.stride(1),
        seq_offsets, n_hist,
        kv_base, kv_offsets, lens,
        plan.rab_index, plan.rab_offsets, plan.rab_strides, plan.rab_table,
        layer, splits, params.alpha, params.inv_norm,
        H=num_heads, NB_COMBINED=plan.rab_table.shape[2], HAS_PREFIX=prefix is not None,
        FAST_SILU=config.fast_silu, SPLIT=splits > 1, MIN_SPLIT_BLOCKS=MIN_SPLIT_BLOCKS,
        ALIGN=_ALIGN, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=head_dim, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return target.to(q.dtype) if splits > 1 else target


# Split the prefix until the SMs hold ~4 waves of programs. Measured on H200 (bench.attention
# --splits, 8k prefix, 320 new tokens per user): batch 8 runs 0.65 ms at 4 splits vs 0.72 at 2;
# batch 1 0.11 ms at 27 splits vs 0.10 at 14.
_SPLIT_WAVES = 4


def _default_splits(programs: int, max_prefix_blocks: int, device: torch.device) -> int:
    # The kernel also caps each sequence's own count by its prefix length (MIN_SPLIT_BLOCKS).
    waves = _SPLIT_WAVES * _num_sms(device)
    return max(1, min(max_prefix_blocks // MIN_SPLIT_BLOCKS, triton.cdiv(waves, max(programs, 1))))


def hstu_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqLayout,
    prefix: PrefixKV | None,
    plan: TritonPlan,
    layer: int,
    params: AttentionParams,
    splits: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Same contract as hstu_attention_reference.

    q, k, v: [T, H, D] views sharing one row stride (the model passes slices of one UVQK tensor),
    each 16-byte aligned with unit stride inside a row.
    """
    total, num_heads, head_dim = q.shape
    if total == 0 or seq.batch_size == 0:
        return torch.empty(total, num_heads, head_dim, dtype=q.dtype, device=q.device)
    stride_t = _check_qkv(q, k, v)
    has_prefix = prefix is not None and max(prefix.lens_host, default=0) > 0
    if config is None:
        config = PREFIX_CONFIG if has_prefix else NO_PREFIX_CONFIG
    bm, bn = config.block_m, config.block_n
    if max(bm, bn) > _MAX_BLOCK:
        raise ValueError(f"block sizes above {_MAX_BLOCK} overrun the bias-index slack")
    if splits is None:
        splits = 1
        if has_prefix:
            assert prefix is not None
            programs = sum(triton.cdiv(seq.length(b), bm) for b in range(seq.batch_size)) * num_heads
            splits = _default_splits(programs, triton.cdiv(max(prefix.lens_host), bn), q.device)
    prefix_d = (prefix.kv_base, prefix.kv_offsets, prefix.lens) if has_prefix and prefix is not None else None
    grid = (triton.cdiv(seq.max_len, bm), seq.batch_size * num_heads, splits)
    return _launch_attention(q, k, v, stride_t, seq.offsets, seq.n_hist, prefix_d, plan, layer, params,
                             grid, config)  # fmt: skip


# ---------------------------------------------------------------------- fixed-grid (CUDA graphs)


@dataclass(frozen=True)
class StaticGrid:
    """Launch sizes fixed before the batch is known. Every bound must hold for the batches run
    with it (StaticBatch.check says which): the kernels skip what lies beyond a batch's sizes."""

    batch: int  # sequences (extra ones have length 0)
    max_len: int  # new tokens of any one sequence (also bounds its bias-index rows)
    rab_col_programs: int  # bias-index programs per row block (they stride over the columns)
    splits: int  # prefix splits of the attention kernel

    @staticmethod
    def plan(batch: int, max_len: int, num_heads: int, device: torch.device) -> StaticGrid:
        """Splits as hstu_attention_triton chooses them for a long prefix (the kernel lowers them
        per sequence for short ones); ~2 waves of bias-index programs."""
        programs = batch * triton.cdiv(max_len, PREFIX_CONFIG.block_m) * num_heads
        splits = max(1, min(64, triton.cdiv(_SPLIT_WAVES * _num_sms(device), programs)))
        row_blocks = batch * triton.cdiv(max_len, _RAB_BLOCK)
        rab_programs = max(1, min(256, triton.cdiv(2 * _num_sms(device), row_blocks)))
        return StaticGrid(batch, max_len, rab_programs, splits)


@dataclass(frozen=True)
class StaticBatch:
    """Device tensors that describe a batch against cached prefixes, read by the kernels at run
    time, plus the fixed grids. The caller fills them before each launch (or graph replay).

    Prefix blocks are addressed as `kv_anchor + kv_offsets[b]` elements: the anchor is one fixed
    allocation, so a captured graph can read psi blocks wherever the allocator put them.
    """

    seq_offsets: torch.Tensor  # [B + 1] int64; sequences past the batch repeat the last offset
    n_hist: torch.Tensor  # [B] int64
    timestamps: torch.Tensor  # [T] int64 (T: the capacity; rows past the batch are ignored)
    prefix_lens: torch.Tensor  # [B] int64
    prefix_timestamps: torch.Tensor  # [capacity] int64
    prefix_ts_offsets: torch.Tensor  # [B + 1] int64
    kv_offsets: torch.Tensor  # [B] int64, elements from kv_anchor
    kv_anchor: torch.Tensor
    rab_index: torch.Tensor  # int16, zero-initialised; a batch needs rab_layout's size + rab_slack
    rab_offsets: torch.Tensor  # [B] int64
    rab_strides: torch.Tensor  # [B] int64
    grid: StaticGrid


def plan_triton_static(
    batch: StaticBatch, table: torch.Tensor, params: AttentionParams, nb_pos: int, nb_time: int
) -> TritonPlan:
    """plan_triton over a StaticBatch: no host reads, fixed grid (capturable)."""
    _install_scratch_allocator()
    g = batch.grid
    grid = (triton.cdiv(g.max_len, _RAB_BLOCK), g.rab_col_programs, g.batch)
    prefix = (batch.prefix_lens, batch.prefix_timestamps, batch.prefix_ts_offsets)
    _launch_rab_index(batch.rab_index, batch.rab_offsets, batch.rab_strides, batch.seq_offsets, batch.n_hist,
                      batch.timestamps, prefix, grid, params, nb_pos, nb_time)  # fmt: skip
    return TritonPlan(batch.rab_index, batch.rab_offsets, batch.rab_strides, table)


def hstu_attention_static(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: StaticBatch,
    plan: TritonPlan,
    layer: int,
    params: AttentionParams,
) -> torch.Tensor:
    """hstu_attention_triton over a StaticBatch (always with a prefix, possibly empty)."""
    stride_t = _check_qkv(q, k, v)
    g = batch.grid
    grid = (triton.cdiv(g.max_len, PREFIX_CONFIG.block_m), g.batch * q.shape[1], g.splits)
    prefix = (batch.kv_anchor, batch.kv_offsets, batch.prefix_lens)
    return _launch_attention(q, k, v, stride_t, batch.seq_offsets, batch.n_hist, prefix, plan, layer, params,
                             grid, PREFIX_CONFIG)  # fmt: skip
