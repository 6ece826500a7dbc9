"""Local NVMe tier: one file per chunk, an LRU index in memory rebuilt from disk at start.

:class:`NvmeAdapter` is the tier's L2 adapter; what it holds is in three modules of
one job each: the files on disk and their I/O (:mod:`~kvpool.agent.l2.nvme_files`),
the index of their sizes with capacity and quota eviction
(:mod:`~kvpool.agent.l2.nvme_space`), and the scan that rebuilds the index at start
(:mod:`~kvpool.agent.l2.nvme_scan`).

The index lives on the event loop; file I/O runs on the adapter's own pool of
``max_concurrency`` threads (the default executor's size would cap it, and other users
would queue behind disk I/O). Operations on one key are serialized and a put is
accounted before its bytes land, so ``used_bytes`` never exceeds the capacity and
matches the files on disk once operations complete. A file that does not open as its
chunk (tampered, truncated, renamed, or under a key this agent no longer holds) is a
miss and is deleted: no other agent reads this disk.

``listener`` (the agent's events, tier ``nvme``) hears of each file once it is written
(``stored``) and of each file the index let go (``removed``: its cause ``pressure`` for a
put's room, ``quota``, ``deleted``, ``corrupt``, ``missing``, or ``failed`` for a put
whose write failed). Each is told after the index changed, so a snapshot of
:meth:`NvmeAdapter.keys_by_tenant` taken after an event's ``seq`` was read reflects it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar, TypeVarTuple

from kvpool.agent.core.cache_types import ChunkListener
from kvpool.agent.l2 import layout
from kvpool.agent.l2.base import AdapterStats, L2Object, ObjectKey, TierUnavailable
from kvpool.agent.l2.codec import IntegrityError, ObjectCodec
from kvpool.agent.l2.keylocks import KeyLocks
from kvpool.agent.l2.nvme_files import ChunkFiles
from kvpool.agent.l2.nvme_scan import scan
from kvpool.agent.l2.nvme_space import NvmeSpace
from kvpool.common.config import NvmeTierConfig

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class NvmeAdapter:
    name = "nvme"

    def __init__(
        self,
        config: NvmeTierConfig,
        pool: str,
        limit_of: Callable[[str], int | None],
        codec: ObjectCodec,
        pinned: Callable[[ObjectKey], bool] = lambda name: False,
    ) -> None:
        """Scan ``config.path/pool`` (creating it if needed); removes temp files left by a crash.

        ``pinned``: whether a chunk is pinned in L1 (its file is never evicted).
        """
        self.config = config
        self.codec = codec
        self.stats = AdapterStats()
        self.failures = 0
        """Reads and deletes failed at the filesystem (EIO, ...); puts count in ``stats``."""
        self.listener: ChunkListener | None = None
        """Told of files written and let go (the agent's events); set before the first put."""
        self._locks = KeyLocks()
        self._executor = ThreadPoolExecutor(
            config.max_concurrency, thread_name_prefix=f"kvpool-nvme-{pool}"
        )
        self._files = ChunkFiles(config, pool, codec)
        self._space = NvmeSpace(int(config.capacity), limit_of, pinned, self._locks, self.stats)
        for name, size in scan(self._files):
            self._space.add(name, size)

    @property
    def root(self) -> Path:
        """The tier's tree, ``config.path/pool``."""
        return self._files.root

    @property
    def direct_io(self) -> bool:
        """Whether O_DIRECT is in use: asked for and accepted by the filesystem."""
        return self._files.direct_io

    def path_of(self, name: ObjectKey) -> Path:
        return self._files.path_of(name)

    def keys_by_tenant(self) -> dict[str, list[bytes]]:
        """Every chunk the tier holds, by tenant (any thread: a prefix index's snapshot)."""
        return self._space.keys_by_tenant()

    def tenant_used(self, tenant: str) -> int:
        """Bytes of the tenant's files in this tier."""
        return self._space.tenant_used(tenant)

    async def put(self, objects: Sequence[L2Object]) -> list[bool]:
        return list(await asyncio.gather(*(self._put_one(obj) for obj in objects)))

    async def get(self, keys: Sequence[ObjectKey]) -> list[bytes | memoryview | None]:
        return list(await asyncio.gather(*(self._get_one(name) for name in keys)))

    async def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return list(await asyncio.gather(*(self._exists_one(name) for name in keys)))

    async def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return list(await asyncio.gather(*(self._delete_one(name) for name in keys)))

    async def close(self) -> None:
        await asyncio.to_thread(self._executor.shutdown)

    async def _put_one(self, obj: L2Object) -> bool:
        name = obj.name
        if not layout.is_valid(name):
            self.stats.put_failures += 1
            return False
        async with self._locks.hold(name):
            if name in self._space:  # a key names its content: already stored
                self._space.touch(name)
                self.stats.puts += 1
                return True
            size = self._files.file_size(len(obj.payload))
            victims = self._space.make_room(name.tenant, size)
            if victims is None:
                self.stats.put_failures += 1
                return False
            self._space.add(name, size)
            try:
                await self._unlink_claimed(victims, "pressure")
                await self._run(self._files.write, name, obj.payload)
            except OSError as error:
                self._forget([name], "failed")
                self.stats.put_failures += 1
                log.warning("NVMe tier: writing %s failed: %s", self.path_of(name), error)
                return False
            except BaseException:
                self._forget([name], "failed")
                raise
            if self.listener is not None:  # under the key's lock: before any later removal
                self.listener.stored(name.tenant, [name.key])
        self.stats.puts += 1
        self.stats.put_bytes += len(obj.payload)
        return True

    async def _get_one(self, name: ObjectKey) -> bytes | memoryview | None:
        self.stats.gets += 1
        if not layout.is_valid(name):
            return None
        async with self._locks.hold(name):
            if name not in self._space:
                return None
            try:
                payload = await self._run(self._files.read, name)
            except IntegrityError as error:
                self.stats.integrity_failures += 1
                log.warning("NVMe tier: %s is corrupt (%s); deleted", self.path_of(name), error)
                await self._drop(name, "corrupt")
                return None
            except FileNotFoundError:  # removed behind the agent's back
                self._forget([name], "missing")
                return None
            except OSError as error:
                self.failures += 1
                log.warning("NVMe tier: reading %s failed: %s", self.path_of(name), error)
                return None
            self._space.touch(name)
        self.stats.hits += 1
        self.stats.get_bytes += len(payload)
        return payload

    async def _exists_one(self, name: ObjectKey) -> bool:
        async with self._locks.hold(name):  # waits for a put in flight
            return name in self._space

    async def _delete_one(self, name: ObjectKey) -> bool:
        if not layout.is_valid(name):
            return True
        async with self._locks.hold(name):
            return name not in self._space or await self._drop(name, "deleted")

    async def _drop(self, name: ObjectKey, cause: str) -> bool:
        """Unlink an indexed file (its key held by the caller) and forget it."""
        try:
            await self._run(self._files.delete, name)
        except OSError as error:
            self.failures += 1
            log.warning("NVMe tier: deleting %s failed: %s", self.path_of(name), error)
            return False
        self._forget([name], cause)
        return True

    def _forget(self, names: list[ObjectKey], cause: str) -> None:
        """Unindex ``names`` and tell the listener."""
        for name in names:
            self._space.remove(name)
        self._tell_removed(names, cause)

    def _tell_removed(self, names: Iterable[ObjectKey], cause: str) -> None:
        """One event per tenant of ``names`` (already unindexed)."""
        if self.listener is None:
            return
        by_tenant: defaultdict[str, list[bytes]] = defaultdict(list)
        for name in names:
            by_tenant[name.tenant].append(name.key)
        for tenant, keys in by_tenant.items():
            self.listener.removed(tenant, keys, cause)

    async def enforce_quota(self, tenant: str) -> int:
        """Evict the tenant's own LRU files down to its (shrunken) quota; returns how many.

        Files in use are skipped; the rest of the excess goes at the tenant's next put.
        """
        victims = self._space.take_over_quota(tenant)
        await self._unlink_claimed(victims, "quota")
        return len(victims)

    async def drop_tenant(self, tenant: str) -> int:
        """Delete every indexed file of ``tenant``, then its directories if that left them
        empty; returns how many files.

        Cost: one unlink per file, run on the adapter's ``max_concurrency`` threads (each
        waits for an operation in flight on its key). A put of the tenant that starts
        during the drop may land after it (dropping again removes it), or fail if its
        directory went meanwhile (the next write-back of the chunk makes it again).
        """
        names = self._space.names_of(tenant)
        if not names:
            return 0
        gone = await self.delete(names)
        if not all(gone):
            raise TierUnavailable(
                f"NVMe tier: {gone.count(False)} of {len(names)} files of tenant {tenant} "
                "could not be deleted (see the log)"
            )
        await self._run(self._files.remove_empty_tenant_dirs, tenant)
        return len(names)

    async def _unlink_claimed(self, victims: list[ObjectKey], cause: str) -> None:
        """Unlink the files of victims claimed and unindexed by the space, then release them.

        The listener hears of them first, while their keys are still claimed: a later put of
        one of them is told after this removal.
        """
        self._tell_removed(victims, cause)
        try:
            results = await asyncio.gather(
                *(self._run(self._files.delete, victim) for victim in victims),
                return_exceptions=True,
            )
        finally:
            for victim in victims:
                self._locks.release(victim)
        self.stats.evictions += len(victims)
        for victim, result in zip(victims, results, strict=True):
            if isinstance(result, BaseException):  # orphaned until the next start's scan
                log.warning("NVMe tier: evicting %s failed: %s", self.path_of(victim), result)

    async def _run(self, fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
