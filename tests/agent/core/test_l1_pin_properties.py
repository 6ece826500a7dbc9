"""Property test of pins: stores, pins, budgets, quotas and clears in any order keep the
cache's rules (``check_invariants``), and a pinned chunk leaves only for a reason a pin
yields to (its pin dropped, a clear, a quota that shrank below it)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvpool.agent.core.cache_types import PinRefused
from kvpool.agent.core.policies import POLICY_NAMES
from kvpool.agent.core.quota_book import QuotaBook
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache

TENANTS = ("space", "busy")
NAMES = st.integers(0, 23)
PIN_NAMES = st.sampled_from(["a", "b"])


class PinMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(pages=24, policy=self.policy, quotas=QuotaBook())
        self.cache.replace_pin_budgets({"space": 6 * PAGE})

    def _pinned(self) -> set[bytes]:
        return {
            k
            for k in (key(n) for n in range(24))
            if self.cache.is_pinned("space", k) and self.cache.contains(k)
        }

    @rule(
        tenant=st.sampled_from(TENANTS),
        names=st.lists(NAMES, min_size=1, max_size=6, unique=True),
        pages=st.integers(1, 2),
    )
    def store(self, tenant: str, names: list[int], pages: int) -> None:
        pinned = self._pinned()
        keys = [key(f"{tenant}-{n}") if tenant == "busy" else key(n) for n in names]
        reservation = self.cache.reserve(tenant, keys, [pages * PAGE] * len(keys))
        if reservation.lease is not None:
            self.cache.commit(reservation.lease)
        assert pinned <= self._pinned(), "a store evicted a pinned chunk"

    @rule(name=PIN_NAMES, names=st.lists(NAMES, max_size=8))
    def pin(self, name: str, names: list[int]) -> None:
        try:
            state = self.cache.put_pin("space", name, [key(n) for n in names])
        except PinRefused:
            assert self.cache.pin_budget("space") == 0
            return
        assert state.pinned <= state.resident <= state.keys == len(set(names))

    @rule(name=PIN_NAMES)
    def unpin(self, name: str) -> None:
        self.cache.delete_pin("space", name)

    @rule(budget=st.sampled_from([0, PAGE, 3 * PAGE, 6 * PAGE]))
    def budget(self, budget: int) -> None:
        self.cache.replace_pin_budgets({"space": budget})
        try:
            self.cache.put_pin("space", "probe", [])
        except PinRefused:
            assert budget == 0
        else:
            self.cache.delete_pin("space", "probe")

    @rule(limit=st.sampled_from([None, 2 * PAGE, 8 * PAGE, 20 * PAGE]))
    def quota(self, limit: int | None) -> None:
        self.cache.set_quota("space", limit)
        if limit is not None:
            assert self.cache.tenant_usage("space").used_bytes <= limit

    @rule(unpin=st.booleans())
    def clear(self, unpin: bool) -> None:
        self.cache.clear("space", unpin=unpin)
        assert not self._pinned()

    @rule()
    def maintain(self) -> None:
        pinned = self._pinned()
        self.cache.maintain()
        assert pinned <= self._pinned()

    @invariant()
    def rules_hold(self) -> None:
        self.cache.check_invariants()
        pins = self.cache.pins("space")
        assert pins.pinned_bytes <= pins.budget_bytes
        assert pins.pinned_bytes == sum(self.cache.pinned_bytes().values())


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_pins_keep_the_rules(policy: str) -> None:
    machine = type(f"PinMachine_{policy}", (PinMachine,), {"policy": policy})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
