"""A copy of the cache's bookkeeping for tests and debugging: :meth:`L1Cache.debug_view`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.leases import Lease, LeaseTable
from kvpool.agent.core.l1.slots import NIL, State

STATES = tuple(State)
"""Each state by its value (the slot table keeps the values)."""


class SlotView(NamedTuple):
    """One slot's metadata."""

    slot: int
    state: State
    key: bytes | None
    tenant: str | None
    """The name of the record the chunk is charged to; None for a free slot."""
    offset: int
    first_page: int
    pages: int
    nbytes: int
    readers: int
    parent: int
    """The slot of the chunk's predecessor in its chain, or ``NIL``."""
    children: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LeaseView:
    writing: bool
    slots: tuple[int, ...]
    expires: float
    """When an open lease expires; for a quarantined one, when its fence ends."""


@dataclass(frozen=True, slots=True)
class TenantView:
    name: str
    used_bytes: int
    chunks: int


@dataclass(frozen=True)
class L1DebugView:
    """A copy of the cache's bookkeeping, for tests and debugging (never the data path)."""

    slots: tuple[SlotView, ...]
    """Every slot, free ones included, by slot number."""
    index: Mapping[bytes, int]
    """Key to slot of the chunks a lookup or a reservation can find (being written or ready)."""
    free_slots: tuple[int, ...]
    free_extents: tuple[tuple[int, int], ...]
    """The page allocator's free (first page, pages) runs, in page order."""
    total_pages: int
    free_pages: int
    high_pages: int
    low_pages: int
    leases: Mapping[int, LeaseView]
    quarantined: Mapping[int, LeaseView]
    tenants: Mapping[str, TenantView]
    record_places: int
    """Places in the record list: the records plus the places dropped ones left."""

    @property
    def used_pages(self) -> int:
        return self.total_pages - self.free_pages

    def live(self) -> list[SlotView]:
        """The slots that hold a chunk (in any state but free)."""
        return [view for view in self.slots if view.state != State.FREE]

    def slot_of(self, key: bytes) -> SlotView:
        return self.slots[self.index[key]]


def debug_view(chunks: Chunks, leases: LeaseTable, evictor: Evictor) -> L1DebugView:
    slots, allocator, tenants = chunks.slots, chunks.allocator, chunks.tenants
    names = [account.name for account in tenants.places]
    total = len(slots.keys)

    def lease_view(record: Lease) -> LeaseView:
        return LeaseView(record.writing, tuple(record.slots), record.expires)

    return L1DebugView(
        slots=tuple(
            map(
                SlotView,
                range(total),
                map(STATES.__getitem__, slots.state),
                slots.keys,
                [None if tenant == NIL else names[tenant] for tenant in slots.tenant],
                slots.offsets,
                slots.first_page,
                slots.pages,
                slots.nbytes,
                slots.readers,
                slots.parent,
                # At most as many as there are slots: children that loop still show.
                [tuple(islice(slots.children(slot), total)) for slot in range(total)],
            )
        ),
        index=dict(chunks.index),
        free_slots=tuple(slots.free),
        free_extents=tuple(allocator.free_extents()),
        total_pages=allocator.total_pages,
        free_pages=allocator.free_pages,
        high_pages=evictor.high_pages,
        low_pages=evictor.low_pages,
        leases={lease: lease_view(record) for lease, record in leases.active.items()},
        quarantined={
            lease: lease_view(record) for lease, record in leases.quarantine.leases.items()
        },
        tenants={
            name: TenantView(name, account.used_bytes, account.chunks)
            for name, account in tenants.by_name.items()
        },
        record_places=len(tenants.places),
    )
