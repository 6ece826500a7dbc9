"""Tenant records: each tenant's usage, counters and eviction policy; idle ones trimmed.

Why a record comes and goes, and how many idle ones stay, is told in
:mod:`kvpool.agent.core.l1`. Slots name their tenant by the record's place in a list (an
int in a flat array); a dropped record's place is vacant until a new record takes it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvpool.agent.core.cache_types import TenantRecord, TenantStats
from kvpool.agent.core.l1.slots import NIL
from kvpool.agent.core.policies import EvictionPolicy, PolicyFactory, SlotArena
from kvpool.agent.core.quota_book import QuotaBook

IDLE_TENANTS = 4096
"""Records of tenants that hold nothing kept for their counters (about 0.6 KiB each)."""


@dataclass
class Tenant:
    name: str
    index: int
    """The record's place in :attr:`TenantTable.places`."""
    policy: EvictionPolicy
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    stored_chunks: int = 0
    evicted_chunks: int = 0


@dataclass
class IdleTenants:
    """Records that held nothing when last used, and the places dropped ones left."""

    bound: int
    vacant: Tenant
    """Fills a dropped record's place in the record list until a new record takes it."""
    records: OrderedDict[str, Tenant] = field(default_factory=OrderedDict)
    """Least recently used first."""
    vacancies: list[int] = field(default_factory=list)


class TenantTable:
    def __init__(
        self, policy: PolicyFactory, quotas: QuotaBook, arena: SlotArena, idle_tenants: int
    ) -> None:
        self.quotas = quotas
        self._policy_factory = policy
        self._arena = arena
        self.by_name: dict[str, Tenant] = {}
        self.places: list[Tenant] = []
        """Every record at its place (``Tenant.index``), or the vacant one."""
        self.idle = IdleTenants(idle_tenants, Tenant("", NIL, policy(arena)))
        self.over_quota: set[str] = set()
        """Tenants that may be over their quota: only these need the periodic check."""

    def account(self, tenant: str) -> Tenant:
        """The tenant's record, made if it has none."""
        account = self.by_name.get(tenant)
        if account is None:
            self.trim_idle()  # before the new record exists: it is in use, never dropped
            policy = self._policy_factory(self._arena)
            if self.idle.vacancies:
                account = Tenant(tenant, self.idle.vacancies.pop(), policy)
                self.places[account.index] = account
            else:
                account = Tenant(tenant, len(self.places), policy)
                self.places.append(account)
            self.by_name[tenant] = account
        return account

    def holds_nothing(self, account: Tenant) -> bool:
        return not account.chunks and not self.quotas.has_own(account.name)

    def rest(self, account: Tenant) -> None:
        """After using a record: one that holds nothing becomes the most recent idle one."""
        idle = self.idle.records
        if self.holds_nothing(account):
            idle[account.name] = account
            idle.move_to_end(account.name)
        else:
            idle.pop(account.name, None)

    def trim_idle(self) -> None:
        """Drop the least recently used idle records past the bound (none may be in use)."""
        idle = self.idle
        while len(idle.records) > idle.bound:
            _, account = idle.records.popitem(last=False)
            if self.holds_nothing(account):  # else it was given chunks since it rested
                del self.by_name[account.name]
                self.places[account.index] = idle.vacant
                idle.vacancies.append(account.index)

    def stats(self, account: TenantRecord) -> TenantStats:
        """One record's usage, quota and counters."""
        return TenantStats(
            tenant=account.name,
            used_bytes=account.used_bytes,
            chunks=account.chunks,
            quota_bytes=self.quotas.limit(account.name),
            hits=account.hits,
            misses=account.misses,
            stored_chunks=account.stored_chunks,
            evicted_chunks=account.evicted_chunks,
        )

    def usage(self, tenant: str) -> TenantStats:
        """Usage of one tenant; asking about an unknown tenant does not create it."""
        account = self.by_name.get(tenant)
        if account is None:
            return TenantStats(tenant, 0, 0, self.quotas.limit(tenant), 0, 0, 0, 0)
        return self.stats(account)
