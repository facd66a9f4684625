"""The position bias by distance (a per-forward table) against the position bucket computed on
chip: the same output, and the table holds exactly the bucketed biases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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
