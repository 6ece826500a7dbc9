"""Eviction: its triggers (watermark, allocation, quota) and carrying out a plan.

What each trigger evicts is told in :mod:`kvpool.agent.core.l1`;
:mod:`~kvpool.agent.core.l1.planner` chooses the victims.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvpool.agent.core.cache_types import EvictionCause
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.planner import EvictionPlan, plan_eviction
from kvpool.agent.core.l1.tenants import Tenant


class Evictor:
    def __init__(self, chunks: Chunks, high_pages: int, low_pages: int) -> None:
        self._chunks = chunks
        self.high_pages = high_pages
        self.low_pages = low_pages
        self.evictions: Counter[str] = Counter()
        """Chunks evicted, by :class:`EvictionCause`."""

    def make_room(self, account: Tenant, nbytes: int, protected: set[int]) -> str | None:
        """Evict the tenant's own chunks so ``nbytes`` more fit its quota; a reason if not."""
        limit = self._chunks.tenants.quotas.limit(account.name)
        if limit is None:
            return None
        if nbytes > limit:
            return f"chunk of {nbytes} bytes exceeds the tenant quota of {limit} bytes"
        excess = account.used_bytes + nbytes - limit
        if excess <= 0:
            return None
        sizes = self._chunks.slots.nbytes
        plan = plan_eviction(self._chunks, excess, sizes, account, protected, required=excess)
        if plan.freed < excess:
            return f"tenant quota of {limit} bytes is full of locked or pinned chunks"
        self.apply(plan, EvictionCause.QUOTA)
        return None

    def allocate(self, pages: int, protected: set[int]) -> int | None:
        """The first of ``pages`` free pages, evicting until they fit; None if nothing can go."""
        chunks = self._chunks
        while True:
            first_page = chunks.allocator.allocate(pages)
            if first_page is not None:
                return first_page
            plan = plan_eviction(chunks, pages, chunks.slots.pages, None, protected, required=pages)
            if not plan.victims:
                return None
            self.apply(plan, EvictionCause.PRESSURE)

    def to_watermark(self, extra_pages: int, protected: set[int]) -> None:
        """Past the high watermark with ``extra_pages`` more: evict towards the low one.

        Best effort, by tails alone: as far towards the low watermark as unlocked chains
        can shrink. Only the pages of ``extra_pages`` (a store's run) that are not free
        may take older chunks too (see :func:`plan_eviction`), once for the whole run.
        """
        allocator = self._chunks.allocator
        used = allocator.total_pages - allocator.free_pages + extra_pages
        if used <= self.high_pages:
            return
        pages = self._chunks.slots.pages
        missing = max(0, extra_pages - allocator.free_pages)
        plan = plan_eviction(
            self._chunks, used - self.low_pages, pages, None, protected, required=missing
        )
        self.apply(plan, EvictionCause.WATERMARK)

    def enforce_quota(self, account: Tenant) -> None:
        """Evict the tenant's chunks down to its quota: unpinned ones first, then pinned ones
        (a pin never lets a tenant exceed its quota)."""
        tenants = self._chunks.tenants
        limit = tenants.quotas.limit(account.name)
        for take_pinned in (False, True):
            if limit is None or account.used_bytes <= limit:
                break
            nbytes = self._chunks.slots.nbytes
            excess = account.used_bytes - limit
            plan = plan_eviction(
                self._chunks, excess, nbytes, account, set(), take_pinned=take_pinned
            )
            self.apply(plan, EvictionCause.QUOTA)
        if limit is not None and account.used_bytes > limit:
            tenants.over_quota.add(account.name)  # its chunks are locked: maintain tries again
        else:
            tenants.over_quota.discard(account.name)

    def enforce_quotas(self) -> None:
        """Enforce the quotas of the tenants that may be over theirs."""
        tenants = self._chunks.tenants
        for tenant in list(tenants.over_quota):
            account = tenants.by_name.get(tenant)
            if account is None:
                tenants.over_quota.discard(tenant)
            else:
                self.enforce_quota(account)

    def apply(self, plan: EvictionPlan, cause: EvictionCause) -> None:
        chunks = self._chunks
        slots, places = chunks.slots, chunks.tenants.places
        if chunks.listener is not None:
            announced: dict[int, list[bytes]] = {}
            for slot in plan.victims:
                announced.setdefault(slots.tenant[slot], []).append(slots.key(slot))
            chunks.announce_removed(announced, cause.value)
        for slot in plan.victims:
            places[slots.tenant[slot]].evicted_chunks += 1
            chunks.remove_from_policy(slot, evicted=True)
            chunks.free(slot)
        self.evictions[cause] += len(plan.victims)
        self._requeue(plan.waiting)

    def _requeue(self, slots: Iterable[int]) -> None:
        """Rank the prefixes an eviction passed over as the newest of their policy's lists.

        Their chains are still cached, so they are in use as much as their tails; and
        without this every later eviction would walk the same heads again to reach the
        tails (a chain stored over several steps has its head oldest).
        """
        tenant, places = self._chunks.slots.tenant, self._chunks.tenants.places
        by_tenant: dict[int, list[int]] = {}
        for slot in slots:
            by_tenant.setdefault(tenant[slot], []).append(slot)
        for place, group in by_tenant.items():
            places[place].policy.requeue(group)
