"""What the cache reports without changing anything: its statistics and its ready keys."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvpool.agent.core.cache_types import EvictionCause, L1Stats
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.slots import State
from kvpool.agent.core.l1.tenants import Tenant


@dataclass
class Traffic:
    """The reserve/commit/lookup cycle's counters, cache-wide."""

    hits: int = 0
    misses: int = 0
    written_bytes: int = 0
    read_bytes: int = 0


def l1_stats(chunks: Chunks, leases: LeaseTable, evictor: Evictor, traffic: Traffic) -> L1Stats:
    layout, slots, allocator = chunks.layout, chunks.slots, chunks.allocator
    page = layout.page_size
    allocated = (allocator.total_pages - allocator.free_pages) * page
    return L1Stats(
        capacity_bytes=layout.data_size,
        allocated_bytes=allocated,
        stored_bytes=chunks.stored_bytes,
        chunks=len(chunks.index),
        held_chunks=len(slots.keys) - len(slots.free),
        hits=traffic.hits,
        misses=traffic.misses,
        written_bytes=traffic.written_bytes,
        read_bytes=traffic.read_bytes,
        evictions={cause.value: evictor.evictions[cause] for cause in EvictionCause},
        lock_expiries=leases.expiries,
        open_leases=len(leases.active),
        quarantined_leases=leases.quarantine.total,
        quarantined_bytes=page
        * sum(
            slots.pages[slot] for held in leases.quarantine.leases.values() for slot in held.slots
        ),
        free_extents=allocator.free_extent_count,
        fragmentation=allocator.fragmentation(),
        page_waste=(allocated - chunks.stored_bytes) / allocated if allocated else 0.0,
        tenant_count=len(chunks.tenants.by_name),
    )


def ready_keys(chunks: Chunks, scope: Tenant | None) -> Iterator[bytes]:
    """Keys of ready chunks (of one tenant, or all)."""
    state, owner = chunks.slots.state, chunks.slots.tenant
    for key, slot in chunks.index.items():
        if state[slot] == State.READY and (scope is None or owner[slot] == scope.index):
            yield key


def keys_by_tenant(chunks: Chunks) -> dict[str, list[bytes]]:
    state, owner, places = chunks.slots.state, chunks.slots.tenant, chunks.tenants.places
    grouped: dict[str, list[bytes]] = {}
    for key, slot in chunks.index.items():
        if state[slot] == State.READY:
            grouped.setdefault(places[owner[slot]].name, []).append(key)
    return grouped
