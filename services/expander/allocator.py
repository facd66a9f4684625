"""First-fit block allocator over one arena [0, capacity): pure bookkeeping, no I/O.

Every block starts at a multiple of ALIGNMENT (4096, one page) and its size is rounded up to a
multiple of it, so blocks never share a page and copies into them start page-aligned. Free space
is a sorted list of disjoint (offset, size) extents; freeing merges an extent with its neighbours,
so two free extents are never adjacent. The number of live blocks is small (one per cached psi of
MBs to hundreds of MB), so the linear first-fit scan is cheap and simple.

Not thread-safe: the daemon calls it from its single event loop.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

ALIGNMENT = 4096


class AllocatorError(ValueError):
    """A caller broke the allocator's contract (freeing an unknown offset, a bad size)."""


class InvariantError(AssertionError):
    """Internal bookkeeping is inconsistent: a bug, never a caller error."""


def align_up(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGNMENT."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class Allocator:
    """First-fit allocator with coalescing over [0, capacity), capacity a multiple of ALIGNMENT.

    `check=True` verifies every invariant after each operation (tests); otherwise `check_invariants()`
    can be called explicitly.
    """

    def __init__(self, capacity: int, *, check: bool = False) -> None:
        if capacity <= 0 or capacity % ALIGNMENT:
            raise AllocatorError(f"capacity must be a positive multiple of {ALIGNMENT}, got {capacity}")
        self._capacity = capacity
        self._check = check
        # Free extents sorted by offset: parallel lists so bisect works on offsets directly.
        self._free_offsets: list[int] = [0]
        self._free_sizes: list[int] = [capacity]
        self._blocks: dict[int, int] = {}  # offset -> aligned size of every live block
        self._used = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes held by live blocks (aligned sizes)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free extent: the biggest allocation that would succeed now."""
        return max(self._free_sizes, default=0)

    @property
    def block_count(self) -> int:
        return len(self._blocks)

    def block_size(self, offset: int) -> int:
        """Aligned size of the live block at offset. Raises AllocatorError if there is none."""
        try:
            return self._blocks[offset]
        except KeyError:
            raise AllocatorError(f"no block at offset {offset}") from None

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, in address order (a copy)."""
        return list(zip(self._free_offsets, self._free_sizes, strict=True))

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new block of at least nbytes (rounded up to ALIGNMENT), or None if no free
        extent is large enough. Raises AllocatorError for nbytes <= 0."""
        if nbytes <= 0:
            raise AllocatorError(f"allocation size must be > 0, got {nbytes}")
        size = align_up(nbytes)
        for i, extent in enumerate(self._free_sizes):
            if extent >= size:
                offset = self._free_offsets[i]
                if extent == size:
                    del self._free_offsets[i]
                    del self._free_sizes[i]
                else:
                    self._free_offsets[i] = offset + size
                    self._free_sizes[i] = extent - size
                self._blocks[offset] = size
                self._used += size
                self._maybe_check()
                return offset
        return None

    def free(self, offset: int) -> None:
        """Returns the block at offset to the free list, merging it with free neighbours.
        Raises AllocatorError if offset is not the start of a live block (double free included)."""
        size = self._blocks.pop(offset, None)
        if size is None:
            raise AllocatorError(f"free of unknown offset {offset}")
        self._used -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        merge_prev = i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset
        merge_next = i < len(self._free_offsets) and offset + size == self._free_offsets[i]
        if merge_prev and merge_next:
            self._free_sizes[i - 1] += size + self._free_sizes[i]
            del self._free_offsets[i]
            del self._free_sizes[i]
        elif merge_prev:
            self._free_sizes[i - 1] += size
        elif merge_next:
            self._free_offsets[i] = offset
            self._free_sizes[i] += size
        else:
            self._free_offsets.insert(i, offset)
            self._free_sizes.insert(i, size)
        self._maybe_check()

    def largest_free_if_freed(self, offsets: Iterable[int]) -> int:
        """Largest free extent there would be if the blocks at `offsets` were freed; changes nothing.
        Lets a caller learn whether evicting a set of blocks can make room before evicting any."""
        extents = self.free_extents() + [(o, self.block_size(o)) for o in set(offsets)]
        extents.sort()
        best = 0
        run_start, run_end = -1, -1
        for offset, size in extents:
            if offset == run_end:
                run_end += size
            else:
                run_start, run_end = offset, offset + size
            best = max(best, run_end - run_start)
        return best

    def check_invariants(self) -> None:
        """Raises InvariantError unless: extents sorted, aligned, non-empty, disjoint and coalesced;
        live blocks aligned and disjoint from each other and from free space; free + used = capacity."""
        problems: list[str] = []
        spans = [(o, s, "free") for o, s in self.free_extents()] + [
            (o, s, "block") for o, s in self._blocks.items()
        ]
        spans.sort()
        cursor = 0
        prev_kind = ""
        for offset, size, kind in spans:
            if offset % ALIGNMENT or size % ALIGNMENT or size <= 0:
                problems.append(f"{kind} ({offset}, {size}) not aligned or empty")
            if offset != cursor:
                problems.append(f"{kind} at {offset}: expected {cursor} (gap or overlap)")
            if kind == "free" and prev_kind == "free":
                problems.append(f"adjacent free extents not coalesced at {offset}")
            cursor = offset + size
            prev_kind = kind
        if cursor != self._capacity:
            problems.append(f"spans end at {cursor}, capacity is {self._capacity}")
        if self._used != sum(self._blocks.values()):
            problems.append(f"used_bytes {self._used} != sum of blocks")
        if self._free_offsets != sorted(self._free_offsets):
            problems.append("free list not sorted")
        if problems:
            raise InvariantError("allocator: " + "; ".join(problems))

    def _maybe_check(self) -> None:
        if self._check:
            self.check_invariants()
