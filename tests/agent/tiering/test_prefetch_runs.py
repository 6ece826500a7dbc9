"""The prefetch's runs from a tier that receives in place (the peer tier's way), on a real
L1: a prefix's runs reserve their pages one after the other before their chunks are asked
for, so that every chunk lands in its pages as it comes, whichever run's comes first; a run
that fails before it is asked for holds up none after it.

The tier here is a stand-in for the peer tier (its own tests run it between agents): it
receives each run's chunks in reverse order of the runs, the later runs first, and notes
whether each chunk's turn had come when it arrived, as the peer link does to choose
between its pages and a buffer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.agent.core.quota_book import QuotaBook
from kvpool.agent.l2.base import Destination, ObjectKey
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.service.landing import TURN_SECONDS, ChunkLanding
from kvpool.agent.tiering.prefetch import RUN_CHUNKS, Prefetcher
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service

ALICE = "a" * 32
RUN = RUN_CHUNKS
CHUNKS = 1 + 2 * RUN + RUN // 2
"""Chunks of one page: the first alone, then runs of the prefetch's, 8 at once."""


class ReversedRunsTier:
    """Holds every chunk; receives a prefix's later runs before its earlier ones."""

    name = "peer"

    def __init__(self, chunks: dict[bytes, bytes], landings: Callable[[], int]) -> None:
        self.chunks = chunks
        self.turns: list[bool | None] = []
        """Each chunk's turn when it arrived, in the order they arrived."""
        self.landings = landings
        self.made: list[int] = []
        """The landings the prefetch had made when each run was asked for."""
        self._runs = 0

    async def exists(self, names: Sequence[ObjectKey]) -> list[bool]:
        return [name.key in self.chunks for name in names]

    async def get(self, names: Sequence[ObjectKey]) -> list[bytes | None]:
        return [self.chunks.get(name.key) for name in names]

    async def get_into(self, name: ObjectKey, into: Destination) -> bool:
        return await self._receive(name, into)

    async def get_run_into(self, names: Sequence[ObjectKey], into: Sequence[Destination]) -> int:
        self._runs += 1
        self.made.append(self.landings())
        await asyncio.sleep(0.2 / self._runs)  # the later a run is asked, the sooner it comes
        filled = 0
        for name, destination in zip(names, into, strict=True):
            if not await self._receive(name, destination):
                break
            filled += 1
        return filled

    async def _receive(self, name: ObjectKey, into: Destination) -> bool:
        payload = self.chunks[name.key]
        self.turns.append(into.turn())
        if not await asyncio.to_thread(into.wait_turn):  # where the peer link waits, aside
            return False
        memory = into.reserve(len(payload))
        if memory is None:
            return False
        memory[:] = payload
        return True


def pull(service: CacheService, tier: ReversedRunsTier, keys: list[bytes]) -> int:
    """Prefetch ``keys`` from ``tier`` into ``service``'s L1: how many it loaded."""

    async def prefetch() -> int:
        prefetcher = Prefetcher(service, [tier])  # type: ignore[list-item]
        await prefetcher.start()
        started = prefetcher.begin(ALICE, keys, None)
        try:
            while not (progress := prefetcher.status(started)) or not progress.done:
                await asyncio.sleep(0.01)
            return progress.loaded
        finally:
            await prefetcher.stop()

    return asyncio.run(prefetch())


def prefix(count: int = CHUNKS) -> tuple[list[bytes], dict[bytes, bytes]]:
    keys = [key(f"chunk-{index}") for index in range(count)]
    return keys, {name: bytes([index % 256]) * PAGE for index, name in enumerate(keys)}


def tier(service: CacheService, chunks: dict[bytes, bytes]) -> ReversedRunsTier:
    """The stand-in tier over ``chunks``, counting the landings ``service`` makes."""
    made = 0
    landing = service.landing

    def counted(*args: Any, **kwargs: Any) -> ChunkLanding:
        nonlocal made
        made += 1
        return landing(*args, **kwargs)

    service.landing = counted  # type: ignore[method-assign]
    return ReversedRunsTier(chunks, lambda: made)


def test_every_chunk_of_a_prefix_lands_in_its_pages_as_it_comes(tmp_path: Path) -> None:
    service = make_service(make_cache(pages=CHUNKS * 2), tmp_path / "q.json")
    keys, chunks = prefix()
    stand_in = tier(service, chunks)
    assert pull(service, stand_in, keys) == CHUNKS
    assert stand_in.turns[1:] == [True] * (CHUNKS - 1)  # none waited for the chunk before it
    assert service.retrieve(ALICE, keys, max_bytes=CHUNKS * PAGE) == [chunks[k] for k in keys]
    assert service.open_write_leases == 0


def test_runs_reserved_ahead_stop_at_the_tenants_quota(tmp_path: Path) -> None:
    """The run the quota refuses, and every run after it, give their pages back: the prefix
    stops at the quota, and nothing waits on the refused run."""
    quota = 1 + RUN + RUN // 2
    cache = make_cache(pages=CHUNKS * 2, quotas=QuotaBook(limits={ALICE: quota * PAGE}))
    service = make_service(cache, tmp_path / "q.json")
    keys, chunks = prefix()
    assert pull(service, tier(service, chunks), keys) == quota
    assert service.lookup(ALICE, keys, lock=False).count == quota
    assert service.open_write_leases == 0 and service.stats().chunks == quota


def test_a_run_past_the_window_gets_its_landings_as_it_takes_its_place(tmp_path: Path) -> None:
    """A prefix of 12 runs (8 in flight at once): the first run is asked for with its own
    landings made, not the prefix's (the work of a long prefix's chunks is spread over its
    transfer instead of coming before it), and every chunk still lands in its pages."""
    count = 1 + 12 * RUN
    service = make_service(make_cache(pages=count * 2), tmp_path / "q.json")
    keys, chunks = prefix(count)
    stand_in = tier(service, chunks)
    assert pull(service, stand_in, keys) == count
    assert stand_in.made[0] == 1 + RUN  # the first chunk's and the first run's
    assert stand_in.made == sorted(stand_in.made) and stand_in.made[-1] == count
    assert stand_in.turns[1:] == [True] * (count - 1)
    assert service.retrieve(ALICE, keys, max_bytes=count * PAGE) == [chunks[k] for k in keys]
    assert service.open_write_leases == 0


def test_a_run_that_fails_before_it_is_asked_for_holds_up_no_run_after_it(
    tmp_path: Path,
) -> None:
    """L1 fails the second run's reservation (an error, not a refusal): the prefix stops
    before that run, and the runs after it, waiting for its turn, hear at once that it
    gave up instead of waiting out a turn's whole time (a minute)."""
    count = 1 + 4 * RUN
    service = make_service(make_cache(pages=count * 2), tmp_path / "q.json")
    keys, chunks = prefix(count)
    reserve = service.reserve
    reservations = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal reservations
        reservations += 1
        if reservations == 3:  # the first chunk's, the first run's, then the second run's
            raise RuntimeError("L1 failed")
        return reserve(*args, **kwargs)

    service.reserve = failing  # type: ignore[method-assign]
    started = time.monotonic()
    assert pull(service, tier(service, chunks), keys) == 1 + RUN
    assert time.monotonic() - started < TURN_SECONDS / 4
    assert service.lookup(ALICE, keys, lock=False).count == 1 + RUN
    assert service.open_write_leases == 0
