"""Every policy through the same scenarios, plus what distinguishes ARC from LRU."""

from __future__ import annotations

import pytest

from kvpool.agent.core.policies import POLICY_NAMES, SlotArena, policy_factory
from tests.support.chunks import key


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_victims_are_the_resident_slots_and_removal_works(name: str) -> None:
    policy = policy_factory(name)(SlotArena(16))
    for slot in range(5):
        policy.insert(slot, key(slot))
    assert sorted(policy.victims()) == [0, 1, 2, 3, 4]
    policy.remove(2, key(2), evicted=True)
    policy.remove(3, key(3), evicted=False)
    assert sorted(policy.victims()) == [0, 1, 4]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_touched_slot_is_not_the_first_victim(name: str) -> None:
    policy = policy_factory(name)(SlotArena(16))
    for slot in range(4):
        policy.insert(slot, key(slot))
    policy.touch([0])
    assert next(iter(policy.victims())) == 1


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_requeued_slots_go_last_in_their_order(name: str) -> None:
    policy = policy_factory(name)(SlotArena(16))
    for slot in range(5):
        policy.insert(slot, key(slot))
    policy.requeue([0, 2])
    assert list(policy.victims()) == [1, 3, 4, 0, 2]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policies_of_one_arena_do_not_interfere(name: str) -> None:
    arena = SlotArena(16)
    first, second = policy_factory(name)(arena), policy_factory(name)(arena)
    first.insert(0, key(0))
    second.insert(1, key(1))
    first.touch([0])
    assert list(first.victims()) == [0] and list(second.victims()) == [1]


def _survivors_of_a_scan(name: str) -> set[int]:
    """Slots 0-3 are used twice, then a one-time scan of 8 new chunks passes a 4-slot budget."""
    policy = policy_factory(name)(SlotArena(64))
    resident: set[int] = set()

    def admit(slot: int) -> None:
        if len(resident) == 4:
            victim = next(iter(policy.victims()))
            policy.remove(victim, key(victim), evicted=True)
            resident.discard(victim)
        policy.insert(slot, key(slot))
        resident.add(slot)

    for slot in range(4):
        admit(slot)
    for slot in range(4):
        policy.touch([slot])
    for slot in range(10, 18):
        admit(slot)
    return resident & {0, 1, 2, 3}


def test_arc_resists_a_scan_that_flushes_lru() -> None:
    assert _survivors_of_a_scan("lru") == set()
    # ARC gives one frequent slot to the first scan chunk (T1 is empty at that moment, so
    # REPLACE takes from T2), then confines the scan to T1.
    assert _survivors_of_a_scan("arc") == {1, 2, 3}


def test_arc_adapts_towards_recency_on_ghost_hits() -> None:
    policy = policy_factory("arc")(SlotArena(64))
    for slot in range(4):
        policy.insert(slot, key(slot))
    policy.remove(0, key(0), evicted=True)  # ghost in B1
    assert policy.target == 0  # type: ignore[attr-defined]
    policy.insert(5, key(0))  # the same key comes back: T1 was too small
    assert policy.target > 0  # type: ignore[attr-defined]


def test_arc_requeue_is_not_a_use() -> None:
    """A prefix passed over by an eviction stays in the list it was in (no promotion)."""
    policy = policy_factory("arc")(SlotArena(16))
    for slot in range(3):
        policy.insert(slot, key(slot))
    policy.touch([2])  # T1 = [0, 1], T2 = [2]
    policy.requeue([0, 2])
    assert list(policy.victims()) == [1, 0, 2]


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known policies are lru, arc"):
        policy_factory("fifo")
