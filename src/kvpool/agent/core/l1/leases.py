"""Leases: every lock and reservation expires; an expired write lease is quarantined.

Why quarantine, and until when, is told in :mod:`kvpool.agent.core.l1`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.agent.core.cache_types import LeaseExpired, UnknownLease
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.slots import DOOMED, NIL, State
from kvpool.common.transfer_results import LookupResult


@dataclass
class Lease:
    writing: bool
    slots: list[int]
    expires: float


@dataclass
class Quarantine:
    """Expired write leases whose pages are held back, oldest first (all fences are as long);
    a lease's ``expires`` is the end of its fence."""

    fence_seconds: float
    leases: dict[int, Lease] = field(default_factory=dict)
    total: int = 0
    """How many leases were ever quarantined."""


class LeaseTable:
    def __init__(
        self,
        chunks: Chunks,
        clock: Callable[[], float],
        lease_seconds: float,
        fence_seconds: float,
    ) -> None:
        self._chunks = chunks
        self._clock = clock
        self.lease_seconds = lease_seconds
        self.active: dict[int, Lease] = {}
        """Open leases."""
        self.expiry_heap: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self.write_leases = 0
        """Open write leases (reservations not yet committed or released)."""
        self.expiries = 0
        """Leases that ever expired."""
        self.quarantine = Quarantine(fence_seconds)

    def open(self, *, writing: bool, slots: list[int], expires: float | None = None) -> int:
        """Open a lease over ``slots`` (already locked or reserved); its number."""
        lease = next(self._ids)
        self.write_leases += writing
        if expires is None:
            expires = self._clock() + self.lease_seconds
        self.active[lease] = Lease(writing, slots, expires)
        if expires != math.inf:
            heapq.heappush(self.expiry_heap, (expires, lease))
        return lease

    def take(self, lease: int) -> Lease:
        """Close an open lease and hand back its record (see :meth:`put_back`)."""
        record = self.active.pop(lease, None)
        if record is None:
            if lease in self.quarantine.leases:
                raise LeaseExpired(
                    f"lease {lease} expired before its commit; its chunks were dropped and "
                    "its pages stay unused until its session ends or a fence passes"
                )
            raise UnknownLease(f"lease {lease} is unknown, already ended or expired")
        self.write_leases -= record.writing
        return record

    def put_back(self, lease: int, record: Lease) -> None:
        self.active[lease] = record
        self.write_leases += record.writing

    def trim(self, lease: int, count: int) -> None:
        """Keep the first ``count`` chunks of an open write lease reserved; free the rest."""
        record = self.active.get(lease)
        if record is None or not record.writing:
            raise UnknownLease(f"lease {lease} is not an open reservation")
        for slot in record.slots[count:]:
            self._chunks.free(slot)
        del record.slots[count:]

    def release(self, lease: int) -> None:
        """End a lease: free its reservation, or drop its read locks, or its quarantine."""
        if lease in self.quarantine.leases:
            self._end_quarantine(lease)
            return
        self._end(self.take(lease))

    def expire(self) -> int:
        """End every lease past its expiry (quarantine a write lease's pages); how many expired.

        Also frees the quarantined pages whose fence has passed.
        """
        now = self._clock()
        expired = 0
        heap = self.expiry_heap
        while heap and heap[0][0] <= now:
            _, lease = heapq.heappop(heap)
            record = self.active.pop(lease, None)
            if record is not None:
                self.write_leases -= record.writing
                if record.writing:
                    self._quarantine(lease, record, now)
                else:
                    self._end(record)
                expired += 1
        self.expiries += expired
        # Every fence is as long, so the oldest quarantine ends first.
        while self.quarantine.leases:
            lease, record = next(iter(self.quarantine.leases.items()))
            if record.expires > now:
                break
            self._end_quarantine(lease)
        return expired

    def pin(self, tenant: str, key: bytes) -> LookupResult:
        """Read-lock one ready chunk of the tenant's with a lease that never expires."""
        chunks, slots = self._chunks, self._chunks.slots
        slot = chunks.index.get(key, NIL)
        account = chunks.tenants.by_name.get(tenant)
        if (
            slot == NIL
            or account is None
            or slots.state[slot] != State.READY
            or slots.tenant[slot] != account.index
        ):
            return LookupResult(None, [], [])
        slots.readers[slot] += 1
        lease = self.open(writing=False, slots=[slot], expires=math.inf)
        return LookupResult(lease, [slots.offsets[slot]], [slots.nbytes[slot]])

    def chunks_of(self, lease: int) -> tuple[str, list[bytes]]:
        """Tenant and keys of an open write lease's chunks, in order; nothing for others."""
        record = self.active.get(lease)
        if record is None or not record.writing or not record.slots:
            return "", []
        slots = self._chunks.slots
        tenant = self._chunks.tenants.places[slots.tenant[record.slots[0]]].name
        return tenant, [slots.key(slot) for slot in record.slots]

    def quarantine_restored(self, slots: list[int]) -> None:
        """Quarantine chunks reserved before a restart under a new lease: their writers may
        still copy."""
        record = Lease(writing=True, slots=slots, expires=0.0)
        self._quarantine(next(self._ids), record, self._clock())

    def _quarantine(self, lease: int, record: Lease, now: float) -> None:
        """Hold an expired write lease's pages: unreachable and unusable, still allocated."""
        self._chunks.quarantine(record.slots)
        record.expires = now + self.quarantine.fence_seconds
        self.quarantine.leases[lease] = record
        self.quarantine.total += 1

    def _end_quarantine(self, lease: int) -> None:
        for slot in self.quarantine.leases.pop(lease).slots:
            self._chunks.free(slot)

    def _end(self, record: Lease) -> None:
        chunks = self._chunks
        if record.writing:
            for slot in record.slots:
                chunks.free(slot)
            return
        readers, state = chunks.slots.readers, chunks.slots.state
        for slot in record.slots:
            readers[slot] -= 1
            if state[slot] == DOOMED and readers[slot] == 0:
                chunks.free(slot)
