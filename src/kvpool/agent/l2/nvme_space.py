"""The NVMe tier's space: the size and tenant of every file, and which files make room.

The index lives on the event loop, least recently used first, for the whole tier and
per tenant. Eviction takes least recently used files that no operation is using and
whose chunks are not pinned in L1 (``pinned``: each tenant's pins hold at most its pin
budget): anyone's for the capacity, only the tenant's own for its quota.

One other thread reads it: the ZMQ server's, for a prefix index's snapshot
(:meth:`NvmeSpace.keys_by_tenant`). So the loop changes the index under a lock that the
snapshot holds while it copies the names (uncontended otherwise: a few tens of ns a change).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.agent.l2.base import AdapterStats, ObjectKey
from kvpool.agent.l2.keylocks import KeyLocks


@dataclass
class _Tenant:
    lru: OrderedDict[ObjectKey, int] = field(default_factory=OrderedDict)
    used_bytes: int = 0


class NvmeSpace:
    """Which files the tier holds, LRU first, against its capacity and the tenants' quotas.

    The total is ``stats.used_bytes`` (the adapter's counters, which the metrics export).
    A victim is claimed in ``locks`` and unindexed in the same step, with nothing awaited
    in between: no operation on its key slips in before the caller unlinks its file and
    releases the key.
    """

    def __init__(
        self,
        capacity: int,
        limit_of: Callable[[str], int | None],
        pinned: Callable[[ObjectKey], bool],
        locks: KeyLocks,
        stats: AdapterStats,
    ) -> None:
        self._capacity = capacity
        self._limit_of = limit_of
        self._pinned = pinned
        self._locks = locks
        self._stats = stats
        self._lru: OrderedDict[ObjectKey, int] = OrderedDict()  # file sizes, LRU first
        self._tenants: dict[str, _Tenant] = {}
        self._changes = threading.Lock()
        """Held by the loop while it changes the index, and by a snapshot while it reads."""

    def __contains__(self, name: ObjectKey) -> bool:
        return name in self._lru

    def tenant_used(self, tenant: str) -> int:
        """Bytes of the tenant's files."""
        account = self._tenants.get(tenant)
        return account.used_bytes if account else 0

    def names_of(self, tenant: str) -> list[ObjectKey]:
        """The tenant's files, least recently used first."""
        account = self._tenants.get(tenant)
        return list(account.lru) if account else []

    def keys_by_tenant(self) -> dict[str, list[bytes]]:
        """Every indexed chunk's key by tenant (any thread), puts in flight included.

        The lock is held for a copy of the names only, in the order of the index's hash
        table rather than the LRU's linked list (a million names in some 15 ms, where
        following the list takes some 400), and they are grouped after.
        """
        with self._changes:
            names = list(dict.keys(self._lru))
        found: defaultdict[str, list[bytes]] = defaultdict(list)
        for name in names:
            found[name.tenant].append(name.key)
        return dict(found)

    def add(self, name: ObjectKey, size: int) -> None:
        """Index a file as the most recently used."""
        with self._changes:
            self._lru[name] = size
            account = self._tenants.setdefault(name.tenant, _Tenant())
            account.lru[name] = size
            account.used_bytes += size
        self._stats.used_bytes += size

    def remove(self, name: ObjectKey) -> None:
        with self._changes:
            size = self._lru.pop(name)
            account = self._tenants[name.tenant]
            del account.lru[name]
            account.used_bytes -= size
            if not account.lru:
                del self._tenants[name.tenant]
        self._stats.used_bytes -= size

    def touch(self, name: ObjectKey) -> None:
        """Make an indexed file the most recently used."""
        with self._changes:
            self._lru.move_to_end(name)
            self._tenants[name.tenant].lru.move_to_end(name)

    def make_room(self, tenant: str, size: int) -> list[ObjectKey] | None:
        """Make room for ``size`` more bytes of ``tenant``: the victims, claimed and unindexed.

        The tenant's quota takes its own LRU files, the capacity anyone's. Atomic:
        None, and nothing changed, if the idle files cannot free enough.
        """
        limit = self._limit_of(tenant)
        if size > self._capacity or (limit is not None and size > limit):
            return None
        victims: dict[ObjectKey, int] = {}
        account = self._tenants.get(tenant)
        if (
            limit is not None
            and account is not None
            and not self._pick(account.lru, account.used_bytes + size - limit, victims)
        ):
            return None
        over = self._stats.used_bytes - sum(victims.values()) + size - self._capacity
        if not self._pick(self._lru, over, victims):
            return None
        return self._take(victims)

    def take_over_quota(self, tenant: str) -> list[ObjectKey]:
        """The tenant's own LRU files past its (shrunken) quota, claimed and unindexed.

        Files in use or pinned are skipped: fewer victims than the excess needs, then.
        """
        limit, account = self._limit_of(tenant), self._tenants.get(tenant)
        if limit is None or account is None or account.used_bytes <= limit:
            return []
        victims: dict[ObjectKey, int] = {}
        self._pick(account.lru, account.used_bytes - limit, victims)
        return self._take(victims)

    def _pick(
        self, order: OrderedDict[ObjectKey, int], excess: int, victims: dict[ObjectKey, int]
    ) -> bool:
        """Add idle unpinned files of ``order``, LRU first, to ``victims`` until they free
        ``excess``."""
        for name, size in order.items():
            if excess <= 0:
                break
            if name not in victims and not self._locks.busy(name) and not self._pinned(name):
                victims[name] = size
                excess -= size
        return excess <= 0

    def _take(self, victims: dict[ObjectKey, int]) -> list[ObjectKey]:
        for victim in victims:
            self._locks.try_claim(victim)  # free: _pick skipped busy keys, and nothing awaited
            self.remove(victim)
        return list(victims)
