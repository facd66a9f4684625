"""Key splits of the Triton attention (the prefix's keys and the causal history's): every split
count gives the same output, the partial sums added in float32 atomically or in two passes, the
last split to arrive writing the result (the split-count models:
tests/unit/test_attention_split_choice.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.hstu_attention import hstu_attention_reference, plan_reference
from tests.gpu.test_triton_attention import assert_bf16_close, random_case

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from kernels.hstu_attention.triton_impl import (  # noqa: E402
    NO_PREFIX_CONFIG,
    PREFIX_CONFIG,
    hstu_attention_triton,
    plan_triton,
)


def _poisoned_call(q, k, v, seq, prefix, plan, params, splits, two_pass=False):
    """The attention with the allocator's next block of the output's size filled with NaN first,
    so that a row no split writes shows up. `two_pass`: the splits' sums in slots of their own."""
    poison = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    del poison
    base = PREFIX_CONFIG if prefix is not None else NO_PREFIX_CONFIG
    config = dataclasses.replace(base, two_pass=two_pass)
    return hstu_attention_triton(q, k, v, seq, prefix, plan, 1, params, splits=splits, config=config)


@pytest.mark.parametrize(
    ("lengths", "n_hist", "plens"),
    [
        ([320] * 8, [64] * 8, [2048] * 8),
        ([300, 1, 129, 0], [200, 1, 0, 0], [3000, 700, 64, 5]),
        # No prefix: the causal history is what the splits share (the full ranking's shape).
        ([4416], [4160], None),
        ([700, 1, 300, 129], [700, 1, 44, 0], None),
    ],
)
@pytest.mark.parametrize("two_pass", [False, True], ids=["atomic-sums", "two-pass"])
def test_every_split_count_gives_the_same_output(lengths, n_hist, plens, two_pass):
    case = random_case(7, lengths, n_hist, plens, heads=4, dim=256)
    q, k, v, seq, prefix, pb, tb, params = case
    plan = plan_triton(seq, prefix, pb, tb, params)
    want = hstu_attention_reference(
        q, k, v, seq, prefix, 1, plan_reference(seq, prefix, pb, tb, params), params
    )
    one = _poisoned_call(q, k, v, seq, prefix, plan, params, 1)
    assert_bf16_close(one, want)
    for splits in (2, 3, 4, 5, 7, 13, 32):
        for _ in range(3):  # a missing ordering between splits would show as a moving error
            got = _poisoned_call(q, k, v, seq, prefix, plan, params, splits, two_pass)
            assert not got.isnan().any(), f"splits={splits}: rows left unwritten"
            assert_bf16_close(got, want)
            # Only the float32 summation order differs from the unsplit kernel.
            assert float((got.float() - one.float()).abs().max()) <= 1e-2 * float(one.float().abs().max())
