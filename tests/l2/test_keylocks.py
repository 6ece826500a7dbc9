"""Per-key locks: exclusion per key, synchronous claims of free keys, cancelled waiters."""

from __future__ import annotations

import asyncio

import pytest

from kvpool.agent.l2.keylocks import KeyLocks

pytestmark = pytest.mark.asyncio


async def test_holders_of_one_key_take_turns_in_arrival_order() -> None:
    locks, order = KeyLocks(), []

    async def worker(index: int) -> None:
        async with locks.hold("k"):
            order.append(f"in {index}")
            await asyncio.sleep(0)
            order.append(f"out {index}")

    await asyncio.gather(*(worker(i) for i in range(3)))
    assert order == ["in 0", "out 0", "in 1", "out 1", "in 2", "out 2"]
    assert not locks.busy("k")


async def test_other_keys_are_not_blocked() -> None:
    locks = KeyLocks()
    async with locks.hold("a"):
        await asyncio.wait_for(locks.claim("b"), timeout=1)
        assert locks.busy("a") and locks.busy("b")
        locks.release("b")


async def test_try_claim_takes_only_a_free_key() -> None:
    locks = KeyLocks()
    assert locks.try_claim("k")
    assert not locks.try_claim("k")
    waiter = asyncio.create_task(locks.claim("k"))
    await asyncio.sleep(0)
    assert not waiter.done()
    locks.release("k")
    await waiter  # handed over
    assert locks.busy("k")
    locks.release("k")
    assert not locks.busy("k")


async def test_a_cancelled_waiter_does_not_block_the_next() -> None:
    locks = KeyLocks()
    assert locks.try_claim("k")
    cancelled = asyncio.create_task(locks.claim("k"))
    patient = asyncio.create_task(locks.claim("k"))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    locks.release("k")
    await asyncio.wait_for(patient, timeout=1)
    locks.release("k")
    assert not locks.busy("k")


async def test_a_waiter_cancelled_after_the_hand_over_passes_the_key_on() -> None:
    locks = KeyLocks()
    assert locks.try_claim("k")
    first = asyncio.create_task(locks.claim("k"))
    second = asyncio.create_task(locks.claim("k"))
    await asyncio.sleep(0)
    locks.release("k")  # hands the key to `first`, which has not run yet
    first.cancel()
    await asyncio.wait_for(second, timeout=1)
    assert first.cancelled()
    locks.release("k")
    assert not locks.busy("k")
