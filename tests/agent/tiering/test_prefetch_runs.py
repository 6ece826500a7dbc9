"""The prefetch's runs from a tier that receives in place (the peer tier's way), on a real
L1: a prefix's runs reserve their pages one after the other before their chunks are asked
for, so that every chunk lands in its pages as it comes, whichever run's comes first.

The tier here is a stand-in for the peer tier (its own tests run it between agents): it
receives each run's chunks in reverse order of the runs, the later runs first, and notes
whether each chunk's turn had come when it arrived, as the peer link does to choose
between its pages and a buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from kvpool.agent.core.quota_book import QuotaBook
from kvpool.agent.l2.base import Destination, ObjectKey
from kvpool.agent.service.cache_service import CacheService
from kvpool.agent.tiering.prefetch import Prefetcher
from tests.support.chunks import key
from tests.support.l1 import PAGE, make_cache, make_service

ALICE = "a" * 32
CHUNKS = 40
"""Chunks of one page: the first alone, then runs of 16 (the prefetch's), 8 at once."""


class ReversedRunsTier:
    """Holds every chunk; receives a prefix's later runs before its earlier ones."""

    name = "peer"

    def __init__(self, chunks: dict[bytes, bytes]) -> None:
        self.chunks = chunks
        self.turns: list[bool | None] = []
        """Each chunk's turn when it arrived, in the order they arrived."""
        self._runs = 0

    async def exists(self, names: Sequence[ObjectKey]) -> list[bool]:
        return [name.key in self.chunks for name in names]

    async def get(self, names: Sequence[ObjectKey]) -> list[bytes | None]:
        return [self.chunks.get(name.key) for name in names]

    async def get_into(self, name: ObjectKey, into: Destination) -> bool:
        return await self._receive(name, into)

    async def get_run_into(self, names: Sequence[ObjectKey], into: Sequence[Destination]) -> int:
        self._runs += 1
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


def prefix() -> tuple[list[bytes], dict[bytes, bytes]]:
    keys = [key(f"chunk-{index}") for index in range(CHUNKS)]
    return keys, {name: bytes([index]) * PAGE for index, name in enumerate(keys)}


def test_every_chunk_of_a_prefix_lands_in_its_pages_as_it_comes(tmp_path: Path) -> None:
    service = make_service(make_cache(pages=CHUNKS * 2), tmp_path / "q.json")
    keys, chunks = prefix()
    tier = ReversedRunsTier(chunks)
    assert pull(service, tier, keys) == CHUNKS
    assert tier.turns[1:] == [True] * (CHUNKS - 1)  # none waited for the chunk before it
    assert service.retrieve(ALICE, keys, max_bytes=CHUNKS * PAGE) == [chunks[k] for k in keys]
    assert service.open_write_leases == 0


def test_runs_reserved_ahead_stop_at_the_tenants_quota(tmp_path: Path) -> None:
    """The run the quota refuses, and every run after it, give their pages back: the prefix
    stops at the quota, and nothing waits on the refused run."""
    quota = 24
    cache = make_cache(pages=CHUNKS * 2, quotas=QuotaBook(limits={ALICE: quota * PAGE}))
    service = make_service(cache, tmp_path / "q.json")
    keys, chunks = prefix()
    assert pull(service, ReversedRunsTier(chunks), keys) == quota
    assert service.lookup(ALICE, keys, lock=False).count == quota
    assert service.open_write_leases == 0 and service.stats().chunks == quota
