"""Prefetch: a lookup that misses in L1 loads the rest of the prefix from L2, asynchronously.

The cache service's lookup starts a prefetch for the keys after the L1 hits
(on the ZMQ thread), whose id the client gets at once. On the event loop, the
prefetch finds how long a run of those keys the tiers hold (``expected``), then
loads them into L1, several at a time, each chunk into pages reserved for it in
prompt order (:class:`~kvpool.agent.service.landing.ChunkLanding`: the peer tier
receives straight into them, others copy there), committed in order, so quotas
apply, a prefix longer than its quota stops at the quota instead of evicting its
own head, and nothing half-copied is ever visible (``loaded``). A chunk L1 held
already counts as placed.
Each chunk comes from the tier holding it that is expected to cost least
(:mod:`kvpool.agent.tiering.costs`; the fixed order is NVMe, peers, S3), and
from the next holder where that one fails (a peer that died mid-transfer).
The first chunk is asked alone; once its size is known, consecutive chunks whose cheapest
tier receives in place (the peer tier) come in runs sized by it, one pipelined request each
(:meth:`~kvpool.agent.l2.base.ReceivesInPlace.get_run_into`), whose pages are reserved in
one call to L1 and committed in one
(:class:`~kvpool.agent.service.landing.RunReservation`), every run's reserved in prompt
order before any is asked for, so that each chunk lands in its pages as it comes; the
chunks after the first a run did not give go one by one.
It stops at the first chunk no tier gives or L1 refuses. Listeners (the ZMQ server,
to answer parked ``prefetch_status`` requests, which wait for the end) hear when the
run is located and when the prefetch is done.

Slots: at most ``max_in_flight`` prefetches run at once (32), and they are shared fairly,
since a slow L2 holds each for as long as it is slow: a tenant holds at most half of them
(16, each loading 8 runs of chunks at a time), and warms (:meth:`PinService.warm
<kvpool.agent.service.pin_service.PinService.warm>`, which an admin or a space's owner
may send by the dozen) a quarter of them all together (8), so warms never take the slots
that lookups need, nor one tenant all of them. A prefetch that finds no slot is refused
(counted in ``refused``): the lookup is answered from L1 alone, the warm is told to retry.

A prefetch of keys that a running one of the same tenant loads already (a decode's lookup
while a peer's offer of the same prompt lands: :mod:`kvpool.agent.peer.offers`) joins it:
its id is the running one's, and nothing is fetched twice (counted in ``joined``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from kvpool.agent.l2.base import L2Adapter, ObjectKey, ReceivesInPlace
from kvpool.agent.service.data_service import DataService
from kvpool.agent.service.landing import ChunkLanding, RunReservation, finish_in_order
from kvpool.agent.tiering.costs import TierCosts
from kvpool.agent.tiering.writeback import LatencyObserver
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)
"""Prefetches follow clients' lookups: one that keeps failing logs a traceback a minute."""

_REMEMBERED = 4096  # finished prefetches kept for status queries
_WINDOW = 8
"""Runs of chunks of one prefetch in flight at once (a chunk is a run of its own but from
the peer tier)."""
_RUN_BYTES = 16 << 20
RUN_CHUNKS = 64
"""A run of chunks from the peer tier: one pipelined request for this many chunks (of the
size of the prefix's first), up to this many bytes. A run costs the pulling agent's event
loop a reservation, a commit and a hand-off to a thread: at 256 KiB, runs of 64 chunks
rather than 16 moved 1.19-1.37 GB/s rather than 0.80-1.24 (docs/platform/peers.md)."""
_TYPICAL_CHUNK = 2 << 20
"""The size the tier costs are compared at before a chunk has been seen."""


@dataclass
class Prefetch:
    id: int
    tenant: str
    keys: list[bytes]
    parent: bytes | None
    warm: bool = False
    expected: int = -1
    loaded: int = 0
    done: bool = False


@dataclass
class PrefetchStats:
    started: int = 0
    refused: int = 0
    """Not started: no slot free (for its tenant, or for a warm)."""
    joined: int = 0
    """Not started: a running prefetch loads the same keys already."""
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    in_flight: int = 0


@dataclass
class Prefetcher:
    service: DataService
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
        self._tenant_slots = max(1, self.max_in_flight // 2)
        self._warm_slots = max(1, self.max_in_flight // 4)
        self._held: Counter[str] = Counter()
        """Slots held by each tenant with a prefetch in flight."""
        self._warms = 0
        """Slots held by warms."""
        self._loading: dict[tuple[str, bytes], tuple[Prefetch, int]] = {}
        """Each key a running prefetch loads (by tenant), with its position there."""
        self._in_place = {tier.name for tier in self.tiers if isinstance(tier, ReceivesInPlace)}
        """The tiers that receive into a landing (a protocol check is too slow per chunk)."""
        self._decisions: weakref.WeakKeyDictionary[ChunkLanding, _Decision] = (
            weakref.WeakKeyDictionary()
        )
        """Each landing's decision, awaitable on the loop (made from any thread)."""

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def begin(
        self, tenant: str, keys: Sequence[bytes], parent: bytes | None, *, warm: bool = False
    ) -> int:
        """Start loading ``keys`` (thread-safe); 0 if no prefetch was started."""
        if not keys or not self.tiers or self._loop is None:
            return 0
        with self._guard:
            running = self._running(tenant, keys)
            if running is not None:
                self.stats.joined += 1
                return running
            if not self._slot_free(tenant, warm):
                self.stats.refused += 1
                return 0
            prefetch = Prefetch(next(self._ids), tenant, list(keys), parent, warm)
            for position, key in enumerate(prefetch.keys):
                self._loading.setdefault((tenant, key), (prefetch, position))
            self._prefetches[prefetch.id] = prefetch
            while len(self._prefetches) > _REMEMBERED:
                self._prefetches.popitem(last=False)
            self.stats.started += 1
            self.stats.in_flight += 1
            self._held[tenant] += 1
            self._warms += warm
        self._loop.call_soon_threadsafe(self._spawn, prefetch)
        return prefetch.id

    def _running(self, tenant: str, keys: Sequence[bytes]) -> int | None:
        """Under the guard: the id of a running prefetch of ``tenant`` that loads ``keys``,
        in order, from one of its positions on (None: there is none)."""
        found = self._loading.get((tenant, keys[0]))
        if found is None:
            return None
        prefetch, position = found
        if prefetch.keys[position : position + len(keys)] != list(keys):
            return None
        return prefetch.id

    def _slot_free(self, tenant: str, warm: bool) -> bool:
        """Whether a prefetch may start (under the guard): a slot is free, its tenant holds
        less than half of them, and a warm finds warms holding less than a quarter."""
        return (
            self.stats.in_flight < self.max_in_flight
            and self._held[tenant] < self._tenant_slots
            and not (warm and self._warms >= self._warm_slots)
        )

    def _free_slot(self, prefetch: Prefetch) -> None:
        """Under the guard: a prefetch ended."""
        for key in prefetch.keys:
            if self._loading.get((prefetch.tenant, key), (None, 0))[0] is prefetch:
                del self._loading[(prefetch.tenant, key)]
        self.stats.in_flight -= 1
        self._held[prefetch.tenant] -= 1
        if not self._held[prefetch.tenant]:
            del self._held[prefetch.tenant]  # tenants come and go: keep only those holding
        self._warms -= prefetch.warm

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
            await self._load(prefetch, holders)
        except Exception as error:
            _failures.exception(f"a prefetch failed: {type(error).__name__}")
        finally:
            prefetch.done = True
            with self._guard:
                self._free_slot(prefetch)
                self._finished.notify_all()
            self._changed()

    async def _load(self, prefetch: Prefetch, holders: list[list[L2Adapter]]) -> None:
        """Fetch the first chunk and, once its size is known (its pages reserved), up to
        :data:`_WINDOW` runs of the rest at once (runs of chunks its size); commit them in
        prompt order, stop at the first chunk that no tier gives or L1 refuses.

        A run's landings are made, and its pages reserved ahead, as it takes its place in
        the window (the runs take it in prompt order): the first runs are asked for before
        the last have landings, and the work of a prefix's thousand chunks is spread over its
        transfer instead of coming before it."""
        if not holders:
            return  # no tier holds the first chunk: nothing to load
        loaded: list[bytes] = []
        landings: list[ChunkLanding] = []
        window = asyncio.Semaphore(_WINDOW)
        ahead = 0
        """The size the next run reserves its pages ahead for (0: it reserves as they come)."""

        async def fetch(run: slice) -> list[bool]:
            nonlocal ahead
            async with window:  # taken in the runs' order
                try:
                    self._landings(prefetch, run.stop, loaded, landings)
                    if run.start:
                        self._reserve_together(landings[run])
                    if ahead and not self._reserve_ahead(landings[run], ahead):
                        ahead = 0  # the runs after it reserve as their chunks come
                except BaseException:
                    for landing in landings[run]:
                        landing.give_up()  # the chunks after them stop waiting
                    raise
                return await self._fetch_run(holders[run], landings[run])

        first = self._landings(prefetch, 1, loaded, landings)[0]
        runs = [slice(0, 1)]
        fetches = [asyncio.ensure_future(fetch(runs[0]))]
        finished = 0
        try:
            await self._decisions[first].wait(first)  # its size known (or none: it failed)
            if first.reserved:  # else none after it lands
                runs += self._runs(holders, first.size or self._chunk_bytes)
                ahead = first.size  # 0 where L1 held the first chunk: the tier tells the size
                fetches += [asyncio.ensure_future(fetch(run)) for run in runs[1:]]
            for run, fetched in zip(runs, fetches, strict=True):
                filled = await fetched
                placed = finish_in_order(landings[run], filled)
                finished = run.stop
                self._placed(landings[run][:placed], filled, loaded, prefetch)
                if placed < len(filled):
                    return
        finally:
            # past a gap nothing is reachable: once every transfer into them has ended
            # (a thread may still be writing), their pages go back
            await asyncio.gather(*fetches, return_exceptions=True)
            for landing in landings[finished:]:
                landing.finish(False)

    def _reserve_together(self, run: list[ChunkLanding]) -> None:
        """A run of chunks (from a tier that receives in place) reserves its pages at once."""
        if len(run) > 1:
            together = RunReservation(self.service, [landing.key for landing in run])
            for position, landing in enumerate(run):
                landing.run, landing.position = together, position

    @staticmethod
    def _reserve_ahead(run: list[ChunkLanding], size: int) -> bool:
        """Reserve the pages of ``run`` (for chunks of ``size``) before any of its chunks is
        asked for, never waiting (the event loop runs it while earlier runs land): whether
        it did (not where the run is not received in place, the run before it holds no pages,
        or L1 refuses it: those from there reserve as their chunks come, and give up after a
        refusal).

        Each chunk then lands in its pages as it comes: none is received into a buffer to
        wait for the chunk before it to reserve (its turn), then copied (docs/platform/peers.md,
        "Figures")."""
        lead = run[0]
        return lead.run is not None and lead.reserve(size, wait=False) is not None

    def _placed(
        self,
        landings: list[ChunkLanding],
        filled: list[bool],
        loaded: list[bytes],
        prefetch: Prefetch,
    ) -> None:
        """``landings``, in L1 now: counted (those that came from a tier), and kept."""
        for landing, came in zip(landings, filled, strict=False):
            if came:
                self.stats.loaded_chunks += 1
                self.stats.loaded_bytes += landing.size
            loaded.append(landing.key)
        prefetch.loaded += len(landings)

    def _runs(self, holders: list[list[L2Adapter]], chunk_bytes: int) -> list[slice]:
        """The chunks after the first in runs: consecutive chunks held by the same tiers,
        whose first receives runs in place (the peer tier), up to :data:`_RUN_BYTES` of
        chunks of ``chunk_bytes``; every other chunk a run of its own."""
        longest = max(1, min(RUN_CHUNKS, _RUN_BYTES // max(1, chunk_bytes)))
        runs: list[slice] = []
        start = 1
        while start < len(holders):
            end = start + 1
            if holders[start][0].name in self._in_place:
                while (
                    end < len(holders) and end - start < longest and holders[end] == holders[start]
                ):
                    end += 1
            runs.append(slice(start, end))
            start = end
        return runs

    async def _fetch_run(
        self, tiers: list[list[L2Adapter]], landings: list[ChunkLanding]
    ) -> list[bool]:
        """A run's chunks into their landings' pages: whether each holds its chunk now. The
        first tier gives what it can in one go; the chunks after the first it did not give
        are fetched one by one (:meth:`_fetch`: the next holder, the next tier)."""
        first = tiers[0][0]
        if len(landings) == 1 or first.name not in self._in_place:
            return [await self._fetch(tiers[0], landings[0])]
        names = [ObjectKey(landing.tenant, landing.key) for landing in landings]
        filled = 0
        try:
            started = time.perf_counter()
            filled = await cast(ReceivesInPlace, first).get_run_into(names, landings)
            if filled:
                per_chunk = (time.perf_counter() - started) / filled
                self._observe(first, per_chunk, landings[0].size)
        except Exception as error:
            _failures.exception(f"a prefetch's run failed: {type(error).__name__}")
        stopped = landings[filled:]
        if stopped and stopped[0].turn() is not False and not _refused(stopped[0]):
            rest = await asyncio.gather(
                *(
                    self._fetch(t, landing)
                    for t, landing in zip(tiers[filled:], stopped, strict=True)
                )
            )
        else:
            rest = [False] * len(stopped)
        for landing in landings:
            landing.give_up()  # whatever happened, the chunks after it stop waiting
        return [True] * filled + rest

    def _landings(
        self, prefetch: Prefetch, count: int, loaded: list[bytes], landings: list[ChunkLanding]
    ) -> list[ChunkLanding]:
        """``landings`` made up to ``count``, one per chunk, each reserving after the one
        before."""
        loop = asyncio.get_running_loop()
        for index in range(len(landings), count):
            decided = _Decision(loop)
            landing = self.service.landing(
                prefetch.tenant,
                prefetch.keys[index],
                prefetch.keys[index - 1] if index else prefetch.parent,
                loaded,
                after=landings[-1] if landings else None,
                on_decided=decided.wake,
            )
            self._decisions[landing] = decided
            landings.append(landing)
        return landings

    async def _fetch(self, tiers: list[L2Adapter], landing: ChunkLanding) -> bool:
        """Get one chunk from the first of ``tiers`` that gives it, into its landing's
        pages; whether they hold it now (False also where L1 refused it)."""
        name = ObjectKey(landing.tenant, landing.key)
        try:
            for tier in tiers:
                if tier.name in self._in_place:
                    started = time.perf_counter()
                    if await cast(ReceivesInPlace, tier).get_into(name, landing):
                        self._observe(tier, time.perf_counter() - started, landing.size)
                        return True
                else:
                    payload = await self._get(tier, landing.tenant, landing.key)
                    if payload is not None:
                        return await self._land(landing, payload)
                if _refused(landing):
                    return False  # L1 refused it: no other tier changes that
            return False
        except Exception as error:
            _failures.exception(f"a prefetch's chunk failed: {type(error).__name__}")
            return False
        finally:
            landing.give_up()  # whatever happened, the chunks after it stop waiting

    async def _turn(self, landing: ChunkLanding) -> bool:
        """Once the chunk before ``landing`` has reserved its place (or given up): whether
        it holds one."""
        if landing.turn() is None:
            assert landing.after is not None  # only a chunk after another waits
            await self._decisions[landing.after].wait(landing.after)
        return bool(landing.turn())

    async def _land(self, landing: ChunkLanding, payload: bytes | memoryview) -> bool:
        """Copy a chunk a tier returned into its landing's pages, in the prefetch's order."""
        view = landing.reserve(len(payload)) if await self._turn(landing) else None
        if view is None:
            return False
        view[:] = payload
        return True

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

    async def _get(self, tier: L2Adapter, tenant: str, key: bytes) -> bytes | memoryview | None:
        started = time.perf_counter()
        (payload,) = await tier.get([ObjectKey(tenant, key)])
        self._observe(tier, time.perf_counter() - started, 0 if payload is None else len(payload))
        return payload

    def _observe(self, tier: L2Adapter, seconds: float, size: int) -> None:
        """A get's latency, for the metrics; and a chunk's (``size`` > 0), for the costs."""
        if self.observe is not None:
            self.observe(tier.name, "get", seconds)
        if size:
            self._chunk_bytes = size
            self.costs.observe(tier.name, seconds, size)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()


def _refused(landing: ChunkLanding) -> bool:
    """L1 refused the chunk its place (quota, full): no tier changes that."""
    return landing.reservation is not None and not landing.reserved


class _Decision:
    """A landing's decision, awaitable on ``loop``: the loop is woken (from any thread) only
    where a coroutine awaits it (the peer tier's chunks wait on their threads instead)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self._awaited = False

    def wake(self) -> None:
        if self._awaited:
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, landing: ChunkLanding) -> None:
        """Until ``landing`` (this decision's) has reserved or given up."""
        self._awaited = True  # before the look: a decision made after it wakes this
        if not landing.decided:
            await self._event.wait()
