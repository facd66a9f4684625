"""The attention's split counts (kernels/hstu_attention/splits.py). Against a cached prefix: whole
waves, and few enough splits that their partial sums do not cost more than they save. Causal,
without a prefix: work is conserved across splits, and the count is chosen where one sequence's
longest row blocks would otherwise hold the pass (batch 1, 4k tokens), not where programs already
fill the SMs."""

from __future__ import annotations

import pytest

from kernels.hstu_attention.splits import (
    MAX_CAUSAL_SPLITS,
    MIN_SPLIT_BLOCKS,
    choose_causal_splits,
    choose_splits,
    makespan_tiles,
    program_key_tiles,
)

# The kernel's tiles (PREFIX_CONFIG), an H100/H200's SMs, the bench preset's heads.
BM, BN, SMS, HEADS = 128, 64, 132, 4


def test_prefix_splits_fill_whole_waves():
    # 8 users x 3 row blocks x 4 heads against 8k (128 key blocks) on 132 SMs: 4 splits make 384
    # programs, 3 waves at 97%; 6 splits would need 5 waves.
    assert choose_splits(96, 128, SMS) == 4
    # Against 4k, at batch 8, one split (measured 0.200 ms on an H200) beats four (0.209).
    assert choose_splits(96, 64, SMS) == 1
    # Short prefixes are not split below MIN_SPLIT_BLOCKS key blocks a split.
    assert choose_splits(4, 8, SMS) <= 8 // MIN_SPLIT_BLOCKS
    assert choose_splits(0, 128, SMS) == choose_splits(96, 0, SMS) == 1


def test_prefix_splits_follow_the_measured_device_times():
    # Device times on an H200 (bench.attention, CUDA-graph timing, attention-variants-nvidia-h200-k9g):
    # one user (12 programs) against 8k took 0.077 ms at 11 splits (one full wave), 0.113 at 5;
    # against 4k 0.061 at 11, 0.085 at 4.
    assert choose_splits(12, 128, SMS) == 11
    assert choose_splits(12, 64, SMS) == 11
    # Two and four users: 5 splits were fastest against 8k (0.113 and 0.188 ms; 11 took 0.116 and
    # 0.213): the partial sums' traffic grows with programs x splits.
    assert choose_splits(24, 128, SMS) == 5
    assert choose_splits(48, 128, SMS) == 5
    # Batches of 2-4 users (the relay's hit batches) split no more than one user does.
    one = choose_splits(12, 128, SMS)
    assert all(choose_splits(12 * users, 128, SMS) <= one for users in (2, 3, 4))
    # A prefix too short for more splits is not split below MIN_SPLIT_BLOCKS key blocks a split.
    assert choose_splits(12, 16, SMS) <= 16 // MIN_SPLIT_BLOCKS


def _row_block_tiles(row_block: int, length: int, n_hist: int, splits: int) -> int:
    """Key tiles of one row block's programs over all its splits."""
    found = [program_key_tiles(row_block, length, n_hist, s, splits, BM, BN) for s in range(splits)]
    return sum(f[0] for f in found if f is not None)


@pytest.mark.parametrize(("length", "n_hist"), [(4416, 4160), (300, 44), (129, 0), (8512, 8256)])
def test_splits_share_out_the_same_tiles(length, n_hist):
    for row_block in range(-(-length // BM)):
        one = _row_block_tiles(row_block, length, n_hist, 1)
        for splits in (2, 3, 5, 8):
            assert _row_block_tiles(row_block, length, n_hist, splits) == pytest.approx(one), (
                row_block,
                splits,
            )


def test_programs_past_the_sequence_or_their_split_count_exit():
    assert program_key_tiles(40, 4416, 4160, 0, 1, BM, BN) is None  # row 5120 of 4416
    # Row block 1 sees two unmasked tiles: fewer than MIN_SPLIT_BLOCKS a split, so one program does them.
    assert program_key_tiles(1, 4416, 4160, 1, 4, BM, BN) is None
    assert program_key_tiles(1, 4416, 4160, 0, 4, BM, BN) == (4, 1)


def test_one_long_sequence_is_split_and_finishes_sooner():
    # 4096 + 320 tokens at batch 1: 35 row blocks x 4 heads, 140 programs on 132 SMs; unsplit,
    # the longest program (the last row block, 66 tiles) is the whole pass.
    lengths, n_hists = (4416,), (4160,)
    splits = choose_causal_splits(lengths, n_hists, HEADS, SMS, BM, BN)
    assert 1 < splits <= MAX_CAUSAL_SPLITS
    one = makespan_tiles(lengths, n_hists, HEADS, 1, SMS, BM, BN)
    chosen = makespan_tiles(lengths, n_hists, HEADS, splits, SMS, BM, BN)
    assert chosen <= 0.75 * one
    assert one >= 66  # the longest program: 65 history tiles and the candidates' own


def test_enough_programs_are_not_split():
    # 8192 + 320 at batch 1 already spreads over two waves longest first; batch 2 fills four.
    assert choose_causal_splits((8512,), (8256,), HEADS, SMS, BM, BN) == 1
    assert choose_causal_splits((8512, 8512), (8256, 8256), HEADS, SMS, BM, BN) == 1
    assert choose_causal_splits((), (), HEADS, SMS, BM, BN) == 1


def test_more_sms_never_take_fewer_splits_for_one_sequence():
    lengths, n_hists = (4416,), (4160,)
    few = choose_causal_splits(lengths, n_hists, HEADS, 66, BM, BN)
    many = choose_causal_splits(lengths, n_hists, HEADS, 264, BM, BN)
    assert many >= few


def test_bad_machine_is_refused():
    with pytest.raises(ValueError, match="SMs"):
        choose_causal_splits((4416,), (4160,), HEADS, 0, BM, BN)
