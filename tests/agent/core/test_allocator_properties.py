"""Property tests of the TLSF extent allocator against a shadow model of allocations."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpool.agent.core.allocator import SUBBINS, ExtentAllocator, _bin_of, _first_bin_that_fits

# Sizes around the bin boundaries matter most: below SUBBINS every size has its
# own bin, above it a bin spans a range and good-fit rounding kicks in.
TOTALS = st.one_of(
    st.integers(1, 40),
    st.sampled_from([SUBBINS - 1, SUBBINS, SUBBINS + 1, 63, 64, 65, 100, 257, 1000, 4096]),
)
REQUESTS = st.one_of(st.integers(1, 12), st.integers(1, 300), st.integers(1, 5000))


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free against a dict of the extents handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = ExtentAllocator(1)
        self.allocated: dict[int, int] = {}  # start -> pages

    @initialize(total=TOTALS)
    def create(self, total: int) -> None:
        self.allocator = ExtentAllocator(total)
        self.allocated = {}

    @rule(pages=REQUESTS)
    def allocate(self, pages: int) -> None:
        before = self.allocator.free_extents()
        free_before = self.allocator.free_pages
        start = self.allocator.allocate(pages)
        if start is None:
            # None only when no free extent is long enough, and nothing changed.
            assert all(length < pages for _, length in before), (pages, before)
            assert self.allocator.free_extents() == before
            assert self.allocator.free_pages == free_before
            return
        # The run came out of one free extent.
        assert any(s <= start and start + pages <= s + length for s, length in before), (
            start,
            pages,
            before,
        )
        assert self.allocator.free_pages == free_before - pages
        self.allocated[start] = pages

    @precondition(lambda self: self.allocated)
    @rule(choice=st.integers(0, 10_000))
    def free(self, choice: int) -> None:
        starts = sorted(self.allocated)
        start = starts[choice % len(starts)]
        pages = self.allocated.pop(start)
        free_before = self.allocator.free_pages
        self.allocator.free(start, pages)
        assert self.allocator.free_pages == free_before + pages
        # The freed run is now inside one (maximal) free extent.
        assert any(
            s <= start and start + pages <= s + length
            for s, length in self.allocator.free_extents()
        )

    @precondition(lambda self: self.allocated)
    @rule(seed=st.integers(0, 2**32 - 1))
    def free_everything(self, seed: int) -> None:
        items = list(self.allocated.items())
        random.Random(seed).shuffle(items)
        for start, pages in items:
            self.allocator.free(start, pages)
        self.allocated = {}
        assert self.allocator.free_extents() == [(0, self.allocator.total_pages)]
        assert self.allocator.fragmentation() == 0.0

    @invariant()
    def extents_partition_the_segment(self) -> None:
        allocator = self.allocator
        total = allocator.total_pages
        free = allocator.free_extents()
        runs = sorted(
            [(s, p, "used") for s, p in self.allocated.items()] + [(s, p, "free") for s, p in free]
        )
        # Sorted by start, consecutive runs must not overlap and must tile [0, total).
        position = 0
        for start, pages, _ in runs:
            assert pages > 0
            assert start == position, (runs, total)  # no overlap, no hole
            position = start + pages
        assert position == total
        assert sum(self.allocated.values()) + allocator.free_pages == total
        assert sum(length for _, length in free) == allocator.free_pages

    @invariant()
    def free_extents_are_maximal(self) -> None:
        free = self.allocator.free_extents()
        for (start, length), (next_start, _) in itertools.pairwise(free):
            assert start + length < next_start, f"adjacent free extents not coalesced: {free}"

    @invariant()
    def summaries_agree(self) -> None:
        allocator = self.allocator
        free = allocator.free_extents()
        assert allocator.free_extent_count == len(free)
        assert allocator.largest_free_extent() == max((length for _, length in free), default=0)
        fragmentation = allocator.fragmentation()
        assert 0.0 <= fragmentation <= 1.0
        if len(free) <= 1:
            assert fragmentation == 0.0
        else:
            assert fragmentation > 0.0

    @invariant()
    def internal_indexes_agree(self) -> None:
        # Read-only look at the bins and boundary maps that make allocate/free O(1).
        allocator = self.allocator
        free = dict(allocator.free_extents())
        assert {s + length: s for s, length in free.items()} == allocator._start_by_end
        for index, members in enumerate(allocator._bins):
            assert bool(allocator._nonempty >> index & 1) == bool(members), index
            for start in members:
                assert _bin_of(free[start]) == index
        assert sum(len(members) for members in allocator._bins) == len(free)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(
    total=TOTALS,
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=60),
)
def test_allocate_none_only_when_nothing_fits(total: int, ops: list[tuple[bool, int]]) -> None:
    """The same contract as the machine, as a flat op list (easier to read when it shrinks)."""
    allocator = ExtentAllocator(total)
    live: list[tuple[int, int]] = []
    for is_alloc, amount in ops:
        if is_alloc or not live:
            largest = allocator.largest_free_extent()
            start = allocator.allocate(amount)
            assert (start is None) == (largest < amount), (amount, allocator.free_extents())
            if start is not None:
                live.append((start, amount))
        else:
            allocator.free(*live.pop(amount % len(live)))
        free = allocator.free_extents()
        assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(free))
        assert sum(n for _, n in live) + allocator.free_pages == total


@given(pages=st.integers(1, 1 << 40))
def test_first_bin_that_fits_only_holds_extents_that_fit(pages: int) -> None:
    first = _first_bin_that_fits(pages)
    own = _bin_of(pages)
    # Bins grow with size, so a bin's smallest extent decides whether all of it fits.
    assert _smallest_in_bin(first) >= pages
    # ... and it is the lowest such bin: the request's own bin, unless that bin also
    # holds shorter extents, in which case the next one.
    if _smallest_in_bin(own) == pages:
        assert first == own
    else:
        assert first == own + 1


@given(a=st.integers(1, 1 << 40), b=st.integers(1, 1 << 40))
def test_bins_are_monotonic(a: int, b: int) -> None:
    if a <= b:
        assert _bin_of(a) <= _bin_of(b)


def _smallest_in_bin(index: int) -> int:
    """The smallest extent length that ``_bin_of`` maps to ``index`` (binary search)."""
    low, high = 1, 1 << 50
    while low < high:
        middle = (low + high) // 2
        if _bin_of(middle) >= index:
            high = middle
        else:
            low = middle + 1
    return low


@pytest.mark.parametrize("total", [1, 8, 9, 100])
def test_free_outside_the_segment_is_refused(total: int) -> None:
    allocator = ExtentAllocator(total)
    for start, pages in [(-1, 1), (0, 0), (0, total + 1), (total, 1)]:
        with pytest.raises(ValueError):
            allocator.free(start, pages)
    assert allocator.free_extents() == [(0, total)]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        ExtentAllocator(0)
    with pytest.raises(ValueError):
        ExtentAllocator(4).allocate(0)


@pytest.mark.parametrize(("total", "pages"), [(1, 2), (8, 9), (64, 72), (100, 1000)])
def test_request_longer_than_the_segment_returns_none(total: int, pages: int) -> None:
    """Also past the top bin the allocator has (once an IndexError)."""
    allocator = ExtentAllocator(total)
    assert allocator.allocate(pages) is None
    assert allocator.free_extents() == [(0, total)]
