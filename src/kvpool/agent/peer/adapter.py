"""The pool's other agents as an L2 tier, read by the prefetch between NVMe and S3.

:meth:`PeerAdapter.exists` asks the pool's prefix index (where there is one; while it
fails, and without one, every peer at once) how much of the prefix each peer holds, and
remembers who holds which chunk; :meth:`PeerAdapter.get` pulls each chunk from a peer
that holds it, trying the next holder where one fails, is busy or no longer has it.
Bytes pulled reach L1 through the prefetch's placement, so the tenant's quota on this
node applies to them as to any store.
The tier stores nothing of its own: ``put`` refuses (the write-back skips it),
``delete``, quota and drops have nothing to do (each peer keeps its own).

Links block (sockets), so they run on the adapter's threads: the event loop
only awaits them. :meth:`PeerAdapter.get_into` receives a chunk straight into the L1
pages the prefetch reserved for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvpool.agent.l2.base import AdapterStats, Destination, L2Object, ObjectKey
from kvpool.agent.l2.buffers import fresh
from kvpool.agent.l2.codec import IntegrityError
from kvpool.agent.peer.directory import PeerDirectory
from kvpool.agent.peer.index_lookup import IndexLookup
from kvpool.agent.peer.links import Fetched, PeerBusy, PeerLink, StopReason
from kvpool.common.web.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)
_failures = RateLimitedLog(log)

T = TypeVar("T")
THREADS = 8
BUSY_WAITS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 0.0)
"""Seconds to wait after each busy answer before asking again (a transfer takes
milliseconds; under a second in all); then the next holder."""
_REMEMBERED = 1 << 16
"""Chunks whose holders are remembered between ``exists`` and ``get``."""


class PeerAdapter:
    name = "peer"

    def __init__(self, directory: PeerDirectory, index: IndexLookup | None = None) -> None:
        """``index``: the pool's prefix index, asked first which peers hold a prefix."""
        self.directory = directory
        self.index = index
        self.stats = AdapterStats()
        self.index_lookups: Counter[str] = Counter()
        """Prefixes located by the index: answered, or failed (the peers were asked)."""
        self._holders: OrderedDict[ObjectKey, list[PeerLink]] = OrderedDict()
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="kvpool-peer-fetch")

    async def put(self, objects: Sequence[L2Object]) -> list[bool]:
        return [False] * len(objects)

    async def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """The leading run of ``keys`` (one tenant's prefix) that some peer holds."""
        if not keys:
            return []
        tenant = keys[0].tenant
        run = [key.key for key in keys[: _same_tenant(keys)]]
        links = self.directory.links()
        held = await self._held_by_index(run, links) if self.index is not None else None
        if held is None:
            counts = await asyncio.gather(
                *(self._run(link.held, tenant, run) for link in links), return_exceptions=True
            )
            held = {
                link: count
                for link, count in zip(links, counts, strict=True)
                if isinstance(count, int)
            }
        best = min(max(held.values(), default=0), len(run))  # no peer answers for more
        for index in range(best):
            by_most = sorted((link for link, n in held.items() if n > index), key=held.__getitem__)
            self._remember(keys[index], by_most[::-1])
        return [index < best for index in range(len(keys))]

    async def _held_by_index(
        self, run: list[bytes], links: list[PeerLink]
    ) -> dict[PeerLink, int] | None:
        """How much of ``run`` each peer holds, as the index knows (None: it could not say)."""
        assert self.index is not None
        if not links:
            return {}
        by_node = await self._run(self.index.held, run, [link.node for link in links])
        self.index_lookups["failed" if by_node is None else "answered"] += 1
        if by_node is None:
            return None
        return {link: by_node[link.node] for link in links if by_node.get(link.node)}

    async def get(self, keys: Sequence[ObjectKey]) -> list[bytes | memoryview | None]:
        """Each chunk in a buffer of its own (the prefetch uses :meth:`get_into`)."""

        async def one(name: ObjectKey) -> memoryview | None:
            buffer = _Buffer()
            return buffer.memory if await self.get_into(name, buffer) else None

        return list(await asyncio.gather(*(one(name) for name in keys)))

    async def get_into(self, name: ObjectKey, into: Destination) -> bool:
        """The chunk from a peer that holds it (the next one where one fails or lost it),
        received into ``into``'s memory once its turn has come."""
        self.stats.gets += 1
        return await self._get_into(name, into)

    async def get_run_into(self, names: Sequence[ObjectKey], into: Sequence[Destination]) -> int:
        """Consecutive chunks of a prefix, each into its ``into``: how many leading chunks
        are there. Each stretch of them that one peer holds first comes in one pipelined
        request (:meth:`PeerLink.fetch_run`); a busy peer is asked for the rest of its run
        again after the waits :meth:`get_into` makes. The chunks after the first that did
        not come are untouched but for that one, whose reservation a second holder reuses,
        and whose peer is not asked for it again where it lost the chunk or failed it
        (:meth:`get_into` asks the others)."""
        self.stats.gets += len(names)
        start, busy = 0, iter(BUSY_WAITS)
        while start < len(names):
            holders = self._holders_of(names[start])
            if not holders:
                break
            link, end = holders[0], start + 1
            while end < len(names) and self._first_holder(names[end]) is link:
                end += 1
            filled, nbytes, stopped = await self._run(
                link.fetch_run, names[start:end], into[start:end]
            )
            self.stats.hits += filled
            self.stats.get_bytes += nbytes
            for name in names[start : start + filled]:
                self._holders.pop(name, None)
            start += filled
            if filled:
                busy = iter(BUSY_WAITS)
            wait = next(busy, None) if stopped == "busy" else None
            if wait is not None:  # the rest of the run, from there, once the peer has room
                await asyncio.sleep(wait)
            elif stopped is not None:
                self._stopped(link, names[start], holders, stopped)
                break
        return start

    def _first_holder(self, name: ObjectKey) -> PeerLink | None:
        holders = self._holders_of(name)
        return holders[0] if holders else None

    def _holders_of(self, name: ObjectKey) -> list[PeerLink]:
        """The peers to ask for ``name``: those remembered (none, where every holder lost or
        failed it), else every peer."""
        remembered = self._holders.get(name)
        return self.directory.links() if remembered is None else remembered

    def _stopped(
        self, link: PeerLink, name: ObjectKey, holders: list[PeerLink], stopped: StopReason
    ) -> None:
        """A run from ``link`` stopped at ``name``: where the peer lost or failed it, the
        other holders are the ones asked for it next (none: no peer is)."""
        if stopped in ("busy", "unwanted"):
            return
        self._remember(name, [other for other in holders if other is not link])
        if stopped == "integrity":
            self.stats.integrity_failures += 1
            _failures.warning(f"peer {link.node} sent a chunk that does not open")
        elif stopped == "failed":
            _failures.warning(f"peer {link.node} failed a fetch: {link.stats.error}")

    async def _get_into(self, name: ObjectKey, into: Destination) -> bool:
        links = self._holders.pop(name, None)
        for link in self.directory.links() if links is None else links:
            fetched, size = await self._fetch(link, name, into)
            if fetched == "filled":
                self.stats.hits += 1
                self.stats.get_bytes += size
                return True
            if fetched == "unwanted":
                return False
        return False

    async def _fetch(
        self, link: PeerLink, name: ObjectKey, into: Destination
    ) -> tuple[Fetched | None, int]:
        """``link``'s answer and the chunk's size; None where it failed or stayed busy."""
        for wait in BUSY_WAITS:
            try:
                return await self._run(link.fetch, name, into)
            except PeerBusy:
                await asyncio.sleep(wait)
            except IntegrityError as error:
                self.stats.integrity_failures += 1
                _failures.warning(f"peer {link.node} sent a chunk that does not open: {error}")
                break
            except (OSError, ValueError) as error:
                _failures.warning(f"peer {link.node} failed a fetch: {error}")
                break
        return None, 0

    async def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return [True] * len(keys)

    async def enforce_quota(self, tenant: str) -> int:
        return 0

    async def drop_tenant(self, tenant: str) -> int:
        return 0

    async def close(self) -> None:
        self.directory.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _run(self, call: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, call, *args)

    def _remember(self, name: ObjectKey, links: list[PeerLink]) -> None:
        self._holders[name] = links
        self._holders.move_to_end(name)
        while len(self._holders) > _REMEMBERED:
            self._holders.popitem(last=False)


def _same_tenant(keys: Sequence[ObjectKey]) -> int:
    tenant = keys[0].tenant
    return next((i for i, key in enumerate(keys) if key.tenant != tenant), len(keys))


class _Buffer:
    """A destination of its own for :meth:`PeerAdapter.get`: no turn to wait for."""

    memory: memoryview | None = None

    def turn(self) -> bool:
        return True

    def wait_turn(self) -> bool:
        return True

    def reserve(self, size: int) -> memoryview:
        self.memory = fresh(size)
        return self.memory
