"""Write-back: committed chunks go to the L2 tiers in the background, never in a store's way.

The cache service reports commits (policy ``all``) or hits (policy ``reused``:
a chunk qualifies at its ``min_hits``-th hit), holding its lock. Each qualifying
chunk is pinned in L1 (a read lock without expiry, so eviction cannot lose it)
and queued; worker tasks on the event loop copy it out, put it to every tier
and unpin it through the service.
The queue is bounded in chunks and in bytes (pins must leave most of L1
evictable): past either bound, chunks are shed (counted, not pinned, free to be
evicted) instead of slowing stores or growing memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpool.agent.l2.base import L2Adapter, L2Object, ObjectKey
from kvpool.agent.service.data_service import DataService
from kvpool.agent.service.hooks import Pins
from kvpool.common.keys import CANARY_TENANT

log = logging.getLogger(__name__)

LatencyObserver = Callable[[str, str, float], None]
"""(tier, operation, seconds)."""

_HIT_MEMORY = 1 << 20  # keys whose hits the ``reused`` policy remembers
_SUBMITTED = -1


@dataclass
class WriteBackStats:
    queued: int = 0
    written: int = 0
    """Chunk copies stored in a tier (a chunk put to two tiers counts twice)."""
    failed: int = 0
    shed: int = 0
    pending: int = 0
    pending_bytes: int = 0


@dataclass(frozen=True, slots=True)
class _Item:
    name: ObjectKey
    lease: int
    offset: int
    size: int


class WriteBack:
    def __init__(
        self,
        service: DataService,
        tiers: Sequence[L2Adapter],
        *,
        policy: Literal["all", "reused"],
        min_hits: int,
        capacity: int,
        capacity_bytes: int,
        workers: int = 4,
        observe: LatencyObserver | None = None,
    ) -> None:
        self._service = service
        self._tiers = list(tiers)
        self._policy = policy
        self._min_hits = min_hits
        self._capacity = capacity
        self._capacity_bytes = capacity_bytes
        self._worker_count = workers
        self._observe = observe
        self._hits: OrderedDict[bytes, int] = OrderedDict()
        self._queue: asyncio.Queue[_Item] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[asyncio.Task[None]] = []
        self.stats = WriteBackStats()
        self._pending = threading.Lock()  # the service's calls and the workers count pending

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._workers = [
            asyncio.create_task(self._work(), name=f"l2-writeback-{n}")
            for n in range(self._worker_count)
        ]

    async def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []

    # Called by the cache service, holding its lock (see service.WriteBackHook).

    def committed(self, tenant: str, keys: Sequence[bytes], pins: Pins) -> None:
        if self._policy == "all":
            # Tail first, so that a tier's recency order keeps the head of a chain longest.
            self._submit(tenant, keys[::-1], pins)

    def hit(self, tenant: str, keys: Sequence[bytes], pins: Pins) -> None:
        if self._policy != "reused":
            return
        qualified = []
        for key in keys:
            count = self._hits.pop(key, 0)
            if count == _SUBMITTED:
                self._hits[key] = _SUBMITTED
                continue
            count += 1
            if count >= self._min_hits:
                qualified.append(key)
                count = _SUBMITTED
            self._hits[key] = count
        while len(self._hits) > _HIT_MEMORY:
            self._hits.popitem(last=False)
        self._submit(tenant, qualified, pins)

    def _submit(self, tenant: str, keys: Sequence[bytes], pins: Pins) -> None:
        if not keys or not self._tiers or tenant == CANARY_TENANT:
            return  # nothing keeps copies (peers only); the doctor's canary stays in L1
        if self._loop is None or self._queue is None:
            return
        items = []
        stats = self.stats
        with self._pending:
            for key in keys:
                if stats.pending >= self._capacity:
                    stats.shed += 1
                    continue
                pinned = pins.pin(tenant, key)
                if pinned.lease is None:
                    continue  # evicted or cleared already
                if stats.pending_bytes + pinned.sizes[0] > self._capacity_bytes:
                    pins.release(pinned.lease)
                    stats.shed += 1
                    continue
                stats.pending += 1
                stats.pending_bytes += pinned.sizes[0]
                stats.queued += 1
                items.append(
                    _Item(ObjectKey(tenant, key), pinned.lease, pinned.offsets[0], pinned.sizes[0])
                )
        if items:
            self._loop.call_soon_threadsafe(self._enqueue, items)

    def _enqueue(self, items: list[_Item]) -> None:
        assert self._queue is not None
        for item in items:
            self._queue.put_nowait(item)

    # Worker tasks on the event loop.

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            item = await self._queue.get()
            try:
                # Pinned, so the bytes stay put: hand the tiers a view, not a copy (a copy on
                # the event loop would hold the GIL against the ZMQ thread's stores).
                view = self._service.chunk_view(item.name.tenant)
                payload = view[item.offset : item.offset + item.size]
                for tier, stored in zip(
                    self._tiers,
                    await asyncio.gather(*(self._put(t, item, payload) for t in self._tiers)),
                    strict=True,
                ):
                    if stored:
                        self.stats.written += 1
                    else:
                        self.stats.failed += 1
                        log.debug("write-back of a chunk to %s failed", tier.name)
            finally:
                self._service.release_all([item.lease])
                with self._pending:
                    self.stats.pending -= 1
                    self.stats.pending_bytes -= item.size

    async def _put(self, tier: L2Adapter, item: _Item, payload: memoryview) -> bool:
        started = time.perf_counter()
        (stored,) = await tier.put([L2Object(item.name, payload)])
        if self._observe is not None:
            self._observe(tier.name, "put", time.perf_counter() - started)
        return stored
