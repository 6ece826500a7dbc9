"""Property tests of the L1 cache: a hypothesis state machine per registered eviction policy.

The machine keeps a small model (open leases, what each of them locks, which
locked entries were cleared, the order of commits) and checks the cache against it,
through the cache's debug view, and the cache's own bookkeeping (``check_invariants``)
after every step. The cache runs as the agent's does, over a segment with its chunk
table (the journal) and a probe table, so that a step may also restart it: a new
cache adopts the segment and restores from the journal, and the machine goes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import random
import shutil
import tempfile
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvpool.agent.core.cache_types import (
    CacheError,
    InvalidRequest,
    LeaseExpired,
    RestoreReport,
    UnknownLease,
)
from kvpool.agent.core.journal import SegmentJournal
from kvpool.agent.core.l1 import NIL, L1Cache, L1DebugView, SlotView, State
from kvpool.agent.core.policies import POLICY_NAMES, policy_factory
from kvpool.agent.core.quota_book import QuotaBook
from kvpool.common.probe_table import ProbeTableReader, ProbeTableWriter
from kvpool.common.quotas import Limit
from kvpool.common.segment import SegmentLayout, SharedSegment

PAGE = 4096
PAGES = 64
LAYOUT = SegmentLayout.plan(PAGE * PAGES, PAGE)  # with a chunk table: one record per page
AGENT_ID = "l1-machine"
LEASE_SECONDS = 30.0
FENCE_SECONDS = 60.0
HIGH, LOW = 0.9, 0.8
TENANTS = ("t0", "t1", "t2", "t3")
KEYS_PER_TENANT = 16
PROMPT_KEYS = 1000
"""Long prompts take keys from PROMPT_KEYS on, each a range of its own."""

QUOTAS: st.SearchStrategy[Limit] = st.one_of(
    st.none(),
    st.none(),
    st.none(),
    st.just(0),
    st.integers(1, 16).map(lambda pages: pages * PAGE),
    st.integers(1, 20 * PAGE),
)
SIZES = st.integers(1, 3 * PAGE)
CHOICE = st.integers(0, 10_000)  # index into whatever the model holds, modulo its length
LAST_SEEN = -1  # as a parent choice: the key seen last (continue the latest run)
Place = tuple[bytes | None, int]
"""A chunk told apart from others of its key: (key, offset)."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key_of(tenant: str, index: int) -> bytes:
    """Keys are tenant-salted in kvpool (see keys.py), so each tenant gets its own pool."""
    return hashlib.sha256(f"{tenant}/{index}".encode()).digest()


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE)


@dataclass
class LeaseModel:
    tenant: str
    writing: bool
    entries: list[tuple[bytes, int]]  # (key, offset) per locked or reserved chunk
    expires: float
    doomed: set[int] = field(default_factory=set)  # entry positions cleared meanwhile

    def live_entries(self) -> list[tuple[bytes, int]]:
        return [entry for i, entry in enumerate(self.entries) if i not in self.doomed]


class L1Machine(RuleBasedStateMachine):
    policy = "lru"
    # Real keys are tenant-salted and never collide across tenants; a shared pool plays
    # a broken or hostile client that sends another tenant's keys.
    shared_keys = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.cache = L1Cache(LAYOUT, policy_factory(self.policy), QuotaBook(), clock=self.clock)
        # What outlives an agent: the segment (anonymous memory, laid out as the agent's),
        # and the stored quotas.
        self.segment = SharedSegment(Path("anonymous"), LAYOUT, mmap.mmap(-1, LAYOUT.total_size))
        self.directory = Path(tempfile.mkdtemp(prefix="kvpool-l1-machine-"))
        self.journal: SegmentJournal | None = None
        self.probe_table: ProbeTableWriter | None = None
        self.default_quota: Limit = None
        self.own_quotas: dict[str, Limit] = {}
        self.idle_tenants = 0
        self.leases: dict[int, LeaseModel] = {}
        self.quarantined: dict[int, tuple[LeaseModel, float]] = {}
        """Expired write leases and the end of their fence."""
        self.dead_leases: list[int] = []
        self.seen_keys: list[bytes] = []
        self.previous_used: dict[str, int] = {}
        self.commits: dict[Place, int] = {}
        """When each chunk was last committed, numbered as the journal numbers commits."""
        self.commit_count = 0
        self.prompts = 0
        """Long prompts stored so far: each gets keys of its own."""

    def teardown(self) -> None:
        if self.journal is not None:
            self.journal.close()
        if self.probe_table is not None:
            self.probe_table.close()
        self.segment.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # ---------------------------------------------------------------- helpers

    def open_cache(self, quotas: QuotaBook, lower_tier: bool) -> L1Cache:
        """An agent's cache over the segment, built as ``open_l1`` (core/factory.py) builds
        it: a journal over the segment's chunk table, a new probe table."""
        self.journal = SegmentJournal(self.segment)
        self.probe_table = ProbeTableWriter(self.directory / "segment.probe", PAGES, AGENT_ID)
        cache = L1Cache(
            LAYOUT,
            policy_factory(self.policy),
            quotas,
            high_watermark=HIGH,
            low_watermark=LOW,
            lease_seconds=LEASE_SECONDS,
            fence_seconds=FENCE_SECONDS,
            clock=self.clock,
            journal=self.journal,
            idle_tenants=self.idle_tenants,
            probe_table=self.probe_table,
        )
        cache.lower_tier = lower_tier
        return cache

    def key(self, tenant: str, index: int) -> bytes:
        return key_of("shared" if self.shared_keys else tenant, index)

    def view(self) -> L1DebugView:
        return self.cache.debug_view()

    def ready_keys(self, tenant: str) -> set[bytes]:
        """The tenant's ready keys, asked of every tenant: one the cache has no account for
        (never stored, or forgotten once idle) has none (``iter_keys`` once listed everyone's
        keys for it)."""
        keys = set(self.cache.iter_keys(tenant))
        if tenant not in {record.name for record in self.cache.tenant_records()}:
            assert not keys, f"iter_keys lists {len(keys)} keys for {tenant}, which has no account"
        return keys

    def ready_by_tenant(self) -> dict[str, set[bytes]]:
        return {tenant: self.ready_keys(tenant) for tenant in TENANTS}

    def offset_of(self, key: bytes) -> int:
        return self.view().slot_of(key).offset

    def used_pages(self) -> int:
        return self.view().used_pages

    def roomy(self, view: L1DebugView, pages: int) -> bool:
        """Whether ``pages`` more fit below the high watermark, in one free extent."""
        largest = max((length for _, length in view.free_extents), default=0)
        return view.used_pages + pages <= view.high_pages and pages <= largest

    def evictable_slots(
        self,
        tenant: str | None = None,
        kept: Set[int] = frozenset(),
        view: L1DebugView | None = None,
    ) -> list[int]:
        """Ready, unlocked chunks whose descendants are all evictable too: what tails alone
        can free, with L2 tiers or without. ``kept``: slots a store protects."""
        view = self.view() if view is None else view
        known: dict[int, bool] = {}

        def evictable(slot: int) -> bool:
            if slot not in known:
                data = view.slots[slot]
                known[slot] = (
                    data.state == State.READY
                    and data.readers == 0
                    and slot not in kept
                    and all(evictable(child) for child in data.children)
                )
            return known[slot]

        return [
            slot.slot
            for slot in view.live()
            if evictable(slot.slot) and tenant in (None, slot.tenant)
        ]

    def ready_parent_links(self, view: L1DebugView | None = None) -> set[tuple[Place, Place]]:
        """(chunk, predecessor) of every live chunk whose predecessor is ready."""
        view = self.view() if view is None else view
        return {
            ((slot.key, slot.offset), (view.slots[slot.parent].key, view.slots[slot.parent].offset))
            for slot in view.live()
            if slot.parent != NIL and view.slots[slot.parent].state == State.READY
        }

    def assert_no_orphans_made(
        self, links: set[tuple[Place, Place]], stored: Sequence[bytes] = (), *, short: bool = False
    ) -> None:
        """Eviction takes a chunk only after all of its descendants, with L2 tiers too.

        The one exception: with L2 tiers, a store that is ``short`` (tails alone may not
        make room for it, in L1 or in its tenant's quota) may take older chunks.
        Chunks are told apart by key and offset: a key may also name a quarantined or
        cleared chunk elsewhere; only indexed chunks count (a write lease that expires
        meanwhile unlinks its chunks). ``stored``: keys a reservation placed anew (one that
        it evicted first is new, perhaps at the same offset).
        """
        if short and self.cache.lower_tier:
            return
        view = self.view()
        live = {  # findable: quarantined or cleared chunks are unreachable by their own rules
            (slot.key, slot.offset)
            for slot in view.live()
            if view.index.get(slot.key) == slot.slot and slot.key not in stored
        }
        for child, parent in links:
            assert child not in live or parent in live, "eviction left a chunk unreachable"

    def short_of_room(
        self,
        view: L1DebugView,
        tenant: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        parent: bytes | None,
    ) -> bool:
        """Whether tails alone may not make room for a run: the only case in which a store
        may cut a chain at its head (with L2 tiers).

        In L1: the run's new chunks do not fit in the largest free extent (the allocator's
        placement beyond that is not modelled). In the quota: tails alone cannot free it.
        Evicting a tail frees what it takes from both the usage and the tails, so the
        quota's slack (limit - usage + what tails can free) shrinks by each chunk placed.
        """
        new = [size for key, size in zip(keys, sizes, strict=False) if key not in view.index]
        largest = max((length for _, length in view.free_extents), default=0)
        if sum(_pages(size) for size in new) > largest:
            return True
        limit = self.cache.quotas.limit(tenant)
        if limit is None:
            return False
        # What a store protects: its parent (if the tenant's) and its keys already cached.
        kept = {view.index[key] for key in keys if key in view.index}
        if parent in view.index and view.slot_of(parent).tenant == tenant:
            kept.add(view.index[parent])
        tails = sum(view.slots[slot].nbytes for slot in self.evictable_slots(tenant, kept, view))
        return sum(new) > limit - self.used_bytes(tenant) + tails

    def used_bytes(self, tenant: str) -> int:
        return self.cache.tenant_usage(tenant).used_bytes

    def end_lease(self, lease: int, committed: int = 0) -> None:
        """The model's side of a lease ending (release, commit or expiry) after the fact."""
        record = self.leases.pop(lease)
        self.dead_leases.append(lease)
        if record.writing:
            index = self.view().index
            for position, (key, _) in enumerate(record.entries):
                if position >= committed and position not in record.doomed:
                    assert key not in index, "an abandoned reservation stayed indexed"

    def expire_in_model(self) -> int:
        """Read leases end; write leases go to quarantine; fences that passed end."""
        now = self.clock.now
        expired = [lease for lease, r in self.leases.items() if r.expires <= now]
        for lease in expired:
            record = self.leases[lease]
            self.end_lease(lease)
            if record.writing:
                self.dead_leases.remove(lease)
                self.quarantined[lease] = (record, now + FENCE_SECONDS)
        for lease, (_, fence) in list(self.quarantined.items()):
            if fence <= now:
                del self.quarantined[lease]
                self.dead_leases.append(lease)
        return len(expired)

    def open_leases(self, *, writing: bool | None = None) -> list[int]:
        return sorted(
            lease for lease, r in self.leases.items() if writing is None or r.writing == writing
        )

    def assert_quota_enforced(self, tenant: str) -> None:
        """After enforcement: within quota, or nothing of the tenant's is evictable."""
        limit = self.cache.quotas.limit(tenant)
        if limit is not None and tenant in self.view().tenants:
            used = self.used_bytes(tenant)
            assert used <= limit or not self.evictable_slots(tenant), (tenant, used, limit)

    # ------------------------------------------------------------------ rules

    @initialize(
        default=st.one_of(st.none(), QUOTAS),
        limits=st.fixed_dictionaries({}, optional=dict.fromkeys(TENANTS, QUOTAS)),
        warm=st.integers(0, 24),
        seed=st.integers(0, 2**32 - 1),
        idle_tenants=st.integers(0, 2),
        lower_tier=st.booleans(),
    )
    def build(
        self,
        *,
        default: Limit,
        limits: dict[str, Limit],
        warm: int,
        seed: int,
        idle_tenants: int,
        lower_tier: bool,
    ) -> None:
        """A fresh cache, warmed with committed chains so that memory pressure comes sooner.

        Few idle records are kept, so records are dropped and their places reused. Some
        runs continue the previous one, as a prompt stored over several steps.
        """
        self.default_quota, self.own_quotas = default, dict(limits)
        self.idle_tenants = idle_tenants
        self.cache = self.open_cache(QuotaBook(default, limits), lower_tier)
        rng = random.Random(seed)
        tenant = rng.choice(TENANTS)
        for _ in range(warm):
            count = rng.randint(1, 4)
            continued = bool(self.seen_keys) and rng.random() < 0.5
            tenant = tenant if continued else rng.choice(TENANTS)
            self.reserve(
                tenant=tenant,
                picks=rng.sample(range(KEYS_PER_TENANT), count),
                sizes=[rng.randint(1, 3 * PAGE) for _ in range(count)],
                parent=LAST_SEEN if continued else None,
                then="commit",
                cut=0,
            )

    @rule(
        tenant=st.sampled_from(TENANTS),
        picks=st.lists(st.integers(0, KEYS_PER_TENANT - 1), min_size=1, max_size=4, unique=True),
        sizes=st.lists(SIZES, min_size=4, max_size=4),
        parent=st.one_of(st.none(), st.just(LAST_SEEN), CHOICE),
        then=st.sampled_from(["hold", "hold", "commit", "commit", "commit", "partial"]),
        cut=CHOICE,
    )
    def reserve(
        self,
        *,
        tenant: str,
        picks: list[int],
        sizes: list[int],
        parent: int | None,
        then: str,
        cut: int,
    ) -> None:
        """Reserve a run; then keep the write lease open, or commit all or part of it."""
        cache = self.cache
        keys = [self.key(tenant, i) for i in picks]
        sizes = sizes[: len(keys)]
        parent_key = (
            None
            if parent is None or not self.seen_keys
            else self.seen_keys[parent % len(self.seen_keys)]
        )
        before = self.view()
        ready_before = self.ready_by_tenant()
        links_before = self.ready_parent_links(before)
        evictions_before = cache.stats().evictions
        roomy = self.roomy(before, sum(_pages(size) for size in sizes))
        short = self.short_of_room(before, tenant, keys, sizes, parent_key)

        reservation = cache.reserve(tenant, keys, sizes, parent=parent_key)

        if parent_key is not None and parent_key not in before.index and not cache.lower_tier:
            assert reservation.placements == () and reservation.lease is None, (
                "a run under a predecessor L1 lacks was stored"
            )
        placements = reservation.placements
        assert len(placements) <= len(keys)
        assert (reservation.refused_reason is None) == (len(placements) == len(keys))
        new = [p for p in placements if p is not None]
        assert (reservation.lease is None) == (not new)
        view = self.view()
        for key, size, placement in zip(keys, sizes, placements, strict=False):
            if placement is None:
                # Already cached, and protected for the rest of the reservation.
                assert key in before.index, "None placement for a key that was not cached"
                assert key in view.index, "a key the reservation relies on was evicted"
                assert view.slot_of(key).tenant == tenant, (
                    "another tenant's chunk counted as cached"
                )
                continue
            # A new placement: the key was not cached, or an earlier chunk of this very
            # reservation evicted it (it was not protected yet).
            assert placement.key == key and placement.nbytes == size
            assert (placement.offset - LAYOUT.data_offset) % PAGE == 0
            assert LAYOUT.data_offset <= placement.offset
            assert placement.offset + size <= LAYOUT.total_size
            slot = view.slot_of(key)
            assert slot.state == State.WRITING
            assert slot.offset == placement.offset

        limit = cache.quotas.limit(tenant)
        if new and limit is not None:
            assert self.used_bytes(tenant) <= limit, "reserve placed a chunk over the quota"

        # Reserving never makes anything ready; it may only evict.
        self.assert_no_orphans_made(links_before, stored=[p.key for p in new], short=short)
        ready_after = self.ready_by_tenant()
        for name in TENANTS:
            assert ready_after[name] <= ready_before[name]
        evictions_after = cache.stats().evictions
        global_eviction = any(
            evictions_after[cause] != evictions_before[cause] for cause in ("watermark", "pressure")
        )
        if roomy:
            # Below the high watermark with an extent that fits everything: only the
            # tenant's quota can cost anything.
            assert not global_eviction, (evictions_before, evictions_after)
        if not global_eviction:
            for name in TENANTS:
                if name != tenant:
                    assert ready_after[name] == ready_before[name], (
                        f"a reserve by {tenant} evicted chunks of {name} without memory pressure"
                    )

        if reservation.lease is not None:
            self.leases[reservation.lease] = LeaseModel(
                tenant,
                writing=True,
                entries=[(p.key, p.offset) for p in new],
                expires=self.clock.now + LEASE_SECONDS,
            )
            if then != "hold":
                self.commit_lease(reservation.lease, None if then == "commit" else cut)
        self.seen_keys.extend(key for key in keys if key not in self.seen_keys)

    @rule(
        tenant=st.sampled_from(TENANTS),
        pages=st.integers(PAGES // 2, PAGES + 8),
        step=st.integers(4, 16),
        size=SIZES,
    )
    def store_a_long_prompt(self, *, tenant: str, pages: int, step: int, size: int) -> None:
        """One prompt of about ``pages`` stored over several steps (chunked prefill): its
        head is the oldest, and each step names the last chunk of the one before. Some
        fit in L1, some do not; most cross the high watermark.
        """
        length = max(1, pages // _pages(size))
        self.prompts += 1
        chain = [self.key(tenant, PROMPT_KEYS * self.prompts + i) for i in range(length)]
        for first in range(0, length, step):
            keys, parent = chain[first : first + step], chain[first - 1] if first else None
            sizes = [size] * len(keys)
            before = self.view()
            links = self.ready_parent_links(before)
            short = self.short_of_room(before, tenant, keys, sizes, parent)
            reservation = self.cache.reserve(tenant, keys, sizes, parent=parent)
            new = [place for place in reservation.placements if place is not None]
            self.assert_no_orphans_made(links, stored=[p.key for p in new], short=short)
            if reservation.lease is not None:  # committed whole at once: the model's side
                assert self.cache.commit(reservation.lease) == len(new)
                for place in new:
                    self.commit_count += 1
                    self.commits[place.key, place.offset] = self.commit_count
                self.dead_leases.append(reservation.lease)
            self.seen_keys.extend(keys)

    @precondition(lambda self: self.open_leases(writing=True))
    @rule(choice=CHOICE, count=st.one_of(st.none(), CHOICE))
    def commit(self, choice: int, count: int | None) -> None:
        writes = self.open_leases(writing=True)
        self.commit_lease(writes[choice % len(writes)], count)

    def commit_lease(self, lease: int, count: int | None) -> None:
        record = self.leases[lease]
        keep = len(record.entries) if count is None else count % (len(record.entries) + 1)
        published = self.cache.commit(lease, None if count is None else keep)
        kept = [i for i in range(keep) if i not in record.doomed]
        assert published == len(kept)
        view = self.view()
        for position, (key, offset) in enumerate(record.entries):
            if position in record.doomed:
                continue
            if position < keep:
                assert self.cache.contains(key)
                assert view.slot_of(key).offset == offset
                self.commit_count += 1  # head first, as the journal numbers them
                self.commits[key, offset] = self.commit_count
        self.end_lease(lease, committed=keep)

    @rule(
        tenant=st.sampled_from(TENANTS),
        owner=st.sampled_from([None, None, None, *TENANTS]),
        picks=st.lists(st.integers(0, KEYS_PER_TENANT - 1), min_size=1, max_size=4),
        lock=st.booleans(),
        known=st.sampled_from([True, True, False]),
    )
    def lookup(
        self, tenant: str, owner: str | None, picks: list[int], lock: bool, known: bool
    ) -> None:
        """Look up random keys (maybe another tenant's), or mostly keys the tenant has."""
        stocked = [name for name in TENANTS if self.ready_keys(name)]
        if known and stocked:
            tenant = stocked[TENANTS.index(tenant) % len(stocked)]
        ready = self.ready_keys(tenant)
        keys = [self.key(owner or tenant, i) for i in picks]
        if known and ready:
            candidates = sorted(ready)
            keys = [candidates[i % len(candidates)] for i in picks]
        expected = 0
        while expected < len(keys) and keys[expected] in ready:
            expected += 1
        view = self.view()
        before = [view.slot_of(key) for key in keys[:expected]]

        hit = self.cache.lookup(tenant, keys, lock=lock)

        assert hit.count == expected
        assert hit.offsets == [slot.offset for slot in before]
        assert hit.sizes == [slot.nbytes for slot in before]
        assert (hit.lease is None) == (not lock or expected == 0)
        if not lock:
            view = self.view()
            assert [view.slot_of(k).readers for k in keys[:expected]] == [
                slot.readers for slot in before
            ]
        if hit.lease is not None:
            self.leases[hit.lease] = LeaseModel(
                tenant,
                writing=False,
                entries=list(zip(keys, hit.offsets, strict=False)),
                expires=self.clock.now + LEASE_SECONDS,
            )

    @precondition(lambda self: self.leases)
    @rule(choice=CHOICE)
    def release(self, choice: int) -> None:
        leases = self.open_leases()
        lease = leases[choice % len(leases)]
        self.cache.release(lease)
        self.end_lease(lease)

    @precondition(lambda self: self.dead_leases)
    @rule(choice=CHOICE, commit=st.booleans())
    def use_ended_lease(self, choice: int, commit: bool) -> None:
        lease = self.dead_leases[choice % len(self.dead_leases)]
        with pytest.raises(UnknownLease):
            if commit:
                self.cache.commit(lease)
            else:
                self.cache.release(lease)

    @precondition(lambda self: self.quarantined)
    @rule(choice=CHOICE, commit=st.booleans())
    def use_quarantined_lease(self, choice: int, commit: bool) -> None:
        """A late commit publishes nothing and changes nothing; a release frees the pages."""
        leases = sorted(self.quarantined)
        lease = leases[choice % len(leases)]
        if commit:
            before = self.cache.stats()
            with pytest.raises(LeaseExpired):
                self.cache.commit(lease)
            assert self.cache.stats() == before
            return
        record, _ = self.quarantined.pop(lease)
        view = self.view()
        held = sum(self.quarantined_slot(view, *entry).pages for entry in record.entries)
        self.cache.release(lease)
        self.dead_leases.append(lease)
        assert self.view().free_pages == view.free_pages + held

    def quarantined_slot(self, view: L1DebugView, key: bytes, offset: int) -> SlotView:
        (slot,) = [
            slot
            for slot in view.live()
            if slot.state == State.QUARANTINED and slot.key == key and slot.offset == offset
        ]
        return slot

    @precondition(lambda self: self.leases)
    @rule(choice=CHOICE)
    def misuse_open_lease(self, choice: int) -> None:
        """A refused commit leaves the lease open and the cache unchanged."""
        leases = self.open_leases()
        lease = leases[choice % len(leases)]
        record = self.leases[lease]
        before = self.cache.stats()
        with pytest.raises(InvalidRequest):
            self.cache.commit(lease, None if not record.writing else len(record.entries) + 1)
        assert self.cache.stats() == before

    @rule(seconds=st.sampled_from([0.5, 1.0, 10.0, 29.0, 30.0, 31.0, 60.0, 61.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule()
    def expire_leases(self) -> None:
        expected = sum(1 for r in self.leases.values() if r.expires <= self.clock.now)
        assert self.cache.expire_leases() == expected
        assert self.expire_in_model() == expected

    @rule()
    def expire_everything(self) -> None:
        self.clock.now += LEASE_SECONDS + 1
        assert self.cache.expire_leases() == len(self.leases)
        self.expire_in_model()
        assert not self.view().leases

    @rule()
    def maintain(self) -> None:
        links_before = self.ready_parent_links()
        self.cache.maintain()
        self.assert_no_orphans_made(links_before)
        self.expire_in_model()
        assert self.used_pages() <= self.view().high_pages or not self.evictable_slots()
        for tenant in TENANTS:
            self.assert_quota_enforced(tenant)

    @rule(tenant=st.sampled_from(TENANTS), limit=QUOTAS, delete=st.booleans())
    def set_quota(self, tenant: str, limit: Limit, delete: bool) -> None:
        ready_before = self.ready_by_tenant()
        evictions_before = self.cache.stats().evictions
        links_before = self.ready_parent_links()
        if delete:
            self.cache.delete_quota(tenant)
            self.own_quotas.pop(tenant, None)
        else:
            self.cache.set_quota(tenant, limit)
            self.own_quotas[tenant] = limit
        self.assert_quota_enforced(tenant)
        self.assert_no_orphans_made(links_before)
        ready_after = self.ready_by_tenant()
        for name in TENANTS:
            if name != tenant:
                assert ready_after[name] == ready_before[name]
        evictions_after = self.cache.stats().evictions
        assert evictions_after["watermark"] == evictions_before["watermark"]
        assert evictions_after["pressure"] == evictions_before["pressure"]

    @precondition(lambda self: self.leases)
    @rule(choice=CHOICE)
    def clear_a_leased_tenant(self, choice: int) -> None:
        """Clear chunks while they are locked or being written (they become DOOMED)."""
        leases = self.open_leases()
        self.clear(scope=self.leases[leases[choice % len(leases)]].tenant)

    @rule(scope=st.sampled_from([None, *TENANTS, "never-seen"]))
    def clear(self, scope: str | None) -> None:
        cache = self.cache
        ready_before = self.ready_by_tenant()
        if scope is None:
            expected = sum(len(keys) for keys in ready_before.values())
        else:
            expected = len(ready_before.get(scope, ()))
        expected += sum(
            len(r.live_entries())
            for r in self.leases.values()
            if r.writing and scope in (None, r.tenant)
        )
        assert cache.clear(scope) == expected
        for name in TENANTS:
            if scope in (None, name):
                assert not self.ready_keys(name)
                view = self.view()
                assert all(view.slots[slot].tenant != name for slot in view.index.values())
            else:
                assert self.ready_keys(name) == ready_before[name]
        assert "never-seen" not in self.view().tenants
        for record in self.leases.values():
            if scope in (None, record.tenant):
                record.doomed = set(range(len(record.entries)))

    @rule(
        pages=st.one_of(st.integers(1, 6), st.integers(1, PAGES + 4)),
        scope=st.sampled_from([None, *TENANTS]),
    )
    def evict(self, pages: int, scope: str | None) -> None:
        cache = self.cache
        view_before = self.view()
        evictable_pages = sum(
            view_before.slots[slot].pages for slot in self.evictable_slots(scope, view=view_before)
        )
        stats_before = cache.stats()
        usage_before = {t.tenant: t for t in map(cache.tenant_stats, cache.tenant_records())}
        ready_before = self.ready_by_tenant()
        links_before = self.ready_parent_links()

        evicted = cache.evict(pages, scope)

        assert evicted == (evictable_pages >= pages)
        self.assert_no_orphans_made(links_before)
        view = self.view()
        if evicted:
            assert view.free_pages - view_before.free_pages >= pages
        else:
            assert view.free_pages == view_before.free_pages
            assert view.index == view_before.index
            # An empty record for a tenant seen for the first time is not a change, and
            # making it may drop another idle one.
            usage_after = {t.tenant: t for t in map(cache.tenant_stats, cache.tenant_records())}
            assert all(
                usage_before.get(name, usage) == usage
                or usage.used_bytes == usage.chunks == usage.evicted_chunks == 0
                for name, usage in usage_after.items()
            )
            assert all(
                usage.used_bytes == usage.chunks == 0
                for name, usage in usage_before.items()
                if name not in usage_after
            )
            stats_after = dataclasses.replace(cache.stats(), tenant_count=stats_before.tenant_count)
            assert stats_after == stats_before
        for name in TENANTS:
            if scope is not None and name != scope:
                assert self.ready_keys(name) == ready_before[name]

    @rule(early=st.lists(st.sampled_from(TENANTS), max_size=3))
    def restart(self, early: list[str]) -> None:
        """The agent stops, however it stops, and a new one adopts the segment.

        As ``open_l1`` (core/factory.py) and the service after it do: a new cache over
        the segment, configured alike, restored from the chunk table the old one left,
        then the stored quotas applied (``CacheService.load_quotas``). What survives:
        the ready chunks, in place, with their tenants and usage, and the links between
        them where the parent was committed first (a record names its parent by commit
        number, which a parent still being written has not got yet). Chunks being
        written, or quarantined, come back quarantined for a fence under one new lease:
        their writers may outlive the agent. Chunks cleared while read-locked stay
        cleared. Nothing else does: leases, locks, lease numbers, counters, idle records.

        ``early``: tenants whose lookups reach the new cache before its restore. The
        agent restores first, but ``restore`` takes any cache that holds no chunk, and
        a record made before it is given chunks without being used again: trimming idle
        records must not drop it.
        """
        before = self.view()
        self.probe_table_lists_the_ready_chunks()
        ready = [slot for slot in before.live() if slot.state == State.READY]
        # A cleared chunk is held by its write lease (being written) or by read locks.
        held = [
            slot
            for slot in before.live()
            if slot.state in (State.WRITING, State.QUARANTINED)
            or (slot.state == State.DOOMED and not slot.readers)
        ]
        parents = {slot.slot: self.restored_parent(before, slot) for slot in ready}
        assert self.journal is not None and self.probe_table is not None
        self.journal.close()
        self.probe_table.close()

        cache = self.cache = self.open_cache(QuotaBook(self.default_quota), self.cache.lower_tier)
        for tenant in early:
            assert cache.lookup(tenant, [self.key(tenant, 0)]).count == 0
        assert self.journal is not None
        report = cache.restore(self.journal.committed(), self.journal.reserved())

        assert report == RestoreReport(len(ready), 0, len(held)), (report, len(ready), len(held))
        view = self.view()
        assert view.index == {slot.key: slot.slot for slot in ready}, "not the ready chunks indexed"
        assert {slot.slot for slot in view.live()} == {slot.slot for slot in ready + held}
        for old in ready + held:
            # In its slot and place, with its tenant and size, unlocked (links: see below).
            state = State.READY if old.state == State.READY else State.QUARANTINED
            expected = old._replace(state=state, readers=0, parent=NIL, children=())
            new = view.slots[old.slot]._replace(parent=NIL, children=())
            assert new == expected, f"slot {old.slot} came back as {new}, not as {expected}"
        for slot, parent in parents.items():
            assert view.slots[slot].parent == parent, "a chain was not restored as journaled"
        assert not view.leases
        if held:
            ((lease, quarantine),) = view.quarantined.items()
            assert set(quarantine.slots) == {slot.slot for slot in held}
            assert quarantine.expires == self.clock.now + FENCE_SECONDS
            self.quarantined = {
                lease: (
                    LeaseModel("", True, [(slot.key, slot.offset) for slot in held], 0.0),
                    quarantine.expires,
                )
            }
        else:
            assert not view.quarantined
            self.quarantined = {}
        holders = {slot.tenant for slot in ready + held}
        assert holders <= set(view.tenants) <= holders | set(early)
        for record in cache.tenant_records():
            stats = cache.tenant_stats(record)
            if record.name not in early:  # counters are the process's
                assert stats.hits == stats.misses == stats.stored_chunks == 0, stats
            assert stats.evicted_chunks == 0, stats
        self.leases = {}
        self.dead_leases = []  # the new cache numbers its leases from 1 again
        self.probe_table_lists_the_ready_chunks()

        for tenant, limit in self.own_quotas.items():
            cache.set_quota(tenant, limit)
            self.assert_quota_enforced(tenant)

    def restored_parent(self, before: L1DebugView, child: SlotView) -> int:
        """The slot a ready chunk's chain link names after a restore (``NIL``: none)."""
        if child.parent == NIL:
            return NIL
        parent = before.slots[child.parent]
        if parent.state != State.READY:
            return NIL  # a chunk being written, or cleared: it comes back unready or not at all
        if self.commits[parent.key, parent.offset] > self.commits[child.key, child.offset]:
            return NIL  # committed after its child, whose record names no commit of it
        return parent.slot

    def probe_table_lists_the_ready_chunks(self) -> None:
        """The table the schedulers probe holds exactly the ready chunks, under their tenants."""
        reader = ProbeTableReader(self.directory / "segment.probe", AGENT_ID)
        try:
            ready = self.ready_by_tenant()
            for tenant in TENANTS:
                for key in self.seen_keys:
                    assert reader.run(tenant, [key]) == (key in ready[tenant]), (
                        f"the probe table lists {key.hex()[:12]} for {tenant} wrongly"
                    )
        finally:
            reader.close()

    # ------------------------------------------------------------- invariants

    @invariant()
    def cache_matches_its_rules_and_the_model(self) -> None:
        """The cache's own rules (slots, pages, index, chains, leases, records, policies),
        then one copy of its bookkeeping against the model."""
        self.cache.check_invariants()
        view = self.view()
        self.placements_tile_the_data_region(view)
        self.slots_are_accounted_for(view)
        self.quarantined_pages_stay_held(view)
        self.locks_match_the_open_leases(view)
        self.usage_is_exact(view)
        self.policies_hold_exactly_the_ready_chunks(view)
        self.chains_stay_within_a_tenant(view)

    def placements_tile_the_data_region(self, view: L1DebugView) -> None:
        """Live chunks and free extents cover the data region exactly, without overlap."""
        runs: list[tuple[int, int]] = []
        for slot in view.live():
            assert slot.pages == _pages(slot.nbytes)
            runs.append((slot.first_page, slot.pages))
            assert LAYOUT.data_offset <= slot.offset
            assert slot.offset == LAYOUT.data_offset + slot.first_page * PAGE
            assert slot.offset + slot.nbytes <= LAYOUT.total_size
        runs += view.free_extents
        position = 0
        for start, pages in sorted(runs):
            assert start == position, f"overlap or hole at page {position}: {sorted(runs)}"
            position += pages
        assert position == PAGES == view.total_pages
        stats = self.cache.stats()
        assert stats.allocated_bytes == view.used_pages * PAGE <= stats.capacity_bytes
        assert 0.0 <= stats.fragmentation <= 1.0
        assert 0.0 <= stats.page_waste < 1.0

    def slots_are_accounted_for(self, view: L1DebugView) -> None:
        live = view.live()
        assert len(view.free_slots) == len(set(view.free_slots)) == PAGES - len(live)
        assert not set(view.free_slots) & {slot.slot for slot in live}
        for key, place in view.index.items():
            assert view.slots[place].key == key
            assert view.slots[place].state in (State.WRITING, State.READY)
        indexed = set(view.index.values())
        assert len(indexed) == len(view.index)
        # Every live slot is indexed, or a cleared chunk still held by an open lease.
        doomed_entries = {
            entry
            for record in self.leases.values()
            for i, entry in enumerate(record.entries)
            if i in record.doomed
        }
        quarantined_entries = {
            entry for record, _ in self.quarantined.values() for entry in record.entries
        }
        for slot in live:
            if slot.slot not in indexed:
                entry = (slot.key, slot.offset)
                if slot.state == State.QUARANTINED:
                    assert entry in quarantined_entries, "a slot quarantined for no lease"
                else:
                    assert slot.state == State.DOOMED, slot
                    assert entry in doomed_entries, "leaked slot"

    def quarantined_pages_stay_held(self, view: L1DebugView) -> None:
        """An expired write lease's pages hold no other chunk until its fence or release."""
        pages = 0
        for record, _ in self.quarantined.values():
            for key, offset in record.entries:
                slot = self.quarantined_slot(view, key, offset)
                assert slot.parent == NIL and not slot.children
                pages += slot.pages
        stats = self.cache.stats()
        assert stats.quarantined_bytes == pages * PAGE
        assert set(view.quarantined) == set(self.quarantined)

    def locks_match_the_open_leases(self, view: L1DebugView) -> None:
        cache = self.cache
        assert set(view.leases) == set(self.leases)
        read_locks: dict[tuple[bytes, int], int] = {}
        for record in self.leases.values():
            if not record.writing:
                for entry in record.entries:
                    read_locks[entry] = read_locks.get(entry, 0) + 1
            for key, offset in record.live_entries():
                # A locked or reserved chunk stays where it was until its lease ends.
                assert key in view.index, "a locked chunk disappeared"
                slot = view.slot_of(key)
                assert slot.offset == offset, "a locked chunk moved"
                if record.writing:
                    assert slot.state == State.WRITING
                    assert not cache.contains(key)
                else:
                    assert cache.contains(key)
        for slot in view.live():
            assert slot.key is not None
            assert slot.readers == read_locks.get((slot.key, slot.offset), 0), slot

    def usage_is_exact(self, view: L1DebugView) -> None:
        used: dict[str | None, int] = {}
        chunks: dict[str | None, int] = {}
        for slot in view.live():
            used[slot.tenant] = used.get(slot.tenant, 0) + slot.nbytes
            chunks[slot.tenant] = chunks.get(slot.tenant, 0) + 1
        assert set(used) <= set(view.tenants), "a chunk is charged to no record"
        for name, account in view.tenants.items():
            assert account.used_bytes == used.get(name, 0), name
            assert account.chunks == chunks.get(name, 0), name
            usage = self.cache.tenant_usage(name)
            assert (usage.used_bytes, usage.chunks) == (account.used_bytes, account.chunks)
        stats = self.cache.stats()
        assert stats.stored_bytes == sum(used.values())
        assert stats.held_chunks == sum(chunks.values())
        assert stats.tenant_count == len(view.tenants)

    @invariant()
    def quota_never_grows_past_limit(self) -> None:
        """Usage only rises while within the quota (it may sit above it after a shrink)."""
        for tenant in TENANTS:
            limit = self.cache.quotas.limit(tenant)
            used = self.used_bytes(tenant)
            if limit is not None:
                assert used <= limit or used <= self.previous_used.get(tenant, 0), (
                    tenant,
                    used,
                    limit,
                )
            self.previous_used[tenant] = used

    def policies_hold_exactly_the_ready_chunks(self, view: L1DebugView) -> None:
        """Each tenant lists its ready chunks (that its policy orders exactly these, each
        once, is a rule of ``check_invariants``)."""
        for name in view.tenants:
            ready = {
                slot.key
                for slot in view.live()
                if slot.state == State.READY and slot.tenant == name
            }
            assert set(self.cache.iter_keys(name)) == ready, name

    def chains_stay_within_a_tenant(self, view: L1DebugView) -> None:
        for slot in view.live():
            if slot.parent == NIL:
                continue
            parent = view.slots[slot.parent]
            assert parent.state != State.FREE
            assert parent.tenant == slot.tenant, "a chain crosses tenants"
            assert slot.slot in parent.children


L1_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("shared_keys", [False, True], ids=["salted-keys", "colliding-keys"])
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_l1_state_machine(policy: str, shared_keys: bool) -> None:
    machine = type(
        f"L1Machine_{policy}", (L1Machine,), {"policy": policy, "shared_keys": shared_keys}
    )
    examples = L1_SETTINGS.max_examples // (2 if shared_keys else 1)
    run_state_machine_as_test(machine, settings=settings(L1_SETTINGS, max_examples=examples))


# --------------------------------------------------- quota isolation, huge segment


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(
    quotas=st.fixed_dictionaries(dict.fromkeys(TENANTS, QUOTAS)),
    steps=st.lists(
        st.tuples(
            st.sampled_from(TENANTS),
            st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
            st.lists(SIZES, min_size=4, max_size=4),
            st.sampled_from(["commit", "commit", "lock", "hold"]),
        ),
        max_size=40,
    ),
)
def test_quota_eviction_never_touches_other_tenants(
    policy: str,
    quotas: dict[str, Limit],
    steps: list[tuple[str, list[int], list[int], str]],
) -> None:
    """With memory to spare, a tenant over its quota only ever evicts its own chunks."""
    pages = 4096
    cache = L1Cache(
        SegmentLayout(page_size=PAGE, data_offset=PAGE, data_size=PAGE * pages),
        policy_factory(policy),
        QuotaBook(limits=quotas),
        clock=FakeClock(),
    )
    for tenant, picks, sizes, then in steps:
        keys = [key_of(tenant, i) for i in picks]
        before = {
            record.name: set(cache.iter_keys(record.name)) for record in cache.tenant_records()
        }
        reservation = cache.reserve(tenant, keys, sizes[: len(keys)])
        for name, keys_before in before.items():
            if name != tenant:
                assert set(cache.iter_keys(name)) == keys_before, (tenant, name)
        limit = quotas[tenant]
        if limit is not None:
            assert cache.tenant_usage(tenant).used_bytes <= limit or reservation.lease is None
        if reservation.lease is not None and then != "hold":
            cache.commit(reservation.lease)
            if then == "lock":  # locked chunks make later quota evictions refuse
                cache.lookup(tenant, keys)
    evictions = cache.stats().evictions
    assert evictions["watermark"] == evictions["pressure"] == 0


# ------------------------------------------------------------------ registry


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_registered_policy_imports_and_runs(name: str) -> None:
    factory = policy_factory(name)
    cache = L1Cache(LAYOUT, factory, QuotaBook(), clock=FakeClock())
    reservation = cache.reserve("t", [key_of("t", 0)], [PAGE])
    assert reservation.lease is not None
    assert cache.commit(reservation.lease) == 1
    assert cache.evict(1)
    assert not cache.contains(key_of("t", 0))


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'") as raised:
        policy_factory("nope")
    for name in POLICY_NAMES:
        assert name in str(raised.value)


# ------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("chunk_pages", [PAGES + 1, 4 * PAGES])
def test_chunk_larger_than_the_segment_is_refused_without_evicting(chunk_pages: int) -> None:
    """Such a chunk can never fit: refuse it before evicting anything for it."""
    cache = L1Cache(LAYOUT, policy_factory("lru"), QuotaBook(), clock=FakeClock())
    reservation = cache.reserve("a", [key_of("a", 0)], [PAGE])
    assert reservation.lease is not None
    cache.commit(reservation.lease)
    try:
        refused = cache.reserve("b", [key_of("b", 0)], [chunk_pages * PAGE])
    except CacheError:
        pass  # refusing with an error is fine too
    else:
        assert refused.placements == ()
        assert refused.refused_reason is not None
    assert cache.contains(key_of("a", 0)), "another tenant's chunk was evicted for nothing"


def test_iter_keys_of_an_unknown_tenant_is_empty() -> None:
    """Not "everyone's keys" (once a bug: an unknown tenant meant no filter at all)."""
    cache = L1Cache(LAYOUT, policy_factory("lru"), QuotaBook(), clock=FakeClock())
    reservation = cache.reserve("a", [key_of("a", 0)], [PAGE])
    assert reservation.lease is not None
    cache.commit(reservation.lease)
    assert list(cache.iter_keys("b")) == []
    assert list(cache.iter_keys()) == [key_of("a", 0)]


def test_a_key_held_by_another_tenant_never_links_chains_across_tenants() -> None:
    """Once a bug: tenant b's run was linked under a's chunk, so a's evictions took b's."""
    # Keys are tenant-salted, so this needs a client that sends another tenant's key.
    cache = L1Cache(LAYOUT, policy_factory("lru"), QuotaBook(), clock=FakeClock())
    shared, own = key_of("a", 0), key_of("b", 1)
    first = cache.reserve("a", [shared], [PAGE])
    assert first.lease is not None
    cache.commit(first.lease)
    second = cache.reserve("b", [shared, own], [PAGE, PAGE])
    if second.lease is not None:
        cache.commit(second.lease)
    b_keys = set(cache.iter_keys("b"))
    slots = cache.debug_view().slots
    for slot in slots:
        if slot.parent != NIL:
            assert slots[slot.parent].tenant == slot.tenant, "a chain crosses tenants"
    cache.check_invariants()
    cache.set_quota("a", 0)  # a's quota eviction ...
    assert not cache.contains(shared)
    assert set(cache.iter_keys("b")) == b_keys, "... evicted b's chunks"
