"""The service's quotas: what a tenant may hold in each tier (the HTTP API's quota routes;
the quota store's and the tenants ConfigMap's changes).

Quota writes do their I/O outside the cache's lock, under a lock of their own, so that two
writers apply in the order they stored; listeners hear of each changed tenant outside both.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.agent.service.results import AboveCeiling, QuotaView
from kvpool.agent.service.state import ServiceState
from kvpool.common.quotas import Limit, Quota, TierLimits, as_limits


class QuotaService(ServiceState):
    """Quotas and ceilings: stored durably, applied to the cache."""

    def quota_limit(self, tenant: str) -> Limit:
        """The tenant's L1 limit, read without the lock (one dict lookup)."""
        return self._cache.quotas.limit(tenant)

    def nvme_quota_limit(self, tenant: str) -> Limit:
        """The tenant's NVMe limit, read without the lock (the NVMe tier asks per put)."""
        return self._cache.quotas.limits(tenant).nvme

    def load_quotas(self) -> int:
        """Apply the stored quotas (at start); returns how many tenants have one."""
        return self.set_quotas(self._quota_store.load())

    def set_quotas(self, limits: Mapping[str, Quota]) -> int:
        """Apply ``limits``, the stored quotas read at start; returns how many there are."""
        with self._lock:
            for tenant, limit in limits.items():
                self._cache.set_quota(tenant, limit)
        return len(limits)

    def replace_quotas(self, limits: Mapping[str, Quota]) -> None:
        """Make the explicit quotas exactly ``limits`` (the store reports a change).

        Under the write lock, so a change reported while this agent stores one of its
        own applies after it, in the order the store saw them.
        """
        changed: list[str] = []
        with self._quota_writes, self._lock:
            book = self._cache.quotas
            for tenant in book.explicit().keys() - limits.keys():
                self._cache.delete_quota(tenant)
                changed.append(tenant)
            for tenant, limit in limits.items():
                if not book.has_own(tenant) or book.limits(tenant) != as_limits(limit):
                    self._cache.set_quota(tenant, limit)
                    changed.append(tenant)
        self._quota_changed(*changed)

    def replace_ceilings(self, ceilings: Mapping[str, TierLimits]) -> None:
        """Make the tenants' ceilings exactly ``ceilings`` (the tenants ConfigMap changed)."""
        with self._lock:
            changed = self._cache.replace_ceilings(ceilings)
        self._quota_changed(*sorted(changed))

    def quota(self, tenant: str) -> QuotaView:
        with self._lock:
            book = self._cache.quotas
            return QuotaView(tenant, book.limits(tenant), book.has_own(tenant))

    def set_quota(self, tenant: str, limits: Quota, *, within_ceiling: bool = False) -> QuotaView:
        """Store the limits durably, then apply them (shrinking evicts at once).

        ``within_ceiling`` (a tenant sets its own): :class:`AboveCeiling` if a tier's
        limit exceeds the tenant's ceiling there, or without a ceiling the default quota
        (unlimited exceeds any bound).
        """
        wanted = as_limits(limits).check()
        with self._quota_writes:
            if within_ceiling:
                self._check_ceiling(tenant, wanted)
            self._quota_store.save(tenant, wanted.stored())
            with self._lock:
                self._cache.set_quota(tenant, wanted)
        self._quota_changed(tenant)
        return self.quota(tenant)

    def _check_ceiling(self, tenant: str, wanted: TierLimits) -> None:
        with self._lock:
            book = self._cache.quotas
            bound, ceiling = book.own_bound(tenant), book.ceiling(tenant)
        above = [] if bound is None else wanted.above(bound)
        if not above:
            return
        tier, limit, most = above[0]
        asked = "unlimited" if limit is None else f"{limit} bytes"
        if ceiling is not None:
            raise AboveCeiling(
                f"the {tier} quota asked ({asked}) is above this tenant's {tier} ceiling of "
                f"{most} bytes, which its KVCacheTenant's spec.quota sets; set at most the "
                "ceiling, or have the KVCacheTenant's quota raised"
            )
        raise AboveCeiling(
            f"the {tier} quota asked ({asked}) is above the default tenant quota of {most} "
            "bytes (default_tenant_quota), the most a tenant without a KVCacheTenant ceiling "
            "may set itself; set at most the default, or ask an admin"
        )

    def delete_quota(self, tenant: str) -> QuotaView:
        with self._quota_writes:
            self._quota_store.delete(tenant)
            with self._lock:
                self._cache.delete_quota(tenant)
        self._quota_changed(tenant)
        return self.quota(tenant)

    def _quota_changed(self, *tenants: str) -> None:
        for tenant in tenants:
            for listener in self.quota_listeners:
                listener(tenant)
