"""The agent's shared state behind one lock: the L1 cache and its durable quotas.

The ZMQ thread, the HTTP handlers and the maintenance task all reach the
cache through this object. Cache operations take microseconds, so one lock
serves them all; quota writes do their I/O outside it (under a lock of their
own, so that two writers apply in the order they stored). Reports (status,
metrics, tenant lists) take the lock for O(1) figures and a copy of the tenant
record list only; reading, ranking and formatting thousands of tenants happens
outside it, so an unauthenticated ``/metrics`` poller cannot stall the data path.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter

from kvpool_agent.cache_types import L1Stats, TenantStats
from kvpool_agent.l1 import L1Cache
from kvpool_agent.quota_store import QuotaStore
from kvpool_agent.quotas import Limit


@dataclass(frozen=True)
class QuotaView:
    tenant: str
    limit: Limit
    explicit: bool
    """False when the tenant has no quota of its own and the default applies."""


@dataclass(frozen=True)
class TenantRanking:
    """The tenants that use the most L1, and the rest summed (for bounded metric labels)."""

    largest: list[TenantStats]
    """Largest first."""
    rest_used_bytes: int
    rest_chunks: int
    rest_count: int


_USED_BYTES = attrgetter("used_bytes")


class CacheService:
    def __init__(self, cache: L1Cache, quota_store: QuotaStore) -> None:
        self.cache = cache
        self.lock = threading.Lock()
        self._quota_store = quota_store
        self._quota_writes = threading.Lock()
        self.quota_listeners: list[Callable[[str], None]] = []
        """Told (outside the locks) which tenant's quota changed, e.g. to shrink L2 tiers."""

    def load_quotas(self) -> int:
        """Apply the stored quotas (at start); returns how many tenants have one."""
        limits = self._quota_store.load()
        with self.lock:
            for tenant, limit in limits.items():
                self.cache.set_quota(tenant, limit)
        return len(limits)

    def replace_quotas(self, limits: Mapping[str, Limit]) -> None:
        """Make the explicit quotas exactly ``limits`` (the store reports a change).

        Under the write lock, so a change reported while this agent stores one of its
        own applies after it, in the order the store saw them.
        """
        changed: list[str] = []
        with self._quota_writes, self.lock:
            book = self.cache.quotas
            for tenant in book.explicit().keys() - limits.keys():
                self.cache.delete_quota(tenant)
                changed.append(tenant)
            for tenant, limit in limits.items():
                if not book.has_own(tenant) or book.limit(tenant) != limit:
                    self.cache.set_quota(tenant, limit)
                    changed.append(tenant)
        self._quota_changed(*changed)

    def quota(self, tenant: str) -> QuotaView:
        with self.lock:
            book = self.cache.quotas
            return QuotaView(tenant, book.limit(tenant), book.has_own(tenant))

    def set_quota(self, tenant: str, limit: Limit) -> QuotaView:
        """Store the limit durably, then apply it (shrinking evicts at once)."""
        with self._quota_writes:
            self._quota_store.save(tenant, limit)
            with self.lock:
                self.cache.set_quota(tenant, limit)
        self._quota_changed(tenant)
        return self.quota(tenant)

    def delete_quota(self, tenant: str) -> QuotaView:
        with self._quota_writes:
            self._quota_store.delete(tenant)
            with self.lock:
                self.cache.delete_quota(tenant)
        self._quota_changed(tenant)
        return self.quota(tenant)

    def _quota_changed(self, *tenants: str) -> None:
        for tenant in tenants:
            for listener in self.quota_listeners:
                listener(tenant)

    def usage(self, tenant: str) -> TenantStats:
        with self.lock:
            return self.cache.tenant_usage(tenant)

    def stats(self) -> L1Stats:
        with self.lock:
            return self.cache.stats()

    def tenants(self) -> list[TenantStats]:
        """Every tenant record's usage and counters."""
        with self.lock:
            records = self.cache.tenant_records()
        return [self.cache.tenant_stats(record) for record in records]

    def ranked_tenants(self, count: int) -> TenantRanking:
        """The ``count`` tenants using the most L1 bytes, and the sums of the others.

        The others' sums are the cache's totals less the largest (a moment apart at most).
        """
        with self.lock:
            totals = self.cache.stats()
            records = self.cache.tenant_records()
        largest = [
            self.cache.tenant_stats(record)
            for record in heapq.nlargest(count, records, key=_USED_BYTES)
        ]
        return TenantRanking(
            largest=largest,
            rest_used_bytes=max(0, totals.stored_bytes - sum(t.used_bytes for t in largest)),
            rest_chunks=max(0, totals.held_chunks - sum(t.chunks for t in largest)),
            rest_count=len(records) - len(largest),
        )

    def clear(self, tenant: str | None = None) -> int:
        with self.lock:
            return self.cache.clear(tenant)

    def maintain(self) -> None:
        with self.lock:
            self.cache.maintain()
