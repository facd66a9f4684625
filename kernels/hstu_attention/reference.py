"""Plain PyTorch HSTU attention: the reference, and the path used on the CPU and the NPU.

Computes, for every new token i of sequence b (see layout.py for positions and masking):

    out_i = sum_j  SiLU(alpha * q_i.k_j + rab[h, bucket_pos(pos_i - pos_j), bucket_time(max(ts_i - ts_j, 0))])
                   / attn_norm * v_j

over the keys j it may see: the whole cached prefix, then its own allowed new tokens, with
rab[h, p, t] = pos_bias[h, p] + time_bias[h, t] (the same combined table the Triton kernel reads).
Accumulates in float32 whatever the input dtype.

As in the Triton path, what does not depend on the layer is computed once per forward pass
(`plan_reference`): per sequence, the combined bias index of every (query, key) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.hstu_attention.layout import AttentionParams, PrefixKV, SeqLayout

# Bounds the [H, rows, keys] score tensor of one chunk (rows * keys * H floats).
_MAX_SCORE_ELEMENTS = 1 << 24


def log_bucket(x: torch.Tensor, mantissa_bits: int, num_buckets: int) -> torch.Tensor:
    """Log-spaced bucket of a non-negative integer distance, from the bits of float32(x + 1).

    bucket = exponent * 2**m + top m mantissa bits: exact for small distances, 2**m buckets per
    octave beyond. Integer-exact, so the Triton kernel (same bit arithmetic) agrees bit for bit.
    Returns int32.
    """
    bits = (x.clamp(min=0) + 1).to(torch.float32).view(torch.int32)
    bucket = (bits >> 23).sub_(127).mul_(1 << mantissa_bits)
    bucket.add_((bits >> (23 - mantissa_bits)).bitwise_and_((1 << mantissa_bits) - 1))
    return bucket.clamp_(max=num_buckets - 1)


@dataclass(frozen=True)
class ReferencePlan:
    """Layer-independent state of one forward pass: bias indices and combined tables."""

    rab_index: tuple[torch.Tensor, ...]  # per sequence [n, P + n] int64 (long: an index)
    rab_table: torch.Tensor  # [L, H, NB_POS * NB_TIME] float32


def _keys(
    seq: SeqLayout, prefix: PrefixKV | None, b: int
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prefix length, positions of the new tokens, key positions, key timestamps) of sequence b."""
    start, n = seq.offsets_host[b], seq.length(b)
    plen = prefix.lens_host[b] if prefix is not None else 0
    dev = seq.timestamps.device
    new_pos = plen + torch.arange(n, device=dev).clamp(max=seq.n_hist_host[b])
    new_ts = seq.timestamps[start : start + n]
    if plen:
        assert prefix is not None
        t0 = int(prefix.ts_offsets[b])
        return (
            plen,
            new_pos,
            torch.cat([torch.arange(plen, device=dev), new_pos]),
            torch.cat([prefix.timestamps[t0 : t0 + plen], new_ts]),
        )
    return plen, new_pos, new_pos, new_ts


def plan_reference(
    seq: SeqLayout,
    prefix: PrefixKV | None,
    pos_tables: torch.Tensor,
    time_tables: torch.Tensor,
    params: AttentionParams,
) -> ReferencePlan:
    """pos_tables [L, H, NB_POS], time_tables [L, H, NB_TIME]."""
    nb_pos, nb_time = pos_tables.shape[2], time_tables.shape[2]
    indices = []
    for b in range(seq.batch_size):
        start, n = seq.offsets_host[b], seq.length(b)
        _, new_pos, key_pos, key_ts = _keys(seq, prefix, b)
        new_ts = seq.timestamps[start : start + n]
        pos = log_bucket(new_pos[:, None] - key_pos[None, :], params.pos_mantissa_bits, nb_pos)
        time = log_bucket(new_ts[:, None] - key_ts[None, :], params.time_mantissa_bits, nb_time)
        indices.append(pos.mul_(nb_time).add_(time).to(torch.int64))
    table = (pos_tables.float()[:, :, :, None] + time_tables.float()[:, :, None, :]).flatten(2)
    return ReferencePlan(tuple(indices), table)


def hstu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqLayout,
    prefix: PrefixKV | None,
    layer: int,
    plan: ReferencePlan,
    params: AttentionParams,
) -> torch.Tensor:
    """q, k, v: [T, H, D] new tokens. Returns [T, H, D] in q's dtype."""
    total, num_heads, head_dim = q.shape
    out = torch.zeros(total, num_heads, head_dim, dtype=torch.float32, device=q.device)
    table = plan.rab_table[layer]  # [H, NB]
    for b in range(seq.batch_size):
        start, n = seq.offsets_host[b], seq.length(b)
        if n == 0:
            continue
        n_hist = seq.n_hist_host[b]
        plen = prefix.lens_host[b] if prefix is not None else 0
        keys_k = k[start : start + n].float()
        keys_v = v[start : start + n].float()
        if prefix is not None and plen > 0:
            keys_k = torch.cat([prefix.read(b, layer, 0).view(plen, num_heads, head_dim).float(), keys_k])
            keys_v = torch.cat([prefix.read(b, layer, 1).view(plen, num_heads, head_dim).float(), keys_v])
        num_keys = keys_k.shape[0]
        j_new = torch.arange(num_keys, device=q.device) - plen  # index among new tokens (<0: prefix)
        index = plan.rab_index[b]
        rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, num_keys * num_heads))
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(n, r0 + rows_per_chunk)
            i = torch.arange(r0, r1, device=q.device)
            qc = q[start + r0 : start + r1].float()
            scores = torch.einsum("ihd,jhd->hij", qc, keys_k) * params.alpha
            scores += table[:, index[r0:r1]]
            jn = j_new[None, :]
            visible = (jn < 0) | ((jn <= i[:, None]) & ((jn < n_hist) | (jn == i[:, None])))
            weights = F.silu(scores).mul_(visible).mul_(params.inv_norm)
            out[start + r0 : start + r1] = torch.einsum("hij,jhd->ihd", weights, keys_v)
    return out.to(q.dtype)
