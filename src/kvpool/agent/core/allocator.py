"""Page allocator for the L1 data region: two-level segregated fit (TLSF).

Chunks of any size share one segment (two models on one node means two chunk
sizes). Free space is kept as maximal extents of whole pages, binned by size
in ``SUBBINS`` sub-bins per power of two. ``allocate`` rounds the request up
to the next bin boundary, so the first non-empty bin at or above it (one bit
scan) always fits: O(1). ``free`` merges with both neighbours through two
boundary maps: O(1). The price of good-fit is that an extent in the request's
own bin may go unused; only when nothing above fits is that bin scanned.

The allocator does not remember allocations (that would cost a dict entry per
chunk); its owner, the L1 cache, frees each extent exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

SUBBIN_BITS = 3
SUBBINS = 1 << SUBBIN_BITS


def _bin_of(pages: int) -> int:
    """The bin holding extents of ``pages`` pages (bins grow monotonically with size)."""
    if pages < SUBBINS:
        return pages
    top = pages.bit_length() - 1
    sub = (pages >> (top - SUBBIN_BITS)) - SUBBINS
    return (top - SUBBIN_BITS + 1) * SUBBINS + sub


def _first_bin_that_fits(pages: int) -> int:
    """The lowest bin whose every extent has at least ``pages`` pages."""
    if pages < SUBBINS:
        return pages
    granularity = 1 << (pages.bit_length() - 1 - SUBBIN_BITS)
    return _bin_of(pages + granularity - 1)


class ExtentAllocator:
    """Hands out runs of whole pages from ``total_pages`` pages; page numbers start at 0."""

    def __init__(self, total_pages: int, used: Iterable[tuple[int, int]] = ()) -> None:
        """All pages free but the ``used`` (first page, pages) runs, which must not overlap."""
        if total_pages <= 0:
            raise ValueError("total_pages must be positive")
        self.total_pages = total_pages
        self.free_pages = 0
        self._length_by_start: dict[int, int] = {}
        self._start_by_end: dict[int, int] = {}
        self._bins: list[dict[int, None]] = [{} for _ in range(_bin_of(total_pages) + 1)]
        self._nonempty = 0  # bitmap over bins
        position = 0
        for start, pages in sorted(used):
            if start < position or start + pages > total_pages or pages <= 0:
                raise ValueError(f"used run [{start}, {start + pages}) overlaps or is out of range")
            self._add_free(position, start - position)
            position = start + pages
        self._add_free(position, total_pages - position)

    def _add_free(self, start: int, pages: int) -> None:
        if pages > 0:
            self._insert(start, pages)
            self.free_pages += pages

    def allocate(self, pages: int) -> int | None:
        """First page of a fresh run of ``pages`` pages, or None if no free extent is that long."""
        if pages <= 0:
            raise ValueError("pages must be positive")
        start = self._pop_good_fit(pages)
        if start is None:
            start = self._find_in_own_bin(pages)
            if start is None:
                return None
            self._unbin(start, self._length_by_start[start])
        length = self._unlink(start)
        if length > pages:
            self._insert(start + pages, length - pages)
        self.free_pages -= pages
        return start

    def free(self, start: int, pages: int) -> None:
        """Return a run obtained from :meth:`allocate`, merging it with free neighbours."""
        if start < 0 or pages <= 0 or start + pages > self.total_pages:
            raise ValueError(f"extent [{start}, {start + pages}) is outside the segment")
        self.free_pages += pages
        before = self._start_by_end.get(start)
        if before is not None:
            pages += self._remove(before)
            start = before
        after = start + pages
        if after in self._length_by_start:
            pages += self._remove(after)
        self._insert(start, pages)

    def largest_free_extent(self) -> int:
        if not self._nonempty:
            return 0
        top = self._bins[self._nonempty.bit_length() - 1]
        return max(self._length_by_start[start] for start in top)

    def fragmentation(self) -> float:
        """External fragmentation: 1 - largest free extent / free pages (0 = one free extent)."""
        if self.free_pages == 0:
            return 0.0
        return 1.0 - self.largest_free_extent() / self.free_pages

    @property
    def free_extent_count(self) -> int:
        return len(self._length_by_start)

    def free_extents(self) -> list[tuple[int, int]]:
        """All free (start, pages) runs in page order; for stats and tests."""
        return sorted(self._length_by_start.items())

    def _pop_good_fit(self, pages: int) -> int | None:
        first = _first_bin_that_fits(pages)
        candidates = self._nonempty >> first
        if not candidates:
            return None
        index = first + (candidates & -candidates).bit_length() - 1
        members = self._bins[index]
        start, _ = members.popitem()  # LIFO: O(1), unlike scanning from the front
        if not members:
            self._nonempty &= ~(1 << index)
        return start

    def _find_in_own_bin(self, pages: int) -> int | None:
        index = _bin_of(pages)
        if index >= len(self._bins):
            return None  # longer than the whole segment
        for start in self._bins[index]:
            if self._length_by_start[start] >= pages:
                return start
        return None

    def _insert(self, start: int, pages: int) -> None:
        self._length_by_start[start] = pages
        self._start_by_end[start + pages] = start
        index = _bin_of(pages)
        self._bins[index][start] = None
        self._nonempty |= 1 << index

    def _remove(self, start: int) -> int:
        self._unbin(start, self._length_by_start[start])
        return self._unlink(start)

    def _unbin(self, start: int, pages: int) -> None:
        index = _bin_of(pages)
        members = self._bins[index]
        del members[start]
        if not members:
            self._nonempty &= ~(1 << index)

    def _unlink(self, start: int) -> int:
        pages = self._length_by_start.pop(start)
        del self._start_by_end[start + pages]
        return pages
