"""The bias tables' kernel forms, derived once per model (kernels/hstu_attention/bias.py)."""

from __future__ import annotations

import torch

from kernels.hstu_attention.bias import (
    POS_TABLE_MAX_DISTANCE,
    BiasTables,
    packed_bias_tables,
    position_by_distance,
)
from kernels.hstu_attention.reference import log_bucket
from services.ranker.model import HSTURanker
from shared.modelspec import preset


def tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 40, generator=gen), torch.randn(2, 3, 24, generator=gen)


def test_by_distance_is_the_bucketed_position_bias_of_every_distance_and_grows():
    pos, time = tables()
    bias = BiasTables(pos, time, pos_mantissa_bits=3)
    assert torch.equal(bias.packed, 0.5 * torch.cat([pos, time], dim=2))
    first = bias.by_distance(100)
    assert first is not None
    assert first.shape[2] >= 101
    expected = 0.5 * pos[:, :, log_bucket(torch.arange(first.shape[2]), 3, 40).long()]
    assert torch.equal(first, expected)
    assert bias.by_distance(50) is first  # covered: not rebuilt
    longer = bias.by_distance(first.shape[2] + 10)
    assert longer is not None
    assert longer.shape[2] > first.shape[2] + 10
    assert torch.equal(longer[:, :, : first.shape[2]], first)
    assert bias.by_distance(POS_TABLE_MAX_DISTANCE) is not None
    assert bias.by_distance(POS_TABLE_MAX_DISTANCE + 1) is None  # the kernel buckets on chip
    # The table the plan built before (exactly longest + 1 distances) is a prefix of it.
    exact = position_by_distance(packed_bias_tables(pos, time), 40, 3, 101)
    assert torch.equal(exact, first[:, :, :101])


def test_a_model_derives_its_bias_once_and_again_when_the_weights_change():
    model = HSTURanker.from_seed(preset("tiny"), seed=1)
    bias = model.attention_bias()
    assert model.attention_bias() is bias
    pos, time = model.bias_tables()
    assert torch.equal(bias.pos, pos)
    assert torch.equal(bias.time, time)
    with torch.no_grad():
        model.layers[0].pos_bias.add_(1.0)  # in place: the version counter moves
    changed = model.attention_bias()
    assert changed is not bias
    assert torch.equal(changed.pos[0], bias.pos[0] + 1.0)
    other = HSTURanker.from_seed(preset("tiny"), seed=2)
    model.load_state_dict(other.state_dict())
    assert torch.equal(model.attention_bias().pos, other.attention_bias().pos)
