"""Tenant records: kept while they hold chunks or a quota; a bounded few idle ones keep counters."""

from __future__ import annotations

import pytest

from kvpool.agent.core.l1 import L1Cache
from kvpool.agent.core.policies import POLICY_NAMES
from kvpool.agent.core.quota_book import QuotaBook
from tests.support.chunks import key
from tests.support.l1 import PAGE, hits, make_cache, store

pytestmark = pytest.mark.parametrize("policy", POLICY_NAMES)


def tenant_names(cache: L1Cache) -> set[str]:
    return {record.name for record in cache.tenant_records()}


def test_lookups_by_new_tenants_leave_at_most_the_idle_bound(policy: str) -> None:
    cache = make_cache(policy=policy, idle_tenants=3)
    store(cache, "owner", [1])
    for number in range(100):
        assert hits(cache, f"stranger-{number}", [1]) == 0
    # The bound, plus the newest: records are dropped before a new one is made.
    assert cache.stats().tenant_count == 1 + 3 + 1
    assert tenant_names(cache) >= {"owner", "stranger-99", "stranger-98"}
    assert "stranger-0" not in tenant_names(cache)
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (0, 100)  # the cache-wide counters stay exact
    assert hits(cache, "owner", [1]) == 1


def test_recently_active_idle_tenants_keep_their_counters(policy: str) -> None:
    cache = make_cache(policy=policy, idle_tenants=2)
    hits(cache, "a", [1, 2])
    hits(cache, "b", [1])
    hits(cache, "a", [3])  # a is now the most recent
    hits(cache, "c", [1])  # drops b, the least recently used
    hits(cache, "d", [1])
    assert tenant_names(cache) == {"a", "c", "d"}
    assert cache.tenant_usage("a").misses == 3
    assert cache.tenant_usage("b").misses == 0  # dropped: its counters went with it


def test_records_holding_chunks_or_a_quota_are_never_dropped(policy: str) -> None:
    cache = make_cache(policy=policy, idle_tenants=0, quotas=QuotaBook(limits={"q": 0}))
    store(cache, "holder", [1, 2])
    hits(cache, "q", [5])
    reservation = cache.reserve("writer", [key(9)], [PAGE])  # write-locked, not committed
    for number in range(20):
        hits(cache, f"stranger-{number}", [1])
    assert {"holder", "q", "writer"} <= tenant_names(cache)
    assert cache.tenant_usage("holder").stored_chunks == 2
    assert cache.tenant_usage("q").misses == 1
    assert reservation.lease is not None
    cache.release(reservation.lease)
    hits(cache, "another", [1])
    assert "writer" not in tenant_names(cache)  # its reservation ended: it holds nothing


def test_a_tenant_that_loses_its_last_chunk_or_quota_becomes_idle(policy: str) -> None:
    cache = make_cache(policy=policy, idle_tenants=0)
    for number in range(10):
        store(cache, f"t{number}", [number])
    cache.set_quota("t0", 1 << 20)
    assert cache.stats().tenant_count == 10
    assert cache.clear() == 10
    assert tenant_names(cache) == {"t0"}  # it still has its own quota
    cache.delete_quota("t0")
    cache.maintain()
    assert cache.stats().tenant_count == 0


def test_a_dropped_records_place_is_reused_without_mixing_tenants(policy: str) -> None:
    cache = make_cache(policy=policy, idle_tenants=0)
    store(cache, "old", [1])
    cache.clear("old")  # drops old's record
    hits(cache, "passer-by", [1])
    store(cache, "new", [2])
    assert cache.debug_view().record_places == 1  # each took the place the one before left
    assert hits(cache, "new", [2]) == 1
    assert hits(cache, "old", [2]) == 0
    assert cache.tenant_usage("new").chunks == 1
    cache.clear()
    assert cache.stats().tenant_count == 0


@pytest.mark.parametrize("bound", [0, 5])
def test_chunks_locked_by_a_lookup_keep_the_record(policy: str, bound: int) -> None:
    cache = make_cache(policy=policy, idle_tenants=bound)
    store(cache, "reader", [1])
    hit = cache.lookup("reader", [key(1)])
    assert cache.clear("reader") == 1  # locked: doomed, freed on release
    for number in range(10):
        hits(cache, f"stranger-{number}", [1])
    assert "reader" in tenant_names(cache)
    assert hit.lease is not None
    cache.release(hit.lease)
    assert cache.tenant_usage("reader").chunks == 0
