"""The operator's daemon loop with kopf's own stop flag (no operator process: the loop's
timing and cancellation are what is tested; tests/operator/test_peers.py runs the daemons
in a real operator and stops it)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter

from kvpool.operator.daemons import every

pytestmark = pytest.mark.asyncio


def _flag() -> tuple[FlagSetter[None], AsyncFlagWaiter[None]]:
    setter: FlagSetter[None] = FlagSetter()
    return setter, AsyncFlagWaiter(setter)


async def test_work_runs_every_period_until_the_flag_is_set() -> None:
    setter, stopped = _flag()
    runs: list[float] = []
    started = time.monotonic()
    daemon = asyncio.create_task(every(stopped, 0.05, lambda: runs.append(time.monotonic())))
    while len(runs) < 3 and time.monotonic() - started < 10:
        await asyncio.sleep(0.01)
    setter.set()
    await asyncio.wait_for(daemon, 1)
    assert len(runs) >= 3
    gaps = [later - earlier for earlier, later in zip([started, *runs], runs, strict=False)]
    assert min(gaps) >= 0.05  # a pause first, then the work, then a pause


async def test_the_flag_ends_a_long_pause_at_once() -> None:
    setter, stopped = _flag()
    daemon = asyncio.create_task(every(stopped, 3600, lambda: None))
    await asyncio.sleep(0.05)
    setter.set()
    await asyncio.wait_for(daemon, 1)


async def test_a_cancelled_daemon_is_cancelled_whenever_it_comes() -> None:
    """kopf cancels a daemon that did not stop on its flag; the cancellation must come out
    as one, at any moment of the pause (its end included), never as a return or a
    TimeoutError (kopf's own timed wait could turn it into either)."""
    outcomes: dict[str, int] = {}
    for _ in range(500):
        setter, stopped = _flag()
        daemon = asyncio.create_task(every(stopped, 0.002, lambda: None))
        await asyncio.sleep(random.uniform(0, 0.01))
        if random.random() < 0.5:
            setter.set()
        daemon.cancel()
        try:
            await daemon
            outcome = "returned"
        except asyncio.CancelledError:
            outcome = "cancelled"
        except Exception as error:
            outcome = type(error).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes == {"cancelled": 500}
