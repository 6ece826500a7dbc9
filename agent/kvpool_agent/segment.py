"""The L1 shared-memory segment: one file under /dev/shm, mapped by the agent and its clients.

Layout (offsets in bytes)::

    0                 header: magic, layout version, page size, data offset, data size
    data_offset       data region: ``data_size`` bytes of whole pages (data_offset = page size)

Offsets handed to clients are absolute file offsets, so a client needs only the
path to map the file and copy at ``offset``. The agent reserves the memory up
front (``posix_fallocate``): a too-small /dev/shm is a clear error at start,
not a SIGBUS in the middle of a store.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"KVPOOLS1"
LAYOUT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # magic, layout version, page size, data offset, data size


class SegmentError(RuntimeError):
    """The segment cannot be created or attached."""


@dataclass(frozen=True)
class SegmentLayout:
    page_size: int
    data_offset: int
    data_size: int

    @property
    def total_size(self) -> int:
        return self.data_offset + self.data_size

    @property
    def pages(self) -> int:
        return self.data_size // self.page_size


class SharedSegment:
    """A mapped segment file. Create it with :meth:`create` (agent) or :meth:`attach` (client)."""

    def __init__(self, path: Path, layout: SegmentLayout, mapping: mmap.mmap) -> None:
        self.path = path
        self.layout = layout
        self._mapping = mapping
        self.view = memoryview(mapping)

    @classmethod
    def create(
        cls, path: Path, data_size: int, page_size: int, *, populate: bool = True
    ) -> SharedSegment:
        """Create (or replace) the segment, reserve its memory and map it."""
        layout = SegmentLayout(page_size, page_size, data_size - data_size % page_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        except OSError as error:
            raise SegmentError(f"cannot create segment {path}: {error.strerror}") from error
        try:
            try:
                os.posix_fallocate(fd, 0, layout.total_size)
            except OSError as error:
                raise SegmentError(
                    f"cannot reserve {layout.total_size} bytes for {path}: {error.strerror}; "
                    "is the shared-memory filesystem large enough?"
                ) from error
            header = _HEADER.pack(
                MAGIC, LAYOUT_VERSION, layout.page_size, layout.data_offset, layout.data_size
            )
            os.pwrite(fd, header, 0)
            os.replace(temporary, path)  # clients never see a half-written header
            return cls(path, layout, _map(fd, layout.total_size, populate))
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: Path, *, populate: bool = False) -> SharedSegment:
        """Map an existing segment created by an agent."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as error:
            raise SegmentError(f"cannot open segment {path}: {error.strerror}") from error
        try:
            raw = os.pread(fd, _HEADER.size, 0)
            if len(raw) < _HEADER.size:
                raise SegmentError(f"{path} is too short to be a kvpool segment")
            magic, version, page_size, data_offset, data_size = _HEADER.unpack(raw)
            if magic != MAGIC:
                raise SegmentError(f"{path} is not a kvpool segment")
            if version != LAYOUT_VERSION:
                raise SegmentError(
                    f"{path} has segment layout {version}; this build reads {LAYOUT_VERSION}"
                )
            layout = SegmentLayout(page_size, data_offset, data_size)
            if os.fstat(fd).st_size < layout.total_size:
                raise SegmentError(f"{path} is shorter than its header says")
            return cls(path, layout, _map(fd, layout.total_size, populate))
        finally:
            os.close(fd)

    def page_offset(self, page: int) -> int:
        """Absolute file offset of a data page."""
        return self.layout.data_offset + page * self.layout.page_size

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.view[offset : offset + len(data)] = data

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.view[offset : offset + length])

    @property
    def mapping(self) -> mmap.mmap:
        return self._mapping

    def close(self) -> None:
        self.view.release()
        self._mapping.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
