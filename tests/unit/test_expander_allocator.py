"""First-fit allocator: alignment, first fit, coalescing, errors, and random sequences vs a model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.expander.allocator import ALIGNMENT, Allocator, AllocatorError, InvariantError, align_up

PAGE = ALIGNMENT


def test_capacity_must_be_aligned_and_positive() -> None:
    for bad in (0, -PAGE, PAGE + 1):
        with pytest.raises(AllocatorError):
            Allocator(bad)


def test_sizes_round_up_to_pages_and_first_fit_packs_from_zero() -> None:
    a = Allocator(8 * PAGE, check=True)
    assert a.allocate(1) == 0
    assert a.allocate(PAGE) == PAGE
    assert a.allocate(PAGE + 1) == 2 * PAGE
    assert a.used_bytes == 4 * PAGE
    assert a.free_bytes == 4 * PAGE
    assert a.largest_free == 4 * PAGE
    assert a.block_size(2 * PAGE) == 2 * PAGE
    assert align_up(1) == PAGE
    assert align_up(PAGE) == PAGE


def test_full_arena_returns_none() -> None:
    a = Allocator(2 * PAGE, check=True)
    assert a.allocate(2 * PAGE) == 0
    assert a.allocate(1) is None
    assert a.largest_free == 0


def test_bad_sizes_and_frees_raise() -> None:
    a = Allocator(4 * PAGE, check=True)
    with pytest.raises(AllocatorError):
        a.allocate(0)
    with pytest.raises(AllocatorError):
        a.allocate(-1)
    off = a.allocate(10)
    assert off is not None
    with pytest.raises(AllocatorError):
        a.free(off + PAGE)  # not the start of a block
    a.free(off)
    with pytest.raises(AllocatorError):
        a.free(off)  # double free
    with pytest.raises(AllocatorError):
        a.block_size(off)


@pytest.mark.parametrize(
    ("free_order", "expected_extents"),
    [
        ([1], [(PAGE, PAGE), (4 * PAGE, 4 * PAGE)]),  # no neighbour free: new extent
        ([1, 0], [(0, 2 * PAGE), (4 * PAGE, 4 * PAGE)]),  # merges with the next extent
        ([0, 1], [(0, 2 * PAGE), (4 * PAGE, 4 * PAGE)]),  # merges with the previous extent
        ([0, 2, 1], [(0, 3 * PAGE), (4 * PAGE, 4 * PAGE)]),  # merges with both
        ([3], [(3 * PAGE, 5 * PAGE)]),  # merges with the tail
        ([0, 1, 2, 3], [(0, 8 * PAGE)]),
    ],
)
def test_free_coalesces_with_neighbours(
    free_order: list[int], expected_extents: list[tuple[int, int]]
) -> None:
    a = Allocator(8 * PAGE, check=True)
    offsets = [a.allocate(PAGE) for _ in range(4)]
    assert offsets == [0, PAGE, 2 * PAGE, 3 * PAGE]
    for i in free_order:
        a.free(PAGE * i)
    assert a.free_extents() == expected_extents


def test_first_fit_takes_the_lowest_hole_that_fits() -> None:
    a = Allocator(16 * PAGE, check=True)
    blocks = [a.allocate(PAGE * n) for n in (1, 3, 1, 2, 1)]  # 0, 1-3, 4, 5-6, 7
    assert blocks == [0, PAGE, 4 * PAGE, 5 * PAGE, 7 * PAGE]
    a.free(PAGE)  # hole of 3 pages at 1
    a.free(5 * PAGE)  # hole of 2 pages at 5
    assert a.allocate(2 * PAGE) == PAGE  # first hole that fits, not the best fit
    assert a.allocate(2 * PAGE) == 5 * PAGE
    assert a.allocate(PAGE) == 3 * PAGE


def test_largest_free_if_freed_changes_nothing() -> None:
    a = Allocator(8 * PAGE, check=True)
    offs = [a.allocate(2 * PAGE) for _ in range(4)]
    assert offs == [0, 2 * PAGE, 4 * PAGE, 6 * PAGE]
    a.free(0)
    before = (a.free_extents(), a.used_bytes)
    assert a.largest_free_if_freed([2 * PAGE]) == 4 * PAGE  # merges with the free hole at 0
    assert a.largest_free_if_freed([4 * PAGE, 6 * PAGE]) == 4 * PAGE
    assert a.largest_free_if_freed([2 * PAGE, 4 * PAGE, 6 * PAGE]) == 8 * PAGE
    assert a.largest_free_if_freed([]) == 2 * PAGE
    assert (a.free_extents(), a.used_bytes) == before


def test_invariant_check_detects_corruption() -> None:
    a = Allocator(4 * PAGE)
    a.allocate(PAGE)
    a._free_sizes[0] += PAGE  # overlap past capacity
    with pytest.raises(InvariantError):
        a.check_invariants()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 5 * PAGE)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_keep_invariants_and_match_a_model(sequence: list[tuple[str, int]]) -> None:
    capacity = 32 * PAGE
    a = Allocator(capacity, check=True)  # check=True: every invariant after every operation
    live: dict[int, int] = {}  # offset -> aligned size
    for op, arg in sequence:
        if op == "alloc":
            off = a.allocate(arg)
            size = align_up(arg)
            if off is None:
                # First fit fails only when no free extent is large enough.
                assert all(s < size for _, s in a.free_extents())
                continue
            assert off % PAGE == 0
            assert off + size <= capacity
            assert all(off + size <= o or o + s <= off for o, s in live.items()), "overlap"
            live[off] = size
        elif live:
            off = sorted(live)[arg % len(live)]
            a.free(off)
            del live[off]
        assert a.used_bytes == sum(live.values())
        assert a.free_bytes + a.used_bytes == capacity
        assert a.largest_free == max((s for _, s in a.free_extents()), default=0)
    for off in list(live):
        a.free(off)
    assert a.free_extents() == [(0, capacity)]
