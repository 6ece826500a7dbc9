"""Prefetch: a lookup that misses in L1 loads the rest of the prefix from L2, asynchronously.

The cache service's lookup starts a prefetch for the keys after the L1 hits
(on the ZMQ thread), whose id the client gets at once. On the event loop, the
prefetch finds how long a run of those keys the tiers hold (``expected``), then
loads them into L1 chunk by chunk through the service's store (reserve, copy,
commit), so quotas apply and nothing half-copied is ever visible (``loaded``).
Each chunk comes from the tier holding it that is expected to cost least
(:mod:`kvpool_agent.tiering.costs`; the fixed order is NVMe, peers, S3), and
from the next holder where that one fails (a peer that died mid-transfer).
It stops at the first chunk no tier gives or L1 refuses. Listeners (the ZMQ server,
to answer parked ``prefetch_status`` requests) hear of every change.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool_agent.l2.base import L2Adapter, ObjectKey
from kvpool_agent.service.cache_service import CacheService
from kvpool_agent.tiering.costs import TierCosts
from kvpool_agent.tiering.writeback import LatencyObserver
from kvpool_agent.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)
"""Prefetches follow clients' lookups: one that keeps failing logs a traceback a minute."""

_REMEMBERED = 4096  # finished prefetches kept for status queries
_BATCH = 8
_TYPICAL_CHUNK = 2 << 20
"""The size the tier costs are compared at before a chunk has been seen."""


@dataclass
class Prefetch:
    id: int
    tenant: str
    keys: list[bytes]
    parent: bytes | None
    expected: int = -1
    loaded: int = 0
    done: bool = False


@dataclass
class PrefetchStats:
    started: int = 0
    refused: int = 0
    """Not started: too many prefetches in flight."""
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    in_flight: int = 0


@dataclass
class Prefetcher:
    service: CacheService
    tiers: Sequence[L2Adapter]
    max_in_flight: int = 32
    observe: LatencyObserver | None = None
    costs: TierCosts = field(default_factory=TierCosts)
    stats: PrefetchStats = field(default_factory=PrefetchStats)

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._prefetches: OrderedDict[int, Prefetch] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._listeners: list[Callable[[], None]] = []
        self._guard = threading.Lock()  # begin() runs on the ZMQ thread, the rest on the loop
        self._finished = threading.Condition(self._guard)
        self._chunk_bytes = _TYPICAL_CHUNK

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def begin(self, tenant: str, keys: Sequence[bytes], parent: bytes | None) -> int:
        """Start loading ``keys`` (thread-safe); 0 if no prefetch was started."""
        if not keys or not self.tiers or self._loop is None:
            return 0
        with self._guard:
            if self.stats.in_flight >= self.max_in_flight:
                self.stats.refused += 1
                return 0
            prefetch = Prefetch(next(self._ids), tenant, list(keys), parent)
            self._prefetches[prefetch.id] = prefetch
            while len(self._prefetches) > _REMEMBERED:
                self._prefetches.popitem(last=False)
            self.stats.started += 1
            self.stats.in_flight += 1
        self._loop.call_soon_threadsafe(self._spawn, prefetch)
        return prefetch.id

    def status(self, prefetch_id: int) -> Prefetch | None:
        with self._guard:
            return self._prefetches.get(prefetch_id)

    def wait(self, prefetch_id: int, timeout: float) -> Prefetch | None:
        """The prefetch once done, or as far as it got in ``timeout`` seconds (blocks: for a
        warm, on an HTTP handler's thread); None for an unknown id."""
        with self._finished:
            prefetch = self._prefetches.get(prefetch_id)
            if prefetch is not None:
                self._finished.wait_for(lambda: prefetch.done, timeout)
            return prefetch

    def _spawn(self, prefetch: Prefetch) -> None:
        task = asyncio.create_task(self._run(prefetch), name=f"prefetch-{prefetch.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, prefetch: Prefetch) -> None:
        try:
            holders = await self._locate(prefetch)
            prefetch.expected = len(holders)
            self._changed()
            parent = prefetch.parent
            loaded: list[bytes] = []
            for start in range(0, len(holders), _BATCH):
                batch = list(
                    zip(prefetch.keys[start:], holders[start : start + _BATCH], strict=False)
                )
                payloads = await asyncio.gather(
                    *(self._get_any(tiers, prefetch.tenant, key) for key, tiers in batch)
                )
                for (key, _), payload in zip(batch, payloads, strict=True):
                    placed = payload is not None and self._place(
                        prefetch.tenant, key, payload, parent, loaded
                    )
                    if not placed:
                        return
                    parent = key
                    loaded.append(key)
                    prefetch.loaded += 1
                self._changed()
        except Exception as error:
            _failures.exception(f"a prefetch failed: {type(error).__name__}")
        finally:
            prefetch.done = True
            with self._guard:
                self.stats.in_flight -= 1
                self._finished.notify_all()
            self._changed()

    async def _locate(self, prefetch: Prefetch) -> list[list[L2Adapter]]:
        """For each key of the leading run the tiers have, the tiers holding it, the one
        expected to cost least first."""
        names = [ObjectKey(prefetch.tenant, key) for key in prefetch.keys]
        found = await asyncio.gather(*(tier.exists(names) for tier in self.tiers))
        holders: list[list[L2Adapter]] = []
        for index in range(len(names)):
            having = [t for t, has in zip(self.tiers, found, strict=True) if has[index]]
            if not having:
                break
            first = self.costs.cheapest([t.name for t in having], self._chunk_bytes)
            holders.append([having[first], *having[:first], *having[first + 1 :]])
        return holders

    async def _get_any(
        self, tiers: list[L2Adapter], tenant: str, key: bytes
    ) -> bytes | memoryview | None:
        for tier in tiers:
            payload = await self._get(tier, tenant, key)
            if payload is not None:
                return payload
        return None

    async def _get(self, tier: L2Adapter, tenant: str, key: bytes) -> bytes | memoryview | None:
        started = time.perf_counter()
        (payload,) = await tier.get([ObjectKey(tenant, key)])
        seconds = time.perf_counter() - started
        if self.observe is not None:
            self.observe(tier.name, "get", seconds)
        if payload is not None:
            self._chunk_bytes = len(payload)
            self.costs.observe(tier.name, seconds, len(payload))
        return payload

    def _place(
        self,
        tenant: str,
        key: bytes,
        payload: bytes | memoryview,
        parent: bytes | None,
        loaded: list[bytes],
    ) -> bool:
        """Store one chunk into L1; False if L1 refused it.

        The chunks this prefetch loaded are kept: a prefix longer than the quota
        stops at the quota instead of evicting its own head. Present already (a
        client or another prefetch stored it meanwhile) counts as placed.
        """
        result = self.service.store(tenant, [key], [payload], parent, keep=loaded, write_back=False)
        self.stats.loaded_chunks += result.stored
        self.stats.loaded_bytes += result.stored * len(payload)
        return result.stored + result.present == 1

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()
