"""What the cache reports without changing anything: its statistics, its ready keys, and
for tests and debugging a copy of its bookkeeping and the check of its rules."""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.agent.core.cache_types import EvictionCause, L1Stats
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.cycle import Traffic
from kvpool.agent.core.l1.debug import L1DebugView, debug_view
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.invariants import check_invariants
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.slots import NIL, State


class Reports:
    """Statistics, listings and debug views: see :class:`~kvpool.agent.core.l1.L1Cache`."""

    def __init__(
        self, chunks: Chunks, leases: LeaseTable, evictor: Evictor, traffic: Traffic
    ) -> None:
        self._chunks = chunks
        self._leases = leases
        self._evictor = evictor
        self._traffic = traffic

    def stats(self) -> L1Stats:
        chunks, leases, traffic = self._chunks, self._leases, self._traffic
        evictions = self._evictor.evictions
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
            evictions={cause.value: evictions[cause] for cause in EvictionCause},
            lock_expiries=leases.expiries,
            open_leases=len(leases.active),
            quarantined_leases=leases.quarantine.total,
            quarantined_bytes=page
            * sum(
                slots.pages[slot]
                for held in leases.quarantine.leases.values()
                for slot in held.slots
            ),
            free_extents=allocator.free_extent_count,
            fragmentation=allocator.fragmentation(),
            page_waste=(allocated - chunks.stored_bytes) / allocated if allocated else 0.0,
            tenant_count=len(chunks.tenants.by_name),
        )

    def contains(self, key: bytes) -> bool:
        slot = self._chunks.index.get(key, NIL)
        return slot != NIL and self._chunks.slots.state[slot] == State.READY

    def ready_keys(self, tenant: str | None) -> Iterator[bytes]:
        """Keys of ready chunks (of one tenant, or all; none of a tenant without a record)."""
        chunks = self._chunks
        scope = None if tenant is None else chunks.tenants.by_name.get(tenant)
        if tenant is not None and scope is None:
            return
        state, owner = chunks.slots.state, chunks.slots.tenant
        for key, slot in chunks.index.items():
            if state[slot] == State.READY and (scope is None or owner[slot] == scope.index):
                yield key

    def keys_by_tenant(self) -> dict[str, list[bytes]]:
        chunks = self._chunks
        state, owner, places = chunks.slots.state, chunks.slots.tenant, chunks.tenants.places
        grouped: dict[str, list[bytes]] = {}
        for key, slot in chunks.index.items():
            if state[slot] == State.READY:
                grouped.setdefault(places[owner[slot]].name, []).append(key)
        return grouped

    def debug_view(self) -> L1DebugView:
        return debug_view(self._chunks, self._leases, self._evictor)

    def check_invariants(self) -> None:
        check_invariants(self._chunks, self._leases)
