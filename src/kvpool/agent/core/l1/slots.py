"""The slot table: each chunk's metadata in flat arrays indexed by slot, and chain links.

A chunk needs at least one page, so there are never more chunks than pages: the
table has a slot per page. Flat arrays cost a few bytes a chunk where an object
would cost a hundred, and the hot paths bind them to locals once per call.

Chains are kept as links between slots: each slot names its predecessor
(``parent``), its first child, and its siblings either side, so a chunk's
children are walked and a slot unlinked in time proportional to its children.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterator

NIL = -1


class State(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    DOOMED = 3
    QUARANTINED = 4


READY = int(State.READY)
DOOMED = int(State.DOOMED)


class SlotTable:
    """Per-slot metadata; a free slot's key is None and its tenant ``NIL``."""

    def __init__(self, pages: int) -> None:
        self.free = array("i", range(pages - 1, -1, -1))
        """The free slots; the next one handed out is the last."""
        self.keys: list[bytes | None] = [None] * pages
        self.state = bytearray(pages)
        self.first_page = array("q", [0]) * pages
        self.offsets = array("q", [0]) * pages  # absolute file offset of each chunk
        self.pages = array("i", [0]) * pages
        self.nbytes = array("q", [0]) * pages
        self.tenant = array("i", [NIL]) * pages  # the place of the tenant's record
        self.readers = array("i", [0]) * pages
        self.pinned = bytearray(pages)
        """1 for a ready chunk that its tenant's pins hold in L1 (see :mod:`.pin_sets`)."""
        self.last_use = array("q", [0]) * pages
        self.sequence = array("q", [0]) * pages  # commit number, for the journal
        self.parent = array("i", [NIL]) * pages
        self.first_child = array("i", [NIL]) * pages
        self.next_sibling = array("i", [NIL]) * pages
        self.prev_sibling = array("i", [NIL]) * pages
        self.tick = 0
        """The recency clock: ``last_use`` values are its ticks."""

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def key(self, slot: int) -> bytes:
        key = self.keys[slot]
        assert key is not None, f"slot {slot} holds no chunk"
        return key

    def children(self, slot: int) -> Iterator[int]:
        child = self.first_child[slot]
        while child != NIL:
            yield child
            child = self.next_sibling[child]

    def link(self, slot: int, parent: int) -> None:
        """Make ``slot`` (linked to nothing yet) the newest child of ``parent``."""
        self.parent[slot] = parent
        self.first_child[slot] = NIL
        self.prev_sibling[slot] = NIL
        self.next_sibling[slot] = NIL
        if parent == NIL:
            return
        sibling = self.first_child[parent]
        self.next_sibling[slot] = sibling
        if sibling != NIL:
            self.prev_sibling[sibling] = slot
        self.first_child[parent] = slot

    def unlink(self, slot: int) -> None:
        """Take ``slot`` out of its chain; its children are left without a parent."""
        parent = self.parent[slot]
        before, after = self.prev_sibling[slot], self.next_sibling[slot]
        if before != NIL:
            self.next_sibling[before] = after
        elif parent != NIL:
            self.first_child[parent] = after
        if after != NIL:
            self.prev_sibling[after] = before
        child = self.first_child[slot]
        while child != NIL:  # orphans: unreachable, left for the policy to evict
            following = self.next_sibling[child]
            self.parent[child] = NIL
            self.prev_sibling[child] = NIL
            self.next_sibling[child] = NIL
            child = following
        self.parent[slot] = NIL
        self.first_child[slot] = NIL
        self.prev_sibling[slot] = NIL
        self.next_sibling[slot] = NIL
