"""Pins in L1: pinned chunks outlive eviction, within their tenant's pin budget."""

from __future__ import annotations

import pytest

from kvpool.agent.core.cache_types import InvalidRequest, PinRefused
from kvpool.agent.core.quota_book import QuotaBook
from tests.support.chunks import key
from tests.support.l1 import PAGE, hits, make_cache, store

SPACE, OTHER = "s" * 32, "o" * 32


def keys(names: range | list[int]) -> list[bytes]:
    return [key(n) for n in names]


def test_a_pinned_chain_outlives_watermark_and_pressure_eviction() -> None:
    cache = make_cache(pages=20, pin_budget=8 * PAGE)
    store(cache, SPACE, list(range(8)))
    state = cache.put_pin(SPACE, "prefix", keys(range(8)))
    assert (state.keys, state.resident, state.pinned, state.pinned_bytes) == (8, 8, 8, 8 * PAGE)
    for first in range(100, 160, 6):  # far more than L1 holds
        store(cache, OTHER, list(range(first, first + 6)))
    assert hits(cache, SPACE, list(range(8))) == 8
    assert cache.stats().evictions["watermark"] + cache.stats().evictions["pressure"] > 0
    cache.check_invariants()


def test_keys_pinned_before_their_chunks_arrive_are_pinned_on_arrival() -> None:
    cache = make_cache(pages=20, pin_budget=4 * PAGE)
    cache.put_pin(SPACE, "early", keys(range(4)))
    assert cache.pins(SPACE).pins[0].resident == 0
    store(cache, SPACE, list(range(4)))
    assert cache.pins(SPACE).pinned_bytes == 4 * PAGE
    for first in range(100, 160, 6):
        store(cache, OTHER, list(range(first, first + 6)))
    assert hits(cache, SPACE, list(range(4))) == 4
    cache.check_invariants()


def test_the_budget_pins_the_head_and_the_rest_stays_evictable() -> None:
    cache = make_cache(pages=20)
    cache.replace_pin_budgets({SPACE: 3 * PAGE})
    cache.put_pin(SPACE, "long", keys(range(6)))
    store(cache, SPACE, list(range(6)))
    (state,) = cache.pins(SPACE).pins
    assert (state.resident, state.pinned, state.pinned_bytes) == (6, 3, 3 * PAGE)
    for first in range(100, 160, 6):
        store(cache, OTHER, list(range(first, first + 6)))
    assert hits(cache, SPACE, list(range(6))) == 3  # the head, pinned; the tail went
    cache.check_invariants()


def test_a_larger_budget_pins_what_a_smaller_one_left_out() -> None:
    cache = make_cache(pages=20, pin_budget=2 * PAGE)
    store(cache, SPACE, list(range(4)))
    cache.put_pin(SPACE, "p", keys(range(4)))
    assert cache.pins(SPACE).pinned_bytes == 2 * PAGE
    cache.replace_pin_budgets({SPACE: 4 * PAGE})
    assert cache.pins(SPACE).pins[0].pinned == 4
    cache.replace_pin_budgets({})  # back to the default
    assert cache.pins(SPACE).pinned_bytes == 2 * PAGE
    cache.check_invariants()


def test_an_unpinned_chunk_is_evictable_again() -> None:
    cache = make_cache(pages=20, pin_budget=8 * PAGE)
    store(cache, SPACE, list(range(4)))
    cache.put_pin(SPACE, "a", keys(range(4)))
    cache.put_pin(SPACE, "b", keys([0, 1]))
    assert cache.delete_pin(SPACE, "a")
    assert not cache.delete_pin(SPACE, "a")
    assert cache.pins(SPACE).pinned_bytes == 2 * PAGE  # "b" still holds 0 and 1
    cache.check_invariants()
    for first in range(100, 160, 6):
        store(cache, OTHER, list(range(first, first + 6)))
    assert hits(cache, SPACE, [0, 1]) == 2 and hits(cache, SPACE, [2]) == 0
    cache.delete_pin(SPACE, "b")
    assert cache.pins(SPACE).pins == []
    for first in range(200, 260, 6):
        store(cache, OTHER, list(range(first, first + 6)))
    assert hits(cache, SPACE, [0]) == 0
    cache.check_invariants()


def test_pins_count_against_the_quota_and_a_shrunken_quota_wins() -> None:
    cache = make_cache(pages=40, quotas=QuotaBook(), pin_budget=8 * PAGE)
    cache.set_quota(SPACE, 6 * PAGE)
    cache.put_pin(SPACE, "p", keys(range(6)))
    store(cache, SPACE, list(range(6)))
    refused = cache.reserve(SPACE, [key(50)], [PAGE])
    assert refused.refused_reason is not None and "pinned" in refused.refused_reason
    cache.set_quota(SPACE, 4 * PAGE)
    assert cache.tenant_usage(SPACE).used_bytes == 4 * PAGE
    assert cache.pins(SPACE).pinned_bytes == 4 * PAGE
    cache.check_invariants()


def test_pinning_with_a_budget_of_zero_is_refused_naming_the_budget() -> None:
    cache = make_cache(pages=20)
    with pytest.raises(PinRefused, match="pin budget"):
        cache.put_pin(SPACE, "p", keys(range(2)))
    with pytest.raises(InvalidRequest):
        cache.put_pin(SPACE, "p", [b"short"])
    assert cache.pins(SPACE).pins == []


def test_a_pin_never_takes_another_tenants_chunk() -> None:
    cache = make_cache(pages=20, pin_budget=8 * PAGE)
    store(cache, OTHER, [1, 2])
    state = cache.put_pin(SPACE, "p", keys([1, 2]))
    assert (state.resident, state.pinned) == (0, 0)
    cache.check_invariants()


def test_an_admins_clear_drops_the_pins_and_a_plain_clear_keeps_them() -> None:
    cache = make_cache(pages=20, pin_budget=8 * PAGE)
    cache.put_pin(SPACE, "p", keys(range(3)))
    store(cache, SPACE, list(range(3)))
    cache.clear(SPACE)
    assert cache.pins(SPACE).pinned_bytes == 0 and len(cache.pins(SPACE).pins) == 1
    store(cache, SPACE, list(range(3)))
    assert cache.pins(SPACE).pinned_bytes == 3 * PAGE  # pinned again on arrival
    cache.clear(SPACE, unpin=True)
    assert cache.pins(SPACE).pins == []
    cache.check_invariants()


def test_a_pinned_chunk_cleared_while_read_is_no_longer_pinned() -> None:
    cache = make_cache(pages=20, pin_budget=8 * PAGE)
    store(cache, SPACE, [1])
    cache.put_pin(SPACE, "p", keys([1]))
    hit = cache.lookup(SPACE, keys([1]))
    cache.clear(SPACE)
    cache.check_invariants()
    assert hit.lease is not None
    cache.release(hit.lease)
    assert cache.pins(SPACE).pinned_bytes == 0
    cache.check_invariants()
