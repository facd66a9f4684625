"""Triton attention vs the reference, and the model on CUDA (run on the device machine)."""

from __future__ import annotations

import pytest
import torch

from kernels.hstu_attention import (
    AttentionImpl,
    AttentionParams,
    PrefixKV,
    SeqLayout,
    hstu_attention_reference,
    plan_reference,
)
from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from shared.modelspec import preset

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from kernels.hstu_attention.triton_impl import hstu_attention_triton, plan_triton  # noqa: E402


def random_case(seed, lengths, n_hist, plens, heads, dim, layers=3, dtype=torch.bfloat16, ts_max=10**6):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    # A strided q/k/v, as the model passes them (views of one UVQK tensor).
    uvqk = torch.randn(total, 4, heads, dim, generator=gen).to("cuda", dtype)
    q, k, v = uvqk[:, 0], uvqk[:, 1], uvqk[:, 2]
    ts = torch.randint(-ts_max, ts_max, (total,), generator=gen)
    start = 0
    for n, h in zip(lengths, n_hist, strict=True):  # candidates carry one timestamp (the query time)
        ts[start + h : start + n] = ts[start + h : start + n].max() if n > h else 0
        start += n
    ts = ts.cuda()
    prefix = None
    if plens is not None:
        kv = [torch.randn(layers, 2, p, heads * dim, generator=gen).to("cuda", dtype) for p in plens]
        pts = [torch.randint(-ts_max, ts_max, (p,), generator=gen).cuda() for p in plens]
        prefix = PrefixKV.build(kv, pts)
    pos_bias = torch.randn(layers, heads, 160, generator=gen).cuda()
    time_bias = torch.randn(layers, heads, 96, generator=gen).cuda()
    params = AttentionParams(alpha=dim**-0.5, inv_norm=1 / 512, pos_mantissa_bits=3, time_mantissa_bits=2)
    return q, k, v, SeqLayout.build(lengths, n_hist, ts), prefix, pos_bias, time_bias, params


def assert_bf16_close(got, want):
    scale = float(want.float().abs().max()) + 1e-6
    err = float((got.float() - want.float()).abs().max())
    assert err <= 2e-2 * scale, f"max error {err:.3e} vs output scale {scale:.3e}"


CASES = [
    # lengths, n_hist, prefix lengths (None: no prefix)
    ([300, 0, 65, 1], [200, 0, 65, 0], None),
    ([300, 0, 65, 1], [200, 0, 65, 0], [1000, 5, 0, 130]),
    ([320] * 3, [64] * 3, [4096, 777, 1]),
    ([0, 0], [0, 0], [10, 0]),
    ([1], [1], [0]),
    ([257], [0], [63]),  # candidates only
    ([700, 130, 129], [600, 2, 129], None),  # several diagonal tiles; history and candidates in one block
    ([700, 130, 129], [600, 2, 129], [300, 0, 2500]),
]


@pytest.mark.parametrize("dim", [64, 256])
def test_triton_reads_the_first_tokens_of_longer_blocks_in_place(dim):
    """psi built in part: each sequence reads its block's first reads[b] tokens in place (the
    block's length strides its layers); as the reference over contiguous copies of them."""
    gen = torch.Generator().manual_seed(dim)
    heads, layers = (2 if dim == 256 else 4), 3
    lengths, n_hist, blocks_len, reads = [320, 257, 64], [64, 0, 64], [4096, 700, 300], [2560, 0, 300]
    q, k, v, seq, _, pb, tb, params = random_case(dim, lengths, n_hist, None, heads=heads, dim=dim)
    blocks = [
        torch.randn(layers, 2, p, heads * dim, generator=gen).to("cuda", torch.bfloat16) for p in blocks_len
    ]
    block_ts = [torch.randint(-(10**6), 10**6, (p,), generator=gen).cuda() for p in blocks_len]
    in_place = PrefixKV.build(blocks, [t[:n] for t, n in zip(block_ts, reads, strict=True)], reads)
    copied = PrefixKV.build(
        [b[:, :, :n].contiguous() for b, n in zip(blocks, reads, strict=True)],
        [t[:n] for t, n in zip(block_ts, reads, strict=True)],
    )
    plan = plan_triton(seq, in_place, pb, tb, params)
    reference = plan_reference(seq, copied, pb, tb, params)
    for layer in range(layers):
        want = hstu_attention_reference(q, k, v, seq, copied, layer, reference, params)
        got = hstu_attention_triton(q, k, v, seq, in_place, plan, layer, params)
        assert_bf16_close(got, want)


@pytest.mark.parametrize("dim", [16, 64, 256])
@pytest.mark.parametrize(("lengths", "n_hist", "plens"), CASES)
def test_triton_matches_reference(dim, lengths, n_hist, plens):
    case = random_case(len(lengths) + dim, lengths, n_hist, plens, heads=2 if dim == 256 else 4, dim=dim)
    q, k, v, seq, prefix, pb, tb, params = case
    plan = plan_triton(seq, prefix, pb, tb, params)
    reference = plan_reference(seq, prefix, pb, tb, params)
    for layer in (0, 1, 2):
        want = hstu_attention_reference(q, k, v, seq, prefix, layer, reference, params)
        got = hstu_attention_triton(q, k, v, seq, prefix, plan, layer, params)
        assert got.shape == want.shape
        if got.numel():
            assert_bf16_close(got, want)
    if prefix is not None and max(prefix.lens_host) > 256:
        split = hstu_attention_triton(q, k, v, seq, prefix, plan, 2, params, splits=3)
        assert_bf16_close(split, want)


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("plens", [None, [0, 700]])
@pytest.mark.parametrize("splits", [None, 3])
def test_triton_rows_past_the_batch_never_reach_it(dim, plens, splits):
    """A CUDA graph's bucket is larger than its batch, and the rows past the last sequence hold
    whatever the memory held: NaN there must not reach the batch. The last sequence's masked
    tiles (its causal diagonal, the candidates' own keys) reach into them; masked keys' V rows
    still enter the product, and 0 x NaN is NaN (an H200 scored a full ranking's candidates at
    rows 1024-1066 of a 1280-token bucket NaN)."""
    lengths, n_hist = [300, 1067], [200, 1019]
    heads = 2 if dim == 256 else 4
    q, k, v, seq, prefix, pb, tb, params = random_case(dim, lengths, n_hist, plens, heads=heads, dim=dim)
    total, pad = sum(lengths), 213
    padded = torch.full((total + pad, 4, heads, dim), float("nan"), dtype=q.dtype, device=q.device)
    for i, t in enumerate((q, k, v)):
        padded[:total, i] = t
    plan = plan_triton(seq, prefix, pb, tb, params)
    reference = plan_reference(seq, prefix, pb, tb, params)
    for layer in (0, 2):
        got = hstu_attention_triton(padded[:, 0], padded[:, 1], padded[:, 2], seq, prefix, plan, layer, params,
                                    splits=splits)[:total]  # fmt: skip
        assert bool(torch.isfinite(got).all()), f"{int((~torch.isfinite(got)).sum())} values not finite"
        assert_bf16_close(got, hstu_attention_reference(q, k, v, seq, prefix, layer, reference, params))


def test_model_on_cuda_cached_equals_full_bf16():
    spec = preset("bench").with_overrides(name="bench-small", num_layers=2, num_items=1000)
    model = HSTURanker.from_seed(spec, seed=0, device="cuda")
    prefixes, suffixes = batch(1, [Shape(16, 2000, 64, 256), Shape(0, 0, 3, 1), Shape(4, 500, 0, 20)])
    full = model.full(prefixes, suffixes)
    psis = model.preinfer(prefixes)
    cached = model.rank_cached(
        suffixes, psis, [model.psi_key(p.user_id, 1, p.fingerprint.digest) for p in prefixes]
    )
    for f, c in zip(full, cached, strict=True):
        assert_bf16_close(c, f)


def test_model_on_cuda_float32_reference_is_exact():
    model = HSTURanker.from_seed(
        preset("tiny"), seed=0, device="cuda", attention_impl=AttentionImpl.REFERENCE
    )
    prefixes, suffixes = batch(2, [Shape(3, 1500, 10, 50), Shape(0, 7, 0, 1)])
    full = model.full(prefixes, suffixes)
    psis = model.preinfer(prefixes)
    cached = model.rank_cached(
        suffixes, psis, [model.psi_key(p.user_id, 1, p.fingerprint.digest) for p in prefixes]
    )
    assert max(float((f - c).abs().max()) for f, c in zip(full, cached, strict=True)) <= 1e-5


@pytest.mark.parametrize("plens", [None, [900, 0, 64]])
def test_triton_time_spans_beyond_int32(plens):
    """Timestamps spread over ~2**41: the kernel falls back to int64 differences for those sequences."""
    lengths, n_hist = [300, 200, 65], [200, 200, 1]
    case = random_case(7, lengths, n_hist, plens, heads=2, dim=64, ts_max=1 << 40)
    q, k, v, seq, prefix, pb, tb, params = case
    plan = plan_triton(seq, prefix, pb, tb, params)
    assert not bool(plan.fits.bool().all())
    want = hstu_attention_reference(
        q, k, v, seq, prefix, 1, plan_reference(seq, prefix, pb, tb, params), params
    )
    assert_bf16_close(hstu_attention_triton(q, k, v, seq, prefix, plan, 1, params), want)


def test_triton_bias_buckets_are_exact():
    """q = k = 0: the scores are the relative bias alone, checked without the dot products' noise."""
    lengths, n_hist = [600, 333], [500, 333]
    q, k, v, seq, prefix, pb, tb, params = random_case(11, lengths, n_hist, [2000, 77], heads=2, dim=64)
    q.zero_()
    k.zero_()
    plan = plan_triton(seq, prefix, pb, tb, params)
    want = hstu_attention_reference(
        q, k, v, seq, prefix, 2, plan_reference(seq, prefix, pb, tb, params), params
    )
    assert_bf16_close(hstu_attention_triton(q, k, v, seq, prefix, plan, 2, params), want)
