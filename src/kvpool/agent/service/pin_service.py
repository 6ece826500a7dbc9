"""The service's pins, warms and shared spaces: what a tenant keeps in L1. A tenant's named
pins (:mod:`kvpool.agent.core.l1.pin_sets`), warms (a prefix loaded from L2 and waited
for), and the tenants ConfigMap's spaces with their pin budgets (the HTTP API's pin routes,
the NVMe tier's pin check, the metrics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpool.agent.core.cache_types import PinState, TenantPins
from kvpool.agent.service.results import SpaceUsage, Warmed, WarmRefused
from kvpool.agent.service.state import ServiceState
from kvpool.common.tenants_configmap import SpaceEntry


class PinService(ServiceState):
    """Pins, warms and shared spaces, under the service's lock."""

    def put_pin(self, tenant: str, name: str, keys: Sequence[bytes]) -> PinState:
        """Make the tenant's pin ``name`` exactly ``keys`` (see :meth:`L1Cache.put_pin`)."""
        with self._lock:
            return self._cache.put_pin(tenant, name, keys)

    def delete_pin(self, tenant: str, name: str) -> bool:
        with self._lock:
            return self._cache.delete_pin(tenant, name)

    def pins(self, tenant: str) -> TenantPins:
        with self._lock:
            return self._cache.pins(tenant)

    def pinned_bytes(self) -> dict[str, tuple[int, int]]:
        """Bytes pinned and pin budget of each tenant that has pins."""
        with self._lock:
            pinned = self._cache.pinned_bytes()
            return {tenant: (n, self._cache.pin_budget(tenant)) for tenant, n in pinned.items()}

    def is_pinned(self, tenant: str, key: bytes) -> bool:
        """Whether the tenant's chunk ``key`` is pinned in L1, read without the lock (the NVMe
        tier asks on the event loop; a pin changing meanwhile may be seen a moment late)."""
        return self._cache.is_pinned(tenant, key)

    def replace_spaces(self, spaces: Mapping[str, SpaceEntry]) -> None:
        """The shared spaces of the tenants ConfigMap: their pin budgets apply, and
        :meth:`spaces` lists them."""
        with self._lock:
            self._spaces = dict(spaces)
            budgets = {space: entry.pin_budget for space, entry in spaces.items()}
            self._cache.replace_pin_budgets(budgets)

    def spaces(self) -> list[SpaceUsage]:
        """Each shared space known, with its usage and its pins' bytes."""
        with self._lock:
            known = [
                (space, entry, self._cache.tenant_usage(space), self._cache.pin_budget(space))
                for space, entry in self._spaces.items()
            ]
            pinned = self._cache.pinned_bytes()
        return [
            SpaceUsage(
                space,
                entry.source,
                len(entry.members),
                len(entry.owners),
                usage,
                self.nvme_used(space),
                pinned.get(space, 0),
                budget,
            )
            for space, entry, usage, budget in known
        ]

    def warm(self, tenant: str, keys: Sequence[bytes], timeout: float) -> Warmed:
        """Load the chunks of ``keys`` (a prefix, in order) that L1 lacks from L2, through a
        prefetch, waiting up to ``timeout`` seconds (blocks: never on the event loop).

        :class:`WarmRefused` if no prefetch slot is free for a warm (warms take a share of
        them only, see :mod:`kvpool.agent.tiering.prefetch`).
        """
        with self._lock:
            before = self._cache.lookup(tenant, keys, lock=False, count=False).count
        loaded, done = 0, True
        missing: int | None = len(keys) - before
        prefetch = self._prefetch
        if before < len(keys) and prefetch is not None:
            after = keys[before - 1] if before else None
            prefetch_id = prefetch.begin(tenant, keys[before:], after, warm=True)
            progress = prefetch.wait(prefetch_id, timeout) if prefetch_id else None
            if progress is None:
                raise WarmRefused("too many loads from L2 in flight for a warm; try again")
            loaded, done = progress.loaded, progress.done
            found = progress.expected
            missing = None if found < 0 else len(keys) - before - found
        with self._lock:
            resident = self._cache.lookup(tenant, keys, lock=False, count=False).count
            self.warm_counts.requests += 1
            self.warm_counts.loaded_chunks += loaded
        return Warmed(len(keys), resident, loaded, missing, done)
