"""Maintenance: the periodic check, and the evictions and clearing that callers ask for.

The periodic check (:meth:`Maintenance.maintain`) expires leases, brings the cache back
under its high watermark, evicts from tenants still over a quota that shrank, trims idle
tenant records and gives back the memory clients wrote outside their chunks (strays).
"""

from __future__ import annotations

from kvpool.agent.core.cache_types import EvictionCause
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.planner import plan_eviction


class Maintenance:
    """Expiry, watermark, quotas, strays, trim: see :class:`~kvpool.agent.core.l1.L1Cache`."""

    def __init__(self, chunks: Chunks, leases: LeaseTable, evictor: Evictor) -> None:
        self._chunks = chunks
        self._tenants = chunks.tenants
        self._leases = leases
        self._evictor = evictor

    def maintain(self) -> None:
        self._leases.expire()
        self._evictor.to_watermark(extra_pages=0, protected=set())
        self._evictor.enforce_quotas()
        self._tenants.trim_idle()
        backing = self._chunks.backing
        if backing is not None:
            for owner in backing.strays():
                backing.trim(owner)

    def evict(self, pages: int, tenant: str | None) -> bool:
        scope = None if tenant is None else self._tenants.account(tenant)
        plan = plan_eviction(self._chunks, pages, self._chunks.slots.pages, scope, protected=set())
        if plan.freed >= pages:
            self._evictor.apply(plan, EvictionCause.PRESSURE)
        if scope is not None:
            self._tenants.rest(scope)
        return plan.freed >= pages

    def clear(self, tenant: str | None, unpin: bool) -> int:
        if unpin:
            self._chunks.pins.drop(tenant)
        scope = None if tenant is None else self._tenants.by_name.get(tenant)
        if tenant is not None and scope is None:
            return 0
        dropped = self._chunks.clear(scope)
        self._tenants.trim_idle()
        return dropped
