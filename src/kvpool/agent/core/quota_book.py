"""The quotas in force: each tenant's own limits, the default, and the ceilings.

What a tenant is allowed is its own limits if it has them, otherwise the default
lowered to its ceiling (:mod:`kvpool.common.quotas` holds the value types). What a tenant
may set itself is bounded by its ceiling, or without one by the default. ``kvpool doctor``'s
canary tenant is allowed :data:`~kvpool.common.keys.CANARY_QUOTA_BYTES` whatever is set: every
chunk token may store there, so it must be no store for anyone. Durable
storage of the limits is a service concern; this book only answers "what is tenant T
allowed".
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.common.keys import CANARY_QUOTA_BYTES, CANARY_TENANT
from kvpool.common.quotas import UNLIMITED, Limit, Quota, TierLimits, as_limits, check_limit

_CANARY_LIMITS = TierLimits.both(CANARY_QUOTA_BYTES)


class QuotaBook:
    def __init__(
        self,
        default: Limit = UNLIMITED,
        limits: Mapping[str, Quota] | None = None,
    ) -> None:
        check_limit(default)
        self.default = default
        self._limits: dict[str, TierLimits] = {}
        self._ceilings: dict[str, TierLimits] = {}
        for tenant, limit in (limits or {}).items():
            self.set(tenant, limit)

    def limits(self, tenant: str) -> TierLimits:
        """The tenant's limits in force: its own, or the default under its ceiling (the
        canary's are fixed)."""
        if tenant == CANARY_TENANT:
            return _CANARY_LIMITS
        own = self._limits.get(tenant)
        if own is not None:
            return own
        default = TierLimits.both(self.default)
        ceiling = self._ceilings.get(tenant)
        return default if ceiling is None else default.capped(ceiling)

    def limit(self, tenant: str) -> Limit:
        """The tenant's L1 limit in force."""
        return self.limits(tenant).l1

    def ceiling(self, tenant: str) -> TierLimits | None:
        return self._ceilings.get(tenant)

    def own_bound(self, tenant: str) -> TierLimits | None:
        """The most the tenant may set itself: its ceiling, or without one the default
        (None: no bound, when there is neither). Admins are bound by neither."""
        ceiling = self._ceilings.get(tenant)
        if ceiling is not None or self.default is UNLIMITED:
            return ceiling
        return TierLimits.both(self.default)

    def has_own(self, tenant: str) -> bool:
        return tenant in self._limits

    def set(self, tenant: str, limit: Quota) -> None:
        """Set the tenant's own limits (a single number: both tiers)."""
        self._limits[tenant] = as_limits(limit).check()

    def delete(self, tenant: str) -> None:
        """Back to the default limit; deleting a tenant without its own limit is a no-op."""
        self._limits.pop(tenant, None)

    def replace_ceilings(self, ceilings: Mapping[str, TierLimits]) -> frozenset[str]:
        """Make the ceilings exactly ``ceilings``; returns the tenants whose ceiling changed."""
        changed = frozenset(
            tenant
            for tenant in self._ceilings.keys() | ceilings.keys()
            if self._ceilings.get(tenant) != ceilings.get(tenant)
        )
        self._ceilings = {tenant: ceiling.check() for tenant, ceiling in ceilings.items()}
        return changed

    def explicit(self) -> dict[str, TierLimits]:
        return dict(self._limits)
