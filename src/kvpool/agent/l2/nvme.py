"""Local NVMe tier: one file per chunk, an LRU index in memory rebuilt from disk at start.

Each chunk is the file ``<path>/<pool>/<tenant>/<2 hex>/<key hex>`` (see
:mod:`~kvpool.agent.l2.layout`) holding the codec's header and body (sealed
or authenticated under the pool's key); under O_DIRECT the file is padded to
whole blocks and the header gives the real length. A file that does not open
as its chunk (tampered, truncated, renamed, or under a key this agent no longer
holds) is a miss and is deleted: no other agent reads this disk.
A write goes to a temp file beside its target and is renamed into place, so a
crash leaves the old file, the new one, or a temp file that the next start removes.

The index (size and tenant of every file, least recently used first) lives on the
event loop; file I/O runs on the adapter's own pool of ``max_concurrency`` threads
(the default executor's size would cap it, and other users would queue behind
disk I/O). Operations on one key are serialized and a put is accounted before its
bytes land, so ``used_bytes`` never exceeds the capacity and matches the files on
disk once operations complete. Eviction takes least recently used files that no
operation is using and whose chunks are not pinned in L1 (``pinned``: each tenant's
pins hold at most its pin budget): anyone's for the capacity, only the tenant's own for its
quota. After a restart the LRU order is the files' mtime order (a hit touches the mtime).

The tree is the agent's alone: ``<path>/<pool>`` and every directory below it are mode
:data:`DIRECTORY_MODE` (0700: another user could otherwise list every tenant id and
chunk key), the files :data:`FILE_MODE` (0600), created exclusively and never through a
symbolic link (:mod:`kvpool.common.files`). A directory of the tree that an older agent
left wider is narrowed at start; one that is not the agent's is refused (the tree's root,
at start) or left alone as a stranger (below it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, TypeVarTuple

from kvpool.agent.l2 import buffers, layout
from kvpool.agent.l2.base import AdapterStats, L2Object, ObjectKey, TierUnavailable
from kvpool.agent.l2.codec import HEADER, IntegrityError, ObjectCodec, payload_length
from kvpool.agent.l2.keylocks import KeyLocks
from kvpool.common.config import NvmeTierConfig, make_setting_directory
from kvpool.common.files import FileRefused, create_exclusive, ensure_directory

log = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
BLOCK = 4096
"""O_DIRECT alignment of buffers, offsets and lengths (covers 512 B and 4 KiB sectors)."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


@dataclass
class _Tenant:
    lru: OrderedDict[ObjectKey, int] = field(default_factory=OrderedDict)
    used_bytes: int = 0


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
        self.root = config.path / pool
        self.stats = AdapterStats()
        self.failures = 0
        """Reads and deletes failed at the filesystem (EIO, ...); puts count in ``stats``."""
        self._limit_of = limit_of
        self._pinned = pinned
        self._lru: OrderedDict[ObjectKey, int] = OrderedDict()  # file sizes, LRU first
        self._tenants: dict[str, _Tenant] = {}
        self._locks = KeyLocks()
        self._known_dirs: set[Path] = set()
        self._executor = ThreadPoolExecutor(
            config.max_concurrency, thread_name_prefix=f"kvpool-nvme-{pool}"
        )
        make_setting_directory(("nvme", "path"), config.path, what="NVMe tier directory")
        self._ensure_own_dir(self.root)
        self.direct_io = config.direct_io and _direct_io_works(self.root)
        """Whether O_DIRECT is in use: asked for and accepted by the filesystem."""
        self._load()

    def path_of(self, name: ObjectKey) -> Path:
        return self.root / layout.relative_path(name)

    def tenant_used(self, tenant: str) -> int:
        """Bytes of the tenant's files in this tier."""
        account = self._tenants.get(tenant)
        return account.used_bytes if account else 0

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
            if name in self._lru:  # a key names its content: already stored
                self._touch(name)
                self.stats.puts += 1
                return True
            size = self._file_size(len(obj.payload))
            victims = self._make_room(name.tenant, size)
            if victims is None:
                self.stats.put_failures += 1
                return False
            self._add(name, size)
            try:
                await self._unlink_claimed(victims)
                await self._run(self._write, name, obj.payload)
            except OSError as error:
                self._remove(name)
                self.stats.put_failures += 1
                log.warning("NVMe tier: writing %s failed: %s", self.path_of(name), error)
                return False
            except BaseException:
                self._remove(name)
                raise
        self.stats.puts += 1
        self.stats.put_bytes += len(obj.payload)
        return True

    async def _get_one(self, name: ObjectKey) -> bytes | memoryview | None:
        self.stats.gets += 1
        if not layout.is_valid(name):
            return None
        async with self._locks.hold(name):
            if name not in self._lru:
                return None
            try:
                payload = await self._run(self._read, name)
            except IntegrityError as error:
                self.stats.integrity_failures += 1
                log.warning("NVMe tier: %s is corrupt (%s); deleted", self.path_of(name), error)
                await self._drop(name)
                return None
            except FileNotFoundError:  # removed behind the agent's back
                self._remove(name)
                return None
            except OSError as error:
                self.failures += 1
                log.warning("NVMe tier: reading %s failed: %s", self.path_of(name), error)
                return None
            self._touch(name)
        self.stats.hits += 1
        self.stats.get_bytes += len(payload)
        return payload

    async def _exists_one(self, name: ObjectKey) -> bool:
        async with self._locks.hold(name):  # waits for a put in flight
            return name in self._lru

    async def _delete_one(self, name: ObjectKey) -> bool:
        if not layout.is_valid(name):
            return True
        async with self._locks.hold(name):
            return name not in self._lru or await self._drop(name)

    async def _drop(self, name: ObjectKey) -> bool:
        """Unlink an indexed file (its key held by the caller) and forget it."""
        try:
            await self._run(_unlink, self.path_of(name))
        except OSError as error:
            self.failures += 1
            log.warning("NVMe tier: deleting %s failed: %s", self.path_of(name), error)
            return False
        self._remove(name)
        return True

    async def enforce_quota(self, tenant: str) -> int:
        """Evict the tenant's own LRU files down to its (shrunken) quota; returns how many.

        Files in use are skipped; the rest of the excess goes at the tenant's next put.
        """
        limit, account = self._limit_of(tenant), self._tenants.get(tenant)
        if limit is None or account is None or account.used_bytes <= limit:
            return 0
        victims: dict[ObjectKey, int] = {}
        self._pick(account.lru, account.used_bytes - limit, victims)
        for victim in victims:
            self._locks.try_claim(victim)
            self._remove(victim)
        await self._unlink_claimed(list(victims))
        return len(victims)

    async def drop_tenant(self, tenant: str) -> int:
        """Delete every indexed file of ``tenant``, then its directories if that left them
        empty; returns how many files.

        Cost: one unlink per file, run on the adapter's ``max_concurrency`` threads (each
        waits for an operation in flight on its key). A put of the tenant that starts
        during the drop may land after it (dropping again removes it), or fail if its
        directory went meanwhile (the next write-back of the chunk makes it again).
        """
        account = self._tenants.get(tenant)
        if account is None:
            return 0
        names = list(account.lru)
        gone = await self.delete(names)
        if not all(gone):
            raise TierUnavailable(
                f"NVMe tier: {gone.count(False)} of {len(names)} files of tenant {tenant} "
                "could not be deleted (see the log)"
            )
        await self._run(self._remove_empty_dirs, self.root / tenant)
        return len(names)

    def _remove_empty_dirs(self, tenant_dir: Path) -> None:
        """The tenant's shard directories, and its own, where they hold nothing now."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for shard in os.scandir(tenant_dir):
                self._known_dirs.discard(Path(shard.path))
                with contextlib.suppress(OSError):  # not empty: a put landed meanwhile
                    os.rmdir(shard.path)
        with contextlib.suppress(OSError):
            os.rmdir(tenant_dir)

    def _make_room(self, tenant: str, size: int) -> list[ObjectKey] | None:
        """Make room for ``size`` more bytes of ``tenant``: the victims, claimed and unindexed.

        The tenant's quota takes its own LRU files, the capacity anyone's. Atomic:
        None, and nothing changed, if the idle files cannot free enough.
        """
        limit = self._limit_of(tenant)
        capacity = int(self.config.capacity)
        if size > capacity or (limit is not None and size > limit):
            return None
        victims: dict[ObjectKey, int] = {}
        account = self._tenants.get(tenant)
        if (
            limit is not None
            and account is not None
            and not self._pick(account.lru, account.used_bytes + size - limit, victims)
        ):
            return None
        over = self.stats.used_bytes - sum(victims.values()) + size - capacity
        if not self._pick(self._lru, over, victims):
            return None
        for victim in victims:
            self._locks.try_claim(victim)  # free: _pick skipped busy keys, and nothing awaited
            self._remove(victim)
        return list(victims)

    def _pick(
        self, order: OrderedDict[ObjectKey, int], excess: int, victims: dict[ObjectKey, int]
    ) -> bool:
        """Add idle unpinned files of ``order``, LRU first, to ``victims`` until they free
        ``excess``."""
        for name, size in order.items():
            if excess <= 0:
                break
            if name not in victims and not self._locks.busy(name) and not self._pinned(name):
                victims[name] = size
                excess -= size
        return excess <= 0

    async def _unlink_claimed(self, victims: list[ObjectKey]) -> None:
        try:
            results = await asyncio.gather(
                *(self._run(_unlink, self.path_of(victim)) for victim in victims),
                return_exceptions=True,
            )
        finally:
            for victim in victims:
                self._locks.release(victim)
        self.stats.evictions += len(victims)
        for victim, result in zip(victims, results, strict=True):
            if isinstance(result, BaseException):  # orphaned until the next start's scan
                log.warning("NVMe tier: evicting %s failed: %s", self.path_of(victim), result)

    def _add(self, name: ObjectKey, size: int) -> None:
        self._lru[name] = size
        account = self._tenants.setdefault(name.tenant, _Tenant())
        account.lru[name] = size
        account.used_bytes += size
        self.stats.used_bytes += size

    def _remove(self, name: ObjectKey) -> None:
        size = self._lru.pop(name)
        account = self._tenants[name.tenant]
        del account.lru[name]
        account.used_bytes -= size
        if not account.lru:
            del self._tenants[name.tenant]
        self.stats.used_bytes -= size

    def _touch(self, name: ObjectKey) -> None:
        self._lru.move_to_end(name)
        self._tenants[name.tenant].lru.move_to_end(name)

    def _file_size(self, payload_bytes: int) -> int:
        size = HEADER.size + payload_bytes
        return _round_up(size) if self.direct_io else size

    async def _run(self, fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # The methods below run on the thread pool.

    def _write(self, name: ObjectKey, payload: bytes | memoryview) -> None:
        path = self.path_of(name)
        self._ensure_dir(path.parent)
        temp = path.with_name(f"{TEMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
        fd = create_exclusive(temp, FILE_MODE, os.O_WRONLY | (_O_DIRECT if self.direct_io else 0))
        try:
            try:
                with self.codec.encode(name, payload) as (header, body):
                    if self.direct_io:
                        _write_all(fd, _aligned(header, body))
                    else:
                        _write_all(fd, header)
                        _write_all(fd, body)
                if self.config.fsync != "never":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        if self.config.fsync == "always":
            _fsync_dir(path.parent)

    def _read(self, name: ObjectKey) -> bytes | memoryview:
        path = self.path_of(name)
        read = _read_direct if self.direct_io else _read_buffered
        payload = read(path, name, self.codec)
        with contextlib.suppress(OSError):
            os.utime(path)  # so that the LRU order rebuilt at start follows hits too
        return payload

    def _ensure_dir(self, directory: Path) -> None:
        """A shard directory ``<root>/<tenant>/<shard>`` of the agent's own, made if missing."""
        if directory in self._known_dirs:
            return
        self._ensure_own_dir(directory.parent)
        self._ensure_own_dir(directory)
        if self.config.fsync == "always":  # the new directory entries must survive too
            _fsync_dir(directory.parent)
            _fsync_dir(directory.parent.parent)
        self._known_dirs.add(directory)

    def _ensure_own_dir(self, directory: Path) -> bool:
        """Make or check a directory of the tree (0700, the agent's); whether it was narrowed."""
        return ensure_directory(
            directory, what="NVMe tier directory", mode=DIRECTORY_MODE, own=True
        )

    # Start-up, on the constructor's thread (no loop yet).

    def _load(self) -> None:
        found: list[tuple[int, ObjectKey, int]] = []
        temps = strays = narrowed = 0
        uid = os.geteuid()
        for tenant_dir in os.scandir(self.root):
            if tenant_dir.name.startswith(TEMP_PREFIX):  # a crash during the O_DIRECT probe
                _unlink(Path(tenant_dir.path))
                temps += 1
            elif tenant_dir.is_dir(follow_symlinks=False):
                try:
                    narrowed += self._ensure_own_dir(Path(tenant_dir.path))
                except FileRefused as error:
                    log.warning("NVMe tier: ignored: %s", error)
                    strays += 1
                    continue
                for shard in os.scandir(tenant_dir.path):
                    if not shard.is_dir(follow_symlinks=False):
                        strays += 1
                        continue
                    try:
                        narrowed += self._ensure_own_dir(Path(shard.path))
                    except FileRefused as error:
                        log.warning("NVMe tier: ignored: %s", error)
                        strays += 1
                        continue
                    for entry in os.scandir(shard.path):
                        if entry.name.startswith(TEMP_PREFIX):
                            _unlink(Path(entry.path))
                            temps += 1
                            continue
                        name = _parse(tenant_dir.name, shard.name, entry.name)
                        if name is None or not entry.is_file(follow_symlinks=False):
                            strays += 1
                            continue
                        stat = entry.stat(follow_symlinks=False)
                        if stat.st_uid != uid:  # not the agent's: never served, never replaced
                            strays += 1
                            continue
                        found.append((stat.st_mtime_ns, name, stat.st_size))
        found.sort(key=lambda item: item[0])
        for _, name, size in found:
            self._add(name, size)
        if narrowed:
            log.info(
                "NVMe tier %s: %d directories narrowed to mode %04o (other users could list them)",
                self.root,
                narrowed,
                DIRECTORY_MODE,
            )
        log.info(
            "NVMe tier %s: %d files, %d bytes; removed %d temp files, ignored %d other entries",
            self.root,
            len(found),
            self.stats.used_bytes,
            temps,
            strays,
        )


def _parse(tenant: str, shard: str, filename: str) -> ObjectKey | None:
    try:
        name = ObjectKey(tenant, bytes.fromhex(filename))
    except ValueError:
        return None
    valid = layout.is_valid(name) and layout.relative_path(name) == f"{tenant}/{shard}/{filename}"
    return name if valid else None


def _round_up(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _aligned(header: bytes, payload: bytes | memoryview) -> mmap.mmap:
    """Header and payload in a page-aligned, zero-padded buffer of whole blocks."""
    size = len(header) + len(payload)
    buffer = mmap.mmap(-1, _round_up(size))
    buffer[: len(header)] = header
    buffer[len(header) : size] = payload
    return buffer


def _write_all(fd: int, data: bytes | memoryview | mmap.mmap) -> None:
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])


def _read_buffered(path: Path, name: ObjectKey, codec: ObjectCodec) -> bytes | memoryview:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        # The body first (one large read keeps the kernel's readahead large), straight into
        # the buffer that get() returns, where a sealed body is decrypted in place.
        body = buffers.fresh(max(0, size - HEADER.size))
        body = body[: _read_into(fd, body, HEADER.size)]
        header = os.pread(fd, HEADER.size, 0)
    finally:
        os.close(fd)
    return codec.open(name, header, body, in_place=True)


def _read_direct(path: Path, name: ObjectKey, codec: ObjectCodec) -> bytes | memoryview:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | _O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        # Never closed explicitly: a traceback may still hold a view; refcounting unmaps it.
        view = memoryview(mmap.mmap(-1, max(_round_up(size), BLOCK)))
        done = _read_into(fd, view, 0)
    finally:
        os.close(fd)
    length = payload_length(view[:done])
    return codec.decode(name, view[: min(done, HEADER.size + length)], in_place=True)


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset`` of the file; how many bytes there were."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            break
        done += got
    return done


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _direct_io_works(directory: Path) -> bool:
    """Whether the filesystem takes an aligned O_DIRECT write (tmpfs before Linux 6.6 refuses)."""
    if not _O_DIRECT:
        log.warning("NVMe tier: no O_DIRECT on this platform; using buffered I/O")
        return False
    probe = directory / f"{TEMP_PREFIX}direct-io-probe-{secrets.token_hex(8)}"
    try:
        fd = create_exclusive(probe, FILE_MODE, os.O_WRONLY | _O_DIRECT)
        try:
            _write_all(fd, mmap.mmap(-1, BLOCK))
        finally:
            os.close(fd)
    except OSError as error:
        log.warning(
            "NVMe tier: %s refuses O_DIRECT (%s); using buffered I/O", directory, error.strerror
        )
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True
