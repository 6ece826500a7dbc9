"""The cache service: the one seam through which every edge reaches the L1 cache.

The ZMQ server, the HTTP API, the maintenance task and the L2 controllers
(write-back, prefetch) call these operations; none of them takes the lock or
touches the cache itself. An operation raises the cache's domain errors
(:class:`~kvpool_agent.core.l1.CacheError` and its kinds); each edge maps them to
its own replies.

Data path: :meth:`CacheService.lookup` (a hit tells the write-back, a miss may
start a prefetch), :meth:`~CacheService.reserve`, :meth:`~CacheService.commit`
(tells the write-back), :meth:`~CacheService.release`, and
:meth:`~CacheService.store` / :meth:`~CacheService.retrieve`, which copy bytes
for callers that cannot map the segment (and for the prefetch). The L2
controllers attach through the small protocols below, given at composition
(:meth:`~CacheService.attach_lower_tiers`): the service imports no L2 code.

Pins and shared spaces: :meth:`~CacheService.put_pin` and the rest keep a tenant's pins
(:mod:`kvpool_agent.core.l1.pin_sets`); :meth:`~CacheService.replace_spaces` takes the
tenants ConfigMap's spaces (their pin budgets, and what :meth:`~CacheService.spaces`
reports); :meth:`~CacheService.warm` loads a prefix from L2 through the prefetch hook and
waits for it.

One lock: cache operations take microseconds, so it serves them all; bulk
copies happen outside it while the chunks are write-locked (store) or
read-locked (retrieve). Quota writes do their I/O outside it (under a lock of
their own, so that two writers apply in the order they stored). Reports
(status, metrics, tenant lists) take the lock for O(1) figures and a copy of
the tenant record list only; reading, ranking and formatting thousands of
tenants happens outside it, so an unauthenticated ``/metrics`` poller cannot
stall the data path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter

from kvpool_agent.chunk_files import ChunkFiles
from kvpool_agent.core.cache_types import (
    L1Stats,
    PinState,
    Reservation,
    TenantPins,
    TenantStats,
    UnknownLease,
)
from kvpool_agent.core.l1 import L1Cache
from kvpool_agent.quotas import Limit, Quota, TierLimits, as_limits
from kvpool_agent.service.hooks import (
    PrefetchHook,
    PrefetchProgress,
    SequencedListener,
    TenantBytes,
    TenantDrop,
    WriteBackHook,
)
from kvpool_agent.service.landing import ChunkLanding
from kvpool_agent.service.results import (
    AboveCeiling,
    Dropped,
    QuotaView,
    SnapshotResult,
    SpaceUsage,
    StoreResult,
    TenantRanking,
    WarmCounts,
    Warmed,
    WarmRefused,
)
from kvpool_agent.tenancy.quota_store import QuotaStore
from kvpool_agent.tenants_configmap import SpaceEntry
from kvpool_agent.transfer_results import LookupResult

_USED_BYTES = attrgetter("used_bytes")


class CacheService:
    def __init__(self, cache: L1Cache, files: ChunkFiles, quota_store: QuotaStore) -> None:
        self._cache = cache
        self._files = files
        self._lock = threading.Lock()
        self._quota_store = quota_store
        self._quota_writes = threading.Lock()
        self._events: SequencedListener | None = None
        self._write_back: WriteBackHook | None = None
        self._prefetch: PrefetchHook | None = None
        self._drop_lower: TenantDrop | None = None
        self._nvme_used: TenantBytes | None = None
        self._spaces: dict[str, SpaceEntry] = {}
        self.warm_counts = WarmCounts()
        self.quota_listeners: list[Callable[[str], None]] = []
        """Told (outside the locks) which tenant's quota changed, e.g. to shrink L2 tiers."""

    # ------------------------------------------------------------ composition

    def publish_events(self, events: SequencedListener) -> None:
        """Tell ``events`` of every chunk stored or removed from now on (under the lock)."""
        with self._lock:
            self._events = events
            self._cache.listener = events

    def attach_lower_tiers(
        self,
        write_back: WriteBackHook,
        prefetch: PrefetchHook,
        drop: TenantDrop,
        nvme_used: TenantBytes | None = None,
    ) -> None:
        """L2 tiers exist: commits and hits go to ``write_back``, misses to ``prefetch``,
        :meth:`drop_tenant` to ``drop``, :meth:`nvme_used` to ``nvme_used`` (None: no
        NVMe tier).

        The cache then also accepts a run whose predecessor it lacks (a prefetch can
        bring the prefix back).
        """
        with self._lock:
            self._write_back = write_back
            self._prefetch = prefetch
            self._drop_lower = drop
            self._nvme_used = nvme_used
            self._cache.lower_tier = True

    # -------------------------------------------------------------- data path

    def lookup(
        self,
        tenant: str,
        keys: Sequence[bytes],
        *,
        lock: bool = True,
        count: bool = True,
        prefetch: bool = False,
        parent: bytes | None = None,
    ) -> LookupResult:
        """The leading run of ready chunks of ``keys`` (see :meth:`L1Cache.lookup`).

        Counted hits tell the write-back (a ``reused`` policy counts them). With
        ``prefetch``, the keys after the hits start loading from L2 (``parent``
        precedes the first key).
        """
        write_back = self._write_back
        with self._lock:
            hit = self._cache.lookup(tenant, keys, lock=lock, count=count)
            if write_back is not None and hit.count and count:
                write_back.hit(tenant, keys[: hit.count], self._cache)
        prefetch_id = 0
        if prefetch and self._prefetch is not None and hit.count < len(keys):
            after = keys[hit.count - 1] if hit.count else parent
            prefetch_id = self._prefetch.begin(tenant, keys[hit.count :], after)
        return dataclasses.replace(hit, prefetch=prefetch_id) if prefetch_id else hit

    def prefetch_status(self, prefetch_id: int) -> PrefetchProgress | None:
        """None for an id never given or long finished (or without L2 tiers)."""
        return None if self._prefetch is None else self._prefetch.status(prefetch_id)

    def reserve(
        self,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None = None,
        *,
        keep: Sequence[bytes] = (),
    ) -> Reservation:
        """Write-lock space for ``keys`` (see :meth:`L1Cache.reserve`)."""
        with self._lock:
            return self._cache.reserve(tenant, keys, sizes, parent, keep)

    def commit(self, lease: int, count: int | None = None) -> int:
        """Make the first ``count`` (default all) reserved chunks ready; tell the write-back."""
        return self._commit(lease, count, write_back=True)

    def _commit(self, lease: int, count: int | None, *, write_back: bool) -> int:
        hook = self._write_back if write_back else None
        with self._lock:
            if hook is None:
                return self._cache.commit(lease, count)
            tenant, keys = self._cache.lease_chunks(lease)
            committed = self._cache.commit(lease, count)
            hook.committed(tenant, keys[:count], self._cache)
        return committed

    def commit_loaded(self, lease: int) -> int:
        """Make reserved chunks that came from L2 ready (they are there already: no
        write-back)."""
        return self._commit(lease, None, write_back=False)

    def chunk_view(self, tenant: str) -> memoryview:
        """The chunk file of ``tenant`` (an L1 account) mapped: its chunks' bytes at their
        offsets, for a tier that reads a chunk or writes a reserved one in place."""
        return self._files.view(tenant)

    def file_id(self, tenant: str) -> int:
        """The id of ``tenant``'s chunk file that clients map (0: it has none)."""
        return self._files.file_id(tenant)

    def landing(
        self,
        tenant: str,
        key: bytes,
        parent: bytes | None,
        keep: list[bytes],
        *,
        after: ChunkLanding | None = None,
        on_decided: Callable[[], None] | None = None,
    ) -> ChunkLanding:
        """A chunk from L2 that a tier receives straight into its reserved pages, reserved
        after the chunk ``after`` (see :class:`~kvpool_agent.service.landing.ChunkLanding`)."""
        return ChunkLanding(self, tenant, key, parent, keep, after, on_decided)

    def release(self, lease: int) -> None:
        """End a lease (read locks, or an uncommitted reservation); UnknownLease if none."""
        with self._lock:
            self._cache.release(lease)

    def release_all(self, leases: Iterable[int]) -> None:
        """End each of ``leases`` still open (an expired one is skipped), under one lock."""
        with self._lock:
            for lease in leases:
                with contextlib.suppress(UnknownLease):
                    self._cache.release(lease)

    def store(
        self,
        tenant: str,
        keys: Sequence[bytes],
        payloads: Sequence[bytes | memoryview],
        parent: bytes | None = None,
    ) -> StoreResult:
        """Reserve, copy ``payloads`` into the tenant's chunk file, commit: the store of a
        caller that does not map it (chunks from L2 land through :meth:`landing`).

        The copy runs outside the lock (the reserved chunks are write-locked).
        """
        reservation = self.reserve(tenant, keys, [len(p) for p in payloads], parent)
        view = self.chunk_view(tenant)
        for place, payload in zip(reservation.placements, payloads, strict=False):
            if place is not None:
                view[place.offset : place.offset + place.nbytes] = payload
        stored = 0
        if reservation.lease is not None:
            stored = self.commit(reservation.lease)
        present = sum(place is None for place in reservation.placements)
        return StoreResult(stored, present, reservation.refused_reason)

    def retrieve(self, tenant: str, keys: Sequence[bytes], max_bytes: int) -> list[bytes]:
        """Copies of the leading run of ready chunks of ``keys`` (read-locked while copied),
        as many as fit in ``max_bytes`` together (a reply's bound; the client asks again)."""
        with self._lock:
            hit = self._cache.lookup(tenant, keys, lock=True)
        if hit.lease is None:
            return []
        try:
            view, found, total = self.chunk_view(tenant), [], 0
            for offset, size in zip(hit.offsets, hit.sizes, strict=True):
                total += size
                if total > max_bytes:
                    break
                found.append(bytes(view[offset : offset + size]))
            return found
        finally:
            self.release(hit.lease)

    def snapshot(self) -> SnapshotResult:
        """Every tenant's keys, and the event sequence number they are consistent with."""
        with self._lock:  # events are published under this lock
            seq = 0 if self._events is None else self._events.seq
            return SnapshotResult(seq, self._cache.keys_by_tenant())

    @property
    def open_write_leases(self) -> int:
        """Reservations not yet committed or released (read without the lock)."""
        return self._cache.open_write_leases

    @property
    def quarantined_leases(self) -> int:
        """How many write leases were ever quarantined (read without the lock to spot news)."""
        return self._cache.quarantined_leases

    def holding_quarantined(self, lease_sets: Sequence[Iterable[int]]) -> list[bool]:
        """For each set of leases, whether one of them is quarantined (see :mod:`l1`)."""
        with self._lock:
            return [any(map(self._cache.is_quarantined, leases)) for leases in lease_sets]

    def warm(self, tenant: str, keys: Sequence[bytes], timeout: float) -> Warmed:
        """Load the chunks of ``keys`` (a prefix, in order) that L1 lacks from L2, through a
        prefetch, waiting up to ``timeout`` seconds (blocks: never on the event loop).

        :class:`WarmRefused` if no prefetch slot is free for a warm (warms take a share of
        them only, see :mod:`kvpool_agent.tiering.prefetch`).
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

    # ------------------------------------------------------------------- pins

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

    # ----------------------------------------------------------------- quotas

    def quota_limit(self, tenant: str) -> Limit:
        """The tenant's L1 limit, read without the lock (one dict lookup)."""
        return self._cache.quotas.limit(tenant)

    def nvme_quota_limit(self, tenant: str) -> Limit:
        """The tenant's NVMe limit, read without the lock (the NVMe tier asks per put)."""
        return self._cache.quotas.limits(tenant).nvme

    def load_quotas(self) -> int:
        """Apply the stored quotas (at start); returns how many tenants have one."""
        return self.set_quotas(self._quota_store.load())

    def set_quotas(self, limits: Mapping[str, Quota]) -> int:
        """Apply ``limits``, the stored quotas read at start; returns how many there are."""
        with self._lock:
            for tenant, limit in limits.items():
                self._cache.set_quota(tenant, limit)
        return len(limits)

    def replace_quotas(self, limits: Mapping[str, Quota]) -> None:
        """Make the explicit quotas exactly ``limits`` (the store reports a change).

        Under the write lock, so a change reported while this agent stores one of its
        own applies after it, in the order the store saw them.
        """
        changed: list[str] = []
        with self._quota_writes, self._lock:
            book = self._cache.quotas
            for tenant in book.explicit().keys() - limits.keys():
                self._cache.delete_quota(tenant)
                changed.append(tenant)
            for tenant, limit in limits.items():
                if not book.has_own(tenant) or book.limits(tenant) != as_limits(limit):
                    self._cache.set_quota(tenant, limit)
                    changed.append(tenant)
        self._quota_changed(*changed)

    def replace_ceilings(self, ceilings: Mapping[str, TierLimits]) -> None:
        """Make the tenants' ceilings exactly ``ceilings`` (the tenants ConfigMap changed)."""
        with self._lock:
            changed = self._cache.replace_ceilings(ceilings)
        self._quota_changed(*sorted(changed))

    def quota(self, tenant: str) -> QuotaView:
        with self._lock:
            book = self._cache.quotas
            return QuotaView(tenant, book.limits(tenant), book.has_own(tenant))

    def set_quota(self, tenant: str, limits: Quota, *, within_ceiling: bool = False) -> QuotaView:
        """Store the limits durably, then apply them (shrinking evicts at once).

        ``within_ceiling`` (a tenant sets its own): :class:`AboveCeiling` if a tier's
        limit exceeds the tenant's ceiling there, or without a ceiling the default quota
        (unlimited exceeds any bound).
        """
        wanted = as_limits(limits).check()
        with self._quota_writes:
            if within_ceiling:
                self._check_ceiling(tenant, wanted)
            self._quota_store.save(tenant, wanted.stored())
            with self._lock:
                self._cache.set_quota(tenant, wanted)
        self._quota_changed(tenant)
        return self.quota(tenant)

    def _check_ceiling(self, tenant: str, wanted: TierLimits) -> None:
        with self._lock:
            book = self._cache.quotas
            bound, ceiling = book.own_bound(tenant), book.ceiling(tenant)
        above = [] if bound is None else wanted.above(bound)
        if not above:
            return
        tier, limit, most = above[0]
        asked = "unlimited" if limit is None else f"{limit} bytes"
        if ceiling is not None:
            raise AboveCeiling(
                f"the {tier} quota asked ({asked}) is above this tenant's {tier} ceiling of "
                f"{most} bytes, which its KVCacheTenant's spec.quota sets; set at most the "
                "ceiling, or have the KVCacheTenant's quota raised"
            )
        raise AboveCeiling(
            f"the {tier} quota asked ({asked}) is above the default tenant quota of {most} "
            "bytes (default_tenant_quota), the most a tenant without a KVCacheTenant ceiling "
            "may set itself; set at most the default, or ask an admin"
        )

    def delete_quota(self, tenant: str) -> QuotaView:
        with self._quota_writes:
            self._quota_store.delete(tenant)
            with self._lock:
                self._cache.delete_quota(tenant)
        self._quota_changed(tenant)
        return self.quota(tenant)

    def _quota_changed(self, *tenants: str) -> None:
        for tenant in tenants:
            for listener in self.quota_listeners:
                listener(tenant)

    # ---------------------------------------------------------------- reports

    def usage(self, tenant: str) -> TenantStats:
        with self._lock:
            return self._cache.tenant_usage(tenant)

    def nvme_used(self, tenant: str) -> int:
        """Bytes of the tenant's files in this node's NVMe tier; 0 without one."""
        return 0 if self._nvme_used is None else self._nvme_used(tenant)

    def stats(self) -> L1Stats:
        with self._lock:
            return self._cache.stats()

    def tenants(self) -> list[TenantStats]:
        """Every tenant record's usage and counters."""
        with self._lock:
            records = self._cache.tenant_records()
        return [self._cache.tenant_stats(record) for record in records]

    def ranked_tenants(self, count: int) -> TenantRanking:
        """The ``count`` tenants using the most L1 bytes, and the sums of the others.

        The others' sums are the cache's totals less the largest (a moment apart at most).
        """
        with self._lock:
            totals = self._cache.stats()
            records = self._cache.tenant_records()
        largest = [
            self._cache.tenant_stats(record)
            for record in heapq.nlargest(count, records, key=_USED_BYTES)
        ]
        return TenantRanking(
            largest=largest,
            rest_used_bytes=max(0, totals.stored_bytes - sum(t.used_bytes for t in largest)),
            rest_chunks=max(0, totals.held_chunks - sum(t.chunks for t in largest)),
            rest_count=len(records) - len(largest),
        )

    def clear(self, tenant: str | None = None, *, unpin: bool = False) -> int:
        """Drop every chunk (of one tenant, or all), and with ``unpin`` the pins too."""
        with self._lock:
            return self._cache.clear(tenant, unpin=unpin)

    def drop_tenant(self, tenant: str, *, unpin: bool = False) -> Dropped:
        """Drop the tenant's chunks (and with ``unpin`` its pins) from L1, then its objects
        from every L2 tier.

        L1 first, so the write-back takes no new chunk of the tenant to L2 after the drop
        (a copy already in flight may still land: dropping again removes it).
        """
        l1_chunks = self.clear(tenant, unpin=unpin)
        l2_objects = 0 if self._drop_lower is None else self._drop_lower(tenant)
        return Dropped(l1_chunks, l2_objects)

    def maintain(self) -> None:
        with self._lock:
            self._cache.maintain()
