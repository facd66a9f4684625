"""A model's relative-bias tables in the forms the attention kernels read, derived once.

The tables are weights: they do not change between forward passes, yet the eager forward rebuilt
what the Triton kernel reads of them on every pass (the halved packed tables, and the position
bias of every distance 0..longest: a log-bucket computation over up to 64k distances and a
gather). On an H200 under load that was ~9% of a full ranking's host time (py-spy samples:
log_bucket 31, packing 10, stacking 8 of the forward's 537; NOTES.md).
`BiasTables` keeps both, grows the by-distance table when a longer sequence comes, and is
rebuilt by its owner when the weights change (`HSTURanker.attention_bias`). Plain torch: it runs
and is tested on the CPU; only the Triton path reads `packed` and `by_distance`.
"""

from __future__ import annotations

import torch

from kernels.hstu_attention.reference import log_bucket

# Longest distance for which a by-distance position table is built (64k distances x 4 B x L x H);
# past it the kernel computes the bucket on chip.
POS_TABLE_MAX_DISTANCE = 1 << 16
# The first by-distance table covers at least this many distances (then doubles as needed).
_MIN_DISTANCES = 4096


def packed_bias_tables(pos_tables: torch.Tensor, time_tables: torch.Tensor) -> torch.Tensor:
    """[L, H, NB_POS + NB_TIME] float32: each layer's and head's position table, then its time
    table, both halved (the kernel evaluates SiLU(x) as h + h * tanh(h) with h = x / 2)."""
    return (0.5 * torch.cat([pos_tables.float(), time_tables.float()], dim=2)).contiguous()


def position_by_distance(
    packed: torch.Tensor, nb_pos: int, mantissa_bits: int, distances: int
) -> torch.Tensor:
    """[L, H, distances] float32, halved: the position bias of every distance 0..distances-1."""
    buckets = log_bucket(torch.arange(distances, device=packed.device), mantissa_bits, nb_pos)
    return packed[:, :, :nb_pos].index_select(2, buckets.long()).contiguous()


class BiasTables:
    """pos [L, H, NB_POS] and time [L, H, NB_TIME] bias tables (float32), with the packed form and
    a by-distance position table derived from them once. Treat the tables as frozen: a new
    BiasTables is made when they change."""

    def __init__(self, pos_tables: torch.Tensor, time_tables: torch.Tensor, pos_mantissa_bits: int) -> None:
        self.pos = pos_tables
        self.time = time_tables
        self.pos_mantissa_bits = pos_mantissa_bits
        self.nb_pos = int(pos_tables.shape[2])
        self.packed = packed_bias_tables(pos_tables, time_tables)
        self._by_distance: torch.Tensor | None = None

    def by_distance(self, longest: int) -> torch.Tensor | None:
        """A by-distance table covering distances 0..longest (it may cover more: the kernel takes
        its length as the row stride), or None past POS_TABLE_MAX_DISTANCE."""
        if longest > POS_TABLE_MAX_DISTANCE:
            return None
        table = self._by_distance
        if table is None or table.shape[2] < longest + 1:
            size = max(_MIN_DISTANCES, 1 << max(longest, 1).bit_length())  # a power of two > longest
            size = min(size, POS_TABLE_MAX_DISTANCE + 1)
            table = position_by_distance(self.packed, self.nb_pos, self.pos_mantissa_bits, size)
            self._by_distance = table  # one assignment: a reader sees the old table or the new
        return table
