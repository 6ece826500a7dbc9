"""The hot path: reserve, commit and look up chunks, and count the traffic.

Every store and every lookup of every connector comes through here, under the service's
lock: the loops bind what they read to locals once and do nothing else. What the
cycle keeps (a chunk's life cycle, which chunks may be evicted to make room) is told
in :mod:`kvpool.agent.core.l1`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat

from kvpool.agent.core.cache_types import InvalidRequest, Placement, Reservation
from kvpool.agent.core.l1.chunks import Chunks
from kvpool.agent.core.l1.eviction import Evictor
from kvpool.agent.core.l1.leases import LeaseTable
from kvpool.agent.core.l1.slots import DOOMED, NIL, READY
from kvpool.agent.core.l1.tenants import Tenant
from kvpool.common.keys import KEY_BYTES
from kvpool.common.transfer_results import LookupResult


@dataclass
class Traffic:
    """The reserve/commit/lookup cycle's counters, cache-wide."""

    hits: int = 0
    misses: int = 0
    written_bytes: int = 0
    read_bytes: int = 0


class ChunkCycle:
    """Reserve, commit, look up: see :class:`~kvpool.agent.core.l1.L1Cache`'s methods."""

    def __init__(
        self, chunks: Chunks, leases: LeaseTable, evictor: Evictor, traffic: Traffic
    ) -> None:
        self._chunks = chunks
        # Bound once: the slot table, the index and the records are never replaced.
        self._slots = chunks.slots
        self._index = chunks.index
        self._tenants = chunks.tenants
        self._pins = chunks.pins
        self._leases = leases
        self._evictor = evictor
        self._traffic = traffic

    def reserve(
        self,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None,
        keep: Sequence[bytes],
    ) -> Reservation:
        check_keys(keys)
        if len(sizes) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(sizes)} sizes")
        data_size = self._chunks.layout.data_size
        if any(not 0 < size <= data_size for size in sizes):
            raise InvalidRequest(
                f"chunk sizes must be positive and at most the segment's {data_size}"
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
        protected.update(self._cached_slots(chain(keep, keys)))
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

    def _cached_slots(self, keys: Iterable[bytes]) -> set[int]:
        """The slots of those of ``keys`` that L1 holds (a prefetch's kept keys grow with its
        prefix: mapped in C, not in a Python loop)."""
        slots = set(map(self._index.get, keys, repeat(NIL)))
        slots.discard(NIL)
        return slots

    def _pages_wanted(self, account: Tenant, keys: Sequence[bytes], sizes: Sequence[int]) -> int:
        """Pages of the chunks of a run that L1 does not hold yet, as far as its tenant's
        quota lets the tenant grow: past that, its chunks take the place of its own (or are
        refused), and room made for them would only evict other tenants' chunks."""
        cached, pages_for = self._index, self._chunks.pages_for
        limit = self._tenants.quotas.limit(account.name)
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

    def commit(self, lease: int, count: int | None) -> int:
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

    def lookup(self, tenant: str, keys: Sequence[bytes], lock: bool, count: bool) -> LookupResult:
        """The hot path of the agent: locals are bound once and the loops do nothing else."""
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


def check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidRequest(f"keys are {KEY_BYTES} bytes")
