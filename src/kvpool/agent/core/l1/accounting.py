"""The tenants' accounts seen from outside: their quotas, and their usage and counters.

A quota that shrinks below what its tenant holds evicts at once (unpinned chunks
first, then pinned ones: see :meth:`~kvpool.agent.core.l1.eviction.Evictor.enforce_quota`);
reading an account never creates one.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.agent.core.cache_types import TenantRecord, TenantStats
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.tenants import TenantTable
from kvpool.common.quotas import Quota, TierLimits


class Accounting:
    """Quotas and usage: see :class:`~kvpool.agent.core.l1.L1Cache`'s methods."""

    def __init__(self, tenants: TenantTable, evictor: Evictor) -> None:
        self._tenants = tenants
        self._quotas = tenants.quotas
        self._evictor = evictor

    def set_quota(self, tenant: str, limit: Quota) -> None:
        self._quotas.set(tenant, limit)
        self._quota_changed(tenant)

    def delete_quota(self, tenant: str) -> None:
        self._quotas.delete(tenant)
        self._quota_changed(tenant)

    def replace_ceilings(self, ceilings: Mapping[str, TierLimits]) -> frozenset[str]:
        changed = self._quotas.replace_ceilings(ceilings)
        for tenant in changed:
            self._quota_changed(tenant)
        return changed

    def _quota_changed(self, tenant: str) -> None:
        account = self._tenants.account(tenant)
        self._evictor.enforce_quota(account)
        self._tenants.rest(account)

    def stats(self, account: TenantRecord) -> TenantStats:
        return self._tenants.stats(account)

    def usage(self, tenant: str) -> TenantStats:
        return self._tenants.usage(tenant)

    def records(self) -> list[TenantRecord]:
        return list(self._tenants.by_name.values())
