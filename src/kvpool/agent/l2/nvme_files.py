"""The NVMe tier's files: where each chunk's file is, and how it is written and read.

Each chunk is the file ``<path>/<pool>/<tenant>/<2 hex>/<key hex>`` (see
:mod:`~kvpool.agent.l2.layout`) holding the codec's header and body (sealed
or authenticated under the pool's key); under O_DIRECT the file is padded to
whole blocks and the header gives the real length.
A write goes to a temp file beside its target and is renamed into place, so a
crash leaves the old file, the new one, or a temp file that the next start removes
(:mod:`~kvpool.agent.l2.nvme_scan`).

The tree is the agent's alone: ``<path>/<pool>`` and every directory below it are mode
:data:`DIRECTORY_MODE` (0700: another user could otherwise list every tenant id and
chunk key), the files :data:`FILE_MODE` (0600), created exclusively and never through a
symbolic link (:mod:`kvpool.common.files`). A tree whose root is not the agent's is
refused at start; a directory below it that is not the agent's fails a write into it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from pathlib import Path

from kvpool.agent.l2 import buffers, layout
from kvpool.agent.l2.base import ObjectKey
from kvpool.agent.l2.codec import HEADER, ObjectCodec, payload_length
from kvpool.common.config import NvmeTierConfig, make_setting_directory
from kvpool.common.files import create_exclusive, ensure_directory

log = logging.getLogger("kvpool.agent.l2.nvme")
"""The tier's logger, whichever of its modules logs: log lines and filters name the tier."""

TEMP_PREFIX = ".tmp-"
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
BLOCK = 4096
"""O_DIRECT alignment of buffers, offsets and lengths (covers 512 B and 4 KiB sectors)."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class ChunkFiles:
    """The tree ``<path>/<pool>``: the path of each chunk's file, and its blocking I/O.

    The constructor makes or checks the tree's root and probes O_DIRECT; the other
    methods block on the disk, so the adapter runs them on its thread pool.
    """

    def __init__(self, config: NvmeTierConfig, pool: str, codec: ObjectCodec) -> None:
        self.root = config.path / pool
        self._codec = codec
        self._fsync = config.fsync
        self._known_dirs: set[Path] = set()
        make_setting_directory(("nvme", "path"), config.path, what="NVMe tier directory")
        self.ensure_own_dir(self.root)
        self.direct_io = config.direct_io and _direct_io_works(self.root)
        """Whether O_DIRECT is in use: asked for and accepted by the filesystem."""

    def path_of(self, name: ObjectKey) -> Path:
        return self.root / layout.relative_path(name)

    def file_size(self, payload_bytes: int) -> int:
        """Bytes on disk of the file of a chunk whose payload is ``payload_bytes``."""
        size = HEADER.size + payload_bytes
        return _round_up(size) if self.direct_io else size

    def write(self, name: ObjectKey, payload: bytes | memoryview) -> None:
        path = self.path_of(name)
        self._ensure_shard_dir(path.parent)
        temp = path.with_name(f"{TEMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
        fd = create_exclusive(temp, FILE_MODE, os.O_WRONLY | (_O_DIRECT if self.direct_io else 0))
        try:
            try:
                with self._codec.encode(name, payload) as (header, body):
                    if self.direct_io:
                        _write_all(fd, _aligned(header, body))
                    else:
                        _write_all(fd, header)
                        _write_all(fd, body)
                if self._fsync != "never":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        if self._fsync == "always":
            _fsync_dir(path.parent)

    def read(self, name: ObjectKey) -> bytes | memoryview:
        """The chunk's payload; raises :class:`~kvpool.agent.l2.codec.IntegrityError` where
        the file does not open as its chunk (tampered, truncated, renamed, or under a key
        this agent no longer holds)."""
        path = self.path_of(name)
        read = _read_direct if self.direct_io else _read_buffered
        payload = read(path, name, self._codec)
        with contextlib.suppress(OSError):
            os.utime(path)  # so that the LRU order rebuilt at start follows hits too
        return payload

    def delete(self, name: ObjectKey) -> None:
        self.path_of(name).unlink(missing_ok=True)

    def remove_empty_tenant_dirs(self, tenant: str) -> None:
        """The tenant's shard directories, and its own, where they hold nothing now."""
        tenant_dir = self.root / tenant
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for shard in os.scandir(tenant_dir):
                self._known_dirs.discard(Path(shard.path))
                with contextlib.suppress(OSError):  # not empty: a put landed meanwhile
                    os.rmdir(shard.path)
        with contextlib.suppress(OSError):
            os.rmdir(tenant_dir)

    def ensure_own_dir(self, directory: Path) -> bool:
        """Make or check a directory of the tree (0700, the agent's); whether it was narrowed."""
        return ensure_directory(
            directory, what="NVMe tier directory", mode=DIRECTORY_MODE, own=True
        )

    def _ensure_shard_dir(self, directory: Path) -> None:
        """A shard directory ``<root>/<tenant>/<shard>`` of the agent's own, made if missing."""
        if directory in self._known_dirs:
            return
        self.ensure_own_dir(directory.parent)
        self.ensure_own_dir(directory)
        if self._fsync == "always":  # the new directory entries must survive too
            _fsync_dir(directory.parent)
            _fsync_dir(directory.parent.parent)
        self._known_dirs.add(directory)


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
