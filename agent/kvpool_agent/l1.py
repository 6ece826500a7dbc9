"""The L1 cache: index, chunk life cycle, locks under leases, eviction and tenant quotas.

It keeps metadata only; clients copy the bytes in and out of the shared segment
at the offsets it hands out. Life cycle of a chunk (one slot)::

    reserve ──► WRITING ──commit──► READY ◄──lookup/release──► READY, read-locked by N
       ▲          │ release      │            │ evicted (unlocked only) / cleared
       │          │              │ lease      ▼
      FREE ◄──────┴──────────────┼───────── DOOMED (cleared while locked; freed on the last unlock)
       ▲                         ▼ expires
       └── release / fence ── QUARANTINED (pages held, no key)

A WRITING chunk is invisible to readers and never evicted; a read-locked one is
never evicted. Every lock belongs to a lease that expires, so a crashed client
pins nothing for long.

A write lease that expires is quarantined, not freed: its client may be stalled
rather than dead, and still copy into those pages. Were they reused, its late
write would land in another chunk, another tenant's perhaps, and nothing would
notice. Quarantined pages stay allocated (counted by the watermarks and the
tenant's usage, never evicted, never handed out) until the lease is released
(the ZMQ server does so when the writer's session ends) or ``fence_seconds``
pass; its commit fails with :class:`LeaseExpired`. Read leases need no
quarantine: a reader that copies from reused pages writes nothing into the
segment, and the connector treats a load whose release fails as a failure.

Chunks form chains (``k_i`` names its predecessor ``k_{i-1}``) and a chunk is
only reachable through its whole prefix. So only chain tails are victims: a
chunk the policy proposes goes after all of its descendants, which matters
because a long prompt stored over several steps has its head oldest (hits are
touched tail first, so a hit chain has its head newest). A run stored under a
predecessor that L1 lacks would be unreachable and is refused, unless L2 tiers
exist: then a prefetch can restore the prefix, and when tails alone cannot make
room, older chunks may go too.

Eviction has three triggers: the high watermark (evict to the low one), an
allocation that does not fit (evict until it does, so a store fails for lack
of memory only when nothing is evictable), and a tenant over its quota (evict
only that tenant's chunks; a tenant never makes room for itself at the expense
of another). Within a tenant the configured policy orders victims; across
tenants, the victim whose last use is oldest goes first.

Tenant records: tenants choose their ids (a new ``cache_salt`` is a new tenant), so
a record lives only while it holds something, a chunk (open leases hold chunks) or
a quota of its own. A record that holds nothing keeps its counters while it is
among the ``idle_tenants`` most recently active such records; past that the
oldest is dropped, so a flood of new ids costs a bounded amount of memory. The
cache-wide counters stay exact; a dropped record's counters go with it.

Not thread-safe: the agent reaches it only through
:class:`~kvpool_agent.service.CacheService`, which calls it under one lock from
every thread (the ZMQ thread, the event loop, the HTTP handlers); only a few
counters (``open_write_leases``, ``quarantined_leases``) and quota limits are read
without that lock.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpool_agent.allocator import ExtentAllocator
from kvpool_agent.cache_types import (
    ChunkListener,
    EvictionCause,
    Hit,
    InvalidRequest,
    L1Stats,
    LeaseExpired,
    Placement,
    Reservation,
    RestoreReport,
    TenantRecord,
    TenantStats,
    UnknownLease,
)
from kvpool_agent.journal import RESERVED, ChunkRecord, SegmentJournal
from kvpool_agent.keys import KEY_BYTES
from kvpool_agent.policies import EvictionPolicy, PolicyFactory, SlotArena
from kvpool_agent.probe_table import ProbeTableWriter
from kvpool_agent.quotas import Quota, QuotaBook, TierLimits
from kvpool_agent.segment import SegmentLayout

NIL = -1
IDLE_TENANTS = 4096
"""Records of tenants that hold nothing kept for their counters (about 0.6 KiB each)."""


class State(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    DOOMED = 3
    QUARANTINED = 4


_READY = int(State.READY)
_DOOMED = int(State.DOOMED)
_STATES = tuple(State)
"""Each state by its value (the slot table keeps the values)."""
_STATE_VALUES = frozenset(int(state) for state in State)
_FINDABLE = (int(State.WRITING), _READY)
"""The states of chunks the index finds."""
_LINKABLE = frozenset((int(State.WRITING), _READY, _DOOMED))
"""The states of chunks that can have children."""


@dataclass
class _Tenant:
    name: str
    index: int
    policy: EvictionPolicy
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    stored_chunks: int = 0
    evicted_chunks: int = 0


@dataclass
class _IdleTenants:
    """Records that held nothing when last used, and the places dropped ones left."""

    bound: int
    vacant: _Tenant
    """Fills a dropped record's place in the record list until a new record takes it."""
    records: OrderedDict[str, _Tenant] = field(default_factory=OrderedDict)
    """Least recently used first."""
    vacancies: list[int] = field(default_factory=list)


@dataclass
class _Lease:
    writing: bool
    slots: list[int]
    expires: float


@dataclass
class _Quarantine:
    """Expired write leases whose pages are held back, oldest first (all fences are as long);
    a lease's ``expires`` is the end of its fence."""

    fence_seconds: float
    leases: dict[int, _Lease] = field(default_factory=dict)
    total: int = 0
    """How many leases were ever quarantined."""


class InvariantError(AssertionError):
    """A rule of the cache's bookkeeping is broken: a bug in the cache, never in a caller."""


class SlotView(NamedTuple):
    """One slot's metadata, as :meth:`L1Cache.debug_view` copies it."""

    slot: int
    state: State
    key: bytes | None
    tenant: str | None
    """The name of the record the chunk is charged to; None for a free slot."""
    offset: int
    first_page: int
    pages: int
    nbytes: int
    readers: int
    parent: int
    """The slot of the chunk's predecessor in its chain, or ``NIL``."""
    children: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LeaseView:
    writing: bool
    slots: tuple[int, ...]
    expires: float
    """When an open lease expires; for a quarantined one, when its fence ends."""


@dataclass(frozen=True, slots=True)
class TenantView:
    name: str
    used_bytes: int
    chunks: int


@dataclass(frozen=True)
class L1DebugView:
    """A copy of the cache's bookkeeping, for tests and debugging (never the data path)."""

    slots: tuple[SlotView, ...]
    """Every slot, free ones included, by slot number."""
    index: Mapping[bytes, int]
    """Key to slot of the chunks a lookup or a reservation can find (being written or ready)."""
    free_slots: tuple[int, ...]
    free_extents: tuple[tuple[int, int], ...]
    """The page allocator's free (first page, pages) runs, in page order."""
    total_pages: int
    free_pages: int
    high_pages: int
    low_pages: int
    leases: Mapping[int, LeaseView]
    quarantined: Mapping[int, LeaseView]
    tenants: Mapping[str, TenantView]
    record_places: int
    """Places in the record list: the records plus the places dropped ones left."""

    @property
    def used_pages(self) -> int:
        return self.total_pages - self.free_pages

    def live(self) -> list[SlotView]:
        """The slots that hold a chunk (in any state but free)."""
        return [view for view in self.slots if view.state != State.FREE]

    def slot_of(self, key: bytes) -> SlotView:
        return self.slots[self.index[key]]


@dataclass
class _EvictionPlan:
    victims: dict[int, None] = field(default_factory=dict)
    freed: int = 0
    waiting: dict[int, int] = field(default_factory=dict)
    """Chunks passed over as the prefix of others: how many children are not victims yet."""


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
    ) -> None:
        """``journal``, if given, records committed chunks in the segment for warm restarts.

        ``fence_seconds`` (default 10 x ``lease_seconds``): the longest an expired write
        lease's pages stay quarantined when nobody releases them.
        ``idle_tenants``: how many records of tenants that hold nothing keep their counters.
        ``probe_table``, if given, is kept to the ready chunks for the connectors' schedulers.
        """
        if not 0 < low_watermark < high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        self.layout = layout
        self.quotas = quotas
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._policy_factory = policy
        pages = layout.pages
        self._allocator = ExtentAllocator(pages)
        self._high_pages = int(pages * high_watermark)
        self._low_pages = int(pages * low_watermark)

        self._make_slot_tables(pages)
        self._arena = SlotArena(pages)
        self._index: dict[bytes, int] = {}
        self._tick = 0
        self._journal = journal
        self._probe_table = probe_table
        self.listener = listener
        self.lower_tier = False
        """L2 tiers are configured: a prefix that L1 lacks can come back by prefetch."""
        self._commit_sequence = 0

        self._tenants: dict[str, _Tenant] = {}
        self._tenant_list: list[_Tenant] = []
        self._idle = _IdleTenants(idle_tenants, _Tenant("", NIL, policy(self._arena)))
        # Tenants that may be over their quota: only these need the periodic check.
        self._over_quota: set[str] = set()
        self._leases: dict[int, _Lease] = {}
        self._expiry_heap: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self._write_leases = 0
        self._quarantine = _Quarantine(
            10 * lease_seconds if fence_seconds is None else fence_seconds
        )

        self._stored_bytes = 0
        self._hits = 0
        self._misses = 0
        self._written_bytes = 0
        self._read_bytes = 0
        self._evictions: Counter[str] = Counter()
        self._lock_expiries = 0

    def _make_slot_tables(self, pages: int) -> None:
        """Per-slot metadata in flat arrays; a chunk needs at least one page, so there are
        never more chunks than pages."""
        self._free_slots = array("i", range(pages - 1, -1, -1))
        self._keys: list[bytes | None] = [None] * pages
        self._state = bytearray(pages)
        self._first_page = array("q", [0]) * pages
        self._offsets = array("q", [0]) * pages  # absolute file offset of each chunk
        self._pages = array("i", [0]) * pages
        self._nbytes = array("q", [0]) * pages
        self._tenant = array("i", [NIL]) * pages
        self._readers = array("i", [0]) * pages
        self._last_use = array("q", [0]) * pages
        self._sequence = array("q", [0]) * pages  # commit number, for the journal
        self._parent = array("i", [NIL]) * pages
        self._first_child = array("i", [NIL]) * pages
        self._next_sibling = array("i", [NIL]) * pages
        self._prev_sibling = array("i", [NIL]) * pages

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
        account = self._account(tenant)
        previous = NIL if parent is None else self._index.get(parent, NIL)
        if parent is not None and previous == NIL and not self.lower_tier:
            # Without a lower tier no lookup reaches these chunks: storing them would only
            # evict the reachable tails of other chains.
            return Reservation(None, (), "the chunk before the first key is not in L1")
        if previous != NIL and self._tenant[previous] != account.index:
            previous = NIL  # never link across tenants
        protected: set[int] = {previous} if previous != NIL else set()
        # The run's own cached chunks too: the room made for the run must not evict them.
        protected.update(slot for slot in map(self._index.get, (*keep, *keys)) if slot is not None)
        placements: list[Placement | None] = []
        new_slots: list[int] = []
        refused: str | None = None
        for position, (key, nbytes) in enumerate(zip(keys, sizes, strict=True)):
            existing = self._index.get(key, NIL)
            if existing != NIL and self._tenant[existing] != account.index:
                # Keys are salted per tenant, so this is a broken or hostile client: never
                # let one tenant's chain hang under another's chunk.
                refused = "key is held by another tenant"
                break
            if existing != NIL:
                placements.append(None)
                protected.add(existing)
                previous = existing
                continue
            refused = self._make_room(account, nbytes, protected)
            if refused is not None:
                break
            if not new_slots:
                # Room for the rest of the run at once: a chain that cannot shrink (its tail
                # is this run's parent) is then walked once per store, not once per chunk.
                wanted = self._pages_wanted(keys[position:], sizes[position:])
                self._evict_to_watermark(extra_pages=wanted, protected=protected)
            slot = self._place(account, key, nbytes, previous, protected)
            if slot == NIL:
                refused = "no evictable memory left in the L1 segment"
                break
            protected.add(slot)
            new_slots.append(slot)
            placements.append(Placement(key, self._offset(slot), nbytes))
            previous = slot
        lease = self._open_lease(writing=True, slots=new_slots) if new_slots else None
        self._rest(account)
        return Reservation(lease, tuple(placements), refused)

    def commit(self, lease: int, count: int | None = None) -> int:
        """Make the first ``count`` (default all) reserved chunks ready; discard the rest.

        Returns how many chunks became ready. Chunks cleared while being written
        are discarded, not published.
        """
        record = self._take_lease(lease)
        if not record.writing:
            self._put_back(lease, record)
            raise InvalidRequest(f"lease {lease} is a read lease; release it instead")
        slots = record.slots
        keep = len(slots) if count is None else count
        if not 0 <= keep <= len(slots):
            self._put_back(lease, record)
            raise InvalidRequest(f"cannot commit {count} of {len(slots)} reserved chunks")
        published: list[int] = []
        # Tail first, so the head of the run ends up the most recently used.
        for position in range(len(slots) - 1, -1, -1):
            slot = slots[position]
            if position >= keep or self._state[slot] == State.DOOMED:
                self._free(slot)
                continue
            self._state[slot] = State.READY
            account = self._tenant_list[self._tenant[slot]]
            if self._probe_table is not None:
                self._probe_table.publish(self._key(slot), account.name)
            self._last_use[slot] = self._next_tick()
            account.policy.insert(slot, self._key(slot))
            account.stored_chunks += 1
            self._written_bytes += self._nbytes[slot]
            published.append(slot)
        if self._journal is not None:
            for slot in reversed(published):  # head first: a parent is numbered before its child
                self._journal.record(self._record_of(slot))
        if self.listener is not None and published:
            tenant = self._tenant_list[self._tenant[published[0]]].name
            self.listener.stored(tenant, [self._key(slot) for slot in reversed(published)])
        return len(published)

    # --------------------------------------------------------------- retrieve

    def lookup(
        self, tenant: str, keys: Sequence[bytes], *, lock: bool = True, count: bool = True
    ) -> Hit:
        """The leading run of ready chunks of ``keys`` (read-locked under a lease if ``lock``).

        ``count``: add the hits and misses to the statistics (a repeated look does not).

        The hot path of the agent: locals are bound once and the loops do nothing else.
        A malformed key cannot be in the index, so it is simply a miss.
        """
        account = self._account(tenant)
        find, state, owner, own = self._index.get, self._state, self._tenant, account.index
        slots: list[int] = []
        for key in keys:
            slot = find(key, NIL)
            if slot == NIL or state[slot] != _READY or owner[slot] != own:
                break
            slots.append(slot)
        hit_count = len(slots)
        if hit_count:
            last_use, readers, tick = self._last_use, self._readers, self._next_tick()
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
            self._hits += hit_count
            self._misses += len(keys) - hit_count
        if not account.chunks:
            self._rest(account)
        offsets = list(map(self._offsets.__getitem__, slots))
        sizes = list(map(self._nbytes.__getitem__, slots))
        lease = None
        if lock and hit_count:
            lease = self._open_lease(writing=False, slots=slots)
            self._read_bytes += sum(sizes)
        return Hit(lease, offsets, sizes)

    def release(self, lease: int) -> None:
        """End a lease: drop read locks, or abandon an uncommitted reservation.

        Releasing a quarantined write lease frees its pages: the caller vouches that its
        writer writes no more (its session ended).
        """
        if lease in self._quarantine.leases:
            self._end_quarantine(lease)
            return
        self._end_lease(self._take_lease(lease))

    def is_quarantined(self, lease: int) -> bool:
        """Whether ``lease`` is a write lease that expired and whose pages are still held."""
        return lease in self._quarantine.leases

    @property
    def quarantined_leases(self) -> int:
        """How many write leases were ever quarantined (read without the lock to spot news)."""
        return self._quarantine.total

    def lease_chunks(self, lease: int) -> tuple[str, list[bytes]]:
        """Tenant and keys of a store lease's chunks, in order (for the write-back)."""
        record = self._leases.get(lease)
        if record is None or not record.writing or not record.slots:
            return "", []
        tenant = self._tenant_list[self._tenant[record.slots[0]]].name
        return tenant, [self._key(slot) for slot in record.slots]

    def pin(self, tenant: str, key: bytes) -> Hit:
        """Read-lock one ready chunk with a lease that never expires, for the L2 write-back.

        Unlike :meth:`lookup` it counts no hit and changes no recency. The pin holds
        the chunk in L1 until the write-back releases it; the write-back queue is
        bounded, and so is what pins can hold.
        """
        slot = self._index.get(key, NIL)
        account = self._tenants.get(tenant)
        if (
            slot == NIL
            or account is None
            or self._state[slot] != State.READY
            or self._tenant[slot] != account.index
        ):
            return Hit(None, [], [])
        self._readers[slot] += 1
        lease = self._open_lease(writing=False, slots=[slot], expires=math.inf)
        return Hit(lease, [self._offset(slot)], [self._nbytes[slot]])

    # ------------------------------------------------------------ maintenance

    def expire_leases(self) -> int:
        """End every lease past its expiry (quarantine a write lease's pages); how many expired.

        Also frees the quarantined pages whose fence has passed.
        """
        now = self._clock()
        expired = 0
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, lease = heapq.heappop(heap)
            record = self._leases.pop(lease, None)
            if record is not None:
                self._write_leases -= record.writing
                if record.writing:
                    self._quarantine_lease(lease, record, now)
                else:
                    self._end_lease(record)
                expired += 1
        self._lock_expiries += expired
        # Every fence is as long, so the oldest quarantine ends first.
        while self._quarantine.leases:
            lease, record = next(iter(self._quarantine.leases.items()))
            if record.expires > now:
                break
            self._end_quarantine(lease)
        return expired

    def maintain(self) -> None:
        """The periodic check: expire leases, restore the watermark, enforce shrunken quotas."""
        self.expire_leases()
        self._evict_to_watermark(extra_pages=0, protected=set())
        for tenant in list(self._over_quota):
            account = self._tenants.get(tenant)
            if account is None:
                self._over_quota.discard(tenant)
            else:
                self._enforce_quota(account)
        self._trim_idle()

    def evict(self, pages: int, tenant: str | None = None) -> bool:
        """Free at least ``pages`` pages (of one tenant, or anyone): all or nothing."""
        scope = None if tenant is None else self._account(tenant)
        plan = self._plan(pages, self._pages, scope, protected=set())
        if plan.freed >= pages:
            self._apply(plan, EvictionCause.PRESSURE)
        if scope is not None:
            self._rest(scope)
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
        account = self._account(tenant)
        self._enforce_quota(account)
        self._rest(account)

    def clear(self, tenant: str | None = None) -> int:
        """Drop every chunk (of one tenant, or all). Locked chunks go when unlocked."""
        scope = None if tenant is None else self._tenants.get(tenant)
        if tenant is not None and scope is None:
            return 0
        dropped = 0
        announced: dict[int, list[bytes]] = {}
        for key, slot in list(self._index.items()):
            if scope is not None and self._tenant[slot] != scope.index:
                continue
            dropped += 1
            if self._state[slot] == State.READY:
                announced.setdefault(self._tenant[slot], []).append(key)
            if self._state[slot] == State.READY and self._readers[slot] == 0:
                self._remove_from_policy(slot, evicted=False)
                self._free(slot)
            else:
                if self._state[slot] == State.READY:
                    self._remove_from_policy(slot, evicted=False)
                    self._withdraw(slot)
                self._state[slot] = State.DOOMED
                del self._index[key]
        self._announce_removed(announced, "cleared")
        self._trim_idle()
        return dropped

    # ----------------------------------------------------------- warm restart

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
        if self._index or self._journal is None:
            raise RuntimeError("restore() needs a fresh cache with a journal")
        total = self._allocator.total_pages
        valid: list[tuple[ChunkRecord, bool]] = []
        discarded: list[int] = []
        for writing, group in ((False, records), (True, reserved)):
            for record in group:
                if isinstance(record, int) or not self._fits(record):
                    discarded.append(record if isinstance(record, int) else record.slot)
                else:
                    valid.append((record, writing))
        kept: list[ChunkRecord] = []
        held: list[ChunkRecord] = []
        end = 0
        for record, writing in sorted(valid, key=lambda pair: pair[0].first_page):
            if record.first_page < end or (not writing and record.key in self._index):
                discarded.append(record.slot)
                continue
            if writing:
                held.append(record)
            else:
                kept.append(record)
                self._index[record.key] = record.slot
            end = record.first_page + record.pages
        for slot in discarded:
            self._journal.erase(slot)
        self._allocator = ExtentAllocator(total, [(r.first_page, r.pages) for r in kept + held])
        for record in sorted(kept, key=lambda r: r.sequence) + held:
            self._adopt(record)
        if held:
            for record in held:
                self._remove_from_policy(record.slot, evicted=False)
            lease = _Lease(writing=True, slots=[r.slot for r in held], expires=0.0)
            self._quarantine_lease(next(self._lease_ids), lease, self._clock())
        for record in kept:
            parent = record.parent
            if (
                0 <= parent < total
                and self._state[parent] == State.READY
                and self._sequence[parent] == record.parent_sequence
                and self._tenant[parent] == self._tenant[record.slot]
            ):
                self._link(record.slot, parent)
        used = {record.slot for record in kept + held}
        self._free_slots = array("i", (s for s in range(total - 1, -1, -1) if s not in used))
        self._commit_sequence = max((r.sequence for r in kept), default=0)
        return RestoreReport(len(kept), len(discarded), len(held))

    def _fits(self, record: ChunkRecord) -> bool:
        """Whether a journal record lies inside the data region and agrees with its size."""
        page, total = self.layout.page_size, self._allocator.total_pages
        return (
            0 <= record.slot < total
            and record.pages > 0
            and 0 <= record.first_page <= total - record.pages
            and (record.pages - 1) * page < record.nbytes <= record.pages * page
        )

    def _adopt(self, record: ChunkRecord) -> None:
        slot, account = record.slot, self._account(record.tenant)
        self._keys[slot] = record.key
        self._state[slot] = State.READY
        if self._probe_table is not None:
            self._probe_table.publish(record.key, account.name)
        self._first_page[slot] = record.first_page
        self._offsets[slot] = self._offset_of(record.first_page)
        self._pages[slot] = record.pages
        self._nbytes[slot] = record.nbytes
        self._tenant[slot] = account.index
        self._readers[slot] = 0
        self._link(slot, NIL)
        self._last_use[slot] = self._next_tick()
        self._sequence[slot] = record.sequence
        account.policy.insert(slot, record.key)
        account.used_bytes += record.nbytes
        account.chunks += 1
        self._stored_bytes += record.nbytes
        self._over_quota.add(account.name)  # the quota may have shrunk while it was away

    def _record_of(self, slot: int) -> ChunkRecord:
        self._commit_sequence += 1
        self._sequence[slot] = self._commit_sequence
        parent = self._parent[slot]
        return ChunkRecord(
            slot,
            parent,
            self._key(slot),
            self._tenant_list[self._tenant[slot]].name,
            self._first_page[slot],
            self._pages[slot],
            self._nbytes[slot],
            self._commit_sequence,
            0 if parent == NIL else self._sequence[parent],  # sequences start at 1
        )

    # ------------------------------------------------------------------ stats

    @property
    def open_write_leases(self) -> int:
        """Reservations not yet committed or released (transfers in flight into L1)."""
        return self._write_leases

    def contains(self, key: bytes) -> bool:
        slot = self._index.get(key, NIL)
        return slot != NIL and self._state[slot] == State.READY

    def iter_keys(self, tenant: str | None = None) -> Iterator[bytes]:
        """Keys of ready chunks (of one tenant, or all)."""
        scope = None if tenant is None else self._tenants.get(tenant)
        if tenant is not None and scope is None:
            return
        for key, slot in self._index.items():
            if self._state[slot] == State.READY and (
                scope is None or self._tenant[slot] == scope.index
            ):
                yield key

    def keys_by_tenant(self) -> dict[str, list[bytes]]:
        """Every ready key, grouped by tenant."""
        grouped: dict[str, list[bytes]] = {}
        for key, slot in self._index.items():
            if self._state[slot] == State.READY:
                grouped.setdefault(self._tenant_list[self._tenant[slot]].name, []).append(key)
        return grouped

    def tenant_usage(self, tenant: str) -> TenantStats:
        """Usage of one tenant; asking about an unknown tenant does not create it."""
        account = self._tenants.get(tenant)
        if account is None:
            return TenantStats(tenant, 0, 0, self.quotas.limit(tenant), 0, 0, 0, 0)
        return self.tenant_stats(account)

    def tenant_records(self) -> list[TenantRecord]:
        """Every tenant record: a copy of the list only, cheap enough to take under a lock.

        The records stay live; :meth:`tenant_stats` reads one later (outside the lock, each
        counter is read whole, though two counters of one record may be a moment apart).
        """
        return list(self._tenants.values())

    def stats(self) -> L1Stats:
        page = self.layout.page_size
        allocated_pages = self._allocator.total_pages - self._allocator.free_pages
        allocated = allocated_pages * page
        return L1Stats(
            capacity_bytes=self.layout.data_size,
            allocated_bytes=allocated,
            stored_bytes=self._stored_bytes,
            chunks=len(self._index),
            held_chunks=len(self._keys) - len(self._free_slots),
            hits=self._hits,
            misses=self._misses,
            written_bytes=self._written_bytes,
            read_bytes=self._read_bytes,
            evictions={cause.value: self._evictions[cause] for cause in EvictionCause},
            lock_expiries=self._lock_expiries,
            open_leases=len(self._leases),
            quarantined_leases=self._quarantine.total,
            quarantined_bytes=page
            * sum(
                self._pages[slot]
                for held in self._quarantine.leases.values()
                for slot in held.slots
            ),
            free_extents=self._allocator.free_extent_count,
            fragmentation=self._allocator.fragmentation(),
            page_waste=(allocated - self._stored_bytes) / allocated if allocated else 0.0,
            tenant_count=len(self._tenants),
        )

    # -------------------------------------------------------------- debugging

    def debug_view(self) -> L1DebugView:
        """A copy of the bookkeeping: slots, index, free pages, leases and records."""
        names = [account.name for account in self._tenant_list]
        allocator = self._allocator

        def lease_view(record: _Lease) -> LeaseView:
            return LeaseView(record.writing, tuple(record.slots), record.expires)

        total = len(self._keys)
        return L1DebugView(
            slots=tuple(
                map(
                    SlotView,
                    range(total),
                    map(_STATES.__getitem__, self._state),
                    self._keys,
                    [None if tenant == NIL else names[tenant] for tenant in self._tenant],
                    self._offsets,
                    self._first_page,
                    self._pages,
                    self._nbytes,
                    self._readers,
                    self._parent,
                    [tuple(self._children(slot)) for slot in range(total)],
                )
            ),
            index=dict(self._index),
            free_slots=tuple(self._free_slots),
            free_extents=tuple(allocator.free_extents()),
            total_pages=allocator.total_pages,
            free_pages=allocator.free_pages,
            high_pages=self._high_pages,
            low_pages=self._low_pages,
            leases={lease: lease_view(record) for lease, record in self._leases.items()},
            quarantined={
                lease: lease_view(record) for lease, record in self._quarantine.leases.items()
            },
            tenants={
                name: TenantView(name, account.used_bytes, account.chunks)
                for name, account in self._tenants.items()
            },
            record_places=len(self._tenant_list),
        )

    def check_invariants(self) -> None:
        """Check every rule the bookkeeping keeps; raise :class:`InvariantError` naming one broken.

        Takes time linear in the slots, leases and records: for tests and debugging.
        """
        self._check_slots()
        self._check_pages()
        self._check_index()
        self._check_chains()
        self._check_leases()
        self._check_quarantine()
        self._check_records()
        self._check_usage()
        self._check_policies()

    def _check_slots(self) -> None:
        """A slot is free exactly when listed free; a live one is charged, sized and placed."""
        free = set(self._free_slots)
        if len(free) != len(self._free_slots):
            raise _broken("free slots", "a slot is listed free twice")
        for slot in range(len(self._keys)):
            state = self._state[slot]
            if state not in _STATE_VALUES:
                raise _broken("slots", f"slot {slot} is in no state ({state})")
            if state == State.FREE:
                if slot not in free:
                    raise _broken("free slots", f"free slot {slot} is not listed free")
                if self._keys[slot] is not None or self._tenant[slot] != NIL:
                    raise _broken("free slots", f"free slot {slot} keeps a key or a tenant")
                if self._readers[slot] or self._sequence[slot]:
                    raise _broken("free slots", f"free slot {slot} keeps readers or a number")
                continue
            if slot in free:
                raise _broken("free slots", f"slot {slot} holds a chunk but is listed free")
            self._check_live_slot(slot)

    def _check_live_slot(self, slot: int) -> None:
        tenant = self._tenant[slot]
        if self._keys[slot] is None:
            raise _broken("slots", f"slot {slot} holds no key")
        if not (
            0 <= tenant < len(self._tenant_list)
            and self._tenants.get(self._tenant_list[tenant].name) is self._tenant_list[tenant]
        ):
            raise _broken(
                "slots", f"slot {slot} is charged to place {tenant}, which holds no record"
            )
        nbytes, pages = self._nbytes[slot], self._pages[slot]
        if nbytes <= 0 or pages != self._pages_for(nbytes):
            raise _broken("slots", f"slot {slot} holds {nbytes} bytes on {pages} pages")
        if self._offsets[slot] != self._offset_of(self._first_page[slot]):
            raise _broken("slots", f"slot {slot}'s offset is not its first page's")
        if self._readers[slot] < 0:
            raise _broken("slots", f"slot {slot} has {self._readers[slot]} readers")
        if self._last_use[slot] > self._tick:
            raise _broken("slots", f"slot {slot} was used at a tick still to come")
        # A quarantined slot may keep the number of a record from before a restart.
        if self._state[slot] != State.QUARANTINED and self._sequence[slot] > self._commit_sequence:
            raise _broken("slots", f"slot {slot}'s commit number was never handed out")

    def _check_pages(self) -> None:
        """Live chunks and free extents cover the data region exactly, without overlap."""
        allocator = self._allocator
        free = allocator.free_extents()
        if allocator.free_pages != sum(pages for _, pages in free):
            raise _broken("pages", f"{allocator.free_pages} pages counted free, not the extents'")
        runs = free + [
            (self._first_page[slot], self._pages[slot])
            for slot in range(len(self._keys))
            if self._state[slot] != State.FREE
        ]
        position = 0
        for start, pages in sorted(runs):
            if start != position:
                raise _broken("pages", f"overlap or hole at page {position}")
            position += pages
        if position != allocator.total_pages:
            raise _broken("pages", f"chunks and free extents end at page {position}")

    def _check_index(self) -> None:
        """The index holds exactly the chunks being written or ready, each under its key."""
        for key, slot in self._index.items():
            if self._keys[slot] != key or self._state[slot] not in _FINDABLE:
                raise _broken(
                    "index",
                    f"key {key.hex()[:12]} names slot {slot}, which holds another key "
                    f"or is {_STATES[self._state[slot]].name}",
                )
        findable = sum(1 for state in self._state if state in _FINDABLE)
        if findable != len(self._index):
            raise _broken(
                "index", f"{findable} chunks are written or ready, {len(self._index)} indexed"
            )

    def _check_chains(self) -> None:
        """Links are mutual, stay within a tenant and never loop; unlinked slots have none."""
        total = len(self._keys)
        for slot in range(total):
            parent = self._parent[slot]
            if self._state[slot] in (State.FREE, State.QUARANTINED):
                if (parent, self._first_child[slot]) != (NIL, NIL) or (
                    self._next_sibling[slot],
                    self._prev_sibling[slot],
                ) != (NIL, NIL):
                    raise _broken(
                        "chains", f"{_STATES[self._state[slot]].name} slot {slot} is linked"
                    )
                continue
            if parent != NIL:
                if self._state[parent] not in _LINKABLE:
                    raise _broken("chains", f"slot {slot}'s predecessor {parent} holds no chunk")
                if self._tenant[parent] != self._tenant[slot]:
                    raise _broken("chains", f"slot {slot}'s chain crosses tenants at {parent}")
                if slot not in self._children(parent):
                    raise _broken("chains", f"slot {slot} is not a child of its predecessor")
            before, child = NIL, self._first_child[slot]
            for _ in range(total):
                if child == NIL:
                    break
                if self._parent[child] != slot or self._prev_sibling[child] != before:
                    raise _broken("chains", f"slot {child} is listed a child of {slot}, not linked")
                before, child = child, self._next_sibling[child]
            if child != NIL:
                raise _broken("chains", f"slot {slot}'s children loop")
        settled: set[int] = set()
        for start in range(total):
            path: set[int] = set()
            slot = start
            while slot != NIL and slot not in settled:
                if slot in path:
                    raise _broken("chains", f"the chain through slot {start} loops")
                path.add(slot)
                slot = self._parent[slot]
            settled |= path

    def _check_leases(self) -> None:
        """Every lock belongs to an open lease, every chunk being written to one write lease."""
        readers: Counter[int] = Counter()
        writers: Counter[int] = Counter()
        scheduled = set(self._expiry_heap)
        for lease, record in self._leases.items():
            if lease in self._quarantine.leases:
                raise _broken("leases", f"lease {lease} is both open and quarantined")
            if record.expires != math.inf and (record.expires, lease) not in scheduled:
                raise _broken(
                    "leases", f"lease {lease} is not in the expiry heap: it never expires"
                )
            (writers if record.writing else readers).update(record.slots)
            allowed = (State.WRITING if record.writing else State.READY, State.DOOMED)
            for slot in record.slots:
                if self._state[slot] not in allowed:
                    name = _STATES[self._state[slot]].name
                    raise _broken("leases", f"lease {lease} holds slot {slot}, which is {name}")
        if self._write_leases != sum(record.writing for record in self._leases.values()):
            raise _broken("leases", f"{self._write_leases} write leases counted open")
        for slot in range(len(self._keys)):
            state = self._state[slot]
            if self._readers[slot] != readers[slot]:
                raise _broken(
                    "leases",
                    f"slot {slot} has {self._readers[slot]} readers, {readers[slot]} read leases",
                )
            if state == State.DOOMED:
                if not readers[slot] + writers[slot]:
                    raise _broken("leases", f"cleared slot {slot} is held by no lease: never freed")
                if writers[slot] > 1:
                    raise _broken("leases", f"slot {slot} is held by {writers[slot]} write leases")
            elif writers[slot] != (state == State.WRITING):
                raise _broken("leases", f"slot {slot} is held by {writers[slot]} write leases")

    def _check_quarantine(self) -> None:
        """Expired write leases hold their slots, fences ending oldest first."""
        held: Counter[int] = Counter()
        fence = -math.inf
        for lease, record in self._quarantine.leases.items():
            if not record.writing:
                raise _broken("quarantine", f"read lease {lease} is quarantined")
            if record.expires < fence:
                raise _broken("quarantine", f"lease {lease}'s fence ends before an older one's")
            fence = record.expires
            held.update(record.slots)
        for slot in range(len(self._keys)):
            if held[slot] != (self._state[slot] == State.QUARANTINED):
                raise _broken(
                    "quarantine",
                    f"{_STATES[self._state[slot]].name} slot {slot} is held by {held[slot]} "
                    "quarantined leases",
                )

    def _check_records(self) -> None:
        """Each record sits at its place in the list; dropped records' places are vacant."""
        records, places, idle = self._tenants, self._tenant_list, self._idle
        for name, account in records.items():
            if account.name != name:
                raise _broken("records", f"record {account.name!r} is filed as {name!r}")
            if not (0 <= account.index < len(places) and places[account.index] is account):
                raise _broken("records", f"record {name!r} is not at its place")
        if len(set(idle.vacancies)) != len(idle.vacancies) or any(
            places[place] is not idle.vacant for place in idle.vacancies
        ):
            raise _broken("records", "a vacancy is listed twice or holds a record")
        if len(records) + len(idle.vacancies) != len(places):
            raise _broken(
                "records",
                f"{len(records)} records, {len(idle.vacancies)} vacancies, {len(places)} places",
            )
        for name, account in idle.records.items():
            if records.get(name) is not account:
                raise _broken("records", f"idle record {name!r} is not a record")
        vacant = idle.vacant
        if vacant.used_bytes or vacant.chunks or next(vacant.policy.victims(), None) is not None:
            raise _broken("records", "the vacant record was charged")

    def _check_usage(self) -> None:
        """Each record's bytes and chunks, and the cache's, are what its slots hold."""
        used: Counter[int] = Counter()
        chunks: Counter[int] = Counter()
        for slot in range(len(self._keys)):
            if self._state[slot] != State.FREE:
                used[self._tenant[slot]] += self._nbytes[slot]
                chunks[self._tenant[slot]] += 1
        for account in self._tenants.values():
            if (account.used_bytes, account.chunks) != (used[account.index], chunks[account.index]):
                raise _broken(
                    "usage",
                    f"record {account.name!r} counts {account.used_bytes} bytes in "
                    f"{account.chunks} chunks; its slots hold {used[account.index]} in "
                    f"{chunks[account.index]}",
                )
        if self._stored_bytes != sum(used.values()):
            raise _broken("usage", f"{self._stored_bytes} bytes counted, {sum(used.values())} held")

    def _check_policies(self) -> None:
        """Each record's policy orders exactly the record's ready chunks, each once."""
        ready: dict[int, set[int]] = {}
        for slot in range(len(self._keys)):
            if self._state[slot] == State.READY:
                ready.setdefault(self._tenant[slot], set()).add(slot)
        for account in self._tenants.values():
            victims = list(account.policy.victims())
            if len(victims) != len(set(victims)) or set(victims) != ready.get(account.index, set()):
                raise _broken(
                    "policies",
                    f"record {account.name!r}'s policy orders {victims}, its ready chunks are "
                    f"{sorted(ready.get(account.index, set()))}",
                )

    # -------------------------------------------------------------- internals

    def _account(self, tenant: str) -> _Tenant:
        account = self._tenants.get(tenant)
        if account is None:
            self._trim_idle()  # before the new record exists: it is in use, never dropped
            policy = self._policy_factory(self._arena)
            if self._idle.vacancies:
                account = _Tenant(tenant, self._idle.vacancies.pop(), policy)
                self._tenant_list[account.index] = account
            else:
                account = _Tenant(tenant, len(self._tenant_list), policy)
                self._tenant_list.append(account)
            self._tenants[tenant] = account
        return account

    def _holds_nothing(self, account: _Tenant) -> bool:
        return not account.chunks and not self.quotas.has_own(account.name)

    def _rest(self, account: _Tenant) -> None:
        """After using a record: one that holds nothing becomes the most recent idle one."""
        idle = self._idle.records
        if self._holds_nothing(account):
            idle[account.name] = account
            idle.move_to_end(account.name)
        else:
            idle.pop(account.name, None)

    def _trim_idle(self) -> None:
        """Drop the least recently used idle records past the bound (none may be in use)."""
        idle = self._idle
        while len(idle.records) > idle.bound:
            _, account = idle.records.popitem(last=False)
            if self._holds_nothing(account):  # else it was given chunks since it rested
                del self._tenants[account.name]
                self._tenant_list[account.index] = idle.vacant
                idle.vacancies.append(account.index)

    def tenant_stats(self, account: TenantRecord) -> TenantStats:
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

    def _make_room(self, account: _Tenant, nbytes: int, protected: set[int]) -> str | None:
        """Evict the tenant's own chunks so ``nbytes`` more fit its quota; a reason if not."""
        limit = self.quotas.limit(account.name)
        if limit is None:
            return None
        if nbytes > limit:
            return f"chunk of {nbytes} bytes exceeds the tenant quota of {limit} bytes"
        excess = account.used_bytes + nbytes - limit
        if excess <= 0:
            return None
        plan = self._plan(excess, self._nbytes, account, protected)
        if plan.freed < excess:
            return f"tenant quota of {limit} bytes is full of locked chunks"
        self._apply(plan, EvictionCause.QUOTA)
        return None

    def _place(
        self, account: _Tenant, key: bytes, nbytes: int, parent: int, protected: set[int]
    ) -> int:
        pages = self._pages_for(nbytes)
        first_page = self._allocate(pages, protected)
        if first_page is None:
            return NIL
        slot = self._free_slots.pop()
        self._keys[slot] = key
        self._state[slot] = State.WRITING
        self._first_page[slot] = first_page
        self._offsets[slot] = self._offset_of(first_page)
        self._pages[slot] = pages
        self._nbytes[slot] = nbytes
        self._tenant[slot] = account.index
        self._readers[slot] = 0
        self._index[key] = slot
        self._link(slot, parent)
        account.used_bytes += nbytes
        account.chunks += 1
        self._stored_bytes += nbytes
        if self._journal is not None:  # its writer may outlive this agent: see restore()
            record = ChunkRecord(slot, NIL, key, account.name, first_page, pages, nbytes, 0, 0)
            self._journal.record(record, RESERVED)
        return slot

    def _pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.layout.page_size)

    def _pages_wanted(self, keys: Sequence[bytes], sizes: Sequence[int]) -> int:
        """Pages of the chunks of a run that L1 does not hold yet."""
        cached = self._index
        return sum(self._pages_for(n) for k, n in zip(keys, sizes, strict=True) if k not in cached)

    def _allocate(self, pages: int, protected: set[int]) -> int | None:
        while True:
            first_page = self._allocator.allocate(pages)
            if first_page is not None:
                return first_page
            plan = self._plan(pages, self._pages, None, protected)
            if not plan.victims:
                return None
            self._apply(plan, EvictionCause.PRESSURE)

    def _evict_to_watermark(self, extra_pages: int, protected: set[int]) -> None:
        used = self._allocator.total_pages - self._allocator.free_pages + extra_pages
        if used <= self._high_pages:
            return
        # Best effort: as far towards the low watermark as unlocked chunks allow.
        plan = self._plan(used - self._low_pages, self._pages, None, protected)
        self._apply(plan, EvictionCause.WATERMARK)

    def _enforce_quota(self, account: _Tenant) -> None:
        limit = self.quotas.limit(account.name)
        if limit is not None and account.used_bytes > limit:
            plan = self._plan(account.used_bytes - limit, self._nbytes, account, protected=set())
            self._apply(plan, EvictionCause.QUOTA)
        if limit is not None and account.used_bytes > limit:
            self._over_quota.add(account.name)  # its chunks are locked: maintain tries again
        else:
            self._over_quota.discard(account.name)

    def _plan(
        self,
        need: int,
        measure: array[int],
        scope: _Tenant | None,
        protected: set[int],
    ) -> _EvictionPlan:
        """Choose victims worth ``need`` (in ``measure`` units) without changing anything.

        Only chain tails are victims, so what stays is whole prefixes whatever order the
        policy proposes (a long prompt stored over several steps has its head oldest). A
        chunk proposed while it has children waits, and goes the moment its last child
        does: the policy ranked it before everything still to come. A chunk with a locked
        descendant, or one being written, stays: it is the prefix of a chunk in use (with
        L2, only while tails alone make room). Chunks still waiting at the end get a
        second chance (see :meth:`_requeue`).
        """
        plan = _EvictionPlan()
        first_child = self._first_child
        for slot in self._victim_order(scope):
            if plan.freed >= need:
                break
            if not self._evictable(slot, protected):
                continue
            if first_child[slot] != NIL:
                kept = sum(1 for child in self._children(slot) if child not in plan.victims)
                if kept:
                    plan.waiting[slot] = kept
                    continue
            self._take(plan, slot, need, measure)
        if plan.freed < need and self.lower_tier:
            # Tails alone do not make room (a chain being extended or written back is all
            # there is): older chunks go too, since a prefetch brings a prefix back. Without
            # this, the rest of a chain longer than L1 would never reach L2 either.
            for slot in list(plan.waiting):
                if plan.freed >= need:
                    break
                del plan.waiting[slot]
                plan.victims[slot] = None
                plan.freed += measure[slot]
        return plan

    def _take(self, plan: _EvictionPlan, slot: int, need: int, measure: array[int]) -> None:
        """Make ``slot`` a victim, then each waiting ancestor that has no child left."""
        victim = slot
        while True:
            plan.victims[victim] = None
            plan.freed += measure[victim]
            parent = self._parent[victim]
            if parent not in plan.waiting or plan.freed >= need:
                return
            plan.waiting[parent] -= 1
            if plan.waiting[parent]:
                return
            del plan.waiting[parent]
            victim = parent

    def _victim_order(self, scope: _Tenant | None) -> Iterator[int]:
        if scope is not None:
            return scope.policy.victims()
        candidates = [account.policy.victims() for account in self._tenant_list if account.chunks]
        return heapq.merge(*candidates, key=self._last_use.__getitem__)

    def _evictable(self, slot: int, protected: set[int]) -> bool:
        return (
            self._state[slot] == State.READY and self._readers[slot] == 0 and slot not in protected
        )

    def _children(self, slot: int) -> Iterator[int]:
        child = self._first_child[slot]
        while child != NIL:
            yield child
            child = self._next_sibling[child]

    def _apply(self, plan: _EvictionPlan, cause: EvictionCause) -> None:
        if self.listener is not None:
            announced: dict[int, list[bytes]] = {}
            for slot in plan.victims:
                announced.setdefault(self._tenant[slot], []).append(self._key(slot))
            self._announce_removed(announced, cause.value)
        for slot in plan.victims:
            self._tenant_list[self._tenant[slot]].evicted_chunks += 1
            self._remove_from_policy(slot, evicted=True)
            self._free(slot)
        self._evictions[cause] += len(plan.victims)
        self._requeue(plan.waiting)

    def _requeue(self, slots: Iterable[int]) -> None:
        """Rank the prefixes an eviction passed over as the newest of their policy's lists.

        Their chains are still cached, so they are in use as much as their tails; and
        without this every later eviction would walk the same heads again to reach the
        tails (a chain stored over several steps has its head oldest).
        """
        by_tenant: dict[int, list[int]] = {}
        for slot in slots:
            by_tenant.setdefault(self._tenant[slot], []).append(slot)
        for tenant, group in by_tenant.items():
            self._tenant_list[tenant].policy.requeue(group)

    def _announce_removed(self, keys_by_tenant: dict[int, list[bytes]], cause: str) -> None:
        if self.listener is not None:
            for tenant, keys in keys_by_tenant.items():
                self.listener.removed(self._tenant_list[tenant].name, keys, cause)

    def _remove_from_policy(self, slot: int, *, evicted: bool) -> None:
        self._tenant_list[self._tenant[slot]].policy.remove(slot, self._key(slot), evicted=evicted)

    def _withdraw(self, slot: int) -> None:
        """The chunk stops being ready: the connectors' schedulers no longer find it."""
        if self._probe_table is not None:
            self._probe_table.withdraw(self._key(slot))

    def _free(self, slot: int) -> None:
        if self._state[slot] == State.READY:
            self._withdraw(slot)
        if self._journal is not None:
            self._journal.erase(slot)  # before the pages can be handed out again
        key = self._key(slot)
        if self._index.get(key) == slot:
            del self._index[key]
        self._unlink(slot)
        self._allocator.free(self._first_page[slot], self._pages[slot])
        account = self._tenant_list[self._tenant[slot]]
        nbytes = self._nbytes[slot]
        account.used_bytes -= nbytes
        account.chunks -= 1
        if not account.chunks:
            self._rest(account)
        self._stored_bytes -= nbytes
        self._keys[slot] = None
        self._sequence[slot] = 0
        self._state[slot] = State.FREE
        self._tenant[slot] = NIL
        self._readers[slot] = 0
        self._free_slots.append(slot)

    def _link(self, slot: int, parent: int) -> None:
        self._parent[slot] = parent
        self._first_child[slot] = NIL
        self._prev_sibling[slot] = NIL
        self._next_sibling[slot] = NIL
        if parent == NIL:
            return
        sibling = self._first_child[parent]
        self._next_sibling[slot] = sibling
        if sibling != NIL:
            self._prev_sibling[sibling] = slot
        self._first_child[parent] = slot

    def _unlink(self, slot: int) -> None:
        parent = self._parent[slot]
        before, after = self._prev_sibling[slot], self._next_sibling[slot]
        if before != NIL:
            self._next_sibling[before] = after
        elif parent != NIL:
            self._first_child[parent] = after
        if after != NIL:
            self._prev_sibling[after] = before
        child = self._first_child[slot]
        while child != NIL:  # orphans: unreachable, left for the policy to evict
            following = self._next_sibling[child]
            self._parent[child] = NIL
            self._prev_sibling[child] = NIL
            self._next_sibling[child] = NIL
            child = following
        self._parent[slot] = NIL
        self._first_child[slot] = NIL
        self._prev_sibling[slot] = NIL
        self._next_sibling[slot] = NIL

    def _open_lease(self, *, writing: bool, slots: list[int], expires: float | None = None) -> int:
        lease = next(self._lease_ids)
        self._write_leases += writing
        if expires is None:
            expires = self._clock() + self.lease_seconds
        self._leases[lease] = _Lease(writing, slots, expires)
        if expires != math.inf:
            heapq.heappush(self._expiry_heap, (expires, lease))
        return lease

    def _take_lease(self, lease: int) -> _Lease:
        record = self._leases.pop(lease, None)
        if record is None:
            if lease in self._quarantine.leases:
                raise LeaseExpired(
                    f"lease {lease} expired before its commit; its chunks were dropped and "
                    "its pages stay unused until its session ends or a fence passes"
                )
            raise UnknownLease(f"lease {lease} is unknown, already ended or expired")
        self._write_leases -= record.writing
        return record

    def _put_back(self, lease: int, record: _Lease) -> None:
        self._leases[lease] = record
        self._write_leases += record.writing

    def _quarantine_lease(self, lease: int, record: _Lease, now: float) -> None:
        """Hold an expired write lease's pages: unreachable and unusable, still allocated."""
        for slot in record.slots:
            key = self._key(slot)
            if self._index.get(key) == slot:
                del self._index[key]  # the key may be stored again, elsewhere
            self._unlink(slot)
            self._state[slot] = State.QUARANTINED
        record.expires = now + self._quarantine.fence_seconds
        self._quarantine.leases[lease] = record
        self._quarantine.total += 1

    def _end_quarantine(self, lease: int) -> None:
        for slot in self._quarantine.leases.pop(lease).slots:
            self._free(slot)

    def _end_lease(self, record: _Lease) -> None:
        if record.writing:
            for slot in record.slots:
                self._free(slot)
            return
        readers, state = self._readers, self._state
        for slot in record.slots:
            readers[slot] -= 1
            if state[slot] == _DOOMED and readers[slot] == 0:
                self._free(slot)

    def _offset(self, slot: int) -> int:
        return self._offsets[slot]

    def _offset_of(self, first_page: int) -> int:
        return self.layout.data_offset + first_page * self.layout.page_size

    def _key(self, slot: int) -> bytes:
        key = self._keys[slot]
        assert key is not None, f"slot {slot} holds no chunk"
        return key

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick


def _check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidRequest(f"keys are {KEY_BYTES} bytes")


def _broken(invariant: str, detail: str) -> InvariantError:
    return InvariantError(f"L1 invariant broken ({invariant}): {detail}")
