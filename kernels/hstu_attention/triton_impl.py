"""Triton HSTU attention for CUDA: jagged new tokens against an optional cached prefix read in place.

Two kernels:

* `_relative_ts_fwd` runs once per forward pass: per sequence, every key's timestamp (prefix and
  new tokens) relative to the sequence's earliest one, as int32, and whether the sequence's span
  fits in 2**30 (then every difference of two of them is an exact int32). A span that does not fit
  (about 34 years of seconds; the model's profile tokens at time 0 beside real timestamps) makes
  the attention read the int64 timestamps for that sequence: a row block whose own queries lie
  close together (ts_block_span) takes them relative to its latest query, clamped into int32,
  which is exact because the time bucket saturates; other blocks take int64 differences per pair.
* `_hstu_attention_fwd` computes BLOCK_M query rows of one (sequence, head): it streams the cached
  prefix K/V straight from each user's psi block, then the sequence's own history keys (causal:
  tiles wholly below the diagonal unmasked, the diagonal tiles masked, tiles above it never
  visited), then adds each candidate's attention to itself (a row-wise dot).

The relative bias is computed on chip, tile by tile. Per pair, the position bias is one lookup in
a table by distance that plan_triton builds per forward pass ([L, H, longest + 1], up to
POS_TABLE_MAX_DISTANCE); the fixed-grid path, and rows that share one position, compute the bucket
instead (int32 arithmetic, an exact float conversion by the 2**23 trick). The time bucket comes from
the int32 relative timestamps (one hardware conversion), each then looked up in the layer's small
per-head table (pos_bias[h]: NB_POS floats, time_bias[h]: NB_TIME floats, both L1-resident). A
block of candidate rows shares one position and one timestamp, so its bias is a single row per
key tile. Pointwise SiLU attention has no softmax, so the prefix can be split across programs and
the partial sums added (atomically, in a float32 buffer; the last split to arrive writes the
output): that keeps the SMs busy when a batch has few query blocks but long prefixes. The split
count is chosen in splits.py (a wave-quantisation model with the partial sums' cost, one program per
SM at a time).

Q/K/V tiles are loaded through TMA tensor descriptors made on the device (psi blocks live at
per-user addresses): with head_dim 256, per-element pointer tensors would not fit in registers.

Semantics are those of reference.py; bucket arithmetic is the same float32 bit manipulation, and
positions must stay below 2**22 (checked where lengths are known on the host).

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

from kernels.hstu_attention.bias import (
    POS_TABLE_MAX_DISTANCE,
    BiasTables,
    packed_bias_tables,
    position_by_distance,
)
from kernels.hstu_attention.layout import AttentionParams, PrefixKV, SeqLayout
from kernels.hstu_attention.splits import MIN_SPLIT_BLOCKS, choose_causal_splits, choose_splits

# Relative timestamps are int32 when a sequence's span is at most this: differences of two then
# lie in [-2**30, 2**30] (no overflow, exact float32 rounding by the hardware conversion).
_TS_SPAN_LIMIT = 1 << 30
# Beyond that, timestamps relative to a row block's latest query are clamped to +-_REL_TS_CLAMP.
_REL_TS_CLAMP = tl.constexpr(1 << 30)
# Position distances are converted to float32 exactly by OR-ing them into the mantissa of 2**23.
MAX_POSITIONS = 1 << 22


@triton.jit
def _bucket_of_float(f, MANT_BITS: tl.constexpr, NUM_BUCKETS: tl.constexpr):
    """log_bucket (reference.py) from float32(x + 1) >= 1: the biased exponent and the top
    mantissa bits are adjacent, so one shift yields exponent * 2**m + mantissa (+ 127 * 2**m)."""
    bits = f.to(tl.int32, bitcast=True)
    return tl.minimum((bits >> (23 - MANT_BITS)) - (127 << MANT_BITS), NUM_BUCKETS - 1)


@triton.jit
def _pos_bucket(y, MANT_BITS: tl.constexpr, NUM_BUCKETS: tl.constexpr):
    """Bucket of a position distance given as y = distance + 1 (int32, any sign)."""
    y = tl.minimum(tl.maximum(y, 1), (1 << 23) - 1)
    # float32(y) exactly, without the (quarter-rate) conversion unit: 2**23 + y, minus 2**23.
    f = (y | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return _bucket_of_float(f, MANT_BITS, NUM_BUCKETS)


@triton.jit
def _time_bucket(y, MANT_BITS: tl.constexpr, NUM_BUCKETS: tl.constexpr):
    """Bucket of a time difference given as y = difference + 1 (int32 or int64, any sign)."""
    return _bucket_of_float(tl.maximum(y, 1).to(tl.float32), MANT_BITS, NUM_BUCKETS)


@triton.jit
def _table_lookup(ptrs):
    """*ptrs, through the read-only L1 path, as an op opaque to Triton: a plain tl.load of these
    gathers would be staged through shared memory by the software pipeliner (a [BLOCK_M, BLOCK_N]
    float32 buffer each, more than the tiles leave free); the tables are tiny and stay in L1."""
    return tl.inline_asm_elementwise(
        "ld.global.nc.f32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _fence_gpu(x):
    """fence.acq_rel.gpu in every thread (x: any int32 tensor, only there to give the op a shape;
    not pure, so it is kept and stays in program order)."""
    return tl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _relative_ts_fwd(
    ts_ptr, ts32_ptr, seq_offsets,
    prefix_ts, prefix_ts32, prefix_ts_offsets, prefix_lens,
    fits_ptr,
    HAS_PREFIX: tl.constexpr, SPAN_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    seq_start = tl.load(seq_offsets + b)
    n = tl.load(seq_offsets + b + 1) - seq_start
    plen = 0
    p_start = 0
    if HAS_PREFIX:
        plen = tl.load(prefix_lens + b)
        p_start = tl.load(prefix_ts_offsets + b)
    big = 0x3FFFFFFFFFFFFFFF
    lo = tl.full([BLOCK], big, tl.int64)
    hi = tl.full([BLOCK], -big, tl.int64)
    for c in range(0, n, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        t = tl.load(ts_ptr + seq_start + offs, mask=offs < n, other=0)
        lo = tl.where(offs < n, tl.minimum(lo, t), lo)
        hi = tl.where(offs < n, tl.maximum(hi, t), hi)
    if HAS_PREFIX:
        for c in range(0, plen, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            t = tl.load(prefix_ts + p_start + offs, mask=offs < plen, other=0)
            lo = tl.where(offs < plen, tl.minimum(lo, t), lo)
            hi = tl.where(offs < plen, tl.maximum(hi, t), hi)
    base = tl.min(lo, axis=0)
    span = tl.max(hi, axis=0) - base
    tl.store(fits_ptr + b, (span <= SPAN_LIMIT).to(tl.int32))
    # Out-of-span values are clamped; they are never read (the kernel then reads int64).
    for c in range(0, n, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        t = tl.load(ts_ptr + seq_start + offs, mask=offs < n, other=0)
        rel = tl.minimum(tl.maximum(t - base, 0), SPAN_LIMIT).to(tl.int32)
        tl.store(ts32_ptr + seq_start + offs, rel, mask=offs < n)
    if HAS_PREFIX:
        for c in range(0, plen, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            t = tl.load(prefix_ts + p_start + offs, mask=offs < plen, other=0)
            rel = tl.minimum(tl.maximum(t - base, 0), SPAN_LIMIT).to(tl.int32)
            tl.store(prefix_ts32 + p_start + offs, rel, mask=offs < plen)


@triton.jit
def _silu_scaled(h, inv_norm, FAST_SILU: tl.constexpr):
    """SiLU(2h) / attn_norm, given h = x / 2."""
    hn = h * inv_norm
    if FAST_SILU:
        # x * sigmoid(x) = h + h * tanh(h): one MUFU op (tanh.approx) instead of exp + rcp.
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [h], dtype=tl.float32, is_pure=True, pack=1
        )
        return hn + hn * t
    else:
        return 2.0 * hn * tl.sigmoid(2.0 * h)


# Key masks of _attend.
_ALL = tl.constexpr(0)  # every key in range is visible (rows past the data read as zeros)
_BELOW = tl.constexpr(1)  # keys j < bound
_CAUSAL = tl.constexpr(2)  # keys j < bound and j <= i
_SELF = tl.constexpr(3)  # key j == i, j >= bound: a candidate's attention to itself


@triton.jit
def _attend(
    acc, q, k_desc, v_desc, desc_row0, col_d, lo, hi, bound,
    k_ts_ptr, k_pos0, offs_m, q_pos1, q_ts1, ts_ref,
    pos_tab, pos_dist, time_tab, alpha_half, inv_norm,
    MASK: tl.constexpr, SHARED_ROW: tl.constexpr,
    POS_BITS: tl.constexpr, NB_POS: tl.constexpr, TIME_BITS: tl.constexpr, NB_TIME: tl.constexpr,
    FAST_SILU: tl.constexpr, POS_BY_DIST: tl.constexpr, REL_TS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """acc += attention of this block's queries to the key tiles starting in [lo, hi) (steps of
    BLOCK_N), under MASK. Key j sits at descriptor row desc_row0 + j, position k_pos0 + j, and has
    the (relative) timestamp k_ts_ptr[j]; q_pos1 / q_ts1 are the query position / timestamp plus
    one, per row ([BLOCK_M]) or, with SHARED_ROW, one scalar for the whole block. Indices j and
    offs_m count from the same origin. _ALL relies on K/V rows past the data being zero (TMA fills
    out-of-bounds rows with zeros): such keys add nothing. The masked modes zero V's rows from `hi`
    on themselves: their last tile may reach past the batch's data into rows of any content. _SELF's bias is bucket 0 of both tables
    (distance 0, the same timestamp)."""
    if MASK == _SELF:
        bias_self = tl.load(pos_tab) + tl.load(time_tab)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = k_desc.load([desc_row0 + start_n, col_d])
        s = tl.dot(q, tl.trans(k))
        if MASK == _SELF:
            h = s * alpha_half + bias_self
        else:
            k_ts = tl.load(k_ts_ptr + offs_n, mask=offs_n < hi, other=0)
            if REL_TS:  # int64 timestamps relative to ts_ref, clamped into int32 (see the kernel)
                k_ts = tl.minimum(tl.maximum(k_ts - ts_ref, -_REL_TS_CLAMP), _REL_TS_CLAMP).to(tl.int32)
            k_pos = k_pos0 + offs_n
            if SHARED_ROW:
                pb = tl.load(pos_tab + _pos_bucket(q_pos1 - k_pos, POS_BITS, NB_POS))
                tb = tl.load(time_tab + _time_bucket(q_ts1 - k_ts, TIME_BITS, NB_TIME))
                h = s * alpha_half + (pb + tb)[None, :]
            else:
                if POS_BY_DIST:  # pos_dist[y] is the bias of distance y - 1 (y >= 1)
                    pb = _table_lookup(pos_dist + tl.maximum(q_pos1[:, None] - k_pos[None, :], 1))
                else:
                    pb = _table_lookup(
                        pos_tab + _pos_bucket(q_pos1[:, None] - k_pos[None, :], POS_BITS, NB_POS)
                    )
                tb = _table_lookup(
                    time_tab + _time_bucket(q_ts1[:, None] - k_ts[None, :], TIME_BITS, NB_TIME)
                )
                h = s * alpha_half + pb + tb
        w = _silu_scaled(h, inv_norm, FAST_SILU)
        if MASK == _BELOW:
            w = tl.where((offs_n < bound)[None, :], w, 0.0)
        elif MASK == _CAUSAL:
            w = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n < bound)[None, :], w, 0.0)
        elif MASK == _SELF:
            w = tl.where((offs_n[None, :] == offs_m[:, None]) & (offs_n >= bound)[None, :], w, 0.0)
        v = v_desc.load([desc_row0 + start_n, col_d])
        if MASK != _ALL:
            # Keys from `hi` on are masked (w = 0), but their V rows still enter the product, and
            # 0 x NaN is NaN: in a padded batch (a CUDA graph's bucket) the rows past the last
            # sequence hold whatever the memory held (a full ranking's candidates at 1024-1066 of
            # a 1280-token bucket scored NaN on an H200 after another engine had used the memory).
            v = tl.where((offs_n < hi)[:, None], v, tl.zeros_like(v))
        acc = tl.dot(w.to(v.dtype), v, acc)
    return acc


@triton.jit
def _attend_all(
    acc, q, pk_desc, pv_desc, k_desc, v_desc, h, seq_start, n_hist, start_m, offs_m,
    plen, lo_p, hi_p, lo_h, hi_h, full_hi, do_diagonal,
    ts_k, pts_k, q_ts1, ts_ref, pos_tab, pos_dist, time_tab, alpha_half, inv_norm,
    HAS_PREFIX: tl.constexpr, SHARED_ROW: tl.constexpr,
    POS_BITS: tl.constexpr, NB_POS: tl.constexpr, TIME_BITS: tl.constexpr, NB_TIME: tl.constexpr,
    FAST_SILU: tl.constexpr, POS_BY_DIST: tl.constexpr, REL_TS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """For one row block: the prefix keys [lo_p, hi_p), the history keys [lo_h, hi_h) below
    every row of the block (below full_hi, unmasked), and if do_diagonal the masked tiles from
    full_hi up to the block's last row. ts_k / pts_k: timestamps of the sequence's new tokens /
    prefix (int32 relative or int64)."""
    col_d = h * BLOCK_D
    if SHARED_ROW:
        q_pos1 = plen + n_hist + 1
    else:
        q_pos1 = plen + tl.minimum(offs_m, n_hist) + 1
    if HAS_PREFIX:
        # Prefix keys: all visible; rows past plen read as zeros (V = 0), so no mask.
        acc = _attend(acc, q, pk_desc, pv_desc, 0, col_d, lo_p, hi_p, hi_p, pts_k, 0, offs_m, q_pos1, q_ts1, ts_ref,
                      pos_tab, pos_dist, time_tab, alpha_half, inv_norm,
                      _ALL, SHARED_ROW, POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, REL_TS, BLOCK_N)  # fmt: skip
    # History keys below every row of the block (and below n_hist): unmasked tiles.
    acc = _attend(acc, q, k_desc, v_desc, seq_start, col_d, lo_h, hi_h, hi_h, ts_k, plen, offs_m,
                  q_pos1, q_ts1, ts_ref, pos_tab, pos_dist, time_tab, alpha_half, inv_norm,
                  _ALL, SHARED_ROW, POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, REL_TS, BLOCK_N)  # fmt: skip
    if do_diagonal:
        # The rest, up to the block's last row (causal) and n_hist: masked tiles.
        hi_new = tl.minimum(start_m + BLOCK_M, n_hist)
        if SHARED_ROW:  # candidates see every history key
            acc = _attend(acc, q, k_desc, v_desc, seq_start, col_d, full_hi, hi_new, hi_new, ts_k, plen, offs_m,
                          q_pos1, q_ts1, ts_ref, pos_tab, pos_dist, time_tab, alpha_half, inv_norm,
                          _BELOW, True, POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, REL_TS, BLOCK_N)  # fmt: skip
        else:
            acc = _attend(acc, q, k_desc, v_desc, seq_start, col_d, full_hi, hi_new, hi_new, ts_k, plen, offs_m,
                          q_pos1, q_ts1, ts_ref, pos_tab, pos_dist, time_tab, alpha_half, inv_norm,
                          _CAUSAL, False, POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, REL_TS, BLOCK_N)  # fmt: skip
    return acc


@triton.jit(do_not_specialize=["layer", "splits", "total", "n_row_blocks", "dist_len"])
def _hstu_attention_fwd(
    Q, K, V, Out, Partial, Arrivals,
    total, stride_t, stride_ot, stride_oh,
    seq_offsets, n_hist_ptr, ts64, ts32, fits_ptr,
    KVBase, prefix_kv_offsets, prefix_lens, prefix_strides, pts64, pts32, pts_offsets,
    bias_tables, pos_by_distance, dist_len, layer, splits, n_row_blocks, alpha_half, inv_norm,
    H: tl.constexpr, NB_POS: tl.constexpr, NB_TIME: tl.constexpr, POS_BITS: tl.constexpr,
    TIME_BITS: tl.constexpr, HAS_PREFIX: tl.constexpr, FAST_SILU: tl.constexpr, POS_BY_DIST: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SPLIT_BLOCKS: tl.constexpr, TS_BLOCK_SPAN: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    TWO_PASS: tl.constexpr, SUM_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Programs start in id order, and the last row blocks of a causal sequence see the most keys:
    # row blocks run in reverse with the heads fastest, so the longest programs of every head
    # start first and the short ones fill in behind them (longest first; at 8k tokens, batch 1,
    # head by head left the four heads' longest blocks queued behind short ones: the last wave
    # ran about 1.4x the balanced time). One sequence's programs still run side by side and
    # share its K/V through L2.
    # (HEADS_FASTEST off: row blocks fastest, head by head, the order this replaced; kept to be
    # measured against, bench.attention --sweep.)
    if HEADS_FASTEST:
        pid_mh = tl.program_id(0)
        h = pid_mh % H
        pid_m = n_row_blocks - 1 - pid_mh // H
        b = tl.program_id(1)
    else:
        pid_m = n_row_blocks - 1 - tl.program_id(0)
        b = tl.program_id(1) // H
        h = tl.program_id(1) % H
    pid_s = tl.program_id(2)
    pid_bh = b * H + h
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
    n_hist = tl.load(n_hist_ptr + b).to(tl.int32)
    # The key tiles visible to every row of the block: the prefix's, then the history's below the
    # block (full_hi). They are shared out among the splits; the masked diagonal tiles and the
    # candidates' own keys stay with split 0.
    full_hi = tl.minimum(start_m, n_hist) // BLOCK_N * BLOCK_N
    units = n_blocks + full_hi // BLOCK_N
    # This row block's own split count: at most `splits`, at least MIN_SPLIT_BLOCKS key blocks
    # each, so a fixed grid (CUDA graphs) does no extra work for short sequences.
    active = splits
    if SPLIT:
        active = tl.minimum(splits, tl.maximum(units // MIN_SPLIT_BLOCKS, 1))
        if pid_s >= active:
            return
    per_split = tl.cdiv(units, active)
    u_lo = pid_s * per_split
    u_hi = tl.minimum(u_lo + per_split, units)
    lo_h = (tl.maximum(u_lo, n_blocks) - n_blocks) * BLOCK_N
    hi_h = (tl.maximum(u_hi, n_blocks) - n_blocks) * BLOCK_N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < n
    # q, k, v are [T, H*D] views with row stride stride_t (columns of one UVQK tensor).
    q_desc = tl.make_tensor_descriptor(
        Q, shape=[total, hd], strides=[stride_t, 1], block_shape=[BLOCK_M, BLOCK_D]
    )
    k_desc = tl.make_tensor_descriptor(
        K, shape=[total, hd], strides=[stride_t, 1], block_shape=[BLOCK_N, BLOCK_D]
    )
    v_desc = tl.make_tensor_descriptor(
        V, shape=[total, hd], strides=[stride_t, 1], block_shape=[BLOCK_N, BLOCK_D]
    )
    q = q_desc.load([seq_start + start_m, h * BLOCK_D])
    # Tables pre-halved (h = x / 2 feeds the SiLU): pos [NB_POS] then time [NB_TIME].
    pos_tab = bias_tables + (layer * H + h).to(tl.int64) * (NB_POS + NB_TIME)
    time_tab = pos_tab + NB_POS
    # With POS_BY_DIST: this layer's and head's position bias by distance, from index -1 (so that
    # pos_dist[distance + 1] is the distance's bias; never read otherwise).
    pos_dist = pos_by_distance + (layer * H + h).to(tl.int64) * dist_len - 1
    shared_row = start_m >= n_hist  # candidates only: one position, one timestamp
    # Rows past n_hist share n_hist's timestamp; rows past n (never stored) read row n - 1's.
    q_row = seq_start + tl.minimum(tl.minimum(offs_m, n_hist), n - 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo_p = 0
    hi_p = 0
    pk_desc = k_desc
    pv_desc = v_desc
    p_start = 0
    if HAS_PREFIX:
        lo_p = tl.minimum(u_lo, n_blocks) * BLOCK_N
        hi_p = tl.minimum(tl.minimum(u_hi, n_blocks) * BLOCK_N, plen)
        # The block's own length strides its layers (psi built in part is read in place: its
        # first plen tokens of a longer block; PrefixKV.layer_strides).
        stride = tl.load(prefix_strides + b).to(tl.int64)
        k_base = KVBase + tl.load(prefix_kv_offsets + b) + (layer * 2).to(tl.int64) * stride * hd
        rows_p = tl.maximum(plen, 1)  # a descriptor needs a non-empty shape; empty prefixes load nothing
        pk_desc = tl.make_tensor_descriptor(
            k_base, shape=[rows_p, hd], strides=[hd, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        pv_desc = tl.make_tensor_descriptor(
            k_base + stride * hd, shape=[rows_p, hd], strides=[hd, 1], block_shape=[BLOCK_N, BLOCK_D]
        )  # fmt: skip
        p_start = tl.load(pts_offsets + b)
    do_diagonal = pid_s == 0
    fits = tl.load(fits_ptr + b) != 0
    # A sequence spanning more than int32 (profile tokens at time 0 beside real timestamps, say):
    # timestamps relative to this block's latest query, keys clamped to +-2**30, still give exact
    # time buckets while the block's queries span at most TS_BLOCK_SPAN: a clamped key is at least
    # the saturation distance away from every query both before and after clamping.
    q_ts64 = tl.load(ts64 + q_row)
    ts_ref = tl.max(q_ts64, axis=0)
    block_fits = ts_ref - tl.min(q_ts64, axis=0) <= TS_BLOCK_SPAN
    if fits:
        if shared_row:
            acc = _attend_all(acc, q, pk_desc, pv_desc, k_desc, v_desc, h, seq_start, n_hist, start_m, offs_m,
                              plen, lo_p, hi_p, lo_h, hi_h, full_hi, do_diagonal, ts32 + seq_start, pts32 + p_start,
                              tl.load(ts32 + seq_start + n_hist) + 1, 0,
                              pos_tab, pos_dist, time_tab, alpha_half, inv_norm, HAS_PREFIX, True,
                              POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, False, BLOCK_M, BLOCK_N, BLOCK_D)  # fmt: skip
        else:
            acc = _attend_all(acc, q, pk_desc, pv_desc, k_desc, v_desc, h, seq_start, n_hist, start_m, offs_m,
                              plen, lo_p, hi_p, lo_h, hi_h, full_hi, do_diagonal, ts32 + seq_start, pts32 + p_start,
                              tl.load(ts32 + q_row) + 1, 0,
                              pos_tab, pos_dist, time_tab, alpha_half, inv_norm, HAS_PREFIX, False,
                              POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, False, BLOCK_M, BLOCK_N, BLOCK_D)  # fmt: skip
    elif block_fits:
        if shared_row:
            acc = _attend_all(acc, q, pk_desc, pv_desc, k_desc, v_desc, h, seq_start, n_hist, start_m, offs_m,
                              plen, lo_p, hi_p, lo_h, hi_h, full_hi, do_diagonal, ts64 + seq_start, pts64 + p_start,
                              (tl.load(ts64 + seq_start + n_hist) - ts_ref + 1).to(tl.int32), ts_ref,
                              pos_tab, pos_dist, time_tab, alpha_half, inv_norm, HAS_PREFIX, True,
                              POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, True, BLOCK_M, BLOCK_N, BLOCK_D)  # fmt: skip
        else:
            acc = _attend_all(acc, q, pk_desc, pv_desc, k_desc, v_desc, h, seq_start, n_hist, start_m, offs_m,
                              plen, lo_p, hi_p, lo_h, hi_h, full_hi, do_diagonal, ts64 + seq_start, pts64 + p_start,
                              (q_ts64 - ts_ref + 1).to(tl.int32), ts_ref,
                              pos_tab, pos_dist, time_tab, alpha_half, inv_norm, HAS_PREFIX, False,
                              POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, True, BLOCK_M, BLOCK_N, BLOCK_D)  # fmt: skip
    else:  # the block's own queries span too much: int64 differences per pair (rare, slower)
        acc = _attend_all(acc, q, pk_desc, pv_desc, k_desc, v_desc, h, seq_start, n_hist, start_m, offs_m,
                          plen, lo_p, hi_p, lo_h, hi_h, full_hi, do_diagonal, ts64 + seq_start, pts64 + p_start,
                          q_ts64 + 1, 0,
                          pos_tab, pos_dist, time_tab, alpha_half, inv_norm, HAS_PREFIX, False,
                          POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, False, BLOCK_M, BLOCK_N, BLOCK_D)  # fmt: skip

    if do_diagonal:
        # Each candidate row (i >= n_hist) also sees itself, no other candidate: the diagonal tiles.
        self_lo = tl.maximum(start_m, n_hist)
        acc = _attend(acc, q, k_desc, v_desc, seq_start, h * BLOCK_D, self_lo // BLOCK_N * BLOCK_N,
                      tl.minimum(start_m + BLOCK_M, n), self_lo, ts32, 0, offs_m, 0, 0, 0,
                      pos_tab, pos_dist, time_tab, alpha_half, inv_norm,
                      _SELF, True, POS_BITS, NB_POS, TIME_BITS, NB_TIME, FAST_SILU, POS_BY_DIST, False, BLOCK_N)  # fmt: skip

    out_rows = (seq_start + offs_m).to(tl.int64)
    out_ptrs = Out + out_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    if SPLIT and TWO_PASS:
        # Each split stores its partial sums in a float32 slot of its own ([splits, T, H, D]: no
        # two programs write one address); the last split of this (row block, sequence, head) to
        # arrive adds the slots up, SUM_ROWS rows at a time (a whole tile of sums beside the
        # loaded one would not fit in registers), and writes Out. The atomic path below adds
        # into one buffer instead: every split's adds meet in the same rows and serialise in L2
        # (on an H200, one user's 320 tokens against 8k took 0.174 ms at 11 splits, 0.130 at 4).
        slot = total.to(tl.int64) * stride_ot
        mine = (
            Partial
            + pid_s.to(tl.int64) * slot
            + out_rows[:, None] * stride_ot
            + h * stride_oh
            + offs_d[None, :]
        )
        tl.store(mine, acc, mask=m_valid[:, None])
        # Every thread's stores are ordered before the arrival below (fence, then barrier), and
        # the arrival's acquire orders the last arriver's reads after everyone's stores.
        _fence_gpu(offs_m)
        tl.debug_barrier()
        arrived = tl.atomic_add(Arrivals + (pid_bh * n_row_blocks + pid_m), 1, sem="acq_rel")
        if arrived == active - 1:
            for r in tl.static_range(0, BLOCK_M, SUM_ROWS):
                rows = start_m + r + tl.arange(0, SUM_ROWS)
                row_valid = rows < n
                at = (seq_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
                summed = tl.zeros([SUM_ROWS, BLOCK_D], dtype=tl.float32)
                for j in range(0, active):
                    summed += tl.load(Partial + j.to(tl.int64) * slot + at, mask=row_valid[:, None], other=0.0,
                                      cache_modifier=".cg")  # fmt: skip
                tl.store(Out + at, summed.to(Out.dtype.element_ty), mask=row_valid[:, None])
    elif SPLIT:
        # Partial sums over prefix splits meet in one float32 buffer (zeroed by the host); the
        # last split of this (row block, sequence, head) to arrive writes the sum as Out's dtype.
        part_ptrs = Partial + out_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.atomic_add(part_ptrs, acc, mask=m_valid[:, None], sem="relaxed")
        # Every thread's additions are ordered before the arrival below (fence, then barrier),
        # and the arrival's acquire orders the last arriver's reads after everyone's additions.
        _fence_gpu(offs_m)
        tl.debug_barrier()
        arrived = tl.atomic_add(Arrivals + (pid_bh * n_row_blocks + pid_m), 1, sem="acq_rel")
        if arrived == active - 1:
            total_acc = tl.load(part_ptrs, mask=m_valid[:, None], other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total_acc.to(Out.dtype.element_ty), mask=m_valid[:, None])
    else:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=m_valid[:, None])


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    fast_silu: bool = True
    heads_fastest: bool = True  # program order: see _hstu_attention_fwd
    # Splits store their partial sums in slots of their own, summed by the last to arrive,
    # instead of adding them atomically into one buffer (_hstu_attention_fwd). Off until
    # measured on a GPU (bench.attention --splits times both).
    two_pass: bool = False


# Measured on H100 (python -m bench.attention, bench preset): see bench/results/attention-*.md.
PREFIX_CONFIG = KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
# Causal passes (no psi: the eager path, and the full / first-chunk graphs through StaticGrid).
# Narrower key tiles with a deeper pipeline: on an H200 (attention-variants-nvidia-h200-k8.json,
# bias on) 8192 + 320 at batch 1 0.411 against 0.524 ms with 128 x 64 x 2 stages, batch 8 x 8192
# 3.20 against 3.88 ms (0.53 of the matmul peak), batch 8 x 4096 0.95 against 1.12; equal at
# batch 1 x 4096. Cached passes stay on PREFIX_CONFIG (the 128 x 32 tile was not faster there).
NO_PREFIX_CONFIG = KernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)
_TS_BLOCK = 1024
# Rows the two-pass sum adds up at a time (registers: SUM_ROWS x head_dim floats twice).
_SUM_ROWS = 32


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
    """What every layer of one forward pass shares: bias tables and relative timestamps."""

    bias_tables: torch.Tensor  # [L, H, NB_POS + NB_TIME] float32, halved (packed_bias_tables)
    nb_pos: int
    nb_time: int
    ts32: torch.Tensor  # [T] int32: new tokens' timestamps relative to their sequence's earliest
    prefix_ts32: torch.Tensor  # [sum P] int32, likewise for the prefixes (one element without any)
    fits: torch.Tensor  # [B] int32: 1 where the sequence's span fits int32 (ts32 valid)
    # [L, H, longest + 1] float32, halved: the position bias of every distance 0..longest, so
    # that per-pair position biases are one lookup (no bucket arithmetic); None: buckets on chip.
    pos_by_distance: torch.Tensor | None = None


def _launch_relative_ts(
    ts32: torch.Tensor,
    prefix_ts32: torch.Tensor,
    fits: torch.Tensor,
    seq_offsets: torch.Tensor,
    timestamps: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    batch: int,
) -> None:
    """prefix: (lens, timestamps, ts_offsets) or None."""
    if prefix is not None:
        plens, pts, pts_off = prefix
    else:
        plens, pts, pts_off = seq_offsets, timestamps, seq_offsets  # never read
    _relative_ts_fwd[(batch,)](
        timestamps, ts32, seq_offsets, pts, prefix_ts32, pts_off, plens, fits,
        HAS_PREFIX=prefix is not None, SPAN_LIMIT=_TS_SPAN_LIMIT, BLOCK=_TS_BLOCK,
    )  # fmt: skip


def plan_triton(
    seq: SeqLayout,
    prefix: PrefixKV | None,
    pos_tables: torch.Tensor,
    time_tables: torch.Tensor,
    params: AttentionParams,
    bias: BiasTables | None = None,
) -> TritonPlan:
    """pos_tables [L, H, NB_POS], time_tables [L, H, NB_TIME] (float32, on the device); `bias`:
    the same tables with their kernel forms derived once (else derived here).
    Raises ValueError if a sequence (prefix plus new tokens) reaches MAX_POSITIONS tokens."""
    _install_scratch_allocator()
    plens = prefix.lens_host if prefix is not None else (0,) * seq.batch_size
    longest = max((p + seq.length(b) for b, p in enumerate(plens)), default=0)
    if longest >= MAX_POSITIONS:
        raise ValueError(
            f"a sequence of {longest} tokens: the Triton attention takes fewer than {MAX_POSITIONS}"
        )
    dev = seq.timestamps.device
    ts32 = torch.empty(max(seq.total_tokens, 1), dtype=torch.int32, device=dev)
    prefix_ts32 = torch.empty(max(sum(plens), 1), dtype=torch.int32, device=dev)
    fits = torch.empty(max(seq.batch_size, 1), dtype=torch.int32, device=dev)
    if seq.batch_size:
        prefix_d = (prefix.lens, prefix.timestamps, prefix.ts_offsets) if prefix is not None else None
        _launch_relative_ts(ts32, prefix_ts32, fits, seq.offsets, seq.timestamps, prefix_d, seq.batch_size)
    nb_pos = pos_tables.shape[2]
    # Distances run 0..longest (rows past a sequence's end, never stored, read one further).
    if bias is not None:
        tables, by_distance = bias.packed, bias.by_distance(longest)
    else:
        tables, by_distance = packed_bias_tables(pos_tables, time_tables), None
        if longest <= POS_TABLE_MAX_DISTANCE:
            by_distance = position_by_distance(tables, nb_pos, params.pos_mantissa_bits, longest + 1)
    return TritonPlan(tables, nb_pos, time_tables.shape[2], ts32, prefix_ts32, fits, by_distance)


def ts_block_span(time_mantissa_bits: int, num_time_buckets: int) -> int:
    """The widest span of query timestamps in one row block for which timestamps relative to the
    block's latest query, clamped to +-2**30, give exact time buckets (-1: never).

    Exact because the time bucket saturates: S, the smallest difference whose bucket is the last
    (float32(S + 1) >= 2**e * (1 + mant / 2**m) for the last bucket's exponent e and mantissa
    mant), is at most 2**30 - span. A key clamped from below is then at least S before every query
    both before and after clamping (last bucket either way); one clamped from above is after
    every query (bucket 0 either way); any other difference is computed exactly in int32."""
    top = num_time_buckets - 1
    m = time_mantissa_bits
    exponent, mant = top >> m, top & ((1 << m) - 1)
    threshold = -(-(((1 << m) + mant) << exponent) // (1 << m))  # ceil(2**e * (1 + mant / 2**m))
    return max(-1, (1 << 30) - (threshold - 1))


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


@dataclass(frozen=True)
class _Prefix:
    """Device views of the cached prefixes as the kernel reads them."""

    kv_base: torch.Tensor
    kv_offsets: torch.Tensor
    lens: torch.Tensor
    timestamps: torch.Tensor
    ts_offsets: torch.Tensor
    strides: torch.Tensor  # each block's layer stride in tokens (its length; `lens` where read whole)


def _launch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stride_t: int,
    seq_offsets: torch.Tensor,
    n_hist: torch.Tensor,
    timestamps: torch.Tensor,
    prefix: _Prefix | None,
    plan: TritonPlan,
    layer: int,
    params: AttentionParams,
    grid: tuple[int, int, int],
    config: KernelConfig,
) -> torch.Tensor:
    """One attention launch over `grid` = (row blocks, sequences x heads, splits), launched as
    (row blocks x heads, sequences, splits) with config.heads_fastest (the kernel's program order).
    Returns [T, H, D] in q's dtype."""
    total, num_heads, head_dim = q.shape
    splits = grid[2]
    launch_grid = grid
    if config.heads_fastest:
        launch_grid = (grid[0] * num_heads, grid[1] // num_heads, splits)
    target = torch.empty(total, num_heads, head_dim, dtype=q.dtype, device=q.device)
    partial, arrivals = target, target  # never read without splits
    if splits > 1 and config.two_pass:
        # A slot of float32 partial sums per split (each written before it is read: no memset),
        # and the zeroed arrival counts.
        partial = torch.empty(splits, total, num_heads, head_dim, dtype=torch.float32, device=q.device)
        arrivals = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=q.device)
    elif splits > 1:
        # One zeroed allocation (one memset): the float32 partial sums, then an arrival count per
        # (row block, sequence x head), as int32.
        n_sums, n_counts = total * num_heads * head_dim, grid[0] * grid[1]
        scratch = torch.zeros(n_sums + n_counts, dtype=torch.float32, device=q.device)
        partial = scratch[:n_sums].view(total, num_heads, head_dim)
        arrivals = scratch[n_sums:].view(torch.int32)
    has_prefix = prefix is not None
    pos_by_distance = plan.pos_by_distance if plan.pos_by_distance is not None else plan.bias_tables
    if prefix is None:  # never read
        prefix = _Prefix(q, seq_offsets, seq_offsets, timestamps, seq_offsets, seq_offsets)
    _hstu_attention_fwd[launch_grid](
        q, k, v, target, partial, arrivals,
        total, stride_t, target.stride(0), target.stride(1),
        seq_offsets, n_hist, timestamps, plan.ts32, plan.fits,
        prefix.kv_base, prefix.kv_offsets, prefix.lens, prefix.strides, prefix.timestamps, plan.prefix_ts32,
        prefix.ts_offsets, plan.bias_tables, pos_by_distance, pos_by_distance.shape[-1], layer, splits, grid[0], 0.5 * params.alpha, params.inv_norm,
        H=num_heads, NB_POS=plan.nb_pos, NB_TIME=plan.nb_time, POS_BITS=params.pos_mantissa_bits,
        TIME_BITS=params.time_mantissa_bits, HAS_PREFIX=has_prefix,
        FAST_SILU=config.fast_silu, POS_BY_DIST=plan.pos_by_distance is not None, SPLIT=splits > 1, MIN_SPLIT_BLOCKS=MIN_SPLIT_BLOCKS,
        TS_BLOCK_SPAN=ts_block_span(params.time_mantissa_bits, plan.nb_time), HEADS_FASTEST=config.heads_fastest,
        TWO_PASS=config.two_pass, SUM_ROWS=_SUM_ROWS,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=head_dim, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return target


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
    if splits is None:
        if has_prefix:
            assert prefix is not None
            programs = sum(triton.cdiv(seq.length(b), bm) for b in range(seq.batch_size)) * num_heads
            splits = choose_splits(programs, triton.cdiv(max(prefix.lens_host), bn), _num_sms(q.device))
        else:
            lengths = tuple(seq.length(b) for b in range(seq.batch_size))
            splits = choose_causal_splits(lengths, seq.n_hist_host, num_heads, _num_sms(q.device), bm, bn)
    prefix_d = None
    if has_prefix and prefix is not None:
        prefix_d = _Prefix(
            prefix.kv_base,
            prefix.kv_offsets,
            prefix.lens,
            prefix.timestamps,
            prefix.ts_offsets,
            prefix.layer_strides,
        )
    grid = (triton.cdiv(seq.max_len, bm), seq.batch_size * num_heads, splits)
    return _launch_attention(q, k, v, stride_t, seq.offsets, seq.n_hist, seq.timestamps, prefix_d, plan,
                             layer, params, grid, config)  # fmt: skip


# ---------------------------------------------------------------------- fixed-grid (CUDA graphs)


@dataclass(frozen=True)
class StaticGrid:
    """Launch sizes fixed before the batch is known. Every bound must hold for the batches run
    with it (StaticBatch.check says which): the kernels skip what lies beyond a batch's sizes."""

    batch: int  # sequences (extra ones have length 0)
    max_len: int  # new tokens of any one sequence
    splits: int  # key splits of the attention kernel
    # The tiles: NO_PREFIX_CONFIG's for a causal pass (its psi empty), as the eager path's.
    config: KernelConfig = PREFIX_CONFIG

    @staticmethod
    def plan(
        batch: int,
        max_len: int,
        num_heads: int,
        device: torch.device,
        tokens: int | None = None,
        prefix_tokens: int = 8192,
    ) -> StaticGrid:
        """Splits as hstu_attention_triton would choose them for prefixes of `prefix_tokens` (the
        kernel lowers them per sequence for shorter ones). `tokens`, the bucket's new tokens in
        all, sharpens the estimate of the row blocks that do work: sequences are rarely all
        max_len long (assumed: half a row block of padding per sequence)."""
        if prefix_tokens == 0:  # a causal pass (full ranking, first chunk): as long as the bucket
            config = NO_PREFIX_CONFIG
            per_seq = (tokens if tokens is not None else batch * max_len) // max(batch, 1)
            lengths = (min(max_len, max(per_seq, 1)),) * batch
            splits = choose_causal_splits(
                lengths, lengths, num_heads, _num_sms(device), config.block_m, config.block_n
            )
            return StaticGrid(batch, max_len, splits, config)
        bm, bn = PREFIX_CONFIG.block_m, PREFIX_CONFIG.block_n
        row_blocks = batch * triton.cdiv(max_len, bm)
        if tokens is not None:
            row_blocks = max(1, min(row_blocks, triton.cdiv(tokens, bm) + batch // 2))
        prefix_blocks = triton.cdiv(prefix_tokens, bn)
        splits = choose_splits(row_blocks * num_heads, prefix_blocks, _num_sms(device))
        return StaticGrid(batch, max_len, splits)


@dataclass(frozen=True)
class StaticBatch:
    """Device tensors that describe a batch against cached prefixes, read by the kernels at run
    time, plus the fixed grids. The caller fills them before each launch (or graph replay).

    Prefix blocks are addressed as `kv_anchor + kv_offsets[b]` elements: the anchor is one fixed
    allocation, so a captured graph can read psi blocks wherever the allocator put them.
    Positions (prefix plus new tokens) must stay below MAX_POSITIONS.
    """

    seq_offsets: torch.Tensor  # [B + 1] int64; sequences past the batch repeat the last offset
    n_hist: torch.Tensor  # [B] int64
    timestamps: torch.Tensor  # [T] int64 (T: the capacity; rows past the batch are ignored)
    prefix_lens: torch.Tensor  # [B] int64
    prefix_timestamps: torch.Tensor  # [capacity] int64
    prefix_ts_offsets: torch.Tensor  # [B + 1] int64
    kv_offsets: torch.Tensor  # [B] int64, elements from kv_anchor
    kv_anchor: torch.Tensor
    grid: StaticGrid
    # [B] int64: the tokens one layer of each block spans (its K or V stride), where a block is
    # read in place built in part (more than prefix_lens); None: complete blocks (prefix_lens).
    prefix_strides: torch.Tensor | None = None


def plan_triton_static(
    batch: StaticBatch, tables: torch.Tensor, params: AttentionParams, nb_pos: int, nb_time: int
) -> TritonPlan:
    """plan_triton over a StaticBatch: no host reads, fixed grid (capturable).
    tables: packed_bias_tables of the model, built once."""
    _install_scratch_allocator()
    dev = batch.timestamps.device
    ts32 = torch.empty(batch.timestamps.numel(), dtype=torch.int32, device=dev)
    prefix_ts32 = torch.empty(batch.prefix_timestamps.numel(), dtype=torch.int32, device=dev)
    fits = torch.empty(batch.grid.batch, dtype=torch.int32, device=dev)
    prefix = (batch.prefix_lens, batch.prefix_timestamps, batch.prefix_ts_offsets)
    _launch_relative_ts(
        ts32, prefix_ts32, fits, batch.seq_offsets, batch.timestamps, prefix, batch.grid.batch
    )
    return TritonPlan(tables, nb_pos, nb_time, ts32, prefix_ts32, fits)


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
    grid = (triton.cdiv(g.max_len, g.config.block_m), g.batch * q.shape[1], g.splits)
    strides = batch.prefix_strides if batch.prefix_strides is not None else batch.prefix_lens
    prefix = _Prefix(batch.kv_anchor, batch.kv_offsets, batch.prefix_lens, batch.prefix_timestamps,
                     batch.prefix_ts_offsets, strides)  # fmt: skip
    return _launch_attention(q, k, v, stride_t, batch.seq_offsets, batch.n_hist, batch.timestamps, prefix,
                             plan, layer, params, grid, g.config)  # fmt: skip
