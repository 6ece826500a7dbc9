"""Per-tenant quotas in bytes, per tier (L1, NVMe): explicit limits, a default, and ceilings.

A limit is an int number of bytes; ``0`` disables caching for the tenant and
``None`` (:data:`UNLIMITED`) means no limit. A :class:`TierLimits` holds one per
tier; a single number anywhere (a stored quota, an HTTP update without its NVMe
limit) means the same limit for both tiers, as before tiers had limits of their own.
The stores deal in :data:`Quota`: that single number when the tiers agree (the only
form an older agent reads), :class:`TierLimits` when they differ.

A ceiling (from the tenant's KVCacheTenant) bounds what the tenant itself may set
(without a ceiling the default bounds it), and the default it falls back to: without an
explicit quota a tenant with a ceiling gets min(default, ceiling) in each tier. An
explicit quota applies as stored (an admin may set one above the ceiling). Durable
storage of the limits is a service concern;
:class:`~kvpool.agent.core.quota_book.QuotaBook` answers "what is tenant T allowed".

This module is the value types and their two stored forms, shared by the agent and the
operator: JSON (:func:`quota_to_json`, the quota file and HTTP) and a quota ConfigMap
value (:func:`quota_to_configmap`: bytes as a decimal string, ``unlimited``, or JSON
limits per tier).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

UNLIMITED = None
UNLIMITED_VALUE = "unlimited"
"""A quota ConfigMap's spelling of no limit (both tiers)."""
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
            check_limit(getattr(self, tier))
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


def quota_to_configmap(quota: Quota) -> str:
    """A quota ConfigMap value: bytes, ``unlimited``, or JSON limits when the tiers differ."""
    stored = quota_to_json(quota)
    if isinstance(stored, dict):
        return json.dumps(stored, sort_keys=True)
    return UNLIMITED_VALUE if stored is None else str(stored)


def quota_from_configmap(value: str) -> Quota:
    """Parse a quota ConfigMap value (:func:`quota_to_configmap`'s forms); ValueError if not."""
    if value == UNLIMITED_VALUE:
        return None
    if value.isascii() and value.isdigit():
        return int(value)
    try:
        parsed = json.loads(value) if value.startswith("{") else None
    except ValueError:
        parsed = None
    if parsed is None:  # JSON that starts with "{" is an object, or not JSON at all
        raise ValueError(
            f'neither a byte count, {UNLIMITED_VALUE!r} nor {{"l1": ..., "nvme": ...}}'
        )
    return quota_from_json(parsed)


def as_limits(value: Quota) -> TierLimits:
    return value if isinstance(value, TierLimits) else TierLimits.both(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _min(limit: Limit, bound: Limit) -> Limit:
    if bound is None:
        return limit
    return bound if limit is None else min(limit, bound)


def check_limit(limit: Limit) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"a quota is a byte count >= 0 or unlimited, got {limit}")
