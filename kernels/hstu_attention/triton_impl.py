"""Triton HSTU attention for CUDA: jagged new tokens against an optional cached prefix read in place.

One program computes BLOCK_M query rows of one (sequence, head). It streams the cached prefix K/V
straight from each user's psi block (base addresses passed as a pointer table, so a batch's psi
never needs to be gathered into one tensor), then the sequence's own history keys (causal), then
adds each candidate's attention to itself (a row-wise dot, no BLOCK_M x BLOCK_M tile). Pointwise
SiLU attention has no softmax, so the prefix can be split across programs (SPLITS) and the partial
sums added: that keeps the SMs busy when a batch has few query blocks but long prefixes.

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


@triton.jit
def _pointwise_weights(
    s, dpos, dts, valid, pos_bias_h, time_bias_h, alpha, inv_norm,
    POS_BITS: tl.constexpr, NB_POS: tl.constexpr, TIME_BITS: tl.constexpr, NB_TIME: tl.constexpr,
    HAS_POS_BIAS: tl.constexpr, HAS_TIME_BIAS: tl.constexpr, FAST_SILU: tl.constexpr,
):  # fmt: skip
    s = s * alpha
    if HAS_POS_BIAS:
        s += tl.load(pos_bias_h + _log_bucket(dpos, POS_BITS, NB_POS))
    if HAS_TIME_BIAS:
        s += tl.load(time_bias_h + _log_bucket(dts, TIME_BITS, NB_TIME))
    w = _silu(s, FAST_SILU) * inv_norm
    return tl.where(valid, w, 0.0)


@triton.jit(do_not_specialize=["layer", "splits"])
def _hstu_attention_fwd(
    Q, K, V, Out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_os, stride_ot, stride_oh,
    seq_offsets, n_hist_ptr, ts_ptr,
    prefix_ptrs, prefix_lens, prefix_ts, prefix_ts_offsets,
    layer, hd, splits,
    pos_bias, time_bias, alpha, inv_norm,
    H: tl.constexpr, HAS_PREFIX: tl.constexpr,
    POS_BITS: tl.constexpr, NB_POS: tl.constexpr, TIME_BITS: tl.constexpr, NB_TIME: tl.constexpr,
    HAS_POS_BIAS: tl.constexpr, HAS_TIME_BIAS: tl.constexpr, FAST_SILU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    seq_start = tl.load(seq_offsets + b)
    n = (tl.load(seq_offsets + b + 1) - seq_start).to(tl.int32)
    start_m = pid_m * BLOCK_M
    if start_m >= n:
        return
    n_hist = tl.load(n_hist_ptr + b).to(tl.int32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < n
    rows = (seq_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_valid[:, None], other=0.0
    )
    q_ts = tl.load(ts_ptr + rows, mask=m_valid, other=0)
    q_rel = tl.minimum(offs_m, n_hist)
    pos_bias_h = pos_bias + h * NB_POS
    time_bias_h = time_bias + h * NB_TIME
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    plen = 0
    if HAS_PREFIX:
        plen = tl.load(prefix_lens + b).to(tl.int32)
        n_blocks = tl.cdiv(plen, BLOCK_N)
        per_split = tl.cdiv(n_blocks, splits)
        lo = pid_s * per_split * BLOCK_N
        hi = tl.minimum((pid_s + 1) * per_split * BLOCK_N, plen)
        if lo < hi:
            base = tl.load(prefix_ptrs + b).to(tl.pointer_type(K.dtype.element_ty))
            k_base = base + (layer * 2).to(tl.int64) * plen * hd + h * BLOCK_D
            v_base = k_base + plen.to(tl.int64) * hd
            ts_base = prefix_ts + tl.load(prefix_ts_offsets + b)
            q_pos = plen + q_rel
            for start_n in range(lo, hi, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                n_valid = offs_n < hi
                kv_off = offs_n.to(tl.int64)[:, None] * hd + offs_d[None, :]
                k = tl.load(k_base + kv_off, mask=n_valid[:, None], other=0.0)
                k_ts = tl.load(ts_base + offs_n, mask=n_valid, other=0)
                s = tl.dot(q, tl.trans(k))
                w = _pointwise_weights(
                    s, q_pos[:, None] - offs_n[None, :], q_ts[:, None] - k_ts[None, :],
                    n_valid[None, :], pos_bias_h, time_bias_h, alpha, inv_norm,
                    POS_BITS, NB_POS, TIME_BITS, NB_TIME, HAS_POS_BIAS, HAS_TIME_BIAS, FAST_SILU,
                )  # fmt: skip
                v = tl.load(v_base + kv_off, mask=n_valid[:, None], other=0.0)
                acc += tl.dot(w.to(v.dtype), v)

    if pid_s == 0:
        # The sequence's own history keys: causal, up to the end of this row block.
        hi_new = tl.minimum(start_m + BLOCK_M, n_hist)
        for start_n in range(0, hi_new, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi_new
            key_rows = (seq_start + offs_n).to(tl.int64)
            k = tl.load(K + key_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                        mask=n_valid[:, None], other=0.0)  # fmt: skip
            k_ts = tl.load(ts_ptr + key_rows, mask=n_valid, other=0)
            s = tl.dot(q, tl.trans(k))
            visible = n_valid[None, :] & (offs_n[None, :] <= offs_m[:, None])
            w = _pointwise_weights(
                s, q_rel[:, None] - offs_n[None, :], q_ts[:, None] - k_ts[None, :],
                visible, pos_bias_h, time_bias_h, alpha, inv_norm, POS_BITS, NB_POS, TIME_BITS, NB_TIME,
                HAS_POS_BIAS, HAS_TIME_BIAS, FAST_SILU,
            )  # fmt: skip
            v = tl.load(V + key_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :],
                        mask=n_valid[:, None], other=0.0)  # fmt: skip
            acc += tl.dot(w.to(v.dtype), v)
        # Each candidate also sees itself (distance 0, same timestamp), and no other candidate.
        if start_m + BLOCK_M > n_hist:
            is_cand = m_valid & (offs_m >= n_hist)
            k_self = tl.load(K + rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                             mask=is_cand[:, None], other=0.0)  # fmt: skip
            v_self = tl.load(V + rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :],
                             mask=is_cand[:, None], other=0.0)  # fmt: skip
            s_self = tl.sum(q.to(tl.float32) * k_self.to(tl.float32), axis=1)
            zero = tl.zeros([BLOCK_M], dtype=tl.int32)
            w_self = _pointwise_weights(
                s_self, zero, zero, is_cand, pos_bias_h, time_bias_h, alpha, inv_norm,
                POS_BITS, NB_POS, TIME_BITS, NB_TIME, HAS_POS_BIAS, HAS_TIME_BIAS, FAST_SILU,
            )  # fmt: skip
            acc += w_self[:, None] * v_self.to(tl.float32)

    out_ptrs = (
        Out + pid_s.to(tl.int64) * stride_os + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    )
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=m_valid[:, None])


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    fast_silu: bool = True


DEFAULT_CONFIG = KernelConfig()


def _num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def hstu_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqLayout,
    prefix: PrefixKV | None,
    layer: int,
    pos_bias: torch.Tensor | None,
    time_bias: torch.Tensor | None,
    params: AttentionParams,
    splits: int | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Same contract as hstu_attention_reference; q/k/v may be strided views [T, H, D].

    A bias given as None is left out (a model without that relative bias).
    """
    total, num_heads, head_dim = q.shape
    out = torch.empty(total, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if total == 0 or seq.batch_size == 0:
        return out
    for t in (q, k, v):
        if t.stride(2) != 1:
            raise ValueError("q, k, v must be contiguous in the head dimension")
    bm, bn = config.block_m, config.block_n
    m_blocks = triton.cdiv(seq.max_len, bm)
    has_prefix = prefix is not None and max(prefix.lens_host, default=0) > 0
    if splits is None:
        splits = 1
        if has_prefix:
            assert prefix is not None
            # Programs that exist anyway; split the prefix until the SMs hold ~2 waves.
            programs = sum(triton.cdiv(seq.length(b), bm) for b in range(seq.batch_size)) * num_heads
            max_blocks = triton.cdiv(max(prefix.lens_host), bn)
            splits = max(1, min(max_blocks // 4, triton.cdiv(2 * _num_sms(q.device), max(programs, 1))))
    if splits > 1:
        partial = torch.empty(splits, total, num_heads, head_dim, dtype=torch.float32, device=q.device)
        target = partial
    else:
        target = out.unsqueeze(0)
    if has_prefix:
        assert prefix is not None
        assert prefix.pointers is not None
        ptrs, lens, pts, pts_off = prefix.pointers, prefix.lens, prefix.timestamps, prefix.ts_offsets
    else:
        ptrs = lens = pts = pts_off = seq.offsets  # never read
    grid = (m_blocks, seq.batch_size * num_heads, splits)
    _hstu_attention_fwd[grid](
        q, k, v, target,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        target.stride(0), target.stride(1), target.stride(2),
        seq.offsets, seq.n_hist, seq.timestamps,
        ptrs, lens, pts, pts_off,
        layer, num_heads * head_dim, splits,
        pos_bias if pos_bias is not None else q, time_bias if time_bias is not None else q,
        params.alpha, params.inv_norm,
        H=num_heads, HAS_PREFIX=has_prefix,
        POS_BITS=params.pos_mantissa_bits, NB_POS=pos_bias.shape[1] if pos_bias is not None else 1,
        TIME_BITS=params.time_mantissa_bits, NB_TIME=time_bias.shape[1] if time_bias is not None else 1,
        HAS_POS_BIAS=pos_bias is not None, HAS_TIME_BIAS=time_bias is not None, FAST_SILU=config.fast_silu,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=head_dim,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        out.copy_(partial.sum(0))
    return out
