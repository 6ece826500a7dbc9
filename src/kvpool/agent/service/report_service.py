"""The service's reports: usage and counters for the status routes and the metrics.

They take the lock for O(1) figures and a copy of the tenant record list only; reading,
ranking and formatting thousands of tenants happens outside it, so an unauthenticated
``/metrics`` poller cannot stall the data path.
"""

from __future__ import annotations

import heapq
from operator import attrgetter

from kvpool.agent.core.cache_types import L1Stats, TenantStats
from kvpool.agent.service.results import TenantRanking
from kvpool.agent.service.state import ServiceState

_USED_BYTES = attrgetter("used_bytes")


class ReportService(ServiceState):
    """What the cache holds, per tenant and in all."""

    def usage(self, tenant: str) -> TenantStats:
        with self._lock:
            return self._cache.tenant_usage(tenant)

    def stats(self) -> L1Stats:
        with self._lock:
            return self._cache.stats()

    def tenants(self) -> list[TenantStats]:
        """Every tenant record's usage and counters."""
        with self._lock:
            records = self._cache.tenant_records()
        return [self._cache.tenant_stats(record) for record in records]

    def ranked_tenants(self, count: int) -> TenantRanking:
        """The ``count`` tenants using the most L1 bytes, and the sums of the others.

        The others' sums are the cache's totals less the largest (a moment apart at most).
        """
        with self._lock:
            totals = self._cache.stats()
            records = self._cache.tenant_records()
        largest = [
            self._cache.tenant_stats(record)
            for record in heapq.nlargest(count, records, key=_USED_BYTES)
        ]
        return TenantRanking(
            largest=largest,
            rest_used_bytes=max(0, totals.stored_bytes - sum(t.used_bytes for t in largest)),
            rest_chunks=max(0, totals.held_chunks - sum(t.chunks for t in largest)),
            rest_count=len(records) - len(largest),
        )
