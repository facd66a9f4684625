"""How many programs share one row block's keys: against a cached prefix, and in causal attention
without one.

Against a prefix (`choose_splits`): a ranking batch has few query rows (320 per user) and long
prefixes, so few programs stream many keys each; splitting the prefix spreads them over the SMs.

Without a prefix (`choose_causal_splits`):

The full ranking and a pre-inference's first chunk are causal passes over one long sequence at
batch 1: the last row block sees every key, the first one a single tile, and one program per SM
runs at a time. At 4416 tokens (4096 + 320), 35 row blocks x 4 heads are 140 programs on 132
SMs: the pass takes as long as its longest program, about twice the balanced time. Pointwise
SiLU attention has no softmax, so a row block's keys can be split across programs and their
partial sums added (the kernel already does this for cached prefixes); this module picks the
count by replaying the launch in the kernel's program order on `num_sms` SMs, each program
starting on the first SM to come free (how the hardware hands out thread blocks).

Pure Python (no Triton), so that the choice is tested on the CPU.
"""

from __future__ import annotations

import functools
import heapq

# What a program costs beyond its key tiles, in tiles: Q's load and the pipeline's fill, plus the
# float32 partial sums added into the output when it is one of several.
_PROGRAM_OVERHEAD_TILES = 2.0
_SPLIT_OVERHEAD_TILES = 3.0
# A program past its sequence or its row block's split count exits at once.
_EXIT_TILES = 0.05
MAX_CAUSAL_SPLITS = 8
# A split covers at least this many key blocks (fewer: the per-program set-up dominates).
MIN_SPLIT_BLOCKS = 4
_MAX_SPLITS = 64
# Against a prefix, fitted on an H200 to device times (bench.attention, CUDA-graph timing, k9g,
# 2026-11-29: 320 tokens a user against 4k and 8k, batch 1, 2, 4 and 8, splits 1-16; 4.7% rms):
# time = waves x (key blocks per split + _PREFIX_PROGRAM_TILES) + _PREFIX_SUM_TILES x programs x
# splits / SMs for split launches (every split's float32 partial sums added into the output: a
# cost of the total traffic, not of the waves). It picks the fastest count measured at 7 of the 8
# shapes (48 programs against 4k: 2 splits, 0.128 ms, where 5 took 0.121). An earlier fit on
# do_bench times (CUDA events around each call, so the host's launch at small shapes) charged
# each split 5 tiles whatever the batch and picked 4-5 splits for one user against 8k: 0.113 ms,
# where 11 take 0.077.
_PREFIX_PROGRAM_TILES = 0.5
_PREFIX_SUM_TILES = 5.3
# With this many waves of programs the SMs stay busy anyway: no split is worth its sums.
_ENOUGH_WAVES = 3


def choose_splits(programs: int, prefix_blocks: int, num_sms: int) -> int:
    """Prefix splits for `programs` (row block, sequence, head) programs over prefixes of
    `prefix_blocks` key blocks, one program per SM at a time (PREFIX_CONFIG's shared memory).

    Time is modelled as waves x (key blocks per split + _PREFIX_PROGRAM_TILES), waves being
    ceil(programs x splits / SMs) (a split count that leaves the last wave mostly empty costs a
    whole wave: batch 8 x 320 tokens against 8k, 96 programs, 4 splits fill 3 waves at 97%), plus
    the partial sums' adds, _PREFIX_SUM_TILES per program and split over the SMs. Ties go to
    fewer splits."""
    if programs < 1 or prefix_blocks < 1:
        return 1
    best, best_cost = 1, 0.0
    for s in range(1, max(1, min(_MAX_SPLITS, prefix_blocks // MIN_SPLIT_BLOCKS)) + 1):
        waves = -(-programs * s // num_sms)
        cost = waves * (-(-prefix_blocks // s) + _PREFIX_PROGRAM_TILES) + (
            _PREFIX_SUM_TILES * programs * s / num_sms if s > 1 else 0.0
        )
        if s == 1 or cost < best_cost:
            best, best_cost = s, cost
    return best


def program_key_tiles(
    row_block: int,
    length: int,
    n_hist: int,
    split: int,
    splits: int,
    block_m: int,
    block_n: int,
) -> tuple[int, int] | None:
    """(key tiles, the row block's split count) of one program: `row_block` of a sequence of
    `length` new tokens (`n_hist` of them history), as split `split` of `splits`; None when it
    exits at once. Mirrors the kernel: the unmasked history tiles are shared out; split 0 also
    does the masked diagonal tiles and the candidates' own keys."""
    start = row_block * block_m
    if start >= length:
        return None
    units = min(start, n_hist) // block_n
    active = min(splits, max(units // MIN_SPLIT_BLOCKS, 1))
    if split >= active:
        return None
    per_split = -(-units // active) if units else 0
    tiles = max(0, min(per_split, units - split * per_split))
    if split == 0:
        diagonal = max(0, min(start + block_m, n_hist) - units * block_n)
        tiles += -(-diagonal // block_n)
        if start + block_m > n_hist:  # candidate rows: their own keys
            tiles += 1
    return tiles, active


def makespan_tiles(
    lengths: tuple[int, ...],
    n_hists: tuple[int, ...],
    num_heads: int,
    splits: int,
    num_sms: int,
    block_m: int,
    block_n: int,
) -> float:
    """The pass's time in key tiles: programs started in the kernel's order (splits slowest, then
    sequences, row blocks last first, heads fastest), each on the SM that comes free first."""
    free = [0.0] * num_sms
    for split in range(splits):
        for length, n_hist in zip(lengths, n_hists, strict=True):
            for row_block in range(-(-length // block_m) - 1, -1, -1):
                found = program_key_tiles(row_block, length, n_hist, split, splits, block_m, block_n)
                tiles = _EXIT_TILES
                if found is not None:  # its key tiles and its overhead
                    tiles = found[0] + (_SPLIT_OVERHEAD_TILES if found[1] > 1 else _PROGRAM_OVERHEAD_TILES)
                for _ in range(num_heads):
                    heapq.heapreplace(free, free[0] + tiles)
    return max(free)


@functools.lru_cache(maxsize=1024)
def choose_causal_splits(
    lengths: tuple[int, ...],
    n_hists: tuple[int, ...],
    num_heads: int,
    num_sms: int,
    block_m: int,
    block_n: int,
) -> int:
    """The split count (1..MAX_CAUSAL_SPLITS) that finishes a causal pass over these sequences
    soonest by makespan_tiles; ties go to fewer splits (fewer float32 sums). Batches with
    _ENOUGH_WAVES waves of programs are not split."""
    if num_sms < 1 or num_heads < 1:
        raise ValueError(f"need SMs and heads, got num_sms={num_sms}, num_heads={num_heads}")
    programs = num_heads * sum(-(-length // block_m) for length in lengths)
    if programs == 0 or programs >= _ENOUGH_WAVES * num_sms:
        return 1
    best, best_time = 1, None
    for splits in range(1, MAX_CAUSAL_SPLITS + 1):
        time = makespan_tiles(lengths, n_hists, num_heads, splits, num_sms, block_m, block_n)
        if best_time is None or time < best_time * 0.98:  # a split must buy more than its noise
            best, best_time = splits, time
    return best
