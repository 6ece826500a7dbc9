"""Per-tenant quotas in bytes, per tier (L1, NVMe): explicit limits, a default, and ceilings.

A limit is an int number of bytes; ``0`` disables caching for the tenant and
``None`` (:data:`UNLIMITED`) means no limit. A :class:`TierLimits` holds one per
tier; a single number anywhere (a stored quota, an HTTP update without its NVMe
limit) means the same limit for both tiers, as before tiers had limits of their own.
The stores deal in :data:`Quota`: that single number when the tiers agree (the only
form an older agent reads), :class:`TierLimits` when they differ.

A ceiling (from the tenant's KVCacheTenant) bounds what the tenant itself may set,
and the default it falls back to: without an explicit quota a tenant with a ceiling
gets min(default, ceiling) in each tier. An explicit quota applies as stored (an admin
may set one above the ceiling). Durable storage of the limits is a service concern;
this book only answers "what is tenant T allowed".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

UNLIMITED = None
Limit = int | None
TIERS = ("l1", "nvme")
_FORMS = 'bytes >= 0, null (unlimited) or {"l1": bytes or null, "nvme": bytes or null}'


@dataclass(frozen=True, slots=True)
class TierLimits:
    """One limit per tier (or, as a ceiling, the most a tenant may set; None: no bound)."""

    l1: Limit
    nvme: Limit

    @classmethod
    def both(cls, limit: Limit) -> TierLimits:
        return cls(limit, limit)

    def check(self) -> TierLimits:
        for tier in TIERS:
            _check(getattr(self, tier))
        return self

    def capped(self, ceiling: TierLimits) -> TierLimits:
        """Each tier's limit, lowered to the ceiling's where the ceiling is lower."""
        return TierLimits(_min(self.l1, ceiling.l1), _min(self.nvme, ceiling.nvme))

    def above(self, ceiling: TierLimits) -> list[tuple[str, Limit, int]]:
        """(tier, limit, bound) of each tier whose limit exceeds ``ceiling`` (unlimited does)."""
        found: list[tuple[str, Limit, int]] = []
        for tier in TIERS:
            limit, bound = getattr(self, tier), getattr(ceiling, tier)
            if bound is not None and (limit is None or limit > bound):
                found.append((tier, limit, bound))
        return found

    def stored(self) -> Quota:
        """The stored form: one number (or None) when both tiers agree, else these limits."""
        return self.l1 if self.l1 == self.nvme else self


Quota = Limit | TierLimits
"""A tenant's limits as stored: one number (or None) for both tiers alike, or per tier."""


def quota_to_json(quota: Quota) -> Limit | dict[str, Limit]:
    limits = as_limits(quota).stored()
    return limits if not isinstance(limits, TierLimits) else {"l1": limits.l1, "nvme": limits.nvme}


def quota_from_json(value: object) -> Quota:
    """Parse :func:`quota_to_json`'s forms into the stored form; ValueError if neither."""
    if value is None or _is_count(value):
        return value  # type: ignore[return-value]
    if isinstance(value, Mapping) and set(value) == set(TIERS):
        limits = [value[tier] for tier in TIERS]
        if all(limit is None or _is_count(limit) for limit in limits):
            return TierLimits(*limits).stored()
    raise ValueError(f"expected {_FORMS}")


class QuotaBook:
    def __init__(
        self,
        default: Limit = UNLIMITED,
        limits: Mapping[str, Quota] | None = None,
    ) -> None:
        _check(default)
        self.default = default
        self._limits: dict[str, TierLimits] = {}
        self._ceilings: dict[str, TierLimits] = {}
        for tenant, limit in (limits or {}).items():
            self.set(tenant, limit)

    def limits(self, tenant: str) -> TierLimits:
        """The tenant's limits in force: its own, or the default under its ceiling."""
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


def as_limits(value: Quota) -> TierLimits:
    return value if isinstance(value, TierLimits) else TierLimits.both(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _min(limit: Limit, bound: Limit) -> Limit:
    if bound is None:
        return limit
    return bound if limit is None else min(limit, bound)


def _check(limit: Limit) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"a quota is a byte count >= 0 or unlimited, got {limit}")
