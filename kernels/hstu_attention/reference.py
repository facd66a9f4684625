"""Plain PyTorch HSTU attention: the reference, and the path used on the CPU and the NPU.

Computes, for every new token i of sequence b (see layout.py for positions and masking):

    out_i = sum_j  SiLU(alpha * q_i.k_j + pos_bias[h, bucket(pos_i - pos_j)]
                        + time_bias[h, bucket(max(ts_i - ts_j, 0))]) / attn_norm * v_j

over the keys j it may see: the whole cached prefix, then its own allowed new tokens.
Accumulates in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.hstu_attention.layout import AttentionParams, PrefixKV, SeqLayout

# Bounds the [H, rows, keys] score tensor of one chunk (rows * keys * H floats).
_MAX_SCORE_ELEMENTS = 1 << 24


def log_bucket(x: torch.Tensor, mantissa_bits: int, num_buckets: int) -> torch.Tensor:
    """Log-spaced bucket of a non-negative integer distance, from the bits of float32(x + 1).

    bucket = exponent * 2**m + top m mantissa bits: exact for small distances, 2**m buckets per
    octave beyond. Integer-exact, so the Triton kernel (same bit arithmetic) agrees bit for bit.
    """
    f = (x.clamp(min=0) + 1).to(torch.float32)
    bits = f.view(torch.int32).to(torch.int64)
    exponent = (bits >> 23) - 127
    mantissa = (bits >> (23 - mantissa_bits)) & ((1 << mantissa_bits) - 1)
    return (exponent * (1 << mantissa_bits) + mantissa).clamp(max=num_buckets - 1)


def hstu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqLayout,
    prefix: PrefixKV | None,
    layer: int,
    pos_bias: torch.Tensor,
    time_bias: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """q, k, v: [T, H, D] new tokens; pos_bias [H, NBp], time_bias [H, NBt]. Returns [T, H, D]."""
    total, num_heads, head_dim = q.shape
    out = torch.zeros(total, num_heads, head_dim, dtype=torch.float32, device=q.device)
    pos_bias = pos_bias.float()
    time_bias = time_bias.float()
    for b in range(seq.batch_size):
        start, n = seq.offsets_host[b], seq.length(b)
        if n == 0:
            continue
        n_hist = seq.n_hist_host[b]
        plen = prefix.lens_host[b] if prefix is not None else 0
        rel = torch.arange(n, device=q.device).clamp(max=n_hist)
        new_pos = plen + rel
        new_ts = seq.timestamps[start : start + n]
        keys_k = k[start : start + n].float()
        keys_v = v[start : start + n].float()
        key_pos, key_ts = new_pos, new_ts
        if prefix is not None and plen > 0:
            block = prefix.kv[b]
            pk = block[layer, 0].view(plen, num_heads, head_dim).float()
            pv = block[layer, 1].view(plen, num_heads, head_dim).float()
            t0 = int(prefix.ts_offsets[b])
            keys_k = torch.cat([pk, keys_k])
            keys_v = torch.cat([pv, keys_v])
            key_pos = torch.cat([torch.arange(plen, device=q.device), new_pos])
            key_ts = torch.cat([prefix.timestamps[t0 : t0 + plen], new_ts])
        num_keys = keys_k.shape[0]
        j_new = torch.arange(num_keys, device=q.device) - plen  # index among new tokens (<0: prefix)
        rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_keys * num_heads))
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(n, r0 + rows_per_chunk)
            i = torch.arange(r0, r1, device=q.device)
            qc = q[start + r0 : start + r1].float()
            scores = torch.einsum("ihd,jhd->hij", qc, keys_k) * params.alpha
            dpos = new_pos[r0:r1, None] - key_pos[None, :]
            dts = new_ts[r0:r1, None] - key_ts[None, :]
            pos_idx = log_bucket(dpos, params.pos_mantissa_bits, pos_bias.shape[1])
            time_idx = log_bucket(dts, params.time_mantissa_bits, time_bias.shape[1])
            scores = scores + pos_bias[:, pos_idx] + time_bias[:, time_idx]
            jn = j_new[None, :]
            visible = (jn < 0) | ((jn <= i[:, None]) & ((jn < n_hist) | (jn == i[:, None])))
            weights = F.silu(scores) * visible * params.inv_norm
            out[start + r0 : start + r1] = torch.einsum("hij,jhd->ihd", weights, keys_v)
    return out.to(q.dtype)
