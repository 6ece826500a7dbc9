"""The L1 cache's public face: it builds the parts and hands each call to the one that
answers it.

The rules the cache keeps are in the package's docstring (:mod:`kvpool.agent.core.l1`);
each part keeps some of them:

* :class:`~kvpool.agent.core.l1.cycle.ChunkCycle`: reserve, commit and look up (the hot
  path);
* :class:`~kvpool.agent.core.l1.leases.LeaseTable`: releasing, expiring and quarantining
  leases, and the write-back's pins;
* :class:`~kvpool.agent.core.l1.accounting.Accounting`: the tenants' quotas and usage;
* :class:`~kvpool.agent.core.l1.pin_sets.PinSets`: the tenants' pins;
* :class:`~kvpool.agent.core.l1.maintenance.Maintenance`: the periodic check, evicting
  and clearing on request;
* :func:`~kvpool.agent.core.l1.restore.restore`: the warm restore;
* :class:`~kvpool.agent.core.l1.reports.Reports`: statistics, listings, debug views.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from kvpool.agent.core.cache_types import (
    ChunkBacking,
    ChunkListener,
    L1Stats,
    PinState,
    Reservation,
    RestoreReport,
    TenantPins,
    TenantRecord,
    TenantStats,
)
from kvpool.agent.core.journal import ChunkRecord, SegmentJournal
from kvpool.agent.core.l1.accounting import Accounting
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.cycle import ChunkCycle, Traffic, check_keys
from kvpool.agent.core.l1.debug import L1DebugView
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.maintenance import Maintenance
from kvpool.agent.core.l1.reports import Reports
from kvpool.agent.core.l1.restore import restore
from kvpool.agent.core.l1.tenants import IDLE_TENANTS
from kvpool.agent.core.policies import PolicyFactory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common.probe_table import ProbeTableWriter
from kvpool.common.quotas import Quota, TierLimits
from kvpool.common.segment import SegmentLayout
from kvpool.common.transfer_results import LookupResult


class L1Cache:
    def __init__(
        self,
        layout: SegmentLayout,
        policy: PolicyFactory,
        quotas: QuotaBook,
        *,
        high_watermark: float = 0.90,
        low_watermark: float = 0.80,
        lease_seconds: float = 30.0,
        fence_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        journal: SegmentJournal | None = None,
        listener: ChunkListener | None = None,
        idle_tenants: int = IDLE_TENANTS,
        probe_table: ProbeTableWriter | None = None,
        pin_budget: int = 0,
        backing: ChunkBacking | None = None,
    ) -> None:
        """``journal``, if given, records committed chunks in the segment for warm restarts.

        ``fence_seconds`` (default 10 x ``lease_seconds``): the longest an expired write
        lease's pages stay quarantined when nobody releases them.
        ``idle_tenants``: how many records of tenants that hold nothing keep their counters.
        ``probe_table``, if given, is kept to the ready chunks for the connectors' schedulers.
        ``pin_budget``: the pin budget of a tenant without one of its own (0: it may not pin).
        ``backing``, if given, holds the chunks' bytes: each account's own memory.
        """
        if not 0 < low_watermark < high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        self.layout = layout
        self.quotas = quotas
        pages = layout.pages
        chunks = Chunks(
            layout,
            policy,
            quotas,
            idle_tenants=idle_tenants,
            pin_budget=pin_budget,
            journal=journal,
            probe_table=probe_table,
            listener=listener,
            backing=backing,
        )
        fence = 10 * lease_seconds if fence_seconds is None else fence_seconds
        leases = LeaseTable(chunks, clock, lease_seconds, fence)
        evictor = Evictor(chunks, int(pages * high_watermark), int(pages * low_watermark))
        traffic = Traffic()
        self._chunks = chunks
        self._leases = leases
        self._pins = chunks.pins
        self._cycle = ChunkCycle(chunks, leases, evictor, traffic)
        self._accounting = Accounting(chunks.tenants, evictor)
        self._maintenance = Maintenance(chunks, leases, evictor)
        self._reports = Reports(chunks, leases, evictor, traffic)

    @property
    def listener(self) -> ChunkListener | None:
        """Told when ready chunks appear in or leave L1."""
        return self._chunks.listener

    @listener.setter
    def listener(self, listener: ChunkListener | None) -> None:
        self._chunks.listener = listener

    @property
    def lower_tier(self) -> bool:
        """L2 tiers are configured: a prefix that L1 lacks can come back by prefetch."""
        return self._chunks.lower_tier

    @lower_tier.setter
    def lower_tier(self, lower_tier: bool) -> None:
        self._chunks.lower_tier = lower_tier

    @property
    def lease_seconds(self) -> float:
        return self._leases.lease_seconds

    # ------------------------------------------------------------ store, retrieve

    def reserve(
        self,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
        keep: Sequence[bytes] = (),
    ) -> Reservation:
        """Write-lock space for ``keys`` (a run of one chain; ``parent`` precedes the first).

        Chunks named in ``keep`` are not evicted to make room (a prefetch keeps the
        prefix it already loaded rather than evicting its own head for its tail).
        """
        return self._cycle.reserve(tenant, keys, sizes, parent, keep)

    def commit(self, lease: int, count: int | None = None) -> int:
        """Make the first ``count`` (default all) reserved chunks ready; discard the rest.

        Returns how many chunks became ready. Chunks cleared while being written
        are discarded, not published.
        """
        return self._cycle.commit(lease, count)

    def lookup(
        self, tenant: str, keys: Sequence[bytes], *, lock: bool = True, count: bool = True
    ) -> LookupResult:
        """The leading run of ready chunks of ``keys`` (read-locked under a lease if ``lock``).

        ``count``: add the hits and misses to the statistics (a repeated look does not).
        A malformed key cannot be in the index, so it is simply a miss.
        """
        return self._cycle.lookup(tenant, keys, lock, count)

    # ----------------------------------------------------------------- leases

    def release(self, lease: int) -> None:
        """End a lease: drop read locks, or abandon an uncommitted reservation.

        Releasing a quarantined write lease frees its pages: the caller vouches that its
        writer writes no more (its session ended).
        """
        self._leases.release(lease)

    def trim(self, lease: int, count: int) -> None:
        """Keep the first ``count`` chunks of an uncommitted reservation; free the rest (their
        keys are free to reserve again)."""
        self._leases.trim(lease, count)

    def is_quarantined(self, lease: int) -> bool:
        """Whether ``lease`` is a write lease that expired and whose pages are still held."""
        return lease in self._leases.quarantine.leases

    @property
    def quarantined_leases(self) -> int:
        """How many write leases were ever quarantined (read without the lock to spot news)."""
        return self._leases.quarantine.total

    @property
    def open_write_leases(self) -> int:
        """Reservations not yet committed or released (transfers in flight into L1)."""
        return self._leases.write_leases

    def lease_chunks(self, lease: int) -> tuple[str, list[bytes]]:
        """Tenant and keys of a store lease's chunks, in order (for the write-back)."""
        return self._leases.chunks_of(lease)

    def pin(self, tenant: str, key: bytes) -> LookupResult:
        """Read-lock one ready chunk with a lease that never expires, for the L2 write-back.

        Unlike :meth:`lookup` it counts no hit and changes no recency. The pin holds
        the chunk in L1 until the write-back releases it; the write-back queue is
        bounded, and so is what pins can hold.
        """
        return self._leases.pin(tenant, key)

    def expire_leases(self) -> int:
        """End every lease past its expiry (quarantine a write lease's pages); how many expired.

        Also frees the quarantined pages whose fence has passed.
        """
        return self._leases.expire()

    # ------------------------------------------------------------ maintenance

    def maintain(self) -> None:
        """The periodic check: expire leases, restore the watermark, enforce shrunken quotas,
        give back memory that clients wrote outside their chunks."""
        self._maintenance.maintain()

    def evict(self, pages: int, tenant: str | None = None) -> bool:
        """Free at least ``pages`` pages (of one tenant, or anyone): all or nothing."""
        return self._maintenance.evict(pages, tenant)

    def clear(self, tenant: str | None = None, *, unpin: bool = False) -> int:
        """Drop every chunk (of one tenant, or all), and with ``unpin`` its pins too.
        Locked chunks go when unlocked."""
        return self._maintenance.clear(tenant, unpin)

    def restore(
        self, records: Iterable[ChunkRecord | int], reserved: Iterable[ChunkRecord | int] = ()
    ) -> RestoreReport:
        """Rebuild the index of a fresh cache from an adopted segment's chunk table.

        Records that fail their checksum (given as bare slot numbers), point
        outside the data region, disagree with their size, or overlap an earlier
        record are discarded and erased; the rest become ready chunks, inserted
        in commit order so that the policies see the oldest first. The pages of
        ``reserved`` records (stores in flight when the last agent stopped, or
        quarantined) are quarantined for a fence: their writers may still copy.
        """
        return restore(self._chunks, self._leases, records, reserved)

    # ---------------------------------------------------------- quotas, usage

    def set_quota(self, tenant: str, limit: Quota) -> None:
        """Set a tenant's limits (a number: both tiers); shrinking L1's evicts right away."""
        self._accounting.set_quota(tenant, limit)

    def delete_quota(self, tenant: str) -> None:
        self._accounting.delete_quota(tenant)

    def replace_ceilings(self, ceilings: Mapping[str, TierLimits]) -> frozenset[str]:
        """Make the tenants' ceilings exactly ``ceilings``; returns the tenants they changed.

        A tenant on the default limit whose ceiling drops below it shrinks at once.
        """
        return self._accounting.replace_ceilings(ceilings)

    def tenant_stats(self, account: TenantRecord) -> TenantStats:
        """One record's usage, quota and counters."""
        return self._accounting.stats(account)

    def tenant_usage(self, tenant: str) -> TenantStats:
        """Usage of one tenant; asking about an unknown tenant does not create it."""
        return self._accounting.usage(tenant)

    def tenant_records(self) -> list[TenantRecord]:
        """Every tenant record: a copy of the list only, cheap enough to take under a lock.

        The records stay live; :meth:`tenant_stats` reads one later (outside the lock, each
        counter is read whole, though two counters of one record may be a moment apart).
        """
        return self._accounting.records()

    # ------------------------------------------------------------------- pins

    def put_pin(self, tenant: str, name: str, keys: Sequence[bytes]) -> PinState:
        """Make the tenant's pin ``name`` exactly ``keys`` (see
        :mod:`~kvpool.agent.core.l1.pin_sets`); :class:`PinRefused` past its budget of 0 or
        the bound on pinned keys."""
        check_keys(keys)
        return self._pins.put(tenant, name, keys)

    def delete_pin(self, tenant: str, name: str) -> bool:
        """Drop one of the tenant's pins; whether it had it."""
        return self._pins.delete(tenant, name)

    def pins(self, tenant: str) -> TenantPins:
        return self._pins.report(tenant)

    def replace_pin_budgets(self, budgets: Mapping[str, int]) -> None:
        """The tenants with a pin budget of their own (the rest have the default)."""
        self._pins.replace_budgets(budgets)

    def pin_budget(self, tenant: str) -> int:
        return self._pins.budget(tenant)

    def pinned_bytes(self) -> dict[str, int]:
        """Bytes pinned per tenant that has pins."""
        return self._pins.pinned_bytes()

    def is_pinned(self, tenant: str, key: bytes) -> bool:
        """Whether the tenant's chunk ``key`` is pinned in L1 (one set lookup: the NVMe
        tier asks without the service's lock)."""
        return self._pins.is_pinned(tenant, key)

    # ---------------------------------------------------------------- reports

    def contains(self, key: bytes) -> bool:
        return self._reports.contains(key)

    def iter_keys(self, tenant: str | None = None) -> Iterator[bytes]:
        """Keys of ready chunks (of one tenant, or all)."""
        return self._reports.ready_keys(tenant)

    def keys_by_tenant(self) -> dict[str, list[bytes]]:
        """Every ready key, grouped by tenant."""
        return self._reports.keys_by_tenant()

    def stats(self) -> L1Stats:
        return self._reports.stats()

    def debug_view(self) -> L1DebugView:
        """A copy of the bookkeeping: slots, index, free pages, leases and records."""
        return self._reports.debug_view()

    def check_invariants(self) -> None:
        """Check every rule the bookkeeping keeps; raise :class:`InvariantError` naming one
        broken. Takes time linear in the slots, leases and records: for tests and debugging.
        """
        self._reports.check_invariants()
