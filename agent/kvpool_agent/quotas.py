"""Per-tenant quotas in bytes: explicit limits plus a default for everyone else.

A limit is an int number of bytes; ``0`` disables caching for the tenant and
``None`` (:data:`UNLIMITED`) means no limit. Durable storage of the limits is a
service concern; this book only answers "what is tenant T allowed".
"""

from __future__ import annotations

from collections.abc import Mapping

UNLIMITED = None
Limit = int | None


class QuotaBook:
    def __init__(
        self, default: Limit = UNLIMITED, limits: Mapping[str, Limit] | None = None
    ) -> None:
        _check(default)
        self.default = default
        self._limits: dict[str, Limit] = {}
        for tenant, limit in (limits or {}).items():
            self.set(tenant, limit)

    def limit(self, tenant: str) -> Limit:
        return self._limits.get(tenant, self.default)

    def has_own(self, tenant: str) -> bool:
        return tenant in self._limits

    def set(self, tenant: str, limit: Limit) -> None:
        _check(limit)
        self._limits[tenant] = limit

    def delete(self, tenant: str) -> None:
        """Back to the default limit; deleting a tenant without its own limit is a no-op."""
        self._limits.pop(tenant, None)

    def explicit(self) -> dict[str, Limit]:
        return dict(self._limits)


def _check(limit: Limit) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"a quota is a byte count >= 0 or unlimited, got {limit}")
