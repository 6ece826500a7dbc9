"""Chunk files: one sparse file per L1 account (a tenant, a shared space, the canary).

The segment's allocator hands out pages of one address space for every account; a chunk's
bytes live in its account's file, at the chunk's segment offset. Each file is as long as
the segment and holds memory only where it holds pages: each page of the data region is
held by one file at most (:class:`ChunkFiles` keeps which), so the files hold no more
memory together than the segment's data region. When the agent places a chunk
(:meth:`ChunkFiles.take`), the pages its file does not hold yet are taken from the file
that holds them (a hole punched there: that account's pods no longer see them) and given
to it (a ``fallocate``, so a full shared-memory filesystem is a refused store and never a
``SIGBUS`` in a writer). A freed chunk's pages stay with its file: the account's next
chunk there costs nothing, and its pods keep their mappings of them. Only its own
account's bytes were ever in them.

No client opens these files by path. The directory (:func:`files_directory`, beside the
segment) is the agent's alone (mode 0700); a connector gets a descriptor of a file from
the agent's door (:mod:`kvpool.common.door`), read-write or read-only as its token may, and
maps it. So a tenant's pod maps its own tenant's chunks and, read-only, its shared spaces':
never another tenant's, whose file it cannot name, open or find.

A client that maps its file read-write can fault pages into the file's holes (reads fault
them in too): they are charged to the client's memory cgroup, and the agent's maintenance
finds them (:meth:`ChunkFiles.strays`) and punches them (:meth:`ChunkFiles.trim`).

A file is known to clients by its inode number (:meth:`ChunkFiles.file_id`), which the
agent's replies name beside each offset: a client that holds a descriptor of an earlier
file (an agent that started from empty made new ones) sees the number differ. The file of
an account is named after the account (hex of its id), so a restarted agent that adopts
its segment adopts the files with it (:meth:`ChunkFiles.open`).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvpool.common.files import FileRefused, create_exclusive, ensure_directory, open_verified

FILE_MODE = 0o600
"""The agent's user only: clients get descriptors from the door, never the path."""
DIRECTORY_MODE = 0o700
SUFFIX = ".kv"


class ChunkFilesFull(OSError):
    """The shared-memory filesystem has no room for a chunk's pages."""


def files_directory(segment_path: Path) -> Path:
    """The chunk files of the segments at ``segment_path``: ``<segment>.files``, beside it,
    one directory in it per segment (:func:`generation_directory`)."""
    return segment_path.with_name(segment_path.name + ".files")


def generation_directory(segment_path: Path, segment_inode: int) -> Path:
    """The chunk files of one segment: named after its file's inode, which a segment made
    under a temporary name keeps once it takes its name. A start that makes a new segment
    and then fails leaves the earlier segment's files as they were.

    Checks (or makes) :func:`files_directory`: the agent's own, 0700."""
    parent = files_directory(segment_path)
    ensure_directory(parent, what="chunk files directory", mode=DIRECTORY_MODE, own=True)
    return parent / str(segment_inode)


def remove_other_generations(directory: Path) -> None:
    """Remove the chunk files of every segment but the one of ``directory`` (segments that
    are no longer at their path)."""
    for entry in directory.parent.iterdir():
        if entry != directory and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)


def file_name(owner: str) -> str:
    """The file of an account: its id in hex (ids are at most 32 bytes: see journal.py)."""
    return owner.encode().hex() + SUFFIX


def owner_of(name: str) -> str | None:
    """The account whose file is named ``name``; None for a name no account's file has."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(name.removesuffix(SUFFIX)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


NO_FILE = -1
"""A page that no file holds."""


@dataclass
class _File:
    owner: str
    index: int
    """Its number in :attr:`ChunkFiles._files` (what :attr:`ChunkFiles._holder` names)."""
    path: Path
    fd: int
    file_id: int
    mapping: mmap.mmap
    view: memoryview
    pages: int = 0
    """Pages of the data region it holds."""


class ChunkFiles:
    """The chunk files of one segment, each ``size`` bytes, created as accounts need them;
    its data region (``data_offset`` on) is made of pages of ``page_size`` bytes."""

    def __init__(self, directory: Path, size: int, page_size: int, data_offset: int) -> None:
        self.directory = directory
        self.size = size
        self.page_size = page_size
        self.data_offset = data_offset
        self._by_owner: dict[str, _File] = {}
        self._by_id: dict[int, _File] = {}
        self._files: list[_File] = []
        self._holder = array("i", [NO_FILE]) * ((size - data_offset) // page_size)
        """Which file holds each page of the data region."""
        self._making = threading.Lock()

    @classmethod
    def open(
        cls, directory: Path, size: int, page_size: int, data_offset: int, *, adopt: bool
    ) -> ChunkFiles:
        """The files of a segment (in its :func:`generation_directory`), adopted (``adopt``:
        keep the files there, the chunks of a warm restart: :meth:`claim` them, then
        :meth:`trim_all`) or new (remove whatever is there)."""
        if not adopt and directory.is_dir() and not directory.is_symlink():
            shutil.rmtree(directory)
        # made with its parents (the agent's 0700) if missing; an existing parent is left
        ensure_directory(directory, what="chunk files directory", mode=DIRECTORY_MODE, own=True)
        files = cls(directory, size, page_size, data_offset)
        if adopt:
            for entry in sorted(os.listdir(directory)):
                owner = owner_of(entry)
                if owner is None:
                    continue
                files._adopt(owner)
        return files

    # ------------------------------------------------------------------ lookups

    def owners(self) -> list[str]:
        return list(self._by_owner)

    def file_id(self, owner: str) -> int:
        """The id (inode number) of ``owner``'s file; 0 if it has none (it never stored)."""
        found = self._by_owner.get(owner)
        return 0 if found is None else found.file_id

    def view(self, owner: str) -> memoryview:
        """``owner``'s file mapped, as long as the segment: chunks at their offsets."""
        return self._file(owner).view

    def chunk_file(self, file_id: int) -> tuple[str, Path] | None:
        """The account and path of the file with id ``file_id``; None if there is none
        (for the door, which opens the path and checks the inode again)."""
        found = self._by_id.get(file_id)
        return None if found is None else (found.owner, found.path)

    # ---------------------------------------------------------------- memory

    def take(self, owner: str, offset: int, length: int) -> None:
        """Make ``owner``'s file hold the pages of ``length`` bytes at ``offset`` (a chunk
        placed there): those it does not hold yet are punched out of the files that hold
        them and given to it. :class:`ChunkFilesFull` if the filesystem has no room (the
        pages are then held by no file)."""
        found = self._file(owner)
        first, count = self._pages_of(offset, length)
        holder = self._holder
        if holder[first : first + count] == array("i", [found.index]) * count:
            return  # its own already: the common case of an account reusing its pages
        for start, end, held_by in _runs(holder, first, first + count):
            if held_by == found.index:
                continue
            if held_by != NO_FILE:
                self._release(self._files[held_by], start, end)
            try:
                os.posix_fallocate(found.fd, self._offset(start), (end - start) * self.page_size)
            except OSError as error:
                self._punch(found, start, end)  # what it did take
                raise ChunkFilesFull(
                    error.errno,
                    f"no room in {self.directory.parent} for {length} bytes of chunks "
                    f"({error.strerror}): is the shared-memory filesystem large enough?",
                ) from None
            holder[start:end] = array("i", [found.index]) * (end - start)
            found.pages += end - start

    def claim(self, owner: str, offset: int, length: int) -> None:
        """Note that ``owner``'s file holds the pages at ``offset`` (a chunk a restarted
        agent restores: its bytes are there already)."""
        found = self._file(owner)
        first, count = self._pages_of(offset, length)
        for start, end, held_by in _runs(self._holder, first, first + count):
            if held_by not in (NO_FILE, found.index):
                self._files[held_by].pages -= end - start
        found.pages += count - self._holder[first : first + count].count(found.index)
        self._holder[first : first + count] = array("i", [found.index]) * count

    def allocated_bytes(self, owner: str) -> int:
        """The memory ``owner``'s file holds."""
        found = self._by_owner.get(owner)
        return 0 if found is None else os.fstat(found.fd).st_blocks * 512

    def held_bytes(self, owner: str) -> int:
        """The memory ``owner``'s file holds for its pages (its chunks', and its freed
        chunks' that no other account took yet)."""
        found = self._by_owner.get(owner)
        return 0 if found is None else found.pages * self.page_size

    def strays(self) -> list[str]:
        """The accounts whose files hold more memory than their pages: a client that maps
        its file can fault pages into its holes (they are charged to its own memory cgroup,
        and :meth:`trim` gives them back)."""
        return [
            f.owner for f in self._files if self.allocated_bytes(f.owner) > self.held_bytes(f.owner)
        ]

    def trim(self, owner: str) -> None:
        """Free the memory of ``owner``'s file outside the pages it holds."""
        found = self._by_owner.get(owner)
        if found is None:
            return
        self._punch_bytes(found, 0, self.data_offset)  # the header's stretch: never a page
        for run in _data_runs(found.fd):
            start, end = max(run[0], self.data_offset), run[1]
            if start >= end:
                continue
            first, count = self._pages_of(start, end - start)
            for run_start, run_end, held_by in _runs(self._holder, first, first + count):
                if held_by != found.index:
                    self._punch(found, run_start, run_end)

    def trim_all(self) -> None:
        """:meth:`trim` every file (after a restart's :meth:`claim` of its chunks)."""
        for found in self._files:
            self.trim(found.owner)

    def _release(self, found: _File, start: int, end: int) -> None:
        """Take the pages [start, end) from ``found``: punched, held by no file."""
        self._punch(found, start, end)
        self._holder[start:end] = array("i", [NO_FILE]) * (end - start)
        found.pages -= end - start

    def _punch(self, found: _File, start: int, end: int) -> None:
        self._punch_bytes(found, self._offset(start), (end - start) * self.page_size)

    @staticmethod
    def _punch_bytes(found: _File, offset: int, length: int) -> None:
        found.mapping.madvise(mmap.MADV_REMOVE, offset, length)

    def _offset(self, page: int) -> int:
        return self.data_offset + page * self.page_size

    def _pages_of(self, offset: int, length: int) -> tuple[int, int]:
        """The first page and the number of pages of ``length`` bytes at ``offset``."""
        first = (offset - self.data_offset) // self.page_size
        last = -(-(offset + length - self.data_offset) // self.page_size)
        return first, last - first

    # -------------------------------------------------------------- lifetime

    def close(self) -> None:
        for found in self._files:
            found.view.release()
            found.mapping.close()
            os.close(found.fd)
        self._by_owner.clear()
        self._by_id.clear()
        self._files.clear()

    def _file(self, owner: str) -> _File:
        """``owner``'s file: mapped already, or adopted, or made (as long as the segment)."""
        found = self._by_owner.get(owner)
        if found is not None:
            return found
        with self._making:  # threads of the agent's edges may ask for a new owner at once
            found = self._by_owner.get(owner)
            return found if found is not None else self._make(owner)

    def _make(self, owner: str) -> _File:
        path = self.directory / file_name(owner)
        try:
            fd = create_exclusive(path, FILE_MODE)
        except FileExistsError:
            return self._adopt(owner)
        try:
            os.ftruncate(fd, self.size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return self._add(owner, path, fd)

    def _adopt(self, owner: str) -> _File:
        path = self.directory / file_name(owner)
        fd, status = open_verified(path, what="chunk file", mode=FILE_MODE, flags=os.O_RDWR)
        if status.st_size != self.size:
            os.close(fd)
            raise FileRefused(
                f"refusing chunk file {path}: {status.st_size} bytes, not the segment's "
                f"{self.size}; remove it"
            )
        return self._add(owner, path, fd)

    def _add(self, owner: str, path: Path, fd: int) -> _File:
        try:
            mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        found = _File(
            owner, len(self._files), path, fd, os.fstat(fd).st_ino, mapping, memoryview(mapping)
        )
        self._files.append(found)
        self._by_owner[owner] = found
        self._by_id[found.file_id] = found
        return found


def _runs(holder: array[int], first: int, end: int) -> Iterator[tuple[int, int, int]]:
    """The maximal [start, end) runs of pages in [first, end) held by one file, and which."""
    start = first
    while start < end:
        held_by = holder[start]
        stop = start + 1
        while stop < end and holder[stop] == held_by:
            stop += 1
        yield start, stop, held_by
        start = stop


def _data_runs(fd: int) -> list[tuple[int, int]]:
    """The [start, end) runs of a sparse file that hold memory (``SEEK_DATA``/``SEEK_HOLE``)."""
    runs: list[tuple[int, int]] = []
    position = 0
    while True:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # no data after position
                return runs
            raise
        position = os.lseek(fd, start, os.SEEK_HOLE)
        runs.append((start, position))
