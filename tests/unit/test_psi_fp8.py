"""psi's K/V in float8 e4m3 with per-group scales (kernels.psi_fp8), and bench.psi_fp8."""

import json
import math

import pytest
import torch

from bench import psi_fp8 as bench_psi_fp8
from kernels import psi_fp8
from kernels.psi_fp8 import FP8, FP8_MAX, dequantize_kv, quantize_kv

HEADS = 4


def kv_of(tokens: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """[L=2, 2, P, H*D=4*16] with each head's magnitude a few decades apart, as layers' K and V are."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, tokens, HEADS * 16, generator=gen)
    magnitudes = torch.tensor([1e-3, 1.0, 30.0, 900.0]).repeat_interleave(16)
    return (kv * magnitudes).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 5, 16])
def test_a_value_comes_back_within_e4m3s_rounding_of_its_groups_scale(dtype, group):
    kv = kv_of(37, dtype)  # 37 tokens: the last group is partial for 5 and 16
    q = quantize_kv(kv, HEADS, group)
    assert q.values.dtype == FP8
    assert q.values.shape == kv.shape
    assert q.scales.shape == (2, 2, math.ceil(37 / group), HEADS)
    back = dequantize_kv(q)
    assert back.dtype == dtype
    assert back.shape == kv.shape
    # Per value: half a step of 3 mantissa bits (2^-4 relative), a subnormal step of e4m3 (2^-9
    # of the scale) for the group's smallest values, and the output dtype's own rounding.
    scale = q.scales.repeat_interleave(group, dim=2)[:, :, :37].repeat_interleave(16, dim=3)
    out_rounding = 0.0 if dtype == torch.float32 else 2.0**-8
    x = kv.float()
    bound = (2.0**-4 + out_rounding) * x.abs() + 2.0**-9 * scale
    assert bool(((back.float() - x).abs() <= bound + 1e-12).all())
    # The scale maps the group's largest magnitude to e4m3's largest finite value: no overflow.
    assert float(q.values.float().abs().max()) <= FP8_MAX


def test_a_scale_is_its_groups_largest_magnitude_times_the_float32_reciprocal_of_448():
    # CUDA divides a tensor by a Python number as a product with the number's float32 reciprocal;
    # the CPU divides. The scale is that product on both, so the GPU's bytes are the CPU's (k25:
    # with amax / 448 they differed in the last bit for some groups). Here: amax values whose
    # quotient and product by the reciprocal differ.
    amax = torch.linspace(0.5, 900.0, 4001)
    reciprocal = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
    assert not torch.equal(amax / 448.0, amax * reciprocal)  # the test can tell them apart
    kv = torch.zeros(1, 2, amax.numel(), 16)
    kv[0, 0, :, 0] = amax  # one head of 16 dims, one token a group: amax is the group's largest
    q = quantize_kv(kv, 1, 1)
    assert torch.equal(q.scales[0, 0, :, 0], amax * reciprocal)


def test_the_bytes_are_half_of_bf16_and_the_scales_a_small_rest():
    kv = kv_of(64, torch.bfloat16)
    plain = kv.numel() * kv.element_size()
    for group in (1, 16, 64):
        q = quantize_kv(kv, HEADS, group)
        scales = 2 * 2 * (64 // group) * HEADS * 4  # a float32 per layer, K or V, group and head
        assert q.nbytes == plain // 2 + scales
    # The bench preset's 256 dims a head, a scale per 16 tokens: 1/1024 more than half.
    q = quantize_kv(torch.zeros(1, 2, 32, 1024, dtype=torch.bfloat16), 4, 16)
    assert q.nbytes / (2 * 32 * 1024 * 2) == pytest.approx((1 + 1 / 1024) / 2)


def test_zeros_stay_zeros_and_a_non_finite_value_poisons_only_its_group():
    kv = kv_of(8)
    kv[0, 0, :4] = 0.0  # layer 0's K, tokens 0-3, every head: a group of zeros at group 4
    kv[1, 1, 6, 20] = float("nan")  # layer 1's V, token 6, head 1
    kv[1, 0, 2, 0] = float("inf")  # layer 1's K, token 2, head 0
    q = quantize_kv(kv, HEADS, 4)
    assert bool((q.scales[0, 0, 0] == 1.0).all())
    back = dequantize_kv(q)
    assert bool((back[0, 0, :4] == 0).all())
    assert bool(back[1, 1, 4:8, 16:32].isnan().all())  # the NaN's group: its 4 tokens of head 1
    assert bool(back[1, 0, 0:4, 0:16].isnan().all())  # the infinity's group
    poisoned = torch.zeros_like(back, dtype=torch.bool)
    poisoned[1, 1, 4:8, 16:32] = True
    poisoned[1, 0, 0:4, 0:16] = True
    assert bool(back[~poisoned].isfinite().all())


def test_dequantize_writes_into_a_given_buffer_of_the_right_shape_only():
    kv = kv_of(10, torch.bfloat16)
    q = quantize_kv(kv, HEADS, 4)
    out = torch.empty_like(kv)
    assert dequantize_kv(q, out) is out
    assert torch.equal(out, dequantize_kv(q))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_kv(q, torch.empty(2, 2, 9, HEADS * 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_kv(q, torch.empty_like(kv, dtype=torch.float32))


@pytest.mark.parametrize(
    ("shape", "heads", "group", "match"),
    [
        ((2, 3, 4, 8), 2, 1, "must be"),
        ((2, 2, 4), 2, 1, "must be"),
        ((2, 2, 4, 10), 4, 1, "do not split"),
        ((2, 2, 4, 8), 0, 1, "do not split"),
        ((2, 2, 4, 8), 2, 0, "group_tokens"),
    ],
)
def test_a_shape_that_does_not_split_is_refused(shape, heads, group, match):
    with pytest.raises(ValueError, match=match):
        quantize_kv(torch.zeros(shape), heads, group)


def test_the_benchmark_scores_fp8_psi_against_psi_as_computed(tmp_path):
    bench_psi_fp8.main(["--device", "cpu", "--preset", "tiny", "--prefix-lens", "64", "200", "--batch", "2",
                        "--candidates", "32", "--group-tokens", "1", "16", "--out-dir", str(tmp_path),
                        "--tag", "t"])  # fmt: skip
    rows = json.loads((tmp_path / "psi-fp8-cpu-t.json").read_text())["results"]
    assert [(r["prefix_len"], r["group_tokens"]) for r in rows] == [(64, 1), (64, 16), (200, 1), (200, 16)]
    for r in rows:
        assert r["eps_full"] <= 1e-5  # float32 on the CPU: psi reproduces full inference exactly
        assert r["eps_fp8"] > 0
        assert r["eps_fp8_over_std"] < 0.25  # the tiny model: ~0.03-0.1
        assert 0.5 <= r["top10_overlap_min"] <= r["top10_overlap_mean"] <= 1.0
        assert r["top10_full_overlap_min"] == 1.0
        assert r["bytes_ratio"] < 0.5  # of float32 psi: a quarter and the scales
    assert (tmp_path / "psi-fp8-cpu-t.md").read_text().startswith("# psi-fp8 on ")


@pytest.mark.parametrize(
    "argv",
    [["--batch", "0"], ["--group-tokens", "0"], ["--prefix-lens", "16"], ["--preset", "huge"], ["--device", "tpu"],
     ["--dtype", "float16"]],
)  # fmt: skip
def test_bad_benchmark_arguments_are_refused_with_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        bench_psi_fp8.main(["--device", "cpu", *argv])
    assert "error" in capsys.readouterr().err


def test_a_psi_too_big_for_one_pass_is_taken_in_several_with_the_same_result(monkeypatch):
    kv = kv_of(37, torch.bfloat16)  # 4 slabs (2 layers x K, V) of 37 x 64 float32: 9472 bytes each
    whole = quantize_kv(kv, HEADS, 5)
    back = dequantize_kv(whole)  # in one pass
    monkeypatch.setattr(psi_fp8, "_PASS_BYTES", 9472 * 3)  # three slabs, then one
    assert psi_fp8._passes(4, 37, 64) == range(0, 4, 3)
    parts = quantize_kv(kv, HEADS, 5)
    assert torch.equal(parts.values.view(torch.uint8), whole.values.view(torch.uint8))
    assert torch.equal(parts.scales, whole.scales)
    monkeypatch.setattr(psi_fp8, "_PASS_BYTES", 1)  # one slab a pass, however small
    assert torch.equal(dequantize_kv(parts), back)
