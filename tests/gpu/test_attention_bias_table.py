"""The position bias by distance (a per-forward table) against the position bucket computed on
chip: the same output, and the table holds exactly the bucketed biases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.hstu_attention import BiasTables, PrefixKV, SeqLayout, hstu_attention_reference, plan_reference
from kernels.hstu_attention.reference import log_bucket
from tests.gpu.test_triton_attention import CASES, assert_bf16_close, random_case

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from kernels.hstu_attention.triton_impl import hstu_attention_triton, plan_triton  # noqa: E402


@pytest.mark.parametrize(("lengths", "n_hist", "plens"), CASES)
def test_table_by_distance_equals_buckets_on_chip(lengths, n_hist, plens):
    q, k, v, seq, prefix, pb, tb, params = random_case(11, lengths, n_hist, plens, heads=2, dim=64)
    plan = plan_triton(seq, prefix, pb, tb, params)
    assert plan.pos_by_distance is not None
    longest = max(p + n for p, n in zip(plens or [0] * len(lengths), lengths, strict=True))
    assert plan.pos_by_distance.shape == (pb.shape[0], pb.shape[1], longest + 1)
    buckets = log_bucket(torch.arange(longest + 1, device="cuda"), params.pos_mantissa_bits, pb.shape[2])
    assert torch.equal(plan.pos_by_distance, 0.5 * pb[:, :, buckets.long()])
    on_chip = dataclasses.replace(plan, pos_by_distance=None)
    for layer in range(pb.shape[0]):
        got = hstu_attention_triton(q, k, v, seq, prefix, plan, layer, params)
        want = hstu_attention_triton(q, k, v, seq, prefix, on_chip, layer, params)
        if got.numel():
            assert_bf16_close(got, want)


@pytest.mark.parametrize("plens", [None, [700, 0, 300]])
def test_time_bias_exact_beside_timestamps_at_zero(plens):
    """The model's profile tokens carry time 0 beside real timestamps (~1.7e9 s): sequences span
    more than int32, so row blocks whose queries lie close together take int32 timestamps relative
    to their latest query (far keys clamped) and the rest int64; both exact against the reference."""
    lengths, n_hist = [400, 300, 130], [300, 299, 2]
    q, k, v, seq, prefix, pb, tb, params = random_case(5, lengths, n_hist, plens, heads=2, dim=64)
    gen = torch.Generator().manual_seed(3)
    epoch, span = 1_700_000_000, 90 * 86_400

    def timeline(n: int, zeros: int) -> torch.Tensor:
        ts = torch.sort(torch.randint(epoch, epoch + span, (n,), generator=gen)).values
        ts[:zeros] = 0
        return ts

    new_ts = []
    for n, h in zip(lengths, n_hist, strict=True):
        ts = timeline(n, 16 if plens is None else 0)
        ts[h:] = epoch + span + 3_600  # candidates at the query time
        new_ts.append(ts)
    seq = SeqLayout.build(lengths, n_hist, torch.cat(new_ts).cuda())
    if prefix is not None:
        prefix = PrefixKV.build(list(prefix.kv), [timeline(p, min(p, 16)).cuda() for p in plens])
    plan = plan_triton(seq, prefix, pb, tb, params)
    assert not bool(plan.fits.bool().all())  # sequences with time-0 tokens span more than int32
    want = hstu_attention_reference(
        q, k, v, seq, prefix, 1, plan_reference(seq, prefix, pb, tb, params), params
    )
    assert_bf16_close(hstu_attention_triton(q, k, v, seq, prefix, plan, 1, params), want)


@pytest.mark.parametrize(("lengths", "n_hist", "plens"), CASES)
def test_tables_derived_once_per_model_give_the_same_attention(lengths, n_hist, plens):
    """A model's BiasTables (packed tables and a by-distance table grown past what one pass
    needs) against the tables plan_triton derives for one pass: bit for bit the same tables, and
    the same output (within bf16 rounding: a launch split over a long prefix sums its partials
    with atomics, whose order is not fixed, so two launches of one plan need not agree bitwise)."""
    q, k, v, seq, prefix, pb, tb, params = random_case(11, lengths, n_hist, plens, heads=2, dim=64)
    fresh = plan_triton(seq, prefix, pb, tb, params)
    bias = BiasTables(pb, tb, params.pos_mantissa_bits)
    bias.by_distance(5)  # a short table first: this pass must grow it
    derived = plan_triton(seq, prefix, pb, tb, params, bias)
    assert derived.pos_by_distance is not None
    assert fresh.pos_by_distance is not None
    covered = fresh.pos_by_distance.shape[2]
    assert derived.pos_by_distance.shape[2] >= covered
    assert torch.equal(derived.pos_by_distance[:, :, :covered], fresh.pos_by_distance)
    assert torch.equal(derived.bias_tables, fresh.bias_tables)
    for layer in range(pb.shape[0]):
        got = hstu_attention_triton(q, k, v, seq, prefix, derived, layer, params)
        want = hstu_attention_triton(q, k, v, seq, prefix, fresh, layer, params)
        if got.numel():
            assert_bf16_close(got, want)
