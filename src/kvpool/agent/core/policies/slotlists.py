"""Doubly linked lists of slot numbers, threaded through shared arrays.

Every chunk in L1 is a slot number. Policies order slots in lists; keeping the
links in two flat ``array('i')`` (8 bytes per slot for all lists together)
instead of an OrderedDict per list (~100 bytes per entry) is what keeps the
per-chunk metadata small. A slot is in at most one list at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

NIL = -1


class SlotArena:
    """The link storage shared by every list of one cache."""

    def __init__(self, slots: int) -> None:
        self.prev = array("i", [NIL]) * slots
        self.next = array("i", [NIL]) * slots
        self.owner = array("i", [NIL]) * slots  # id of the list a slot is in
        self._next_list_id = 0

    def new_list(self) -> SlotList:
        list_id = self._next_list_id
        self._next_list_id += 1
        return SlotList(self, list_id)


class SlotList:
    """One ordered list: head is the oldest end, tail the newest."""

    def __init__(self, arena: SlotArena, list_id: int) -> None:
        self._arena = arena
        self.list_id = list_id
        self.head = NIL
        self.tail = NIL
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, slot: int) -> bool:
        return self._arena.owner[slot] == self.list_id

    def append(self, slot: int) -> None:
        arena = self._arena
        arena.owner[slot] = self.list_id
        arena.prev[slot] = self.tail
        arena.next[slot] = NIL
        if self.tail == NIL:
            self.head = slot
        else:
            arena.next[self.tail] = slot
        self.tail = slot
        self.size += 1

    def remove(self, slot: int) -> None:
        arena = self._arena
        if arena.owner[slot] != self.list_id:
            raise KeyError(f"slot {slot} is not in list {self.list_id}")
        before, after = arena.prev[slot], arena.next[slot]
        if before == NIL:
            self.head = after
        else:
            arena.next[before] = after
        if after == NIL:
            self.tail = before
        else:
            arena.prev[after] = before
        arena.owner[slot] = NIL
        self.size -= 1

    def move_to_tail(self, slots: Sequence[int]) -> None:
        """Move ``slots`` (all in this list) to the tail, keeping their order.

        Runs that are already adjacent in the list (the usual case: a chain's
        chunks were stored and hit together) move as one splice, so a hit costs
        one comparison per chunk rather than a relink.
        """
        following = self._arena.next
        count = len(slots)
        start = 0
        while start < count:
            end = start
            while end + 1 < count and following[slots[end]] == slots[end + 1]:
                end += 1
            self._splice_to_tail(slots[start], slots[end])
            start = end + 1

    def _splice_to_tail(self, first: int, last: int) -> None:
        """Move the adjacent run ``first`` .. ``last`` to the tail."""
        if last == self.tail:
            return
        prev, following = self._arena.prev, self._arena.next
        before, after = prev[first], following[last]  # after exists: last is not the tail
        if before == NIL:
            self.head = after
        else:
            following[before] = after
        prev[after] = before
        prev[first] = self.tail
        following[self.tail] = first
        following[last] = NIL
        self.tail = last

    def __iter__(self) -> Iterator[int]:
        """Oldest first. The list must not change while it is iterated."""
        slot = self.head
        following = self._arena.next
        while slot != NIL:
            yield slot
            slot = following[slot]
