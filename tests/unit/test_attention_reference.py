"""The reference attention against a per-element brute force of the documented semantics."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.hstu_attention import (
    AttentionParams,
    PrefixKV,
    SeqLayout,
    hstu_attention_reference,
    log_bucket,
    plan_reference,
)


def brute_force(q, k, v, lengths, n_hist, ts, prefix_kv, prefix_ts, layer, pos_bias, time_bias, params):
    out = torch.zeros_like(q, dtype=torch.float64)
    start = 0
    heads, dim = q.shape[1], q.shape[2]
    for b, n in enumerate(lengths):
        plen = prefix_kv[b].shape[2] if prefix_kv else 0
        for i in range(n):
            qpos = plen + min(i, n_hist[b])
            keys = []  # (k, v, pos, ts)
            for j in range(plen):
                pk = prefix_kv[b][layer, 0, j].view(heads, dim)
                pv = prefix_kv[b][layer, 1, j].view(heads, dim)
                keys.append((pk, pv, j, int(prefix_ts[b][j])))
            for j in range(n):
                if j <= i and (j < n_hist[b] or j == i):
                    keys.append((k[start + j], v[start + j], plen + min(j, n_hist[b]), int(ts[start + j])))
            for kk, vv, kpos, kts in keys:
                for h in range(heads):
                    s = float(q[start + i, h].double() @ kk[h].double()) * params.alpha
                    pb = log_bucket(torch.tensor(qpos - kpos), params.pos_mantissa_bits, pos_bias.shape[1])
                    tb = log_bucket(
                        torch.tensor(max(int(ts[start + i]) - kts, 0)),
                        params.time_mantissa_bits,
                        time_bias.shape[1],
                    )
                    s += float(pos_bias[h, pb]) + float(time_bias[h, tb])
                    w = s / (1 + math.exp(-s)) * params.inv_norm
                    out[start + i, h] += w * vv[h].double()
        start += n
    return out


@pytest.mark.parametrize("with_prefix", [False, True])
def test_reference_matches_brute_force(with_prefix):
    gen = torch.Generator().manual_seed(0)
    heads, dim, layers = 2, 4, 2
    lengths, n_hist = [5, 0, 4, 1], [3, 0, 4, 0]
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    ts = torch.randint(0, 5000, (total,), generator=gen)
    ts[[3, 4]] = 4000  # sequence 0's candidates share the query time
    plens = [3, 2, 0, 4]
    prefix_kv = [torch.randn(layers, 2, p, heads * dim, generator=gen, dtype=torch.float64) for p in plens]
    prefix_ts = [torch.randint(0, 5000, (p,), generator=gen) for p in plens]
    pos_bias = torch.randn(heads, 12, generator=gen)
    time_bias = torch.randn(heads, 20, generator=gen)
    params = AttentionParams(alpha=0.5, inv_norm=1 / 7, pos_mantissa_bits=1, time_mantissa_bits=2)
    seq = SeqLayout.build(lengths, n_hist, ts)
    prefix = PrefixKV.build(prefix_kv, prefix_ts) if with_prefix else None
    layers_pos = torch.stack([torch.zeros_like(pos_bias), pos_bias])  # the test uses layer 1
    layers_time = torch.stack([torch.zeros_like(time_bias), time_bias])
    plan = plan_reference(seq, prefix, layers_pos, layers_time, params)
    got = hstu_attention_reference(q, k, v, seq, prefix, 1, plan, params)
    want = brute_force(
        q,
        k,
        v,
        lengths,
        n_hist,
        ts,
        prefix_kv if with_prefix else None,
        prefix_ts,
        1,
        pos_bias,
        time_bias,
        params,
    )
    assert torch.allclose(got.double(), want, atol=1e-6)  # the bias table is float32


def test_log_bucket_exact_for_small_then_logarithmic():
    x = torch.arange(0, 1 << 20)
    b = log_bucket(x, mantissa_bits=2, num_buckets=10_000)
    assert torch.all(b[1:] >= b[:-1])  # monotone
    assert b[:4].tolist() == [0, 4, 6, 8]  # 1, 2, 3, 4 -> distinct buckets
    assert int(b[-1]) == 4 * 20  # x + 1 = 2**20: exponent 20, mantissa 0
    assert int(log_bucket(torch.tensor(10**12), 2, 50)) == 49  # clamped
    assert int(log_bucket(torch.tensor(-5), 2, 50)) == 0  # negative distances clamp to 0


def test_a_prefix_read_in_part_in_place_equals_a_copy_of_that_part():
    """PrefixKV.build(..., lens): each sequence reads its block's first lens[b] tokens in place
    (psi built in part), the block's own length its layer stride; the same attention as over a
    contiguous copy of those tokens, exactly."""
    gen = torch.Generator().manual_seed(3)
    heads, dim, layers = 2, 4, 3
    lengths, n_hist = [5, 3, 4], [3, 3, 4]
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=gen) for _ in range(3))
    ts = torch.randint(0, 5000, (total,), generator=gen)
    ts[[3, 4]] = 4000
    blocks = [torch.randn(layers, 2, p, heads * dim, generator=gen) for p in (7, 4, 6)]
    block_ts = [torch.randint(0, 5000, (b.shape[2],), generator=gen) for b in blocks]
    reads = [3, 0, 6]  # in part, nothing, whole
    in_place = PrefixKV.build(blocks, [t[:n] for t, n in zip(block_ts, reads, strict=True)], reads)
    copied = PrefixKV.build(
        [b[:, :, :n].contiguous() for b, n in zip(blocks, reads, strict=True)],
        [t[:n] for t, n in zip(block_ts, reads, strict=True)],
    )
    assert in_place.lens_host == copied.lens_host == (3, 0, 6)
    assert in_place.layer_strides.tolist() == [7, 4, 6]
    assert copied.strides is None  # read whole: the lengths are the strides
    assert torch.equal(in_place.read(0, 2, 1), blocks[0][2, 1, :3])
    pos, time = torch.randn(layers, heads, 12, generator=gen), torch.randn(layers, heads, 20, generator=gen)
    params = AttentionParams(alpha=0.5, inv_norm=1 / 7, pos_mantissa_bits=1, time_mantissa_bits=2)
    seq = SeqLayout.build(lengths, n_hist, ts)
    for layer in range(layers):
        want = hstu_attention_reference(
            q, k, v, seq, copied, layer, plan_reference(seq, copied, pos, time, params), params
        )
        got = hstu_attention_reference(
            q, k, v, seq, in_place, layer, plan_reference(seq, in_place, pos, time, params), params
        )
        assert torch.equal(got, want)


def test_a_prefix_read_past_its_block_or_with_other_timestamps_is_refused():
    block = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="reading 5 tokens of a psi block of 4"):
        PrefixKV.build([block], [torch.zeros(5, dtype=torch.int64)], [5])
    with pytest.raises(ValueError, match="2 tokens but 4 timestamps"):
        PrefixKV.build([block], [torch.zeros(4, dtype=torch.int64)], [2])
    with pytest.raises(ValueError, match="one length"):
        PrefixKV.build([block], [torch.zeros(2, dtype=torch.int64)], [2, 2])
