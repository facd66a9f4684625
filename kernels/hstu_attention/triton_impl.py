"""Triton HSTU attention for CUDA: jagged new tokens against an optional cached prefix read in place.

Two kernels:

* `_rab_index_fwd` runs once per forward pass. The relative-bias bucket of a (query, key) pair
  depends on positions and timestamps only, not on the layer or the head, so it is computed once
  (int16: pos_bucket * NB_TIME + time_bucket) instead of 2 x layers x heads times inside the
  attention loop. Sequence b gets a row-major [n_b, stride_b] matrix: prefix keys in columns
  [0, P_b), history key j in column round_up(P_b, 8) + j, the rest padded with index 0.
* `_hstu_attention_fwd` computes BLOCK_M query rows of one (sequence, head): it streams the cached
  prefix K/V straight from each user's psi block, then the sequence's own history keys (causal),
  then adds each candidate's attention to itself (a row-wise dot). The bias is one gather from the
  layer's combined table pos_bias[h, p] + time_bias[h, t]. Pointwise SiLU attention has no softmax,
  so the prefix can be split across programs (SPLITS) and partial sums added: that keeps the SMs
  busy when a batch has few query blocks but long prefixes.

Q/K/V tiles are loaded through TMA tensor descriptors made on the device (psi blocks live at
per-user addresses): with head_dim 256, per-element pointer tensors would not fit in registers.

Semantics are those of reference.py; bucket arithmetic is the same integer bit manipulation.
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
    r0 = pid_r * BLOCK_R
    c0 = pid_c * BLOCK_C
    # Every entry of the padded row is written (padding with index 0): the attention kernel loads
    # whole tiles without masks and gathers with them, so each must be a valid table index.
    if r0 >= n or c0 >= stride:
        return
    r = r0 + tl.arange(0, BLOCK_R)
    c = c0 + tl.arange(0, BLOCK_C)
    r_valid = r < n
    in_prefix = c < plen
    j = c - plen_pad  # history key index for columns past the (padded) prefix
    in_hist = (j >= 0) & (j < n_hist)
    q_ts = tl.load(ts_ptr + seq_start + r, mask=r_valid, other=0)
    k_ts = tl.load(ts_ptr + seq_start + j, mask=in_hist, other=0)
    if HAS_PREFIX:
        pts = prefix_ts + tl.load(prefix_ts_offsets + b)
        k_ts = tl.where(in_prefix, tl.load(pts + c, mask=in_prefix, other=0), k_ts)
    # Prefix key c sits at position c, history key j at plen + j.
    k_pos = tl.where(in_prefix, c, plen + j)
    q_pos = plen + tl.minimum(r, n_hist)
    dpos = q_pos[:, None] - k_pos[None, :]
    dts = q_ts[:, None] - k_ts[None, :]
    idx = _log_bucket(dpos, POS_BITS, NB_POS) * NB_TIME + _log_bucket(dts, TIME_BITS, NB_TIME)
    idx = tl.where((in_prefix | in_hist)[None, :], idx, 0)
    out = Idx + tl.load(idx_offsets + b) + r.to(tl.int64)[:, None] * stride + c[None, :]
    tl.store(out, idx.to(tl.int16), mask=r_valid[:, None] & (c < stride)[None, :])


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
    total, stride_t, stride_os, stride_ot, stride_oh,
    seq_offsets, n_hist_ptr,
    KVBase, prefix_kv_offsets, prefix_lens,
    RabIdx, rab_offsets, rab_strides, rab_table,
    layer, splits, alpha, inv_norm,
    H: tl.constexpr, NB_COMBINED: tl.constexpr, HAS_PREFIX: tl.constexpr, FAST_SILU: tl.constexpr,
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
    plen = 0
    if HAS_PREFIX:
        plen = tl.load(prefix_lens + b).to(tl.int32)
    # Bias index rows of this block: unmasked, vectorised loads (see plan_triton for the slack).
    # A block of candidates only shares one row (same position and timestamp): 1-D bias per key.
    rab_base = RabIdx + tl.multiple_of(tl.load(rab_offsets + b), ALIGN)
    rab_stride = tl.multiple_of(tl.load(rab_strides + b), ALIGN)
    shared_row = start_m >= n_hist
    rab_ptrs = rab_base + tl.minimum(offs_m, n_hist).to(tl.int64)[:, None] * rab_stride
    hist_col0 = tl.cdiv(plen, ALIGN) * ALIGN
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if HAS_PREFIX:
        n_blocks = tl.cdiv(plen, BLOCK_N)
        per_split = tl.cdiv(n_blocks, splits)
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
    out_ptrs = (
        Out + pid_s.to(tl.int64) * stride_os + out_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    )
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

    rab_index: torch.Tensor  # int16, per sequence [n, stride] (layout above), concatenated, + slack
    rab_offsets: torch.Tensor  # [B] int64, element offset of each sequence's matrix
    rab_strides: torch.Tensor  # [B] int64, row stride of each sequence's matrix
    rab_table: torch.Tensor  # [L, H, NB_POS * NB_TIME] float32: pos_bias[p] + time_bias[t]


def plan_triton(
    seq: SeqLayout,
    prefix: PrefixKV | None,
    pos_tables: torch.Tensor,
    time_tables: torch.Tensor,
    params: AttentionParams,
) -> TritonPlan:
    """pos_tables [L, H, NB_POS], time_tables [L, H, NB_TIME] (float32, on the device)."""
    _install_scratch_allocator()
    nb_pos, nb_time = pos_tables.shape[2], time_tables.shape[2]
    if nb_pos * nb_time > torch.iinfo(torch.int16).max:
        raise ValueError("num_pos_buckets * num_time_buckets must fit in int16")
    dev = seq.timestamps.device
    plens = prefix.lens_host if prefix is not None else (0,) * seq.batch_size
    offsets, strides, size, max_rows, max_cols = [], [], 0, 0, 0
    for b in range(seq.batch_size):
        rows = seq.length(b)
        stride = _round_up(_round_up(plens[b], _ALIGN) + seq.n_hist_host[b], _ALIGN)
        offsets.append(size)
        strides.append(stride)
        size += rows * stride
        max_rows, max_cols = max(max_rows, rows), max(max_cols, stride)
    meta = torch.tensor(offsets + strides, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
    slack = _MAX_BLOCK * (max_cols + 1) + _MAX_BLOCK
    rab_index = torch.empty(size + slack, dtype=torch.int16, device=dev)
    rab_index[size:].zero_()
    table = (pos_tables.float()[:, :, :, None] + time_tables.float()[:, :, None, :]).flatten(2).contiguous()
    rab_offsets, rab_strides = meta[: seq.batch_size], meta[seq.batch_size :]
    if max_rows and max_cols:
        if prefix is not None:
            plens_d, pts, pts_off = prefix.lens, prefix.timestamps, prefix.ts_offsets
        else:
            plens_d, pts, pts_off = seq.offsets, seq.timestamps, seq.offsets  # never read
        grid = (triton.cdiv(max_rows, _RAB_BLOCK), triton.cdiv(max_cols, _RAB_BLOCK), seq.batch_size)
        _rab_index_fwd[grid](
            rab_index, rab_offsets, rab_strides,
            seq.offsets, seq.n_hist, seq.timestamps,
            plens_d, pts, pts_off,
            HAS_PREFIX=prefix is not None,
            POS_BITS=params.pos_mantissa_bits, NB_POS=nb_pos, TIME_BITS=params.time_mantissa_bits, NB_TIME=nb_time,
            ALIGN=_ALIGN, BLOCK_R=_RAB_BLOCK, BLOCK_C=_RAB_BLOCK,
        )  # fmt: skip
    return TritonPlan(rab_index, rab_offsets, rab_strides, table)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


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
    out = torch.empty(total, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if total == 0 or seq.batch_size == 0:
        return out
    stride_t = q.stride(0)
    for t in (q, k, v):
        if t.stride(0) != stride_t or t.stride(1) != head_dim or t.stride(2) != 1:
            raise ValueError("q, k, v must be [T, H, D] rows of one stride, contiguous within a row")
        if t.data_ptr() % 16 or (stride_t * t.element_size()) % 16:
            raise ValueError("q, k, v rows must be 16-byte aligned")
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
            # Programs that exist anyway; split the prefix until the SMs hold ~2 waves.
            programs = sum(triton.cdiv(seq.length(b), bm) for b in range(seq.batch_size)) * num_heads
            max_blocks = triton.cdiv(max(prefix.lens_host), bn)
            splits = max(1, min(max_blocks // 4, triton.cdiv(2 * _num_sms(q.device), max(programs, 1))))
    if splits > 1:
        target = torch.empty(splits, total, num_heads, head_dim, dtype=torch.float32, device=q.device)
    else:
        target = out.unsqueeze(0)
    if has_prefix:
        assert prefix is not None
        kv_base, kv_offsets, lens = prefix.kv_base, prefix.kv_offsets, prefix.lens
    else:
        kv_base, kv_offsets, lens = q, seq.offsets, seq.offsets  # never read
    grid = (triton.cdiv(seq.max_len, bm), seq.batch_size * num_heads, splits)
    _hstu_attention_fwd[grid](
        q, k, v, target,
        total, stride_t, target.stride(0), target.stride(1), target.stride(2),
        seq.offsets, seq.n_hist,
        kv_base, kv_offsets, lens,
        plan.rab_index, plan.rab_offsets, plan.rab_strides, plan.rab_table,
        layer, splits, params.alpha, params.inv_norm,
        H=num_heads, NB_COMBINED=plan.rab_table.shape[2], HAS_PREFIX=has_prefix, FAST_SILU=config.fast_silu,
        ALIGN=_ALIGN, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=head_dim,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        out.copy_(target.sum(0))
    return out
