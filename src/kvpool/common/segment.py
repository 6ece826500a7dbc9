"""The L1 segment: one file under /dev/shm, the agent's own, that describes L1.

Layout (offsets in bytes)::

    0              header: magic, layout version, page size, table and data placement, CRC
    table_offset   chunk table: one fixed-size record per page (see journal.py)
    data_offset    data region: ``data_size`` bytes of whole pages, page-aligned

The file holds the header and the chunk table only. The data region is an address space:
its pages are allocated to chunks, and a chunk's bytes live at the chunk's offset in its
account's chunk file (:mod:`kvpool.common.chunk_files`), which clients map. Offsets handed
to clients are these absolute offsets. The agent reserves the table's memory up front
(``posix_fallocate``): a too-small /dev/shm is a clear error at start.

The file outlives the agent. A restarted agent calls :meth:`SharedSegment.open`,
which re-adopts a compatible segment (same layout version, size and page size,
intact header) and otherwise recreates it from empty, saying why. The agent builds a new
segment under a temporary name and renames it into place only once its start succeeded
(:meth:`SharedSegment.install`): a start that fails leaves the earlier segment as it was.

The agent creates the file exclusively (see :mod:`kvpool.common.files`) with mode
:data:`SEGMENT_MODE`: the agent's user only (the table names every tenant's keys). It
adopts only a regular file of its own user whose mode grants no more than that; anything
else at the segment's name is refused at start, as it may be another user's file.

One agent at a time owns a segment: before it creates or adopts anything, it holds the
lock of ``<segment>.lock`` (:func:`lock_path`, a :class:`~kvpool.common.files.LockFile`)
until it ends. A second agent for the same segment waits for it (a rollout's old pod that
is still stopping), then adopts the segment, or gives up (:class:`SegmentInUse`).

A segment is known by its file's identity (:attr:`SharedSegment.identity`: device and
inode), which the agent names in its hello: a client sees a segment made anew (its chunk
files are new too).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvpool.common.files import (
    FileRefused,
    check_replaceable,
    create_temporary,
    ensure_directory,
    open_verified,
)
from kvpool.common.names import DOOR_SOCKET, DOOR_SUFFIX

MAGIC = b"KVPOOLS1"
LAYOUT_VERSION = 3
"""3: the data lives in the chunk files, not in the segment."""
# magic, layout version, page size, table offset, table slots, data offset, data size, CRC32
_HEADER = struct.Struct("<8sIIQQQQI")
HEADER_BYTES = 4096
TABLE_RECORD_BYTES = 128
SEGMENT_MODE = 0o600
"""The agent's user only."""
ADOPTABLE_MODE = 0o660
"""The widest mode of a segment the agent adopts (and narrows): agents before layout 3 let
their group, the connectors, map it."""
LOCK_MODE = 0o600
"""The owner lock: the agent's user only (another agent of that user reads who holds it)."""
DIRECTORY_MODE = 0o710
"""A segment directory the agent creates: its group may reach the files, not list them."""


class SegmentError(RuntimeError):
    """The segment cannot be created or attached."""


class SegmentInUse(SegmentError):
    """Another live agent owns the segment (holds its lock)."""


def door_path(segment_path: Path) -> Path:
    """The agent's door (:mod:`kvpool.common.door`) beside its segment:
    ``<segment>.door/agent.sock``."""
    return segment_path.with_name(segment_path.name + DOOR_SUFFIX) / DOOR_SOCKET


def lock_path(segment_path: Path) -> Path:
    """The owner lock of a segment: ``<segment>.lock``, beside it."""
    return segment_path.with_name(segment_path.name + ".lock")


FileIdentity = tuple[int, int]
"""A file's device and inode numbers."""


def identity_of(status: os.stat_result) -> FileIdentity:
    return status.st_dev, status.st_ino


@dataclass(frozen=True)
class SegmentLayout:
    page_size: int
    data_offset: int
    data_size: int
    table_offset: int = 0
    table_slots: int = 0

    @classmethod
    def plan(cls, data_size: int, page_size: int) -> SegmentLayout:
        """Header, then one table record per page, then the page-aligned data region."""
        data_size -= data_size % page_size
        slots = data_size // page_size
        table_end = HEADER_BYTES + slots * TABLE_RECORD_BYTES
        data_offset = -(-table_end // page_size) * page_size
        return cls(page_size, data_offset, data_size, HEADER_BYTES, slots)

    def header(self) -> bytes:
        fields = (
            MAGIC,
            LAYOUT_VERSION,
            self.page_size,
            self.table_offset,
            self.table_slots,
            self.data_offset,
            self.data_size,
        )
        body = _HEADER.pack(*fields, 0)[: _HEADER.size - 4]
        return body + zlib.crc32(body).to_bytes(4, "little")

    @classmethod
    def from_header(cls, raw: bytes) -> SegmentLayout:
        """Parse a header; :class:`SegmentError` says what is wrong with it."""
        if len(raw) < _HEADER.size:
            raise SegmentError("too short to be a kvpool segment")
        magic, version, page, table_offset, slots, data_offset, data_size, crc = _HEADER.unpack(
            raw[: _HEADER.size]
        )
        if magic != MAGIC:
            raise SegmentError("not a kvpool segment")
        if version != LAYOUT_VERSION:
            raise SegmentError(f"segment layout {version}; this build reads {LAYOUT_VERSION}")
        if zlib.crc32(raw[: _HEADER.size - 4]) != crc:
            raise SegmentError("damaged header (checksum mismatch)")
        return cls(page, data_offset, data_size, table_offset, slots)

    @property
    def total_size(self) -> int:
        """The data region's end: how long each chunk file is."""
        return self.data_offset + self.data_size

    @property
    def file_size(self) -> int:
        """The segment file's size: the header and the table."""
        return self.data_offset

    @property
    def pages(self) -> int:
        return self.data_size // self.page_size


class SharedSegment:
    """A mapped segment file: :meth:`create` or :meth:`open` (the agent's way in)."""

    def __init__(
        self,
        path: Path,
        layout: SegmentLayout,
        mapping: mmap.mmap,
        identity: FileIdentity = (0, 0),
    ) -> None:
        self.path = path
        self.layout = layout
        self._mapping = mapping
        self.view = memoryview(mapping)
        self.identity = identity
        """Device and inode of the file mapped (whatever is at :attr:`path` now); (0, 0) for
        an anonymous mapping."""
        self.pending: Path | None = None
        """The temporary name of a created segment not yet at :attr:`path` (see
        :meth:`install`)."""

    @classmethod
    def create(
        cls,
        path: Path,
        data_size: int,
        page_size: int,
        *,
        populate: bool = True,
        pending: bool = False,
    ) -> SharedSegment:
        """Create (or replace one of the agent's own) segment, reserve its memory and map it.

        With ``pending``, the new file keeps its temporary name (:attr:`pending`) until
        :meth:`install` puts it at ``path``: until then, whatever is there stays.
        """
        layout = SegmentLayout.plan(data_size, page_size)
        try:
            check_directory(path)
            check_replaceable(path, "segment")
            fd, temporary = create_temporary(path, SEGMENT_MODE)
        except FileRefused as error:
            raise SegmentError(str(error)) from None
        except OSError as error:
            raise SegmentError(f"cannot create segment {path}: {error.strerror}") from error
        try:
            try:
                os.posix_fallocate(fd, 0, layout.file_size)
            except OSError as error:
                raise SegmentError(
                    f"cannot reserve {layout.file_size} bytes for {path}: {error.strerror}; "
                    "is the shared-memory filesystem large enough?"
                ) from error
            os.pwrite(fd, layout.header(), 0)
            identity = identity_of(os.fstat(fd))
            segment = cls(path, layout, _map(fd, layout.file_size, populate), identity)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        segment.pending = temporary
        if not pending:
            try:
                segment.install()
            except BaseException:
                segment.close()
                raise
        return segment

    def install(self) -> None:
        """Put a :attr:`pending` segment at its path (replacing one of the agent's own there):
        clients never see a half-written header, nor a segment of a start that failed."""
        if self.pending is None:
            return
        try:
            check_replaceable(self.path, "segment")
            os.replace(self.pending, self.path)
        except BaseException:
            self.pending.unlink(missing_ok=True)
            raise
        self.pending = None

    @classmethod
    def open(
        cls, path: Path, data_size: int, page_size: int, *, pending: bool = False
    ) -> tuple[SharedSegment, str | None]:
        """The agent's way in: adopt a compatible segment of its own, else create one (with
        ``pending``, under a temporary name: see :meth:`create`).

        Returns the segment and, when it was created rather than adopted, why.
        :class:`SegmentError` if what is at ``path`` is not the agent's to adopt.
        """
        try:
            check_directory(path)
            fd, status = open_verified(path, what="segment", mode=ADOPTABLE_MODE, flags=os.O_RDWR)
        except FileNotFoundError:
            return cls.create(path, data_size, page_size, pending=pending), "no segment yet"
        except FileRefused as error:
            raise SegmentError(str(error)) from None
        except OSError as error:
            raise SegmentError(f"cannot open segment {path}: {error.strerror}") from error
        try:
            if stat.S_IMODE(status.st_mode) != SEGMENT_MODE:
                os.fchmod(fd, SEGMENT_MODE)  # an older agent's: its group mapped it
            try:
                segment = cls._map_existing(path, fd, populate=True)
            except SegmentError as error:
                return cls.create(path, data_size, page_size, pending=pending), str(
                    error
                ).removeprefix(f"{path}: ")
        finally:
            os.close(fd)
        if segment.layout != SegmentLayout.plan(data_size, page_size):
            segment.close()
            reason = "the configured size or page size differs from the segment's"
            return cls.create(path, data_size, page_size, pending=pending), reason
        return segment, None

    @classmethod
    def _map_existing(cls, path: Path, fd: int, populate: bool) -> SharedSegment:
        try:
            layout = SegmentLayout.from_header(os.pread(fd, _HEADER.size, 0))
        except SegmentError as error:
            raise SegmentError(f"{path}: {error}") from None
        status = os.fstat(fd)
        if status.st_size < layout.file_size:
            raise SegmentError(f"{path} is shorter than its header says")
        return cls(path, layout, _map(fd, layout.file_size, populate), identity_of(status))

    @property
    def table(self) -> memoryview:
        """The chunk table region (agent only)."""
        layout = self.layout
        end = layout.table_offset + layout.table_slots * TABLE_RECORD_BYTES
        return self.view[layout.table_offset : end]

    @property
    def mapping(self) -> mmap.mmap:
        return self._mapping

    def is_at_path(self) -> bool:
        """Whether :attr:`path` still names the file mapped (not removed, not replaced)."""
        try:
            return identity_of(os.lstat(self.path)) == self.identity
        except OSError:
            return False

    def close(self) -> None:
        self.view.release()
        self._mapping.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def check_directory(path: Path) -> None:
    """The segment's directory: created for the agent's group to reach, or a directory of the
    agent or root where no other user may swap the segment for a file of theirs (as a
    connector maps whatever file is at the name)."""
    ensure_directory(path.parent, what="segment directory", mode=DIRECTORY_MODE, guard_entries=True)


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
