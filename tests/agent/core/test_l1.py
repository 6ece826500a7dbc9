"""Rules of the L1 cache, one test per rule, run for every registered policy where it applies."""

from __future__ import annotations

import itertools

import pytest

from kvpool.agent.core.cache_types import InvalidRequest, LeaseExpired, Reservation, UnknownLease
from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import POLICY_NAMES
from kvpool.agent.core.quota_book import QuotaBook
from tests.support.chunks import key
from tests.support.l1 import PAGE, FakeClock, hits, make_cache, store

pytestmark = pytest.mark.parametrize("policy", POLICY_NAMES)


def test_reserved_chunk_is_invisible_until_commit(policy: str) -> None:
    cache = make_cache(policy=policy)
    reservation = cache.reserve("t", [key(1)], [100])
    assert hits(cache, "t", [1]) == 0
    assert reservation.lease is not None
    assert cache.commit(reservation.lease) == 1
    assert hits(cache, "t", [1]) == 1


def test_lookup_returns_the_leading_run_only(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [1, 2, 3])
    store(cache, "t", [5])
    assert hits(cache, "t", [1, 2, 3, 4, 5]) == 3
    assert hits(cache, "t", [4, 1]) == 0


def test_duplicate_store_is_a_no_op(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [1])
    used = cache.stats().allocated_bytes
    again = cache.reserve("t", [key(1), key(2)], [PAGE, PAGE])
    assert again.placements[0] is None and again.placements[1] is not None
    # A key being written by another client is not reserved twice either.
    racing = cache.reserve("t", [key(2)], [PAGE])
    assert racing.placements == (None,) and racing.lease is None
    assert cache.stats().allocated_bytes == used + PAGE


def test_placements_are_distinct_and_inside_the_data_region(policy: str) -> None:
    cache = make_cache(pages=50, policy=policy)
    reservation = cache.reserve(
        "t", [key(n) for n in range(10)], [PAGE * (1 + n % 3) for n in range(10)]
    )
    spans = sorted((p.offset, p.offset + p.nbytes) for p in reservation.placements if p)
    layout = cache.layout
    assert spans[0][0] >= layout.data_offset and spans[-1][1] <= layout.total_size
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_commit_of_a_prefix_discards_the_rest(policy: str) -> None:
    cache = make_cache(policy=policy)
    reservation = cache.reserve("t", [key(1), key(2), key(3)], [PAGE] * 3)
    assert reservation.lease is not None
    assert cache.commit(reservation.lease, count=2) == 2
    assert hits(cache, "t", [1, 2, 3]) == 2
    assert cache.stats().allocated_bytes == 2 * PAGE
    with pytest.raises(UnknownLease):
        cache.commit(reservation.lease)


def test_a_trimmed_reservation_keeps_its_head_and_frees_its_keys_after(policy: str) -> None:
    cache = make_cache(policy=policy)
    reservation = cache.reserve("t", [key(1), key(2), key(3)], [PAGE] * 3)
    assert reservation.lease is not None
    cache.trim(reservation.lease, 1)
    assert cache.stats().allocated_bytes == PAGE
    again = cache.reserve("t", [key(2), key(3)], [PAGE // 2] * 2, key(1))  # free to reserve
    assert again.lease is not None and None not in again.placements
    assert cache.commit(reservation.lease) == 1 and cache.commit(again.lease) == 2
    assert hits(cache, "t", [1, 2, 3]) == 3
    lookup = cache.lookup("t", [key(1), key(2), key(3)], lock=False)
    assert lookup.sizes == [PAGE, PAGE // 2, PAGE // 2]
    with pytest.raises(UnknownLease):
        cache.trim(lookup.lease or 12345, 0)


def test_release_of_a_reservation_frees_it(policy: str) -> None:
    cache = make_cache(policy=policy)
    reservation = cache.reserve("t", [key(1)], [PAGE])
    assert reservation.lease is not None
    cache.release(reservation.lease)
    assert cache.stats().allocated_bytes == 0 and hits(cache, "t", [1]) == 0
    with pytest.raises(UnknownLease):
        cache.release(reservation.lease)


def test_commit_of_a_read_lease_is_refused_and_keeps_the_lease(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [1])
    hit = cache.lookup("t", [key(1)])
    assert hit.lease is not None
    with pytest.raises(InvalidRequest):
        cache.commit(hit.lease)
    cache.release(hit.lease)


def test_read_locked_chunks_are_never_evicted(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [1, 2])
    hit = cache.lookup("t", [key(1), key(2)])
    assert not cache.evict(1)  # atomic: nothing evictable, nothing changes
    assert hits(cache, "t", [1, 2]) == 2
    assert hit.lease is not None
    cache.release(hit.lease)
    assert cache.evict(1)


def test_evict_is_all_or_nothing(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [1])
    store(cache, "t", [2])
    hit = cache.lookup("t", [key(2)])
    before = cache.stats()
    assert not cache.evict(2)
    assert cache.stats().chunks == before.chunks == 2
    assert hit.lease is not None
    assert cache.evict(1)
    assert hits(cache, "t", [2]) == 1 and hits(cache, "t", [1]) == 0


def test_expired_leases_release_their_locks(policy: str, clock: FakeClock) -> None:
    cache = make_cache(policy=policy, clock=clock)
    store(cache, "t", [1])
    cache.lookup("t", [key(1)])  # a reader that crashes and never releases
    abandoned = cache.reserve("t", [key(2)], [PAGE])  # a writer that crashes mid-store
    assert abandoned.lease is not None
    clock.advance(29)
    assert cache.expire_leases() == 0
    clock.advance(2)
    assert cache.expire_leases() == 2
    stats = cache.stats()
    assert stats.lock_expiries == 2 and stats.open_leases == 0
    assert stats.allocated_bytes == 2 * PAGE  # the abandoned reservation is quarantined
    assert cache.evict(1)  # the read lock is gone
    with pytest.raises(LeaseExpired):
        cache.commit(abandoned.lease)


def pages_of(reservation: Reservation) -> set[int]:
    return {
        page
        for placement in reservation.placements
        if placement is not None
        for page in range(placement.offset, placement.offset + placement.nbytes, PAGE)
    }


def test_an_expired_write_lease_keeps_its_pages_from_everyone_until_its_fence(
    policy: str, clock: FakeClock
) -> None:
    """A writer stalled past its lease may still copy into its pages: nobody else gets them."""
    cache = make_cache(policy=policy, clock=clock, pages=4, high=1.0, low=0.5)
    stalled = cache.reserve("a", [key(1)], [2 * PAGE])
    assert stalled.lease is not None
    clock.advance(31)
    assert cache.expire_leases() == 1
    stats = cache.stats()
    assert (stats.quarantined_leases, stats.quarantined_bytes) == (1, 2 * PAGE)
    assert stats.allocated_bytes == 2 * PAGE and cache.tenant_usage("a").used_bytes == 2 * PAGE
    # The other half of the segment, then memory pressure: B evicts its own chunk,
    # never the quarantined pages.
    first = cache.reserve("b", [key(2)], [2 * PAGE])
    assert first.lease is not None and cache.commit(first.lease) == 1
    second = cache.reserve("b", [key(3)], [PAGE])
    assert second.lease is not None and cache.commit(second.lease) == 1
    assert not pages_of(stalled) & (pages_of(first) | pages_of(second))
    assert cache.contains(key(3)) and not cache.contains(key(2))  # B made room from its own
    assert cache.reserve("b", [key(4)], [3 * PAGE]).lease is None  # not even under pressure
    with pytest.raises(LeaseExpired):  # the late commit publishes nothing
        cache.commit(stalled.lease)
    assert not cache.contains(key(1))

    clock.advance(10 * 30)  # the fence: 10 lease times
    cache.expire_leases()
    stats = cache.stats()
    assert (stats.quarantined_leases, stats.quarantined_bytes) == (1, 0)
    assert cache.tenant_usage("a").used_bytes == 0
    assert cache.reserve("b", [key(4)], [3 * PAGE]).lease is not None  # the pages are back
    with pytest.raises(UnknownLease):
        cache.commit(stalled.lease)


def test_releasing_a_quarantined_lease_frees_its_pages_and_its_key_is_free_at_once(
    policy: str, clock: FakeClock
) -> None:
    cache = make_cache(policy=policy, clock=clock)
    stalled = cache.reserve("a", [key(1), key(2)], [PAGE, PAGE], parent=None)
    assert stalled.lease is not None
    clock.advance(31)
    cache.expire_leases()
    again = cache.reserve("a", [key(1)], [PAGE])  # stored again elsewhere meanwhile
    assert again.lease is not None and not pages_of(again) & pages_of(stalled)
    assert cache.commit(again.lease) == 1
    assert cache.stats().allocated_bytes == 3 * PAGE
    cache.release(stalled.lease)  # its session ended: its writer writes no more
    stats = cache.stats()
    assert stats.allocated_bytes == PAGE and stats.quarantined_bytes == 0
    assert hits(cache, "a", [1]) == 1
    with pytest.raises(UnknownLease):
        cache.release(stalled.lease)


def test_clear_of_locked_chunks_frees_them_on_release(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "a", [1, 2])
    store(cache, "b", [3])
    hit = cache.lookup("a", [key(1)])
    writing = cache.reserve("a", [key(4)], [PAGE])
    assert cache.clear("a") == 3
    assert hits(cache, "a", [1]) == 0 and hits(cache, "b", [3]) == 1
    assert cache.stats().allocated_bytes == 3 * PAGE  # the locked and the writing chunk stay
    assert hit.lease is not None and writing.lease is not None
    cache.release(hit.lease)
    assert cache.commit(writing.lease) == 0  # cleared while written: discarded
    assert cache.stats().allocated_bytes == PAGE and hits(cache, "a", [4]) == 0
    assert cache.clear() == 1 and cache.stats().chunks == 0


def test_high_watermark_evicts_down_to_low(policy: str) -> None:
    cache = make_cache(pages=100, policy=policy, high=0.9, low=0.8)
    for n in range(90):
        store(cache, "t", [n])
    assert cache.stats().chunks == 90 and sum(cache.stats().evictions.values()) == 0
    store(cache, "t", [1000])  # 91 pages > high: evict to 80 - 1
    stats = cache.stats()
    assert stats.allocated_bytes == 80 * PAGE
    assert stats.evictions["watermark"] == 11
    assert hits(cache, "t", [1000]) == 1


def test_background_check_restores_the_watermark(policy: str) -> None:
    cache = make_cache(pages=100, policy=policy, high=0.5, low=0.4)
    store(cache, "t", list(range(50)))
    hit = cache.lookup("t", [key(n) for n in range(50)])
    store(cache, "t", [1000, 1001])  # above high, but every older chunk is locked
    assert cache.stats().allocated_bytes == 52 * PAGE
    assert hit.lease is not None
    cache.release(hit.lease)
    cache.maintain()
    assert cache.stats().allocated_bytes == 40 * PAGE


def test_store_never_fails_while_something_is_evictable(policy: str) -> None:
    cache = make_cache(pages=20, policy=policy, high=1.0, low=0.99)
    for n in range(100):
        store(cache, "t", [n], size=PAGE * (1 + n % 4))
    assert cache.stats().allocated_bytes <= 20 * PAGE


def test_store_is_refused_when_everything_is_locked(policy: str) -> None:
    cache = make_cache(pages=20, policy=policy, high=1.0, low=0.99)
    store(cache, "t", list(range(20)))
    hit = cache.lookup("t", [key(n) for n in range(20)])
    assert hit.count == 20
    refused = cache.reserve("t", [key(100)], [PAGE])
    assert refused.lease is None and refused.placements == ()
    assert refused.refused_reason is not None and "no evictable memory" in refused.refused_reason


def test_eviction_takes_the_tail_of_a_chain_first(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [0, 1, 2, 3])
    cache.lookup("t", [key(n) for n in range(4)], lock=False)
    assert cache.evict(1)
    assert hits(cache, "t", [0, 1, 2, 3]) == 3


def store_chain(cache: L1Cache, tenant: str, names: list[int], batch: int) -> None:
    """Store ``names`` as one chain over several steps, as vLLM's chunked prefill does."""
    for start in range(0, len(names), batch):
        parent = names[start - 1] if start else None
        reservation = cache.reserve(
            tenant,
            [key(n) for n in names[start : start + batch]],
            [PAGE] * len(names[start : start + batch]),
            None if parent is None else key(parent),
        )
        if reservation.lease is not None:
            cache.commit(reservation.lease)


def test_a_chain_stored_in_steps_shrinks_from_its_tail(policy: str) -> None:
    cache = make_cache(policy=policy)
    store_chain(cache, "t", [0, 1, 2], batch=1)  # the head is the oldest part
    store(cache, "t", [9])
    cache.lookup("t", [key(9)], lock=False)
    assert cache.evict(1)
    assert hits(cache, "t", [0, 1, 2]) == 2 and hits(cache, "t", [9]) == 1


def test_a_prefix_an_eviction_passed_over_gets_a_second_chance(policy: str) -> None:
    """Its chain was still cached when the eviction came by: it ranks as recent as its tail,
    and the next eviction does not walk it again."""
    cache = make_cache(policy=policy)
    store_chain(cache, "t", [0, 1, 2], batch=1)
    store(cache, "t", [9])
    assert cache.evict(1)  # 0 and 1 are passed over, 2 goes
    assert cache.evict(1)
    assert hits(cache, "t", [0, 1, 2]) == 2 and hits(cache, "t", [9]) == 0


def test_a_long_prompt_stored_in_steps_keeps_the_longest_prefix_that_fits(policy: str) -> None:
    """The issue's case scaled down: a 300-chunk chain in 16-chunk steps into 240 pages."""
    cache = make_cache(pages=240, policy=policy, high=0.9, low=0.8)
    chain = list(range(300))
    store_chain(cache, "t", chain, batch=16)
    stats = cache.stats()
    assert hits(cache, "t", chain) == stats.chunks  # all reachable: nothing is dead weight
    cache.maintain()  # the agent's periodic check
    stats = cache.stats()
    assert stats.allocated_bytes == 192 * PAGE  # the low watermark
    assert hits(cache, "t", chain) == stats.chunks == 192


def test_with_l2_a_chain_longer_than_l1_is_stored_whole(policy: str) -> None:
    """Every chunk reaches L1, so the write-back can take it to L2; L1 keeps what fits."""
    cache = make_cache(pages=240, policy=policy, high=0.9, low=0.8)
    cache.lower_tier = True
    for start in range(0, 300, 16):
        names = list(range(start, min(start + 16, 300)))
        store(cache, "t", names, parent=start - 1 if start else None)
    assert cache.lookup("t", [key(n) for n in range(284, 300)], lock=False).count == 16
    assert cache.stats().allocated_bytes <= 240 * PAGE


def test_independent_chains_shrink_least_recently_used_first(policy: str) -> None:
    cache = make_cache(policy=policy)
    store_chain(cache, "t", [0, 1, 2, 3], batch=2)
    store_chain(cache, "t", [10, 11, 12, 13], batch=2)
    cache.lookup("t", [key(n) for n in range(4)], lock=False)
    assert cache.evict(2)
    assert hits(cache, "t", [0, 1, 2, 3]) == 4
    assert hits(cache, "t", [10, 11, 12, 13]) == 2


def test_a_hit_prefix_outlives_its_tail_in_every_policy_list(policy: str) -> None:
    """ARC keeps a hit prefix in its frequency list and the tail in its recency list; when
    it takes victims from the frequency list first, the prefix still waits for its tail."""
    cache = make_cache(policy=policy)
    store(cache, "t", [200, 201, 202, 203])
    assert cache.evict(4)
    store(cache, "t", [200])  # ghost hits: ARC's recency target grows to 2
    store(cache, "t", [201])
    store_chain(cache, "t", [0, 1, 2, 3], batch=2)
    cache.lookup("t", [key(0), key(1)], lock=False)
    assert cache.evict(3)
    assert hits(cache, "t", [0, 1, 2, 3]) == 3 and hits(cache, "t", [200]) == 0


def test_a_locked_chunk_keeps_its_prefix(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [9])
    store_chain(cache, "t", [0, 1, 2, 3], batch=2)
    pinned = cache.pin("t", key(3))  # the write-back pins one chunk, not its prefix
    assert pinned.lease is not None
    assert not cache.evict(2)  # only 9 may go: 0-2 are the prefix of a chunk in use
    assert cache.evict(1)
    assert hits(cache, "t", [0, 1, 2, 3]) == 4 and hits(cache, "t", [9]) == 0


def test_a_run_whose_predecessor_is_gone_is_refused_without_l2(policy: str) -> None:
    cache = make_cache(policy=policy)
    refused = cache.reserve("t", [key(1), key(2)], [PAGE, PAGE], parent=key(0))
    assert refused.lease is None and refused.placements == ()
    assert refused.refused_reason is not None and "before the first key" in refused.refused_reason
    assert cache.stats().allocated_bytes == 0
    cache.lower_tier = True  # with L2, a prefetch can bring the prefix back
    stored = cache.reserve("t", [key(1), key(2)], [PAGE, PAGE], parent=key(0))
    assert stored.lease is not None and stored.refused_reason is None


def test_over_quota_tenant_evicts_only_its_own_chunks(policy: str) -> None:
    cache = make_cache(pages=100, policy=policy, quotas=QuotaBook(limits={"a": 3 * PAGE}))
    store(cache, "b", [100, 101])
    store(cache, "a", [1])
    store(cache, "a", [2])
    store(cache, "a", [3])
    hits(cache, "a", [1])
    store(cache, "a", [4])
    assert cache.tenant_usage("a").used_bytes == 3 * PAGE
    assert hits(cache, "b", [100, 101]) == 2
    assert hits(cache, "a", [1]) == 1  # recently used: survived
    assert cache.stats().evictions["quota"] == 1


def test_a_tenant_at_its_quota_makes_no_room_at_others_expense(policy: str) -> None:
    """Room for a run is made as far as its tenant's quota lets the tenant grow: past that
    its chunks take its own chunks' place or are refused, and room made for them would only
    evict other tenants' chunks (a quota of 3 pages once evicted 57 of another's 85)."""
    cache = make_cache(pages=100, policy=policy, quotas=QuotaBook(limits={"a": 3 * PAGE}))
    store(cache, "b", list(range(100, 185)))
    store(cache, "a", [1, 2, 3])  # 88 pages: under the high watermark of 90
    run = cache.reserve("a", [key(n) for n in range(10, 60)], [PAGE] * 50)
    assert run.refused_reason is not None and "quota" in run.refused_reason
    assert sum(place is not None for place in run.placements) == 3  # in place of 1, 2, 3
    assert hits(cache, "b", list(range(100, 185))) == 85
    assert cache.stats().evictions["watermark"] == 0


def test_quota_full_of_locked_chunks_refuses(policy: str) -> None:
    cache = make_cache(policy=policy, quotas=QuotaBook(limits={"a": 2 * PAGE}))
    store(cache, "a", [1, 2])
    cache.lookup("a", [key(1), key(2)])
    refused = cache.reserve("a", [key(3)], [PAGE])
    assert refused.refused_reason is not None and "quota" in refused.refused_reason
    assert cache.tenant_usage("a").used_bytes == 2 * PAGE


def test_zero_quota_disables_caching_and_default_applies(policy: str) -> None:
    cache = make_cache(policy=policy, quotas=QuotaBook(default=0, limits={"vip": None}))
    refused = cache.reserve("anyone", [key(1)], [PAGE])
    assert refused.lease is None and refused.refused_reason is not None
    store(cache, "vip", list(range(10)))
    assert cache.tenant_usage("vip").chunks == 10


def test_chunk_larger_than_the_quota_is_refused(policy: str) -> None:
    cache = make_cache(policy=policy, quotas=QuotaBook(default=PAGE))
    refused = cache.reserve("t", [key(1)], [PAGE + 1])
    assert refused.refused_reason is not None and "exceeds" in refused.refused_reason


def test_shrinking_a_quota_evicts_at_once(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", list(range(10)))
    cache.set_quota("t", 4 * PAGE)
    usage = cache.tenant_usage("t")
    assert usage.used_bytes == 4 * PAGE and usage.quota_bytes == 4 * PAGE
    assert hits(cache, "t", list(range(10))) == 4  # the head of the chain stays
    cache.delete_quota("t")
    assert cache.tenant_usage("t").quota_bytes is None


def test_usage_accounting_is_exact(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [1], size=100)
    store(cache, "t", [2], size=PAGE + 1)
    usage = cache.tenant_usage("t")
    assert usage.used_bytes == PAGE + 101 and usage.chunks == 2
    stats = cache.stats()
    assert stats.stored_bytes == PAGE + 101 and stats.allocated_bytes == 3 * PAGE
    assert 0 < stats.page_waste < 1


def test_another_tenants_keys_never_hit(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "a", [1])
    assert hits(cache, "b", [1]) == 0
    # and b's store of the same key does not link into or replace a's chunk
    assert cache.reserve("b", [key(2)], [PAGE], parent=key(1)).lease is not None


def test_hits_and_misses_are_counted(policy: str) -> None:
    cache = make_cache(policy=policy)
    store(cache, "t", [1, 2])
    hits(cache, "t", [1, 2, 3, 4])
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (2, 2)
    usage = cache.tenant_usage("t")
    assert (usage.hits, usage.misses) == (2, 2)


def test_fragmentation_is_reported(policy: str) -> None:
    cache = make_cache(pages=100, policy=policy)
    for n in range(10):
        store(cache, "t", [n])
    assert cache.stats().fragmentation == 0.0
    for n in range(0, 10, 2):
        assert cache.lookup("t", [key(n)]).lease is not None
    assert cache.evict(5)  # only the odd chunks are unlocked: holes between locked ones
    stats = cache.stats()
    assert stats.fragmentation > 0 and stats.free_extents == 5  # four holes and the tail


@pytest.mark.parametrize(
    ("keys", "sizes"),
    [
        ([b"short"], [1]),
        ([key(1)], [1, 2]),
        ([key(1)], [0]),
        ([key(1), key(1)], [1, 1]),
    ],
)
def test_malformed_reservations_are_rejected(
    policy: str, keys: list[bytes], sizes: list[int]
) -> None:
    cache = make_cache(policy=policy)
    with pytest.raises(InvalidRequest):
        cache.reserve("t", keys, sizes)
    assert cache.stats().allocated_bytes == 0
