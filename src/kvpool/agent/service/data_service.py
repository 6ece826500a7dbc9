"""The service's data operations: the ZMQ edge's (lookups, stores, leases, copies for callers
that cannot map the segment, the index's snapshot), the L2 tiers' (landings, chunk views),
and removing a tenant's chunks.

A lookup's hits tell the write-back and a miss may start a prefetch; a commit tells the
write-back; chunks from L2 land through :meth:`DataService.landing` and commit without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence

from kvpool.agent.core.cache_types import Reservation, UnknownLease
from kvpool.agent.service.hooks import PrefetchProgress
from kvpool.agent.service.landing import ChunkLanding
from kvpool.agent.service.results import Dropped, SnapshotResult
from kvpool.agent.service.state import ServiceState
from kvpool.common.transfer_results import LookupResult, StoreResult


class DataService(ServiceState):
    """Lookups, stores, leases and copies, under the service's lock."""

    def lookup(
        self,
        tenant: str,
        keys: Sequence[bytes],
        *,
        lock: bool = True,
        count: bool = True,
        prefetch: bool = False,
        parent: bytes | None = None,
    ) -> LookupResult:
        """The leading run of ready chunks of ``keys`` (see :meth:`L1Cache.lookup`).

        Counted hits tell the write-back (a ``reused`` policy counts them). With
        ``prefetch``, the keys after the hits start loading from L2 (``parent``
        precedes the first key).
        """
        write_back = self._write_back
        with self._lock:
            hit = self._cache.lookup(tenant, keys, lock=lock, count=count)
            if write_back is not None and hit.count and count:
                write_back.hit(tenant, keys[: hit.count], self._cache)
        prefetch_id = 0
        if prefetch and self._prefetch is not None and hit.count < len(keys):
            after = keys[hit.count - 1] if hit.count else parent
            prefetch_id = self._prefetch.begin(tenant, keys[hit.count :], after)
        return dataclasses.replace(hit, prefetch=prefetch_id) if prefetch_id else hit

    def prefetch_status(self, prefetch_id: int) -> PrefetchProgress | None:
        """None for an id never given or long finished (or without L2 tiers)."""
        return None if self._prefetch is None else self._prefetch.status(prefetch_id)

    def reserve(
        self,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
        *,
        keep: Sequence[bytes] = (),
    ) -> Reservation:
        """Write-lock space for ``keys`` (see :meth:`L1Cache.reserve`)."""
        with self._lock:
            return self._cache.reserve(tenant, keys, sizes, parent, keep)

    def commit(self, lease: int, count: int | None = None) -> int:
        """Make the first ``count`` (default all) reserved chunks ready; tell the write-back."""
        return self._commit(lease, count, write_back=True)

    def _commit(self, lease: int, count: int | None, *, write_back: bool) -> int:
        hook = self._write_back if write_back else None
        with self._lock:
            if hook is None:
                return self._cache.commit(lease, count)
            tenant, keys = self._cache.lease_chunks(lease)
            committed = self._cache.commit(lease, count)
            hook.committed(tenant, keys[:count], self._cache)
        return committed

    def commit_loaded(self, lease: int, count: int | None = None) -> int:
        """Make the first ``count`` (default all) reserved chunks that came from L2 ready
        (they are there already: no write-back); discard the rest."""
        return self._commit(lease, count, write_back=False)

    def trim(self, lease: int, count: int) -> None:
        """Keep the first ``count`` chunks of a reservation; free the rest."""
        with self._lock:
            self._cache.trim(lease, count)

    def chunk_view(self, tenant: str) -> memoryview:
        """The chunk file of ``tenant`` (an L1 account) mapped: its chunks' bytes at their
        offsets, for a tier that reads a chunk or writes a reserved one in place."""
        return self._files.view(tenant)

    def file_id(self, tenant: str) -> int:
        """The id of ``tenant``'s chunk file that clients map (0: it has none)."""
        return self._files.file_id(tenant)

    def landing(
        self,
        tenant: str,
        key: bytes,
        parent: bytes | None,
        keep: list[bytes],
        *,
        after: ChunkLanding | None = None,
        on_decided: Callable[[], None] | None = None,
    ) -> ChunkLanding:
        """A chunk from L2 that a tier receives straight into its reserved pages, reserved
        after the chunk ``after`` (see :class:`~kvpool.agent.service.landing.ChunkLanding`)."""
        return ChunkLanding(self, tenant, key, parent, keep, after, on_decided)

    @property
    def lease_seconds(self) -> float:
        """How long a lease lasts before it expires (the cache's setting)."""
        return self._cache.lease_seconds

    def release(self, lease: int) -> None:
        """End a lease (read locks, or an uncommitted reservation); UnknownLease if none."""
        with self._lock:
            self._cache.release(lease)

    def release_all(self, leases: Iterable[int]) -> None:
        """End each of ``leases`` still open (an expired one is skipped), under one lock."""
        with self._lock:
            for lease in leases:
                with contextlib.suppress(UnknownLease):
                    self._cache.release(lease)

    def store(
        self,
        tenant: str,
        keys: Sequence[bytes],
        payloads: Sequence[bytes | memoryview],
        parent: bytes | None = None,
    ) -> StoreResult:
        """Reserve, copy ``payloads`` into the tenant's chunk file, commit: the store of a
        caller that does not map it (chunks from L2 land through :meth:`landing`).

        The copy runs outside the lock (the reserved chunks are write-locked).
        """
        reservation = self.reserve(tenant, keys, [len(p) for p in payloads], parent)
        view = self.chunk_view(tenant)
        for place, payload in zip(reservation.placements, payloads, strict=False):
            if place is not None:
                view[place.offset : place.offset + place.nbytes] = payload
        stored = 0
        if reservation.lease is not None:
            stored = self.commit(reservation.lease)
        present = sum(place is None for place in reservation.placements)
        return StoreResult(stored, present, reservation.refused_reason)

    def retrieve(self, tenant: str, keys: Sequence[bytes], max_bytes: int) -> list[bytes]:
        """Copies of the leading run of ready chunks of ``keys`` (read-locked while copied),
        as many as fit in ``max_bytes`` together (a reply's bound; the client asks again)."""
        with self._lock:
            hit = self._cache.lookup(tenant, keys, lock=True)
        if hit.lease is None:
            return []
        try:
            view, found, total = self.chunk_view(tenant), [], 0
            for offset, size in zip(hit.offsets, hit.sizes, strict=True):
                total += size
                if total > max_bytes:
                    break
                found.append(bytes(view[offset : offset + size]))
            return found
        finally:
            self.release(hit.lease)

    def snapshot(self, tiers: Iterable[str] = ()) -> SnapshotResult:
        """Every tenant's keys, and the event sequence number they are consistent with; with
        them the keys of the listed lower ``tiers`` asked for (others are left out).

        L1's keys are read with ``seq`` under the lock (L1's events are published under it).
        A lower tier's are read after, outside it, so that a large NVMe tier never holds up
        L1: they reflect every event up to ``seq`` and maybe some after it, which the
        subscriber applies again. That is harmless, as each event sets its keys' presence
        (stored: there, removed: gone) and the last one for a key wins either way.
        """
        with self._lock:  # L1's events are published under this lock
            seq = 0 if self._events is None else self._events.seq
            l1 = self._cache.keys_by_tenant()
            listed = self._listed_tiers
        lower = {tier: listed[tier]() for tier in dict.fromkeys(tiers) if tier in listed}
        return SnapshotResult(seq, l1, lower)

    @property
    def open_write_leases(self) -> int:
        """Reservations not yet committed or released (read without the lock)."""
        return self._cache.open_write_leases

    @property
    def quarantined_leases(self) -> int:
        """How many write leases were ever quarantined (read without the lock to spot news)."""
        return self._cache.quarantined_leases

    def holding_quarantined(self, lease_sets: Sequence[Iterable[int]]) -> list[bool]:
        """For each set of leases, whether one of them is quarantined (see :mod:`l1`)."""
        with self._lock:
            return [any(map(self._cache.is_quarantined, leases)) for leases in lease_sets]

    def clear(self, tenant: str | None = None, *, unpin: bool = False) -> int:
        """Drop every chunk (of one tenant, or all), and with ``unpin`` the pins too."""
        with self._lock:
            return self._cache.clear(tenant, unpin=unpin)

    def drop_tenant(self, tenant: str, *, unpin: bool = False) -> Dropped:
        """Drop the tenant's chunks (and with ``unpin`` its pins) from L1, then its objects
        from every L2 tier.

        L1 first, so the write-back takes no new chunk of the tenant to L2 after the drop
        (a copy already in flight may still land: dropping again removes it).
        """
        l1_chunks = self.clear(tenant, unpin=unpin)
        l2_objects = 0 if self._drop_lower is None else self._drop_lower(tenant)
        return Dropped(l1_chunks, l2_objects)

    def maintain(self) -> None:
        with self._lock:
            self._cache.maintain()
