"""The scheduler's scope: for which tenants this engine's token may look up and store.

An engine's token acts for every tenant, a tenant's for its own (the link learns which at
hello). For any other tenant (a shared space, or another tenant's salt) only the agent
knows: its answer is remembered for :data:`ACCESS_REUSE_S`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpool.connector.link import AgentLink

log = logging.getLogger(__name__)

ACCESS_REUSE_S = 30.0
"""How long the agent's answer stands on whether this engine's token may act for a tenant
other than its own (a shared space): until then a refused tenant's chunks are neither
looked up nor stored, and an allowed one's are probed in the table of ready chunks (which
answers for any tenant, so it is read only for tenants the agent allowed)."""


class TenantAccess:
    """What the agent said lately about this engine's token and each tenant."""

    def __init__(self, link: AgentLink, clock: Callable[[], float]) -> None:
        self._link = link
        self._clock = clock
        self._access: dict[str, tuple[bool, float]] = {}
        """Tenant -> (whether the agent let this engine act for it, until when that stands)."""

    def token_acts_for(self, tenant: str) -> bool:
        """An engine's token acts for any tenant, a tenant's for its own (no need to ask)."""
        bound = self._link.bound_tenant
        return not bound or tenant == bound

    def allowed(self, tenant: str) -> bool | None:
        """Whether this engine's token may act for ``tenant`` (None: not known now)."""
        if self.token_acts_for(tenant):
            return True
        allowed, until = self._access.get(tenant, (None, 0.0))
        return allowed if self._clock() < until else None

    def until(self) -> float:
        """Until when an answer asked now stands."""
        return self._clock() + ACCESS_REUSE_S

    def refused(self, tenant: str, until: float, error: Exception) -> None:
        """The agent refused this engine's token ``tenant``: say so, and remember it."""
        if len(self._access) > 4096:
            self._access.clear()
        self._access[tenant] = (False, until)
        log.warning(
            "kvpool: the agent refused this engine's token tenant %s (%s); "
            "its chunks are neither loaded nor stored for %d s",
            tenant,
            error,
            ACCESS_REUSE_S,
        )

    def answered(self, tenant: str, until: float) -> None:
        """The agent answered for ``tenant``: remember it, unless the token is its own."""
        if not self.token_acts_for(tenant):
            self._access[tenant] = (True, until)
