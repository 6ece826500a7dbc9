"""The L1 cache's public face: the reserve/commit/lookup cycle and what its callers ask.

The rules it keeps are in the package's docstring (:mod:`kvpool.agent.core.l1`); the
parts it is made of each keep one of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from kvpool.agent.core.cache_types import (
    ChunkBacking,
    ChunkListener,
    EvictionCause,
    InvalidRequest,
    L1Stats,
    PinState,
    Placement,
    Reservation,
    RestoreReport,
    TenantPins,
    TenantRecord,
    TenantStats,
)
from kvpool.agent.core.journal import ChunkRecord, SegmentJournal
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.debug import L1DebugView, debug_view
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.invariants import check_invariants
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.planner import plan_eviction
from kvpool.agent.core.l1.reports import Traffic, keys_by_tenant, l1_stats, ready_keys
from kvpool.agent.core.l1.restore import restore
from kvpool.agent.core.l1.slots import DOOMED, NIL, READY, State
from kvpool.agent.core.l1.tenants import IDLE_TENANTS, Tenant
from kvpool.agent.core.policies import PolicyFactory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common.keys import KEY_BYTES
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
        self._chunks = chunks
        # Bound once: the slot table, the index and the records are never replaced.
        self._slots = chunks.slots
        self._index = chunks.index
        self._tenants = chunks.tenants
        self._pins = chunks.pins
        fence = 10 * lease_seconds if fence_seconds is None else fence_seconds
        self._leases = LeaseTable(chunks, clock, lease_seconds, fence)
        self._evictor = Evictor(chunks, int(pages * high_watermark), int(pages * low_watermark))

        self._traffic = Traffic()

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

    # ------------------------------------------------------------------ store

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
        _check_keys(keys)
        if len(sizes) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(sizes)} sizes")
        if any(not 0 < size <= self.layout.data_size for size in sizes):
            raise InvalidRequest(
                f"chunk sizes must be positive and at most the segment's {self.layout.data_size}"
            )
        if len(set(keys)) != len(keys):
            raise InvalidRequest("a reservation names the same key twice")
        chunks, owner, evictor = self._chunks, self._slots.tenant, self._evictor
        account = self._tenants.account(tenant)
        previous = NIL if parent is None else self._index.get(parent, NIL)
        if parent is not None and previous == NIL and not chunks.lower_tier:
            # Without a lower tier no lookup reaches these chunks: storing them would only
            # evict the reachable tails of other chains.
            return Reservation(None, (), "the chunk before the first key is not in L1")
        if previous != NIL and owner[previous] != account.index:
            previous = NIL  # never link across tenants
        protected: set[int] = {previous} if previous != NIL else set()
        # The run's own cached chunks too: the room made for the run must not evict them.
        protected.update(slot for slot in map(self._index.get, (*keep, *keys)) if slot is not None)
        placements: list[Placement | None] = []
        new_slots: list[int] = []
        refused: str | None = None
        for position, (key, nbytes) in enumerate(zip(keys, sizes, strict=True)):
            existing = self._index.get(key, NIL)
            if existing != NIL and owner[existing] != account.index:
                # Keys are salted per tenant, so this is a broken or hostile client: never
                # let one tenant's chain hang under another's chunk.
                refused = "key is held by another tenant"
                break
            if existing != NIL:
                placements.append(None)
                protected.add(existing)
                previous = existing
                continue
            refused = evictor.make_room(account, nbytes, protected)
            if refused is not None:
                break
            if not new_slots:
                # Room for the rest of the run at once: a chain that cannot shrink (its tail
                # is this run's parent) is then walked once per store, not once per chunk.
                wanted = self._pages_wanted(account, keys[position:], sizes[position:])
                evictor.to_watermark(extra_pages=wanted, protected=protected)
            pages = chunks.pages_for(nbytes)
            first_page = evictor.allocate(pages, protected)
            if first_page is None:
                refused = "no evictable memory left in the L1 segment"
                break
            refused = chunks.back(account, first_page, pages)
            if refused is not None:
                break
            slot = chunks.place(account, key, nbytes, first_page, pages)
            self._slots.link(slot, previous)
            protected.add(slot)
            new_slots.append(slot)
            placements.append(Placement(key, self._slots.offsets[slot], nbytes))
            previous = slot
        lease = self._leases.open(writing=True, slots=new_slots) if new_slots else None
        self._tenants.rest(account)
        return Reservation(lease, tuple(placements), refused)

    def _pages_wanted(self, account: Tenant, keys: Sequence[bytes], sizes: Sequence[int]) -> int:
        """Pages of the chunks of a run that L1 does not hold yet, as far as its tenant's
        quota lets the tenant grow: past that, its chunks take the place of its own (or are
        refused), and room made for them would only evict other tenants' chunks."""
        cached, pages_for = self._index, self._chunks.pages_for
        limit = self.quotas.limit(account.name)
        room = None if limit is None else limit - account.used_bytes
        pages = 0
        for k, nbytes in zip(keys, sizes, strict=True):
            if k in cached:
                continue
            if room is not None:
                room -= nbytes
                if room < 0:
                    break
            pages += pages_for(nbytes)
        return pages

    def commit(self, lease: int, count: int | None = None) -> int:
        """Make the first ``count`` (default all) reserved chunks ready; discard the rest.

        Returns how many chunks became ready. Chunks cleared while being written
        are discarded, not published.
        """
        leases, chunks, slots = self._leases, self._chunks, self._slots
        record = leases.take(lease)
        if not record.writing:
            leases.put_back(lease, record)
            raise InvalidRequest(f"lease {lease} is a read lease; release it instead")
        reserved = record.slots
        keep = len(reserved) if count is None else count
        if not 0 <= keep <= len(reserved):
            leases.put_back(lease, record)
            raise InvalidRequest(f"cannot commit {count} of {len(reserved)} reserved chunks")
        published: list[int] = []
        state, places, probe_table = slots.state, self._tenants.places, chunks.probe_table
        traffic, pins = self._traffic, self._pins
        # Tail first, so the head of the run ends up the most recently used.
        for position in range(len(reserved) - 1, -1, -1):
            slot = reserved[position]
            if position >= keep or state[slot] == DOOMED:
                chunks.free(slot)
                continue
            state[slot] = READY
            account = places[slots.tenant[slot]]
            if probe_table is not None:
                probe_table.publish(slots.key(slot), account.name)
            slots.last_use[slot] = slots.next_tick()
            account.policy.insert(slot, slots.key(slot))
            account.stored_chunks += 1
            traffic.written_bytes += slots.nbytes[slot]
            published.append(slot)
        if pins.by_tenant:
            for slot in reversed(published):  # head first: a budget holds a prefix
                pins.arrived(slot, places[slots.tenant[slot]].name)
        if chunks.journal is not None:
            for slot in reversed(published):  # head first: a parent is numbered before its child
                chunks.journal.record(chunks.record_of(slot))
        if chunks.listener is not None and published:
            tenant = places[slots.tenant[published[0]]].name
            chunks.listener.stored(tenant, [slots.key(slot) for slot in reversed(published)])
        return len(published)

    # --------------------------------------------------------------- retrieve

    def lookup(
        self, tenant: str, keys: Sequence[bytes], *, lock: bool = True, count: bool = True
    ) -> LookupResult:
        """The leading run of ready chunks of ``keys`` (read-locked under a lease if ``lock``).

        ``count``: add the hits and misses to the statistics (a repeated look does not).

        The hot path of the agent: locals are bound once and the loops do nothing else.
        A malformed key cannot be in the index, so it is simply a miss.
        """
        account = self._tenants.account(tenant)
        table = self._slots
        find, state, owner, own = self._index.get, table.state, table.tenant, account.index
        slots: list[int] = []
        for key in keys:
            slot = find(key, NIL)
            if slot == NIL or state[slot] != READY or owner[slot] != own:
                break
            slots.append(slot)
        hit_count = len(slots)
        if hit_count:
            last_use, readers, tick = table.last_use, table.readers, table.next_tick()
            if lock:
                for slot in slots:
                    last_use[slot] = tick
                    readers[slot] += 1
            else:
                for slot in slots:
                    last_use[slot] = tick
            account.policy.touch(slots[::-1])  # tail first: the head ends up the most recent
        if count:
            account.hits += hit_count
            account.misses += len(keys) - hit_count
            self._traffic.hits += hit_count
            self._traffic.misses += len(keys) - hit_count
        if not account.chunks:
            self._tenants.rest(account)
        offsets = list(map(table.offsets.__getitem__, slots))
        sizes = list(map(table.nbytes.__getitem__, slots))
        lease = None
        if lock and hit_count:
            lease = self._leases.open(writing=False, slots=slots)
            self._traffic.read_bytes += sum(sizes)
        return LookupResult(lease, offsets, sizes)

    def release(self, lease: int) -> None:
        """End a lease: drop read locks, or abandon an uncommitted reservation.

        Releasing a quarantined write lease frees its pages: the caller vouches that its
        writer writes no more (its session ended).
        """
        self._leases.release(lease)

    def is_quarantined(self, lease: int) -> bool:
        """Whether ``lease`` is a write lease that expired and whose pages are still held."""
        return lease in self._leases.quarantine.leases

    @property
    def quarantined_leases(self) -> int:
        """How many write leases were ever quarantined (read without the lock to spot news)."""
        return self._leases.quarantine.total

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

    # ------------------------------------------------------------ maintenance

    def expire_leases(self) -> int:
        """End every lease past its expiry (quarantine a write lease's pages); how many expired.

        Also frees the quarantined pages whose fence has passed.
        """
        return self._leases.expire()

    def maintain(self) -> None:
        """The periodic check: expire leases, restore the watermark, enforce shrunken quotas,
        give back memory that clients wrote outside their chunks."""
        self.expire_leases()
        self._evictor.to_watermark(extra_pages=0, protected=set())
        self._evictor.enforce_quotas()
        self._tenants.trim_idle()
        backing = self._chunks.backing
        if backing is not None:
            for owner in backing.strays():
                backing.trim(owner)

    def evict(self, pages: int, tenant: str | None = None) -> bool:
        """Free at least ``pages`` pages (of one tenant, or anyone): all or nothing."""
        scope = None if tenant is None else self._tenants.account(tenant)
        plan = plan_eviction(self._chunks, pages, self._slots.pages, scope, protected=set())
        if plan.freed >= pages:
            self._evictor.apply(plan, EvictionCause.PRESSURE)
        if scope is not None:
            self._tenants.rest(scope)
        return plan.freed >= pages

    def set_quota(self, tenant: str, limit: Quota) -> None:
        """Set a tenant's limits (a number: both tiers); shrinking L1's evicts right away."""
        self.quotas.set(tenant, limit)
        self._quota_changed(tenant)

    def delete_quota(self, tenant: str) -> None:
        self.quotas.delete(tenant)
        self._quota_changed(tenant)

    def replace_ceilings(self, ceilings: Mapping[str, TierLimits]) -> frozenset[str]:
        """Make the tenants' ceilings exactly ``ceilings``; returns the tenants they changed.

        A tenant on the default limit whose ceiling drops below it shrinks at once.
        """
        changed = self.quotas.replace_ceilings(ceilings)
        for tenant in changed:
            self._quota_changed(tenant)
        return changed

    def _quota_changed(self, tenant: str) -> None:
        account = self._tenants.account(tenant)
        self._evictor.enforce_quota(account)
        self._tenants.rest(account)

    def clear(self, tenant: str | None = None, *, unpin: bool = False) -> int:
        """Drop every chunk (of one tenant, or all), and with ``unpin`` its pins too.
        Locked chunks go when unlocked."""
        if unpin:
            self._pins.drop(tenant)
        scope = None if tenant is None else self._tenants.by_name.get(tenant)
        if tenant is not None and scope is None:
            return 0
        dropped = self._chunks.clear(scope)
        self._tenants.trim_idle()
        return dropped

    # ------------------------------------------------------------------- pins

    def put_pin(self, tenant: str, name: str, keys: Sequence[bytes]) -> PinState:
        """Make the tenant's pin ``name`` exactly ``keys`` (see
        :mod:`~kvpool.agent.core.l1.pin_sets`); :class:`PinRefused` past its budget of 0 or
        the bound on pinned keys."""
        _check_keys(keys)
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
        return {tenant: pins.pinned_bytes for tenant, pins in self._pins.by_tenant.items()}

    def is_pinned(self, tenant: str, key: bytes) -> bool:
        """Whether the tenant's chunk ``key`` is pinned in L1 (one set lookup: the NVMe
        tier asks without the service's lock)."""
        return self._pins.is_pinned(tenant, key)

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

    # ------------------------------------------------------------------ stats

    @property
    def open_write_leases(self) -> int:
        """Reservations not yet committed or released (transfers in flight into L1)."""
        return self._leases.write_leases

    def contains(self, key: bytes) -> bool:
        slot = self._index.get(key, NIL)
        return slot != NIL and self._slots.state[slot] == State.READY

    def iter_keys(self, tenant: str | None = None) -> Iterator[bytes]:
        """Keys of ready chunks (of one tenant, or all)."""
        scope = None if tenant is None else self._tenants.by_name.get(tenant)
        if tenant is not None and scope is None:
            return
        yield from ready_keys(self._chunks, scope)

    def keys_by_tenant(self) -> dict[str, list[bytes]]:
        """Every ready key, grouped by tenant."""
        return keys_by_tenant(self._chunks)

    def tenant_stats(self, account: TenantRecord) -> TenantStats:
        """One record's usage, quota and counters."""
        return self._tenants.stats(account)

    def tenant_usage(self, tenant: str) -> TenantStats:
        """Usage of one tenant; asking about an unknown tenant does not create it."""
        return self._tenants.usage(tenant)

    def tenant_records(self) -> list[TenantRecord]:
        """Every tenant record: a copy of the list only, cheap enough to take under a lock.

        The records stay live; :meth:`tenant_stats` reads one later (outside the lock, each
        counter is read whole, though two counters of one record may be a moment apart).
        """
        return list(self._tenants.by_name.values())

    def stats(self) -> L1Stats:
        return l1_stats(self._chunks, self._leases, self._evictor, self._traffic)

    # -------------------------------------------------------------- debugging

    def debug_view(self) -> L1DebugView:
        """A copy of the bookkeeping: slots, index, free pages, leases and records."""
        return debug_view(self._chunks, self._leases, self._evictor)

    def check_invariants(self) -> None:
        """Check every rule the bookkeeping keeps; raise :class:`InvariantError` naming one
        broken. Takes time linear in the slots, leases and records: for tests and debugging.
        """
        check_invariants(self._chunks, self._leases)


def _check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidRequest(f"keys are {KEY_BYTES} bytes")
